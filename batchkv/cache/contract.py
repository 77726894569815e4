"""The tensor contract of `update_and_attend`, checked before anything is written.

It runs per layer per step, also while a CUDA graph is captured, so it reads only attributes
(shape, dtype, device, stride): no tensor values, no host synchronisation.
"""

from __future__ import annotations

import math

import torch

from batchkv.cache.config import CacheConfig
from batchkv.checks import is_int
from batchkv.errors import ContractError
from batchkv.ops.support import COMPUTE_DTYPES

WHERE = "update_and_attend"


def check_attend_args(
    cfg: CacheConfig,
    width: int,
    device: torch.device,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    causal: bool,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Refuse (ContractError naming the argument) anything but: `layer` an int in [0, num_layers);
    q [width, Hq, D] with Hq a positive multiple of kv_heads; k [width, kv_heads, D], v [width, kv_heads,
    Dv] (D the config's head_dim, Dv its value_dim); all three
    float16/bfloat16/float32 (k, v are cast to the store's dtype on write; the Triton write loads
    no other dtype, so no backend takes one) on `device` with a contiguous last dim; `scale` None
    or a number; `causal` a bool; `softcap` None or a finite number >= 0; `sinks` None or a
    float16/bfloat16/float32 tensor [Hq] with unit stride on `device`.
    """
    if not is_int(layer) or not 0 <= layer < cfg.num_layers:
        raise ContractError(f"{WHERE}: layer is {layer!r}; it must be an integer in [0, {cfg.num_layers})")
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ContractError(f"{WHERE}: {name} is a {type(t).__name__}; pass a torch.Tensor")
    d = cfg.head_dim
    if q.dim() != 3 or q.shape[0] != width or q.shape[2] != d or not q.shape[1] or q.shape[1] % cfg.kv_heads:
        raise ContractError(
            f"{WHERE}: q must be [W={width}, Hq, D={d}] with Hq a positive multiple of kv_heads={cfg.kv_heads}; "
            f"got {list(q.shape)}"
        )
    for name, t, dim in (("k", k, "D"), ("v", v, "Dv")):
        want = (width, cfg.kv_heads, cfg.head_dim if name == "k" else cfg.value_dim)
        if t.shape != want:
            raise ContractError(f"{WHERE}: {name} must be [W, Hkv, {dim}] = {list(want)}; got {list(t.shape)}")
    if any(t.dtype not in COMPUTE_DTYPES for t in tensors.values()):
        raise ContractError(
            f"{WHERE}: q must be float16, bfloat16 or float32, and so must k and v (cast to the store's {cfg.kv_dtype} "
            f"on write); got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    for name, t in tensors.items():
        if t.device != device:
            raise ContractError(f"{WHERE}: {name} is on {t.device}; the cache is on {device}")
        if t.stride(-1) != 1:
            raise ContractError(f"{WHERE}: {name} needs a contiguous last dim; call .contiguous()")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ContractError(f"{WHERE}: scale is {scale!r}; use None (1/sqrt(D)) or a number")
    if not isinstance(causal, bool):
        raise ContractError(f"{WHERE}: causal is {causal!r}; use True or False")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf
    ):
        raise ContractError(f"{WHERE}: softcap is {softcap!r}; use None (no cap) or a positive finite number")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise ContractError(f"{WHERE}: sinks is a {type(sinks).__name__}; pass a float tensor [Hq] or None")
        if sinks.shape != (q.shape[1],) or sinks.dtype not in COMPUTE_DTYPES or sinks.stride() != (1,):
            raise ContractError(
                f"{WHERE}: sinks must be one float16/bfloat16/float32 logit per query head, contiguous "
                f"[Hq={q.shape[1]}]; got {sinks.dtype} {list(sinks.shape)}"
            )
        if sinks.device != device:
            raise ContractError(f"{WHERE}: sinks are on {sinks.device}; the cache is on {device}")
