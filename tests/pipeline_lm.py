"""A tiny language model with the SenseNova-U1 pipeline's call signature, and its two decode loops.

`PipelineLM(input_ids [B, S], indexes [3, S], past_key_values=, use_cache=, paged_cache=)` returns
an object with `.logits` [B, S, vocab] (float32). Attention takes the pipeline's two paths: with a
transformers `DynamicCache` it appends by `update` and runs torch SDPA (the eager path), and with
`paged_cache` a single-token step calls `paged_cache.attend(layer_idx, q, k, v, scale)`.

`eager_loop` and `paged_loop` drive it the way the pipeline does: prefill into a DynamicCache,
then decode token by token, either on the DynamicCache or through `PagedDecodeCache` and
`DecodeGraphRunner` (grow at a bucket boundary, `set_length`, `step`, `to_dynamic_cache`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache

from batchkv.compat import DecodeGraphRunner, PagedDecodeCache


def text_indexes(start: int, n: int, device: torch.device | str) -> torch.Tensor:
    """int64 [3, n]: (t, 0, 0) with t from `start`."""
    idx = torch.zeros(3, n, dtype=torch.int64, device=device)
    idx[0] = torch.arange(start, start + n, device=device)
    return idx


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, layer_idx: int, hidden: int, q_heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx, self.q_heads, self.kv_heads, self.head_dim = layer_idx, q_heads, kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, q_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(q_heads * head_dim, hidden, bias=False)

    def forward(self, h, cos, sin, past_key_values, paged_cache):
        b, s, _ = h.shape
        q = self.q_proj(h).view(b, s, self.q_heads, self.head_dim).transpose(1, 2)  # [B, Hq, S, D]
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if paged_cache is not None:
            if s != 1:
                raise ValueError("the paged path serves single-token decode steps only")
            out = paged_cache.attend(self.layer_idx, q, k, v, self.scale)  # [1, 1, Hq, D]
        else:
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, self.layer_idx)
            n = k.shape[2]
            mask = None
            if s > 1:  # query i sits at position n - s + i
                mask = torch.arange(n, device=h.device)[None, :] <= torch.arange(n - s, n, device=h.device)[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out = out.transpose(1, 2)  # [B, S, Hq, D]
        return self.o_proj(out.reshape(b, s, self.q_heads * self.head_dim))


class Layer(nn.Module):
    def __init__(self, layer_idx: int, hidden: int, q_heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.input_norm = nn.Parameter(torch.ones(hidden))
        self.post_norm = nn.Parameter(torch.ones(hidden))
        self.self_attn = Attention(layer_idx, hidden, q_heads, kv_heads, head_dim)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, h, cos, sin, past_key_values, paged_cache):
        h = h + self.self_attn(_rms(h, self.input_norm), cos, sin, past_key_values, paged_cache)
        return h + self.down(F.silu(self.up(_rms(h, self.post_norm))))


class PipelineLM(nn.Module):
    """Embeddings, `num_layers` pre-norm layers (GQA attention with RoPE over the t index, SiLU MLP)."""

    def __init__(self, vocab=61, hidden=64, num_layers=3, q_heads=4, kv_heads=2, head_dim=16, seed=0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(i, hidden, q_heads, kv_heads, head_dim) for i in range(num_layers))
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        inv_freq = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids, indexes, past_key_values=None, use_cache=False, paged_cache=None):
        h = self.embed(input_ids)  # [B, S, H]
        freqs = indexes[0].float()[:, None] * self.inv_freq.float()  # [S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)  # [S, D], broadcast over B, heads
        for layer in self.layers:
            h = layer(h, cos, sin, past_key_values, paged_cache)
        logits = self.lm_head(_rms(h, self.norm)).float()
        return SimpleNamespace(logits=logits, past_key_values=past_key_values if use_cache else None)


def _prefill(lm: nn.Module, prompt: torch.Tensor) -> DynamicCache:
    dyn = DynamicCache()
    with torch.no_grad():
        lm(input_ids=prompt[None], indexes=text_indexes(0, len(prompt), prompt.device), past_key_values=dyn)
    return dyn


def eager_loop(lm: nn.Module, prompt: torch.Tensor, tokens: list[int]) -> tuple[list[torch.Tensor], DynamicCache]:
    """Decode `tokens` after `prompt` on a DynamicCache: logits [vocab] per step, and the cache."""
    dyn, out = _prefill(lm, prompt), []
    device, n = prompt.device, len(prompt)
    for i, token in enumerate(tokens):
        ids = torch.tensor([[token]], device=device)
        with torch.no_grad():
            logits = lm(input_ids=ids, indexes=text_indexes(n + i, 1, device), past_key_values=dyn, use_cache=True)
        out.append(logits.logits[0, -1])
    return out, dyn


def paged_loop(lm, prompt, tokens, context=None, dtype=torch.float32, graphs=None, **options):
    """The pipeline's paged decode: reuse `context` = (cache, runner) when it fits, else build one.

    Returns (logits per step, the DynamicCache written back, (cache, runner)).
    """
    dyn, out = _prefill(lm, prompt), []
    device, n = prompt.device, len(prompt)
    num_layers, kv_heads, head_dim = lm.num_layers, lm.kv_heads, lm.head_dim
    if context is not None and context[0].reusable_for(num_layers, kv_heads, head_dim, dtype, n + 1):
        paged, runner = context
        assert paged.load_prefix(dyn)
    else:
        paged = PagedDecodeCache.from_dynamic_cache(dyn, num_layers, device, dtype, **options)
        runner = DecodeGraphRunner(lm, paged, device, graphs=graphs)
    for i, token in enumerate(tokens):
        if paged.length + 1 > paged.bucket:
            paged.grow(paged.length + 1)
        paged.set_length(paged.length + 1)
        out.append(runner.step(token, n + i)[0, -1].clone())
    paged.to_dynamic_cache(dyn)
    return out, dyn, (paged, runner)


class SenseNovaPipelineAdapter(nn.Module):
    """batchkv's SenseNova-U1 model behind the pipeline's call signature (paged decode path only).

    The model attends through `cache.update_and_attend`, which `PagedDecodeCache` forwards to its
    `max_seqs = 1` store, so it runs on the facade unchanged. Returns `.logits` [1, 1, vocab].
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        cfg = model.config
        self.num_layers, self.kv_heads, self.head_dim = cfg.num_layers, cfg.kv_heads, cfg.head_dim
        self.register_buffer("rows", torch.zeros(1, dtype=torch.int64, device=model.device), persistent=False)

    def forward(self, input_ids, indexes, past_key_values=None, use_cache=False, paged_cache=None):
        if paged_cache is None:
            raise ValueError("this adapter serves the paged decode path only")
        logits = self.model(input_ids.reshape(1), indexes, paged_cache, self.rows)  # [1, vocab]
        return SimpleNamespace(logits=logits.view(1, 1, -1))


def sensenova_runs(model: nn.Module, prompt: torch.Tensor, tokens: list[int], **options):
    """The model's eager reference (SDPA over K/V grown by cat) and the pipeline loop on the facade.

    Returns ((reference logits per step, reference K/V per layer), (paged logits, DynamicCache
    written back), runner).
    """
    from batchkv.models.reference import reference_logits

    device, n = prompt.device, len(prompt)
    _, past = reference_logits(model, prompt, text_indexes(0, n, device))
    dyn = DynamicCache()
    for layer, (k, v) in enumerate(past):
        dyn.update(k[None], v[None], layer)  # [Hkv, T, D] -> [1, Hkv, T, D]
    want = []
    for i, token in enumerate(tokens):
        ids = torch.tensor([token], device=device)
        logits, past = reference_logits(model, ids, text_indexes(n + i, 1, device), past)
        want.append(logits[-1])
    lm = SenseNovaPipelineAdapter(model)
    paged = PagedDecodeCache.from_dynamic_cache(dyn, lm.num_layers, device, model.dtype, **options)
    runner = DecodeGraphRunner(lm, paged, device)
    got = []
    for i, token in enumerate(tokens):
        if paged.length + 1 > paged.bucket:
            paged.grow(paged.length + 1)
        paged.set_length(paged.length + 1)
        got.append(runner.step(token, n + i)[0, -1].clone())
    paged.to_dynamic_cache(dyn)
    return (want, past), (got, dyn), runner
