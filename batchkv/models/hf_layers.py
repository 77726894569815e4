"""transformers' Llama-form decoder layers with the residual adds inside the norm kernels, and the norms
writing the e4m3 codes their FP8 readers take.

transformers' Llama decoder layer (and Qwen2's, Qwen3's, Mistral's, Gemma's, SmolLM3's, ... the same
text; Gemma's norms keep it out, see `fuse_layers`) runs `residual = h; h = input_layernorm(h);
h = self_attn(h); h = residual + h; residual = h; h = post_attention_layernorm(h); h = mlp(h);
return residual + h`: two adds of [W, H] rows a layer,
each a kernel of its own before or after a norm kernel, and with FP8 projections a separate
quantiser pass over each norm's output. `fuse_layers(hf_model)` (run by `HFModel` at construction
while `FUSE` is on, after `hf_fuse`, `hf_norms` and `hf_rope`) gives every decoder layer whose class
forward is that text (transformers 5.17's or 5.24's words, local names aside, as `hf_norms` compares
sources) and whose two norms are `FusedRMSNorm`s a forward of its own doing the same steps:

- `residual + attention` and `post_attention_layernorm` as one launch (`FusedRMSNorm.add`);
- `residual + mlp` and the norm that reads the sum next (the next layer's `input_layernorm`, the last
  layer's: the decoder's `norm`) as one launch (`FusedRMSNorm.add_ahead`): the layer returns the sum
  and the next norm, called with that very tensor, unchanged since (its version counter), returns the
  norm already made. Only where the decoder's forward is proven to pass each layer's output straight
  to the next layer and the last one's to `self.norm` (its source: the loop over `self.layers` holds
  that one call, and `hidden_states = self.norm(hidden_states)` follows it), and only in a call where
  no forward hook on the layer or pre-hook on the next one could see or change the sum in between
  (taps, output capture): otherwise the plain add, and the next norm computes its own;
- the norms' readers: `input_layernorm`'s is the fused q|k|v where the attention is a known form
  (`hf_rope.known_attention`: its hidden states reach only `q_proj`, `k_proj`, `v_proj`),
  `post_attention_layernorm`'s the fused gate|up of a `SiluGatedMLP`. A reader that is an `Fp8Linear`
  (whenever the model is quantised, before or after this) is given the codes and per-row scales of the
  norm's output from the norm's own launch (`batchkv.models.quant.producers.rms_norm_quant`,
  `FusedProjection.give`) and skips its quantiser; the norm still writes its output, so nothing else
  that reads it sees a difference.

Every step rounds as transformers' ops do (the sum to the model dtype, then the norm's roundings; the
codes from the rounded output, as the quantiser computes them), so the outputs are the same bits; off
CUDA the steps are transformers' own ops. With a transformers cache passed (`generate`) the class's
forward runs, unchanged. Nothing is read back to the host and the choices are made per call, so a
captured step replays the kernels it recorded. Under tensor parallelism each rank's norms are whole and
its fused projections its slices, so each rank quantises the same rows for its own slices.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
import types

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from batchkv.models.hf_fuse import FusedProjection, SiluGatedMLP, fuse_projections
from batchkv.models.hf_norms import FusedRMSNorm, canonical_source, function_source, fuse_norms
from batchkv.models.hf_rope import fuse_rope, known_attention

FUSE = True  # HFModel adapts the decoder layers at construction while this is on (an A/B switch)

_LAYER = """
def forward(self, hidden_states, attention_mask=None, position_ids=None, {cache}=None, use_cache=False,
            position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids, {cache}={cache},
        use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
    )
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
"""
_FORMS = {canonical_source(_LAYER.format(cache=name), False): name for name in ("cache", "past_key_values")}
_CACHES = ("cache", "past_key_values")
_by_class: dict[type, str | None] = {}


def _layer_form(cls: type) -> str | None:
    """The name of the transformers-cache argument if `cls`'s forward is Llama's decoder layer's, else None."""
    if cls not in _by_class:
        call = cls.__call__
        plain = call is nn.Module.__call__ or (
            getattr(call, "__qualname__", "") == "GradientCheckpointingLayer.__call__"
            and getattr(call, "__module__", "") == "transformers.modeling_layers"
        )
        _by_class[cls] = _FORMS.get(function_source(getattr(cls, "forward", None), False)) if plain else None
    return _by_class[cls]


def _chains(decoder: nn.Module) -> bool:
    """Whether the decoder's forward (its class's, in source) passes each layer's output straight to the next
    layer and the last one's to `self.norm`: `for [i, ]decoder_layer in [enumerate(]self.layers[:
    self.config.num_hidden_layers][)]:` whose body is `hidden_states = decoder_layer(hidden_states, ...)`
    alone, followed by `hidden_states = self.norm(hidden_states)`."""
    forward = getattr(type(decoder), "forward", None)
    if "forward" in decoder.__dict__ or not inspect.isfunction(forward):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    layers = "self.layers[:self.config.num_hidden_layers]"
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for stmt, after in itertools.pairwise(body) if isinstance(body, list) else ():
            if isinstance(stmt, ast.For) and ast.unparse(stmt.iter) in (layers, f"enumerate({layers})"):
                return _passes_on(stmt) and ast.unparse(after) == "hidden_states = self.norm(hidden_states)"
    return False


def _passes_on(loop: ast.For) -> bool:
    """Whether the loop's body is `hidden_states = decoder_layer(hidden_states, <keywords>)` alone."""
    if loop.orelse or len(loop.body) != 1 or not isinstance(loop.body[0], ast.Assign):
        return False
    assign = loop.body[0]
    call = assign.value
    return (
        ast.unparse(loop.target) in ("decoder_layer", "(i, decoder_layer)", "i, decoder_layer")
        and [ast.unparse(t) for t in assign.targets] == ["hidden_states"]
        and isinstance(call, ast.Call)
        and ast.unparse(call.func) == "decoder_layer"
        and [ast.unparse(a) for a in call.args] == ["hidden_states"]
    )


def _unhooked(layer: nn.Module, following: nn.Module | None) -> bool:
    """No forward hook on `layer` nor a global one, and no forward pre-hook on `following` (the module
    whose call reads the layer's output next) nor a global one: nothing sees the output in between."""
    globally = torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
    return not (globally or layer._forward_hooks or (following is not None and following._forward_pre_hooks))


def _adapted_forward(cache_arg: str, original):
    def forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        caches = {name: kwargs.pop(name) for name in _CACHES if name in kwargs}
        if args or any(cache is not None for cache in caches.values()):  # a transformers cache: the class's own
            return original(self, hidden_states, *args, **kwargs, **caches)
        call = {"attention_mask": None, "position_ids": None, cache_arg: None, "use_cache": False,
                "position_embeddings": None} | kwargs  # fmt: skip
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **call)
        residual, hidden_states = self.post_attention_layernorm.add(residual, hidden_states)
        hidden_states = self.mlp(hidden_states)
        ahead = self.__dict__.get("_norm_ahead")  # (the norm that reads the sum next, the module calling it)
        if ahead is not None and _unhooked(self, ahead[1]):
            return ahead[0].add_ahead(residual, hidden_states)
        return residual + hidden_states

    return forward


def _norms(layer: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    return getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)


def _set_readers(layer: nn.Module, shared: set[int], done: dict[str, int]) -> None:
    """Make the layer's fused q|k|v (of a known attention) and gate|up (of a `SiluGatedMLP`) its norms' readers,
    where the norm is this layer's alone (a norm module shared between places has no one reader)."""
    before, after = _norms(layer)
    qkv = getattr(layer.self_attn, "fused_qkv", None)
    if isinstance(qkv, FusedProjection) and known_attention(layer.self_attn) and id(before) not in shared:
        object.__setattr__(before, "reader", qkv)
        done["qkv_reader"] += 1
    if isinstance(layer.mlp, SiluGatedMLP) and id(after) not in shared:
        object.__setattr__(after, "reader", layer.mlp.fused_gate_up)
        done["gate_up_reader"] += 1


def fuse_layers(hf_model: nn.Module) -> dict[str, int]:
    """Adapt each decoder layer of Llama's form whose norms are `FusedRMSNorm`s that round the normed rows
    first (Llama's norm and its copies; compiled for the H200, the forms that do not (Gemma's, Olmo2's) gave
    the kernel's codes and norms 1-ulp apart from the separate passes' at 256+ rows, so they keep those
    passes) (module docstring): returns
    how many layers were adapted, chained to the next norm, and had a q|k|v and a gate|up reader set, e.g.
    {"layers": 32, "ahead": 32, "qkv_reader": 32, "gate_up_reader": 32}. Does nothing when `FUSE` is off."""
    done = {"layers": 0, "ahead": 0, "qkv_reader": 0, "gate_up_reader": 0}
    decoder = getattr(hf_model, getattr(hf_model, "base_model_prefix", ""), hf_model)
    layers = list(getattr(decoder, "layers", ()))
    if not FUSE or not layers:
        return done
    seen = [id(norm) for layer in layers for norm in _norms(layer)] + [id(getattr(decoder, "norm", None))]
    shared = {key for key in seen if seen.count(key) > 1}
    adapted = []
    for layer in layers:
        form = _layer_form(type(layer))
        ok = form is not None and "forward" not in layer.__dict__
        ok = ok and all(isinstance(norm, FusedRMSNorm) and norm.form.round_first for norm in _norms(layer))
        if ok:
            layer.forward = types.MethodType(_adapted_forward(form, type(layer).forward), layer)
            done["layers"] += 1
            _set_readers(layer, shared, done)
        adapted.append(ok)
    if not _chains(decoder):
        return done
    count = min(len(layers), getattr(getattr(decoder, "config", None), "num_hidden_layers", len(layers)))
    for i in range(count):
        last = i + 1 == count
        norm = getattr(decoder, "norm", None) if last else (layers[i + 1].input_layernorm if adapted[i + 1] else None)
        if adapted[i] and isinstance(norm, FusedRMSNorm) and norm.form.round_first:  # (norm, its next caller)
            object.__setattr__(layers[i], "_norm_ahead", (norm, None if last else layers[i + 1]))
            done["ahead"] += 1
    return done


def fuse_decoder(hf_model: nn.Module) -> dict[str, int]:
    """Every fusion `HFModel(fuse=True)` makes, in order: q/k/v and gate/up as one GEMM each
    (`batchkv.models.hf_fuse`), the RMSNorm modules and Llama-form RoPE as one kernel each (`hf_norms`,
    `hf_rope`), then the decoder layers' residual adds and FP8 codes inside the norms (`fuse_layers`, whose
    counts it returns)."""
    fuse_projections(hf_model)
    fuse_norms(hf_model)
    fuse_rope(hf_model)
    return fuse_layers(hf_model)
