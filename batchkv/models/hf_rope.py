"""transformers' Llama-style attention with its rotary embedding as one kernel (`batchkv.models.fused.rope_qk`).

`apply_rotary_pos_emb` runs ten eager ops per layer on the GPU (for q and for k: x * cos, the
negation and the cat of `rotate_half`, * sin, the sum). `fuse_rope(hf_model)` (run by `HFModel` at
construction while `FUSE` is on) gives each attention module whose class forward is, in source,
Llama's, Qwen2's or Mistral's (Llama's passing the sliding window on from the module or the config)
or Qwen3's (Qwen2's with q and k RMS-normed per head first, by `hf_norms`' kernel) a forward of its
own: the same steps, with the rotation of q and k one launch. The rule is `hf_norms`': transformers
5.17's or 5.24's text, local names aside, with the module's `apply_rotary_pos_emb` and `rotate_half`
Llama's too. Under batchkv's own attention the rotation moves into the cache's K/V write (`deferred_rope`).
Only the module's `forward` attribute is set: transformers' functions and classes are
untouched, and a module that already has a forward of its own (another adapter) is left alone. With
a transformers cache passed (`generate`), the class's forward runs, unchanged. Off CUDA (and for
batches of more than one row, or heads that are not a power of two) `rope_qk` runs transformers'
op sequence, so the CPU results are the class's to the bit.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn

from batchkv.models.fused import rope_qk
from batchkv.models.hf_norms import canonical_source, function_source

FUSE = True  # HFModel adapts the attention modules at construction while this is on
# Under batchkv's attention ("batchkv", `batchkv.models.hf`) the adapted forward hands q and k on unrotated,
# with the step's (cos, sin) in the kwargs (ROPE_KWARG), and the cache's K/V write rotates both in its own
# launch (`deferred_rope`; one launch a layer fewer). WRITE_ROPE False: `rope_qk` here, as elsewhere (A/B).
WRITE_ROPE = True
ATTENTION = "batchkv"
ROPE_KWARG = "batchkv_rope"

_FORWARD = """
def forward(self, hidden_states, {signature}, **kwargs):
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
{qk}
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if {cache} is not None:
        key_states, value_states = {cache}.update(key_states, value_states, self.layer_idx{update})
    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, {sliding}**kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights
"""
# Llama's (no window), Qwen2's and Mistral's (the window passed on, from the module or the config), in
# transformers 5.24's words (the cache argument `cache`) and 5.17's (`past_key_values`).
_WINDOWS = {"": None, "sliding_window=self.sliding_window, ": "module",
            'sliding_window=getattr(self.config, "sliding_window", None), ': "config"}  # fmt: skip
_CACHES = {"cache": ", kwargs=kwargs", "past_key_values": ""}
_SIGNATURES = ("position_embeddings=None, attention_mask=None", "position_embeddings, attention_mask")
_QK = {  # the q and k heads as they are (Llama) or each RMS-normed first (Qwen3's q_norm and k_norm)
    False: "    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n"
    "    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
    True: "    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)\n"
    "    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)",
}
_APPLY = """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""
_ROTATE = """
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
"""
_FORMS = {
    canonical_source(_FORWARD.format(signature=f"{signature}, {cache}=None", cache=cache, update=update,
                                     sliding=sliding, qk=qk), False): (cache, window, normed)
    for signature in _SIGNATURES
    for cache, update in _CACHES.items()
    for sliding, window in _WINDOWS.items()
    for normed, qk in _QK.items()
}  # fmt: skip
_HELPERS = {"apply_rotary_pos_emb": canonical_source(_APPLY), "rotate_half": canonical_source(_ROTATE)}
_Form = tuple[str, str | None, bool]  # (cache argument, where the window comes from, q/k normed)
_by_class: dict[type, _Form | None] = {}


def _class_form(cls: type) -> _Form | None:
    """(the name of its transformers-cache argument, where its sliding window comes from: None, "module"
    or "config", whether q and k are RMS-normed first) if `cls`'s forward is Llama's, Qwen2's, Mistral's
    or Qwen3's (module docstring), else None."""
    if cls not in _by_class:
        forward = getattr(cls, "forward", None)
        scope = getattr(inspect.unwrap(forward), "__globals__", {}) if forward is not None else {}
        known = (
            cls.__call__ is nn.Module.__call__ and scope.get("torch") is torch and "ALL_ATTENTION_FUNCTIONS" in scope
        )
        known = known and all(function_source(scope.get(name)) == text for name, text in _HELPERS.items())
        _by_class[cls] = _FORMS.get(function_source(forward, False)) if known else None
    return _by_class[cls]


def rope_form(module: nn.Module) -> _Form | None:
    """`module`'s (cache argument, window source, q/k normed) if `fuse_rope` would adapt it, else None."""
    if "forward" in module.__dict__ or module._forward_hooks or module._forward_pre_hooks:
        return None
    return _class_form(type(module))


def known_attention(module: nn.Module) -> bool:
    """Whether `module` runs its class's forward or `fuse_rope`'s for it, and that forward is one of the
    known forms: it reads its hidden states only through `q_proj`, `k_proj` and `v_proj`, and the shape."""
    own = module.__dict__.get("forward")
    adapted = own is None or getattr(getattr(own, "__func__", None), "__qualname__", "") == _ADAPTED
    return adapted and _class_form(type(module)) is not None


def _adapted_forward(form: _Form, original, scope: dict):
    interfaces, eager = scope["ALL_ATTENTION_FUNCTIONS"], scope["eager_attention_forward"]
    cache_arg, window, normed = form

    def forward(
        self: nn.Module, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        caches = [kwargs.pop(name, None) for name in {cache_arg, "past_key_values", "cache"}]
        if any(cache is not None for cache in caches):  # a transformers cache (generate): the class's own forward
            kwargs[cache_arg] = next(cache for cache in caches if cache is not None)
            return original(self, hidden_states, position_embeddings, attention_mask, **kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)
        k = self.k_proj(hidden_states).view(hidden_shape)
        if normed:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        if WRITE_ROPE and self.config._attn_implementation == ATTENTION:
            kwargs[ROPE_KWARG] = (cos, sin)  # rotated by the cache's write (`deferred_rope`)
        else:
            q, k = rope_qk(q, k, cos, sin)
        attend = interfaces.get_interface(self.config._attn_implementation, eager)
        dropout = 0.0 if not self.training else self.attention_dropout
        if window == "module":
            kwargs["sliding_window"] = self.sliding_window
        elif window == "config":
            kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
        out, weights = attend(self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    return forward


_ADAPTED = _adapted_forward.__qualname__ + ".<locals>.forward"


def fuse_rope(model: nn.Module) -> int:
    """Give every attention module under `model` of Llama's form the forward with the one-kernel
    RoPE (module docstring). Returns how many; does nothing when `FUSE` is off."""
    if not FUSE:
        return 0
    done = 0
    for module in model.modules():
        form = rope_form(module)
        if form is not None:
            original = type(module).forward
            forward = _adapted_forward(form, original, inspect.unwrap(original).__globals__)
            module.forward = types.MethodType(forward, module)
            done += 1
    return done


def deferred_rope(cache: object, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> tuple:
    """(query, key, extras) for the "batchkv" attention of an adapted module: with no ROPE_KWARG in
    `kwargs`, q and k as they came (rotated) and no extras; else, for a cache whose write rotates them
    (`fuses_rope`), q and k unrotated and {"rope": (cos, sin) [W, D]} for `update_and_attend`; for any
    other cache, q and k rotated here (`rope_qk`) and no extras."""
    rope = kwargs.get(ROPE_KWARG)
    if rope is None:
        return query, key, {}
    cos, sin = rope
    if getattr(cache, "fuses_rope", False) and cos.dim() == 3 and cos.shape[0] == 1:
        return query, key, {"rope": (cos[0], sin[0])}
    return (*rope_qk(query, key, cos, sin), {})
