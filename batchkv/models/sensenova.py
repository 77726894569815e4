"""SenseNova-U1 language model, understanding path, attending through a batchkv cache.

This is our implementation of the published description of the model (see DESIGN.md, "SenseNova
facts"), not a port of its code. Per packed token row (W rows, hidden size H):

    h      = embed[input_ids]                                          # [W, H]
    for each layer l:
        x        = RMSNorm(h) * input_layernorm                        # eps 1e-6
        q, k, v  = x @ Wq.T, x @ Wk.T, x @ Wv.T                        # [W, Hq, D], [W, Hkv, D] x2, no bias
        q[..., :D/2] = RMSNorm(q[..., :D/2]) * q_norm                  # t half
        q[..., D/2:] = RMSNorm(q[..., D/2:]) * q_norm_hw               # h|w half; same for k with k_norm*
        q, k     = rope3d(q, indexes), rope3d(k, indexes)
        a        = cache.update_and_attend(l, q, k, v, scale=D**-0.5)   # causal, GQA
        h        = h + a.reshape(W, Hq*D) @ Wo.T
        x        = RMSNorm(h) * post_attention_layernorm
        h        = h + (silu(x @ Wgate.T) * (x @ Wup.T)) @ Wdown.T
    logits = (RMSNorm(h[logits_rows]) * norm) @ lm_head.T              # untied head, float32 out

RMSNorm(x) = x / sqrt(mean(x^2) + eps), computed in float32 and cast back before the weight.

rope3d rotates three sections of head_dim independently, each with the rotate-half convention
inside its section (dim j pairs with dim j + n/2 of an n-dim section; both turn by angle_j):

    section t: dims [0, D/2),      angle_j = indexes[0] * 5e6 ** (-2j / (D/2)),  j < D/4
    section h: dims [D/2, 3D/4),   angle_j = indexes[1] * 1e4 ** (-2j / (D/4)),  j < D/8
    section w: dims [3D/4, D),     angle_j = indexes[2] * 1e4 ** (-2j / (D/4)),  j < D/8
    out = x * cos(angle) + rotate_half_within_section(x) * sin(angle)

Angles are computed in float32 from the step's `indexes`, then cos/sin are cast to the model
dtype. Text tokens use index (t, 0, 0), which makes the h and w sections the identity. The RoPE
index t is not the KV position: a whole image takes one t step, so callers track it separately.

Speed (decode is weight-read bound, so the step is 4 matmuls a layer plus as few small kernels
as possible): q/k/v are one fused matmul and gate/up another (fused when weights are loaded; the
checkpoint keeps the separate names); on CUDA each residual add runs fused with the RMSNorm after
it, the split QK-norm and RoPE of all q and k heads are one kernel, and SiLU*mul another
(`batchkv.models.fused`); RoPE tables are computed once per step for all layers; only the
`logits_rows` rows reach the final norm and LM head. At up to `GEMV_MAX_ROWS` rows on CUDA the
matmuls are the few-row kernel of `batchkv.models.gemv`, which streams the weights at the read
bandwidth, takes SiLU*mul into the down projection and writes the logits in float32 directly. A
layer is 4 matmuls, 3 or 4 small kernels, the K/V write and attention.

Tensor parallelism (`shard`, a `batchkv.models.parallel.Shard`): each rank holds its query and KV heads, its
1/N of the MLP and of the vocabulary (`local_config` is that geometry); o and down are followed by
one all-reduce each, the embedding by one, and the LM head's logits are gathered. One rank (the
default `Shard()`) is the whole model and none of that runs.

Image tokens in the published model attend bidirectionally within one t index; this module serves
text (causal) only.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from batchkv.cache.config import LayerSpec
from batchkv.models.config import SenseNovaConfig
from batchkv.models.fused import add_rms_norm, qk_norm_rope
from batchkv.models.gemv import linear
from batchkv.models.parallel.shard import Shard


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x / sqrt(mean(x^2, -1) + eps))`: normalised in float32, rounded to x's dtype, then
    scaled (Qwen3RMSNorm's rounding). Two kernels on CUDA (torch's fused rms_norm, then the scale).
    """
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight


class Rope3D(nn.Module):
    """3-D rotary embedding: t on the first D/2 dims, h and w on D/4 each (see the module docstring).

    Buffers (all [D]): `inv_freq` (float32, the frequency of each dim's pair), `axis` (which index
    row drives the dim: 0 t, 1 h, 2 w), `partner` (the dim it pairs with under rotate-half) and
    `sign` (-1 for the first half of a section, +1 for the second).
    """

    def __init__(self, head_dim: int, theta_t: float, theta_hw: float) -> None:
        super().__init__()
        inv_freq, axis, partner, sign = [], [], [], []
        start = 0
        sections = ((head_dim // 2, theta_t), (head_dim // 4, theta_hw), (head_dim // 4, theta_hw))  # t, h, w
        for ax, (size, theta) in enumerate(sections):
            half = size // 2
            freq = 1.0 / (theta ** (torch.arange(0, size, 2, dtype=torch.float32) / size))  # [size/2]
            inv_freq.append(torch.cat([freq, freq]))
            axis += [ax] * size
            partner += [start + half + j for j in range(half)] + [start + j for j in range(half)]
            sign += [-1.0] * half + [1.0] * half
            start += size
        self.inv_freq = nn.Buffer(torch.cat(inv_freq), persistent=False)
        self.axis = nn.Buffer(torch.tensor(axis, dtype=torch.int64), persistent=False)
        self.partner = nn.Buffer(torch.tensor(partner, dtype=torch.int64), persistent=False)
        self.sign = nn.Buffer(torch.tensor(sign, dtype=torch.float32), persistent=False)

    def tables(self, indexes: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin: [W, D] in `dtype`, from indexes int64 [3, W]. Capturable."""
        angle = indexes.index_select(0, self.axis).T.float() * self.inv_freq  # [W, D] float32
        return angle.cos().to(dtype), (angle.sin() * self.sign).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [W, H, D] with tables from `tables` ([W, D]). Three kernels; capturable."""
        return torch.addcmul(x * cos[:, None], x.index_select(-1, self.partner), sin[:, None])

    def forward(self, x: torch.Tensor, indexes: torch.Tensor) -> torch.Tensor:
        """Rotate x [W, H, D] at indexes int64 [3, W]."""
        cos, sin = self.tables(indexes, x.dtype)
        return self.apply(x, cos, sin)


def _param(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    """One decoder layer's fused weights (see `batchkv.models.weights` for the checkpoint names).

    qkv: [(Hq + 2 Hkv) D, H] = cat(q_proj, k_proj, v_proj); gate_up: [2 I, H] = cat(gate, up);
    q_norm, k_norm: [2, D/2] = stack(t-half weight, hw-half weight). Under FP8 compute the four
    projections are `batchkv.models.quant.Fp8Linear` layers (`SenseNovaLM.quantize`).
    """

    PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")

    def __init__(self, cfg: SenseNovaConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        h, d, i = cfg.hidden, cfg.head_dim, cfg.intermediate
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = _param(h, **kw)
        self.qkv = _param((cfg.q_heads + 2 * cfg.kv_heads) * d, h, **kw)
        self.q_norm = _param(2, d // 2, **kw)
        self.k_norm = _param(2, d // 2, **kw)
        self.o_proj = _param(h, cfg.q_heads * d, **kw)
        self.post_attention_layernorm = _param(h, **kw)
        self.gate_up = _param(2 * i, h, **kw)
        self.down = _param(h, i, **kw)


def local_geometry(config: SenseNovaConfig, shard: Shard) -> SenseNovaConfig:
    """The geometry one rank holds: its query and KV heads, MLP width and vocabulary rows."""
    q, kv = shard.heads(config.q_heads, config.kv_heads)
    inter = shard.part(config.intermediate, "the MLP width (intermediate)")
    vocab = shard.vocab_rows(config.vocab)
    return replace(config, q_heads=len(q), kv_heads=len(kv), intermediate=len(inter), vocab=vocab)


class SenseNovaLM(nn.Module):
    """The SenseNova-U1 language model, driven one packed step at a time through a batchkv cache.

    Parameters start uninitialised; `batchkv.models.build_model` fills them from a seed or a
    checkpoint. Call: `logits = model(input_ids, indexes, cache, logits_rows)` (see
    `batchkv.models` for the contract). The forward is CUDA-graph capturable: no host reads, no
    data-dependent shapes; everything is static given W and R. `shard`: this rank's share under
    tensor parallelism (default: the whole model); `config` stays the whole model's geometry.
    """

    def __init__(
        self,
        config: SenseNovaConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        shard: Shard | None = None,
    ):
        super().__init__()
        self.config = config
        self.shard = shard or Shard(device=torch.device(device))
        self.local_config = local = local_geometry(config, self.shard)
        device, dtype = torch.device(device), dtype or config.dtype
        h = config.hidden
        self.embed_tokens = _param(local.vocab, h, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(local, device, dtype) for _ in range(config.num_layers))
        self.norm = _param(h, device=device, dtype=dtype)
        self.lm_head = _param(local.vocab, h, device=device, dtype=dtype)
        self.rope = Rope3D(config.head_dim, config.theta_t, config.theta_hw).to(device)
        self.scale = config.head_dim**-0.5  # as the published code writes it
        self.quantization: str | None = None  # "fp8" after `quantize`

    @property
    def vocab_size(self) -> int:
        return self.config.vocab

    @property
    def device(self) -> torch.device:
        return self.lm_head.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.dtype

    def quantize(self, quantization: str) -> None:
        """Replace every decoder projection (qkv, o, gate_up, down) by its `Fp8Linear` (quantization
        "fp8"); the embedding, norms and LM head keep the model dtype. The float weights are freed."""
        from batchkv.models.quant import check_quantization, quantize_layers

        if check_quantization(quantization) is None:
            return
        for layer in self.layers:
            quantize_layers(layer, DecoderLayer.PROJECTIONS)
        self.quantization = quantization

    def cache_spec(self) -> dict:
        """KV geometry for `CacheConfig(**model.cache_spec(), max_seqs=..., capacity=..., ...)`."""
        cfg = self.config
        return {
            "num_layers": cfg.num_layers,
            "kv_heads": self.local_config.kv_heads,  # this rank's share under tensor parallelism
            "head_dim": cfg.head_dim,
            "layers": tuple(LayerSpec() for _ in range(cfg.num_layers)),
            "dtype": self.dtype,
        }

    def _attention(self, layer: int, p: DecoderLayer, x: torch.Tensor, cos, sin, cache) -> torch.Tensor:
        cfg = self.local_config
        d, hq, hkv = cfg.head_dim, cfg.q_heads, cfg.kv_heads  # this rank's heads
        qkv = linear(x, p.qkv)  # [W, (Hq + 2 Hkv) D] (x may be `Fp8Rows`, quantised by the norm)
        w = qkv.shape[0]
        # Split QK-norm then RoPE over the q and k heads: one fused kernel on CUDA.
        q, k = qk_norm_rope(qkv, p.q_norm, p.k_norm, cos, sin, self.rope.partner, hq, hkv, cfg.rms_eps)
        v = qkv[:, (hq + hkv) * d :].view(w, hkv, d)
        out = cache.update_and_attend(layer, q, k, v, scale=self.scale)  # [W, Hq, D]
        return self.shard.all_reduce(linear(out.reshape(w, hq * d), p.o_proj))  # row-parallel: sum the ranks

    def forward(self, input_ids: torch.Tensor, indexes: torch.Tensor, cache, logits_rows: torch.Tensor) -> torch.Tensor:
        """One packed step. input_ids int64 [W], indexes int64 [3, W], logits_rows int64 [R].

        Returns float32 [R, vocab]. `cache` must be declared and prepared for width W.
        """
        h = self.hidden_states(input_ids, indexes, cache, logits_rows)
        logits = linear(h, self.lm_head, out_dtype=torch.float32)  # the float32 cast fused at few rows
        return self.shard.gather(logits, self.config.vocab)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings [W, H] of int64 [W] ids, in the model dtype (a DFlash drafter's block input)."""
        return self.shard.embed(input_ids, self.embed_tokens)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """LM head of final-normed hidden states [R, H] -> logits [R, vocab] in the model dtype."""
        return self.shard.gather(linear(h, self.lm_head), self.config.vocab)

    def _producers(self):
        """(add-RMSNorm, SiLU-mul then the down projection) as functions of the projection that reads
        their output: `(consumer, h, delta, weight, eps) -> (h + delta, normed)` and `(gate_up, down)
        -> mlp`. Under FP8 compute the norm and the SiLU-mul also quantise their outputs for an
        `Fp8Linear` reader (`batchkv.models.quant.producers`)."""
        if self.quantization is None:
            return (lambda consumer, h, delta, weight, eps: add_rms_norm(h, delta, weight, eps),
                    lambda gate_up, down: linear(gate_up, down, silu_mul=True))  # fmt: skip
        from batchkv.models.quant.producers import add_rms_norm_for, silu_mul_linear

        return add_rms_norm_for, silu_mul_linear

    def hidden_states(
        self, input_ids: torch.Tensor, indexes: torch.Tensor, cache, logits_rows: torch.Tensor, taps=None
    ) -> torch.Tensor:
        """The step of `forward`, stopping before the LM head: final-normed hidden states [R, H] of
        `logits_rows`. `taps` (a `batchkv.models.taps.HiddenTaps`, or None) receives the hidden
        states after its layers for its rows. Capturable.
        """
        eps = self.config.rms_eps
        h = self.shard.embed(input_ids, self.embed_tokens)  # [W, H]
        cos, sin = self.rope.tables(indexes, h.dtype)  # [W, D] each, shared by every layer
        layers = self.layers
        x = rms_norm(h, layers[0].input_layernorm, eps)
        norm, silu_down = self._producers()
        for layer, p in enumerate(layers):
            # Each residual add is fused with the norm that follows it: one kernel on CUDA.
            h, x = norm(p.gate_up, h, self._attention(layer, p, x, cos, sin, cache), p.post_attention_layernorm, eps)
            mlp = silu_down(linear(x, p.gate_up), p.down)  # silu(gate) * up, then down
            mlp = self.shard.all_reduce(mlp)  # row-parallel: sum the ranks
            if layer + 1 < len(layers):
                h, x = norm(layers[layer + 1].qkv, h, mlp, layers[layer + 1].input_layernorm, eps)
            else:
                h = h + mlp
            if taps is not None:
                taps.record(layer, h)
        return rms_norm(h.index_select(0, logits_rows), self.norm, eps)  # [R, H]
