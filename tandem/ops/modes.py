"""The kernel modes a user can ask for (torch-free, so ``tandem.config`` can offer them)."""

KERNEL_MODES = {
    "auto": "the fastest implementation of each op that this device, dtype and CPU support",
    "torch": "the plain torch form of every op (for comparisons and debugging)",
}
