"""The kernel modes a user can ask for, and the one-line summary of which paths run (torch-free,
so ``tandem.config`` and the bench report can use them)."""

KERNEL_MODES = {
    "auto": "the fastest implementation of each op that this device, dtype and CPU support",
    "torch": "the plain torch form of every op (for comparisons and debugging)",
}


def describe_paths(paths: dict, reason: bool = True) -> str:
    """``LoadedModel.paths()`` (or the ``paths`` of /config and result.json) in one line: CPU and
    features, the kernel variants in use, the activation dtype and the weight format (with how it
    was chosen when ``reason``)."""
    cpu = paths.get("cpu")
    where = f"{cpu['model']} [{' '.join(cpu['features'])}]" if cpu else paths.get("device", "?")
    kernels = sorted({impl for impl in paths.get("ops", {}).values() if impl.startswith("native")}) or ["torch only"]
    line = f"{where}; kernels {', '.join(kernels)}; {paths.get('dtype')} activations; weights {paths.get('quantization')}"
    return line + (f" ({paths['quantization_reason']})" if reason and paths.get("quantization_reason") else "")
