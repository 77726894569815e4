"""SDPA and torch-varlen peers of sdpa_varlen for bench/kernel_bench.py, each tried every way it runs.

A peer is a generator of `Candidate`s over data it gathers once (outside timing): the bench times
every candidate, checks it against the reference, and keeps the fastest that matches. The SDPA
peers run in two layouts ("gqa": `enable_gqa=True`; "folded": the GQA group on the query axis)
under every backend `sdpa_kernel` can pin (one that refuses is recorded as refused); `varlen` runs
where the installed torch ships it, its causal keyword found from the signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .kernel_cases import Case

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


@dataclass
class Candidate:
    """One way to run a peer: its settings, the calls to time (rotation j each), and rotation 0's output."""

    config: dict
    calls: list[Callable[[], object]]
    output: Callable[[], torch.Tensor]  # [T, Hq, D]


def gather(store: torch.Tensor, col: int, length: int, width: int = 0) -> torch.Tensor:
    """[Hkv, width, D] copy of one column's first `length` positions, zero padded to `width`."""
    _, _, hkv, d = store.shape
    buf = torch.zeros(hkv, width or length, d, dtype=store.dtype, device=store.device)
    buf[:, :length] = store[:length, col].permute(1, 0, 2)
    return buf


def to_layout(q_seq: torch.Tensor, layout: str, hkv: int) -> torch.Tensor:
    """[q_len, Hq, D] -> gqa [Hq, q_len, D] or folded [Hkv, G*q_len, D] (row g*q_len + i)."""
    q_len, hq, d = q_seq.shape
    if layout == "gqa":
        return q_seq.transpose(0, 1)
    return q_seq.view(q_len, hkv, hq // hkv, d).permute(1, 2, 0, 3).reshape(hkv, hq // hkv * q_len, d)


def from_layout(o: torch.Tensor, layout: str, q_len: int, hq: int) -> torch.Tensor:
    """Inverse of `to_layout` for one sequence's output: -> [q_len, Hq, D]."""
    if layout == "gqa":
        return o.transpose(0, 1)
    hkv, _, d = o.shape
    return o.reshape(hkv, hq // hkv, q_len, d).permute(2, 0, 1, 3).reshape(q_len, hq, d)


def causal_rows(q_len: int, length: int, width: int, layout: str, g: int, device) -> torch.Tensor:
    """Boolean [rows, width]: query i (of each group head when folded) sees keys t <= length - q_len + i."""
    i = torch.arange(q_len if layout == "gqa" else g * q_len, device=device) % q_len
    return torch.arange(width, device=device)[None, :] <= (length - q_len + i)[:, None]


def _sdpa(backend: SDPBackend, q, k, v, mask, causal: bool, gqa: bool) -> torch.Tensor:
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def sdpa_exact(case: Case, k: torch.Tensor, v: torch.Tensor) -> Iterator[Candidate]:
    """SDPA per sequence over its exact prefix. A chunk without history (kv_end == q_len > 1) is
    plain causal attention and takes `is_causal` in the gqa layout instead of a mask."""
    geo, q_len = case.geo, case.q_len
    plain = q_len > 1 and all(n == q_len for n in case.lengths)
    kv = [[(gather(k, c, n)[None], gather(v, c, n)[None]) for c, n in zip(cols, case.lengths, strict=True)]
          for cols in case.cols]  # fmt: skip
    for layout in ("gqa", "folded"):
        qs, masks = [], []
        for b, n in enumerate(case.lengths):
            qs.append(to_layout(case.q[b * q_len : (b + 1) * q_len], layout, geo.hkv)[None])
            use_mask = q_len > 1 and not (plain and layout == "gqa")
            masks.append(causal_rows(q_len, n, n, layout, geo.g, geo.device) if use_mask else None)
        causal, gqa = plain and layout == "gqa", layout == "gqa"
        for name, backend in BACKENDS.items():

            def call(j, backend=backend, qs=qs, masks=masks, causal=causal, gqa=gqa):
                return [_sdpa(backend, q, kk, vv, m, causal, gqa)
                        for q, (kk, vv), m in zip(qs, kv[j % case.rot], masks, strict=True)]  # fmt: skip

            def output(call=call, layout=layout):
                return torch.cat([from_layout(o[0], layout, q_len, geo.hq) for o in call(0)])

            calls = [lambda j=j, call=call: call(j) for j in range(case.calls)]
            yield Candidate({"layout": layout, "backend": name}, calls, output)


def sdpa_padded_mask(case: Case, k: torch.Tensor, v: torch.Tensor) -> Iterator[Candidate]:
    """One SDPA over the batch padded to its longest (rounded up to 64) with a boolean length mask."""
    geo, q_len = case.geo, case.q_len
    width = -(-max(case.lengths) // 64) * 64
    kv = []
    for cols in case.cols:
        pairs = list(zip(cols, case.lengths, strict=True))
        kv.append((torch.stack([gather(k, c, n, width) for c, n in pairs]),
                   torch.stack([gather(v, c, n, width) for c, n in pairs])))  # fmt: skip
    for layout in ("gqa", "folded"):
        q = torch.stack([to_layout(case.q[b * q_len : (b + 1) * q_len], layout, geo.hkv) for b in range(case.batch)])
        mask = torch.stack([causal_rows(q_len, n, width, layout, geo.g, geo.device) for n in case.lengths])[:, None]
        for name, backend in BACKENDS.items():

            def call(j, backend=backend, q=q, mask=mask, gqa=layout == "gqa"):
                return _sdpa(backend, q, *kv[j % case.rot], mask, False, gqa)

            def output(call=call, layout=layout):
                return torch.cat([from_layout(o, layout, q_len, geo.hq) for o in call(0)])

            calls = [lambda j=j, call=call: call(j) for j in range(case.calls)]
            yield Candidate({"layout": layout, "backend": name, "width": width}, calls, output)


def varlen_api() -> tuple[Callable | None, dict]:
    """torch's own varlen attention, if this torch ships it: (function or None, what was found)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return None, {"exists": False, "why": f"torch {torch.__version__} has no torch.nn.attention.varlen ({exc})"}
    params = list(inspect.signature(varlen_attn).parameters)
    return varlen_attn, {"exists": True, "api": "torch.nn.attention.varlen.varlen_attn", "parameters": params}


def varlen(case: Case, k: torch.Tensor, v: torch.Tensor) -> Iterator[Candidate]:
    """`varlen_attn` over K/V packed per rotation ([sum kv_end, Hkv, D]) with cumulative lengths."""
    fn, info = varlen_api()
    if fn is None:
        raise RuntimeError(info["why"])
    params = info["parameters"]
    kwargs: dict = {}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    if case.q_len > 1:  # flash aligns the causal diagonal bottom-right: query i sees kv_end - q_len + i
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0)
        else:
            kwargs["is_causal"] = True
    dev = case.geo.device
    lens = torch.tensor([0, *case.lengths]).cumsum(0).to(dev, torch.int32)
    cu_q = (torch.arange(case.batch + 1) * case.q_len).to(dev, torch.int32)
    packed = []
    for cols in case.cols:
        pairs = list(zip(cols, case.lengths, strict=True))
        packed.append((torch.cat([k[:n, c] for c, n in pairs]), torch.cat([v[:n, c] for c, n in pairs])))
    max_k = max(case.lengths)

    def call(j):
        return fn(case.q, *packed[j % case.rot], cu_q, lens, case.q_len, max_k, **kwargs)

    calls = [lambda j=j: call(j) for j in range(case.calls)]
    shown = {key: list(val) if isinstance(val, tuple) else val for key, val in kwargs.items()}
    yield Candidate({"api": info["api"], "kwargs": shown}, calls, lambda: call(0))


PEERS = {"sdpa_exact": sdpa_exact, "sdpa_padded_mask": sdpa_padded_mask, "varlen": varlen}
