"""w8a8's bf16 road: bf16 rows times a bf16 weight in calls of one fixed row count.

oneDNN chooses its blocking, and so the order of each dot product's sums, by the row count of the
call; on AMX a row's bits changed with it (docs/performance.md, Intel Xeon). Calls of one row
count, padded with zeros, make a row's result depend on its own values only, which keeps w8a8's
prompt rows independent of the batch they share (``tandem.models.quant``). With the weights packed
once in oneDNN's layout for that count, 128-row calls ran the rows of a 256-token chunk as fast as
one unpacked 256-row call, and a short chunk costs one call (Xeon, AMX).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.ops.dispatch import BF16_TILE_ROWS

def _packed(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``weight`` in oneDNN's own layout for ``rows``-row calls, or None where torch has no
    oneDNN (or the weight is not on the CPU): then every call repacks it."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    except (RuntimeError, AttributeError):
        return None


class TiledBf16Weight:
    """A bf16 weight [N, K] that multiplies bf16 rows in calls of exactly ``tile`` rows (the
    last padded with zeros), so each row's bits are the same whatever else shares the call."""

    def __init__(self, weight: torch.Tensor, tile: int = BF16_TILE_ROWS, pack: bool = True) -> None:
        self.tile = tile
        self.out_features = weight.shape[0]
        self.device = weight.device
        self.packed = _packed(weight, tile) if pack else None
        self.weight = weight if self.packed is None else None  # one copy of the weights, not two

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)

    def __call__(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``bf16(x) @ weight.T`` for ``x`` [M, K] -> bf16 [M, N]; with ``scale`` [N], float32
        ``(bf16(x) @ weight.T) * scale``. Each tile is rounded to bf16 and scaled while it is in
        cache: over a whole long chunk those two passes cost about a quarter of the matmuls' time."""
        m, tile = x.shape[0], self.tile
        out = torch.empty(m, self.out_features, dtype=torch.bfloat16 if scale is None else torch.float32,
                          device=x.device)
        for start in range(0, m, tile):
            rows = min(tile, m - start)
            if rows == tile:
                y = self._call(x[start:start + tile].to(torch.bfloat16))
            else:  # the last, short tile: zero rows pad it to the call's count
                padded = x.new_zeros(tile, x.shape[1], dtype=torch.bfloat16)
                padded[:rows] = x[start:]
                y = self._call(padded)[:rows]
            out[start:start + rows] = y
            if scale is not None:  # widened first: a float32 multiply runs at twice a mixed one's speed
                out[start:start + rows].mul_(scale)
        return out
