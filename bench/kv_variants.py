"""Key-quantisation variants for `bench/kv_accuracy.py` run on an fp32 store holding fake-quantised K/V.

An e4m3 store holds `code * scale` and the torch reference attends over those values in fp32;
an fp32 store handed the same values (`fake_e4m3`) runs the same arithmetic, bit for bit (the
`fq` variant reproduces `e4m3`). That lets one cache express what the e4m3 write cannot: rows
kept in bf16 (attention sinks), K or V alone, keys centred by a mean, other rounding. A variant
name is `fq` followed by flags, e.g. `fq-centre-had-sink4`:

- `centre`: keys minus a per-(layer, KV head) channel mean taken from the sequence's first chunk
  and fixed after (q . mu is the same at every position of a row, so softmax is unchanged);
- `centrecal`: the mean calibrated on the other text (a per-model constant);
- `had`: then q and k rotated per head by the normalised Walsh-Hadamard matrix;
- `gptq`: keys rounded channel by channel with error feedback (GPTQ's update) weighted by the
  queries' second moment E[q q^T] per (layer, KV head), calibrated on the other text: codes and
  per-row scale unchanged in form, so kernel reads are the same;
- `search`: each key row's scale chosen among amax / (448 2^(-c/8)), c = 0..7 (shifting the
  e4m3 grid under the row), the one with the least query-weighted error e^T E[q q^T] e
  (calibrated on the other text): still one scale per row, so kernel reads are the same;
- `vgptq`: values rounded the same way, weighted by the output projection's Gram matrix
  W_o,h^T W_o,h summed over the KV head's query heads (a static per-model constant: V's error
  reaches the residual stream through W_o);
- `sink1`, `sink4`: the sequence's first 1 / 4 positions kept in bf16 (K and V);
- `konly` / `vonly`: only K / only V rounded to e4m3, the other plane bf16 as the reference;
- `bf16`: nothing rounded to e4m3 (both planes bf16): must equal the reference (a check).
"""

from __future__ import annotations

import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig, rotation
from batchkv.ops.reference import dequantize_fp8, quantize_fp8
from batchkv.ops.support import FP8, FP8_MAX

FLAGS = {"centre", "centrecal", "had", "gptq", "search", "vgptq", "sink1", "sink4", "konly", "vonly", "bf16"}


def fake_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> the fp32 values an e4m3 store holds for it (a scale per row)."""
    return dequantize_fp8(*quantize_fp8(x))


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


class Calibration:
    """Per-(layer, KV head) key mean [Hkv, D] and query second moment E[q q^T] [Hkv, D, D] of one
    text (the queries of a KV head's GQA group pooled), gathered by a `Plan` with `record` set."""

    def __init__(self, layers: int) -> None:
        self.k_sum: list = [0.0] * layers
        self.qq_sum: list = [0.0] * layers
        self.count = [0] * layers
        self.q_count = [0] * layers

    def add(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        hkv = k.shape[1]
        qg = q.float().reshape(q.shape[0], hkv, -1, q.shape[-1])  # [W, Hkv, group, D]
        self.k_sum[layer] = self.k_sum[layer] + k.float().sum(0)
        self.qq_sum[layer] = self.qq_sum[layer] + torch.einsum("wgid,wgie->gde", qg, qg)
        self.count[layer] += k.shape[0]
        self.q_count[layer] += qg.shape[0] * qg.shape[2]

    def mean(self, layer: int) -> torch.Tensor:
        return self.k_sum[layer] / self.count[layer]

    def qq(self, layer: int) -> torch.Tensor:
        return self.qq_sum[layer] / self.q_count[layer]


def gptq_round(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Keys x [N, Hkv, D] fp32 -> e4m3-representable values, one scale per (row, head) as the
    store's (amax / 448 of the row), channels rounded in order with GPTQ's error feedback: u
    [Hkv, D, D] is the upper Cholesky factor of H^-1 (H = E[q q^T] + damping), so the rounding
    error of channel j is pushed onto channels > j where the queries see it least."""
    scale = quantize_fp8(x)[1][..., None]  # [N, Hkv, 1]
    x, out = x.clone(), torch.empty_like(x)
    for j in range(x.shape[-1]):  # D steps
        col = (x[..., j : j + 1] / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
        out[..., j : j + 1] = col
        err = (x[..., j] - col[..., 0]) / u[:, j, j]  # [N, Hkv]
        x[..., j + 1 :] -= err[..., None] * u[None, :, j, j + 1 :]
    return out


def search_round(x: torch.Tensor, h: torch.Tensor, steps: int = 8) -> torch.Tensor:
    """Keys x [N, Hkv, D] fp32 -> e4m3-representable values with one scale per (row, head), the
    scale amax / (448 2^(-c / steps)) whose rounding error e has the least e^T h e (h [Hkv, D, D])."""
    amax = x.abs().amax(-1, keepdim=True).clamp_min(2.0**-126 * FP8_MAX)  # [N, Hkv, 1]
    best, best_err = None, None
    for c in range(steps):
        scale = amax / (FP8_MAX * 2.0 ** (-c / steps))
        y = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
        e = y - x
        err = torch.einsum("nhd,hde,nhe->nh", e, h, e)[..., None]
        best = y if best is None else torch.where(err < best_err, y, best)
        best_err = err if best_err is None else torch.minimum(err, best_err)
    return best


def output_grams(model, kv_heads: int, head_dim: int) -> list[torch.Tensor]:
    """Per layer [Hkv, D, D]: sum over a KV head's query heads h of W_o,h^T W_o,h (W_o,h the
    [hidden, D] columns of o_proj that head h's output meets), for an HF Llama-style model."""
    grams = []
    for layer in getattr(model.hf, model.hf.base_model_prefix).layers:
        w = layer.self_attn.o_proj.weight.float()  # [hidden, Hq * D]
        heads = w.reshape(w.shape[0], -1, head_dim)  # [hidden, Hq, D]
        g = torch.einsum("xhd,xhe->hde", heads, heads)  # [Hq, D, D]
        grams.append(g.reshape(kv_heads, -1, head_dim, head_dim).sum(1))
    return grams


def _cholesky_inverse_upper(h: torch.Tensor) -> torch.Tensor:
    """H [Hkv, D, D] -> upper Cholesky factor of (H + 1% mean diag)^-1, as GPTQ uses."""
    d = h.shape[-1]
    damp = 0.01 * h.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(d)
    inv = torch.linalg.inv(h.double() + damp)
    return torch.linalg.cholesky(inv, upper=True).float()


class Plan:
    """What a variant does to one step's q, k, v before the fp32 write (see the module docstring)."""

    def __init__(self, flags: set[str], layers: int, head_dim: int, calib: Calibration | None = None) -> None:
        unknown = flags - FLAGS
        if unknown:
            raise ValueError(f"unknown variant flags {sorted(unknown)}; known: {sorted(FLAGS)}")
        self.flags, self.calib = flags, calib
        self.record: Calibration | None = None
        self.h = rotation.hadamard(head_dim) if "had" in flags else None
        self.mu: list[torch.Tensor | None] = [None] * layers
        self.u: list[torch.Tensor | None] = [None] * layers
        self.sinks = 4 if "sink4" in flags else 1 if "sink1" in flags else 0
        self.uv: list[torch.Tensor] | None = None  # `vgptq`: [Hkv, D, D] per layer, set by the caller

    def _mean(self, layer: int, k: torch.Tensor) -> torch.Tensor | None:
        if self.mu[layer] is None and "centre" in self.flags:
            self.mu[layer] = k.mean(0)  # [Hkv, D] of the first chunk, fixed after
        if self.mu[layer] is None and "centrecal" in self.flags:
            self.mu[layer] = self.calib.mean(layer)
        return self.mu[layer]

    def _round_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        if self.flags & {"vonly", "bf16"}:
            return bf16(k)
        if not self.flags & {"gptq", "search"}:
            return fake_e4m3(k)
        if self.u[layer] is None:
            h = self.calib.qq(layer)
            self.u[layer] = h if self.h is None else self.h @ h @ self.h  # in the stored keys' basis
            if "gptq" in self.flags:
                self.u[layer] = _cholesky_inverse_upper(self.u[layer])
        return gptq_round(k, self.u[layer]) if "gptq" in self.flags else search_round(k, self.u[layer])

    def __call__(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        q, k, v = q.float(), k.float(), v.float()
        if self.record is not None:
            self.record.add(layer, q, k)
        mu = self._mean(layer, k)
        if mu is not None:
            k = k - mu
        if self.h is not None:
            q, k = q @ self.h, k @ self.h
        kq, vq = self._round_keys(layer, k), bf16(v) if self.flags & {"konly", "bf16"} else fake_e4m3(v)
        if self.uv is not None and not self.flags & {"konly", "bf16"}:
            vq = gptq_round(v, self.uv[layer])
        keep = max(0, min(self.sinks - start, k.shape[0]))  # rows of this step among the first sinks
        if keep:
            kq[:keep], vq[:keep] = bf16(k[:keep]), bf16(v[:keep])
        return q, kq, vq


class FakeQuantCache(BatchedSequenceCache):
    """A one-sequence fp32 cache whose every K/V write goes through `plan` first (positions
    counted per layer, so chunks must arrive in order: what scoring does)."""

    def __init__(self, config: CacheConfig, device, plan: Plan) -> None:
        super().__init__(config, device)
        self.plan, self.at = plan, [0] * config.num_layers

    def update_and_attend(self, layer, q, k, v, scale=None, causal=True):
        start, self.at[layer] = self.at[layer], self.at[layer] + k.shape[0]
        q, k, v = self.plan(layer, start, q, k, v)
        return super().update_and_attend(layer, q, k, v, scale=scale, causal=causal)
