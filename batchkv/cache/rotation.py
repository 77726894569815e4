"""Keys rotated before e4m3 quantisation: a normalised Walsh-Hadamard transform of q and k per head.

Why: a trained model's keys carry a few outlier channels (the same ones at every position), and
its queries line up with them, so q . k is dominated by a few products. e4m3 keeps about 3 bits
of mantissa, a relative error of up to 2^-4 per element, and an error on the dominant products
is an error on the whole logit. An orthonormal D x D matrix H (H H^T = I) spreads every channel
over all D (QuaRot, SpinQuant): (q H) . (k H) = q . k exactly, while each rotated product is
about 1/D of the logit, so the elements' independent rounding errors average out (~1/sqrt(D)).

What: for an e4m3 store with `CacheConfig.key_rotation` on (opt-in: docs/design.md), the step's
keys are rotated before the write (so the store holds rotated, quantised keys) and the queries
before attention; V and the output are untouched, so the attention is the same in exact
arithmetic. H = Sylvester Hadamard / sqrt(D) (D a power of two, which the kernels require): its
entries are +-1/sqrt(D), so it is symmetric and its own inverse. Anything reading keys back out
of the store (the single-sequence facade's `to_dynamic_cache`) un-rotates them with the same H;
keys loaded from outside are rotated on the way in.

Cost: two [W * H, D] x [D, D] products per layer (q: Hq heads, k: Hkv heads), 2 D FLOPs per
element, computed in fp32 and cast back to the step's dtype. Capturable (plain matmuls).
"""

from __future__ import annotations

import math

import torch

from batchkv.ops.rope import rotate_step


def hadamard(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix, fp32 [d, d], d a power of two: H = H^T = H^-1."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Walsh-Hadamard matrix needs a power-of-two size; got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(device)


class KeyRotation:
    """Rotate q and k of one step by an orthonormal [D, D] matrix (fp32), and keys back.

    `matrix` must be orthonormal; `unrotate` applies its transpose, so the pair is exact for
    any such matrix (the default, `hadamard(D)`, is symmetric).
    """

    def __init__(self, matrix: torch.Tensor) -> None:
        self.matrix = matrix.float()
        self.inverse = self.matrix.T.contiguous()

    @classmethod
    def for_head_dim(cls, head_dim: int, device: torch.device | str) -> KeyRotation:
        return cls(hadamard(head_dim, device))

    @staticmethod
    def _apply(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        # x: [W, H, D] (any float dtype) -> x @ m in fp32, back in x's dtype
        return torch.matmul(x.float(), m).to(x.dtype)

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [W, Hq, D], k [W, Hkv, D] -> (q H, k H): the same q . k, keys ready to quantise."""
        return self._apply(q, self.matrix), self._apply(k, self.matrix)

    def rotate_keys(self, k: torch.Tensor) -> torch.Tensor:
        """Keys [..., D] from outside (a loaded prefix) into the store's rotated basis."""
        return self._apply(k, self.matrix)

    def unrotate(self, k: torch.Tensor) -> torch.Tensor:
        """Keys [..., D] read back from the store into the model's basis."""
        return self._apply(k, self.inverse)


def build_rotation(config, device: torch.device) -> KeyRotation | None:
    """The cache's key rotation: a Hadamard `KeyRotation` when `config.key_rotation`, else None."""
    return KeyRotation.for_head_dim(config.head_dim, device) if config.key_rotation else None


def keys_for_write(rotation: KeyRotation | None, rounding, layer: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, rope: tuple | None) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:  # fmt: skip
    """(q, k, rope) as the write and the attention take them: a step's unrotated q and k and its `rope` =
    (cos, sin) pass through while neither a key rotation nor a key rounding (`rounding`, a device
    `KeyRounding`) comes after RoPE; with one, RoPE is applied here first (torch ops, `ops.rope`),
    then the rotation (q and k) and the rounding (k), and rope is None."""
    if rope is not None and (rotation is not None or rounding is not None):
        q, (k, v, _), rope = *rotate_step(q, (k, v, None), rope), None
    if rotation is not None:  # e4m3 keys: rotate q and k alike (q . k unchanged), V as is
        q, k = rotation.rotate(q, k)
    if rounding is not None:  # fp32 keys on the store's e4m3 grid: the write keeps their codes
        k = rounding.round(layer, k)
    return q, k, rope
