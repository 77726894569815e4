"""A tiny language model that drives the cache the way the real ones do, and its eager oracle.

`ToyModel` follows the executor's model interface: forward(input_ids [W], indexes [3, W], cache,
logits_rows [R]) -> float32 [R, vocab], `cache_spec()`, `vocab_size`, `device`. Two layers (one
flat, one sliding-window ring), GQA, RoPE on the t index plus an absolute sin(t) signal (so a
wrong t shows even when it is off by a constant), a SwiGLU MLP and an untied LM head.

`reference_generate` is the oracle: it decodes one sequence alone and recomputes the whole prefix
each token with torch SDPA and an explicit causal/window mask, with no cache at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchkv.cache import LayerSpec


def _rope(x: torch.Tensor, t: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE of x [W, H, D] at positions t [W]."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = t.float()[:, None] * freqs[None, :]  # [W, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class ToyModel(nn.Module):
    """Random-init toy LM: vocab 97, hidden 32, 4 query / 2 KV heads of 8, layers flat + ring(window)."""

    def __init__(
        self,
        *,
        vocab: int = 97,
        hidden: int = 32,
        heads: int = 4,
        kv_heads: int = 2,
        head_dim: int = 8,
        window: int = 8,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.vocab_size, self.heads, self.kv_heads, self.head_dim = vocab, heads, kv_heads, head_dim
        self.window, self.dtype, self.device = window, dtype, torch.device(device)
        gen = torch.Generator().manual_seed(seed)

        def linear(n_in: int, n_out: int, gain: float = 1.0) -> nn.Linear:
            layer = nn.Linear(n_in, n_out, bias=False)
            layer.weight.data = torch.randn(n_out, n_in, generator=gen) * gain / n_in**0.5
            return layer

        self.embed = nn.Embedding(vocab, hidden)
        self.embed.weight.data = torch.randn(vocab, hidden, generator=gen)
        # An absolute signal of t (RoPE alone is blind to a constant shift of t): sin(t * freq).
        self.t_freq = nn.Parameter(torch.rand(hidden, generator=gen), requires_grad=False)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            block = nn.ModuleDict(
                {
                    "q": linear(hidden, heads * head_dim),
                    "k": linear(hidden, kv_heads * head_dim),
                    "v": linear(hidden, kv_heads * head_dim),
                    "o": linear(heads * head_dim, hidden),
                    "gate": linear(hidden, 2 * hidden),
                    "up": linear(hidden, 2 * hidden),
                    "down": linear(2 * hidden, hidden),
                }
            )
            self.blocks.append(block)
        self.head = linear(hidden, vocab, gain=4.0)
        self.to(device=self.device, dtype=dtype)

    def cache_spec(self) -> dict:
        return {
            "num_layers": 2,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "layers": (LayerSpec("flat"), LayerSpec("ring", window=self.window)),
            "dtype": self.dtype,
        }

    def _layers(self, input_ids: torch.Tensor, t: torch.Tensor, attend) -> torch.Tensor:
        """The network around attention; attend(layer, q, k, v) -> [W, Hq, D]."""
        x = self.embed(input_ids) + torch.sin(t.float()[:, None] * self.t_freq.float()).to(self.dtype)
        w = input_ids.shape[0]
        for i, block in enumerate(self.blocks):
            h = F.rms_norm(x, (x.shape[-1],), eps=1e-6)
            q = _rope(block["q"](h).view(w, self.heads, self.head_dim), t)
            k = _rope(block["k"](h).view(w, self.kv_heads, self.head_dim), t)
            v = block["v"](h).view(w, self.kv_heads, self.head_dim)
            x = x + block["o"](attend(i, q, k, v).reshape(w, -1))
            h = F.rms_norm(x, (x.shape[-1],), eps=1e-6)
            x = x + block["down"](F.silu(block["gate"](h)) * block["up"](h))
        return F.rms_norm(x, (x.shape[-1],), eps=1e-6)

    def forward(self, input_ids, indexes, cache, logits_rows) -> torch.Tensor:
        """input_ids int64 [W]; indexes int64 [3, W] (t, h, w); logits_rows int64 [R] -> float32 [R, vocab]."""
        return self.head(self.hidden_states(input_ids, indexes, cache, logits_rows)).float()

    def hidden_states(self, input_ids, indexes, cache, logits_rows, taps=None) -> torch.Tensor:
        """Final-normed hidden states [R, hidden] of `logits_rows` (speculative decoding's verify path)."""
        return self._layers(input_ids, indexes[0], cache.update_and_attend)[logits_rows]

    @torch.no_grad()
    def reference_logits(self, ids: list[int], rope_offset: int = 0) -> torch.Tensor:
        """Logits of every position of one sequence, recomputed from scratch: float32 [L, vocab]."""
        input_ids = torch.tensor(ids, device=self.device)
        n = len(ids)
        pos = torch.arange(n, device=self.device)
        causal = pos[None, :] <= pos[:, None]
        masks = [causal, causal & (pos[None, :] > pos[:, None] - self.window)]
        group = self.heads // self.kv_heads

        def attend(layer, q, k, v):
            q, k, v = (x.transpose(0, 1) for x in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=masks[layer]).transpose(0, 1)

        return self.head(self._layers(input_ids, pos + rope_offset, attend)).float()


def reference_generate(
    model: ToyModel,
    prompt: list[int],
    max_new_tokens: int,
    *,
    stop_token_ids: tuple[int, ...] = (),
    capacity: int | None = None,
    rope_offset: int = 0,
) -> tuple[list[int], str]:
    """Greedy decode of one prompt alone, no cache: (tokens, finish reason stop|length|capacity)."""
    ids, out = list(prompt), []
    while True:
        token = int(model.reference_logits(ids, rope_offset)[-1].argmax())
        out.append(token)
        if token in stop_token_ids:
            return out, "stop"
        if len(out) >= max_new_tokens:
            return out, "length"
        if capacity is not None and len(prompt) + len(out) > capacity:
            return out, "capacity"
        ids.append(token)
