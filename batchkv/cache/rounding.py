"""Keys rounded to e4m3 with error feedback weighted by the queries: GPTQ's update on each key row.

Why: the e4m3 write rounds every element of a key to nearest on its own, so the logit error
q . e (e the key's rounding error) is the sum of D independent errors. Rounding the channels in
order and moving each one's error onto the channels still to come, through the upper Cholesky
factor U of H^-1 (GPTQ, Frantar et al. 2022, applied to one key row instead of a weight row),
minimises E[(q . e)^2] = e^T H e for H = E[q q^T], the queries' second moment: the error goes
where the queries look least. Exact in real arithmetic (nothing to round: k comes back as it
was), so q . k and the attention are the model's up to the rounding, as with any e4m3 store.

What: `KeyRounding(factors)` holds U per (layer, KV head), [L, Hkv, D, D] fp32, in the stored
keys' basis (after `key_rotation`); `KeyRounding.calibrate(moments)` builds it from H with 1%
of its mean diagonal added (GPTQ's damping), and `batchkv.score.calibrate_key_rounding` measures
H on a text. `round(layer, k)` returns fp32 values on the e4m3 grid of the store's own per-row
scale, amax / 448: the row's largest element keeps code +-448 (its error still feeds forward),
every other code is clamped to +-448, so the store's write, which rounds to nearest with that
scale, stores exactly these codes (the scale it recomputes is at most an ulp off). The write
kernels, the attention, read-back, clones and prefix sharing are unchanged: there is no state per
sequence, only a per-model constant.

Cost: D steps per layer and step, each a rank-1 update of the step's [W, Hkv, D] keys, D^2 FMAs
per (token, KV head): 4,096 at D = 64. As torch code here it is D small launches per layer (the
reference path; a fused write would do the loop in registers). U takes L * Hkv * D^2 * 4 bytes
(1.4 MiB for SmolLM2-135M).
"""

from __future__ import annotations

import torch

from batchkv.errors import ConfigError
from batchkv.ops.support import FP8, FP8_MAX, SCALE_FLOOR

DAMPING = 0.01  # of H's mean diagonal, added before inverting (GPTQ's default)


class KeyRounding:
    """Query-weighted rounding of e4m3 keys; `factors` [L, Hkv, D, D] fp32 upper-triangular, U with
    U^T U = (H + damping)^-1 per (layer, KV head). Compared by identity (it holds tensors)."""

    def __init__(self, factors: torch.Tensor) -> None:
        if factors.dim() != 4 or factors.shape[-1] != factors.shape[-2]:
            raise ConfigError(f"KeyRounding factors must be [layers, kv_heads, D, D]; got {list(factors.shape)}")
        diag = factors.diagonal(dim1=-2, dim2=-1)
        if not bool(torch.isfinite(factors).all()) or not bool((diag > 0).all()):
            raise ConfigError("KeyRounding factors must be finite with a positive diagonal (KeyRounding.calibrate)")
        self.factors = factors.float().triu()

    @classmethod
    def calibrate(cls, moments: torch.Tensor, damping: float = DAMPING) -> KeyRounding:
        """H [L, Hkv, D, D] (E[q q^T] of each KV head's queries, in the stored keys' basis) -> rounding."""
        h = moments.double()
        eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
        h = h + damping * h.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye
        return cls(torch.linalg.cholesky(torch.linalg.inv(h), upper=True).float())

    def shape(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) the factors are for."""
        return tuple(self.factors.shape[:3])

    def to(self, device: torch.device | str) -> KeyRounding:
        return KeyRounding(self.factors.to(device))

    def round(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """k [W, Hkv, D] (any float dtype) -> fp32 [W, Hkv, D] values code * scale, codes e4m3, one
        scale per (row, head) as the store's (max(amax / 448, 2^-126)). Capturable (no host reads)."""
        u = self.factors[layer]  # [Hkv, D, D]
        x = k.float().clone()
        amax = x.abs().amax(-1, keepdim=True)  # [W, Hkv, 1]
        scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(SCALE_FLOOR)  # IEEE division, as the write
        top = x.abs().argmax(-1, keepdim=True)  # [W, Hkv, 1]: the channel that keeps code +-448
        top_code = torch.where(x.gather(-1, top) < 0, -FP8_MAX, FP8_MAX)
        out = torch.empty_like(x)
        for j in range(x.shape[-1]):  # D steps
            code = (x[..., j : j + 1] / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
            code = torch.where(top == j, top_code, code)
            out[..., j : j + 1] = code * scale
            err = (x[..., j] - out[..., j]) / u[:, j, j]  # [W, Hkv]
            x[..., j + 1 :] -= err[..., None] * u[None, :, j, j + 1 :]
        return out.masked_fill(amax == 0, 0.0)  # an all-zero row stays zeros (NaN rows stay NaN: the write marks them)
