"""`DFlashDrafter`: the drafter's forward over a batchkv cache (the math is in `batchkv.models.dflash`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchkv.cache.config import LayerSpec
from batchkv.models.dflash.config import DFlashConfig
from batchkv.models.taps import HiddenTaps


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [W, H, D] with cos/sin [W, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class DFlashDrafter(nn.Module):
    """A DFlash drafter over a target model (see the module docstring). Parameters are named as in
    the checkpoint; the target's embedding and LM head are used, not copied.

    target: a model with `embed(ids) -> [W, H]` and `head(h) -> [R, vocab]` (SenseNovaLM, HFModel).
    """

    def __init__(self, config: DFlashConfig, target, device: torch.device | str = "cpu", dtype=torch.bfloat16):
        super().__init__()
        self.config = config
        c, kw = config, {"device": torch.device(device), "dtype": dtype}
        self.fc = nn.Linear(c.features, c.hidden, bias=False, **kw)
        self.hidden_norm = nn.Parameter(torch.ones(c.hidden, **kw), requires_grad=False)
        self.layers = nn.ModuleList()
        for _ in range(c.num_layers):
            attn = nn.Module()
            attn.q_proj = nn.Linear(c.hidden, c.q_heads * c.head_dim, bias=False, **kw)
            attn.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False, **kw)
            attn.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False, **kw)
            attn.o_proj = nn.Linear(c.q_heads * c.head_dim, c.hidden, bias=False, **kw)
            attn.q_norm = nn.Module()
            attn.k_norm = nn.Module()
            attn.q_norm.weight = nn.Parameter(torch.ones(c.head_dim, **kw), requires_grad=False)
            attn.k_norm.weight = nn.Parameter(torch.ones(c.head_dim, **kw), requires_grad=False)
            mlp = nn.Module()
            mlp.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False, **kw)
            mlp.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False, **kw)
            mlp.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False, **kw)
            layer = nn.Module()
            layer.self_attn, layer.mlp = attn, mlp
            layer.input_layernorm = nn.Module()
            layer.post_attention_layernorm = nn.Module()
            layer.input_layernorm.weight = nn.Parameter(torch.ones(c.hidden, **kw), requires_grad=False)
            layer.post_attention_layernorm.weight = nn.Parameter(torch.ones(c.hidden, **kw), requires_grad=False)
            self.layers.append(layer)
        self.norm = nn.Parameter(torch.ones(c.hidden, **kw), requires_grad=False)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.inv_freq = nn.Buffer(inv_freq.to(device), persistent=False)
        self.scale = c.head_dim**-0.5
        self._target = (target,)  # not a submodule: its weights are the target's
        self.requires_grad_(False)

    @property
    def target(self):
        return self._target[0]

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def cache_spec(self) -> dict:
        """KV geometry of the drafter's own cache (flat layers; its steps are non-causal)."""
        c = self.config
        layers = tuple(LayerSpec() for _ in range(c.num_layers))
        return {"num_layers": c.num_layers, "kv_heads": c.kv_heads, "head_dim": c.head_dim, "layers": layers,
                "dtype": self.dtype}  # fmt: skip

    def make_taps(self, max_rows: int) -> HiddenTaps:
        """The static tap buffer a target fills with this drafter's context features."""
        return HiddenTaps(self.config.target_layer_ids, self.config.hidden, max_rows, self.device, self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        is_context: torch.Tensor,
        t_index: torch.Tensor,
        cache,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """One drafter step over the column store (declared and prepared, width W).

        input_ids int64 [W] (block rows: anchor then mask_token_id; context rows: any id);
        features [W, len(target_layer_ids) * H] (context rows; others ignored); is_context bool [W];
        t_index int64 [W] (RoPE index of each row's position); rows int64 [R] (block rows whose
        drafts are wanted). Returns the final-normed hidden states [R, H]: `target.head` gives the
        draft logits. Capturable.
        """
        c, w = self.config, input_ids.shape[0]
        ctx = _rms(self.fc(features.to(self.dtype)), self.hidden_norm, c.rms_eps)  # [W, H]
        h = self.target.embed(input_ids).to(self.dtype)
        cos, sin = self._rope_tables(t_index)
        use_ctx = is_context[:, None]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = _rms(h, layer.input_layernorm.weight, c.rms_eps)
            q = _rms(attn.q_proj(x).view(w, c.q_heads, c.head_dim), attn.q_norm.weight, c.rms_eps)
            k, v = self._kv(attn, torch.where(use_ctx, ctx, x), cos, sin)
            out = cache.update_and_attend(i, _rope(q, cos, sin), k, v, scale=self.scale, causal=False)  # [W, Hq, D]
            h = h + attn.o_proj(out.reshape(w, -1))
            x = _rms(h, layer.post_attention_layernorm.weight, c.rms_eps)
            h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))
        return _rms(h.index_select(0, rows), self.norm, c.rms_eps)

    def write_context(self, features: torch.Tensor, t_index: torch.Tensor, cache) -> None:
        """A step of context rows only (no block to draft): the K/V `forward` writes for them,
        without the layers' queries, outputs and MLPs, which only block rows need.

        features [W, len(target_layer_ids) * H]; t_index int64 [W]; the cache declared and prepared
        for width W. The cache's one entry point writes and attends; its output is not used (the
        queries are the keys, repeated over each GQA group). Capturable.
        """
        c, w = self.config, features.shape[0]
        ctx = _rms(self.fc(features.to(self.dtype)), self.hidden_norm, c.rms_eps)  # [W, H]
        cos, sin = self._rope_tables(t_index)
        for i, layer in enumerate(self.layers):
            k, v = self._kv(layer.self_attn, ctx, cos, sin)
            q = k[:, :, None].expand(w, c.kv_heads, c.q_heads // c.kv_heads, c.head_dim).reshape(w, c.q_heads, -1)
            cache.update_and_attend(i, q, k, v, scale=self.scale, causal=False)

    def _rope_tables(self, t_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angle = t_index.float()[:, None] * self.inv_freq  # [W, D/2] float32
        return angle.cos().to(self.dtype), angle.sin().to(self.dtype)

    def _kv(self, attn: nn.Module, src: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """k (normed, rotated) and v [W, Hkv, D] of one layer from its source rows src [W, H]."""
        c, w = self.config, src.shape[0]
        k = _rms(attn.k_proj(src).view(w, c.kv_heads, c.head_dim), attn.k_norm.weight, c.rms_eps)
        return _rope(k, cos, sin), attn.v_proj(src).view(w, c.kv_heads, c.head_dim)
