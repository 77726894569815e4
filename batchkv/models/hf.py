"""Serve a transformers causal LM (Qwen3, Llama, ...) through a batchkv cache.

`HFModel(hf_model)` has the batchkv model interface (see `batchkv.models`). It runs the model's
own forward over the packed step as one batch row `[1, W]` with `position_ids = indexes[0]`,
`use_cache=False` (no transformers cache is built) and `logits_to_keep = logits_rows`, while the
config's attention implementation is switched to "batchkv" for the duration of the call:

- "batchkv" is registered in transformers' `AttentionInterface`. The attention modules hand it
  query/key/value `[1, H, W, D]` after RoPE (and after QK-norm where the model has one); it calls
  `cache.update_and_attend(module.layer_idx, q [W, Hq, D], k, v, scale=module scaling)` with the
  cache passed down through the forward's kwargs, and returns `([1, W, Hq, D], None)`.
- "batchkv" is deliberately *not* registered as a mask function: transformers' mask builders
  return None for attention implementations without one, so no `[W, W]` mask is ever made.

Sliding-window layers (`config.layer_types == "sliding_attention"`, or `sliding_window` on a model
without layer types) become `LayerSpec("flat", window=sliding_window)` in `cache_spec()`; the
cache applies the window, with the same meaning as transformers' (the last `window` positions,
the query's own included). A sliding layer without a window (a Qwen3 config with
`use_sliding_window=False` leaves `sliding_window` None) attends fully, as in transformers.

The cache reaches the attention function two ways: in the forward's kwargs, and as the active cache
of the running `HFModel` call (a context variable), for decoder layers that do not pass their
kwargs on to the attention module (StableLM). Gemma2's `softcap` and gpt-oss's sinks (`s_aux`), which
the attention modules hand the function, go to `update_and_attend(softcap=, sinks=)`.

Refused at construction (ConfigError naming the architecture; `hf_refusals.py`): an attention class whose forward
does not dispatch through `ALL_ATTENTION_FUNCTIONS` (Falcon picks its kernels itself: the cache
would never see its keys), a soft-capping config whose attention does not pass the cap on, and
non-causal configs. Query/key and value heads of different widths (DeepSeek-V2/V3's multi-head
latent attention, expanded by transformers: keys qk_nope + qk_rope = 192 wide, values 128) go to the
cache as they are: `cache_spec()` gives `head_dim` (the keys') and `value_dim` (the values'), and the
store keeps each at its own width (docs/design.md, "Latent KV", has what a latent store would save).
`tests/test_model_coverage.py` holds the table of architectures served and refused.

Graph safety: with the mask skipped and position ids given, the Qwen3/Llama forwards do no host
reads, so the call is capturable when the cache's attention is.
Uses only APIs present in transformers 5.17 through 5.25 (`TRANSFORMERS_RANGE`, the `batchkv[hf]`
extra); importing this module without a transformers in that range is a DependencyError.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from batchkv.cache.config import LayerSpec
from batchkv.errors import ConfigError, ContractError, DependencyError
from batchkv.models.hf_fuse import fused_groups
from batchkv.models.hf_layers import fuse_decoder
from batchkv.models.hf_refusals import refuse_unrouted_attention, refuse_unsupported
from batchkv.models.hf_rope import ATTENTION as ATTN_NAME
from batchkv.models.hf_rope import deferred_rope

TRANSFORMERS_RANGE = ">=5.17,<6"  # as pyproject's `hf` extra; tested with 5.17 through 5.25
_INSTALL = "pip install 'batchkv[hf]'"

try:
    import transformers
    from transformers import AttentionInterface
except ImportError as exc:
    raise DependencyError(f"HFModel needs transformers{TRANSFORMERS_RANGE} ({exc}); {_INSTALL}") from exc
_VERSION = tuple(int(part) for part in re.findall(r"\d+", transformers.__version__)[:2])
if not (5, 17) <= _VERSION < (6, 0):
    raise DependencyError(
        f"HFModel needs transformers{TRANSFORMERS_RANGE}; this is transformers {transformers.__version__}: {_INSTALL}"
    )

CACHE_KWARG = "batchkv_cache"
# The cache of the HFModel call running now: the attention finds it here when a decoder layer does not
# pass the forward's kwargs on to its attention module (StableLM), as well as in the kwargs.
_ACTIVE_CACHE: contextvars.ContextVar = contextvars.ContextVar("batchkv_cache", default=None)


def batchkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [1, Hq, W, D], key/value [1, Hkv, W, D] after RoPE (or
    before it, with the step's cos and sin in the kwargs for the cache's write: `hf_rope.deferred_rope`).

    Writes K/V and attends through the batchkv cache found in `kwargs["batchkv_cache"]`; the mask
    is ignored (the cache knows each token's sequence and position). Returns ([1, W, Hq, D], None).
    Capturable when the cache is.
    """
    cache = kwargs[CACHE_KWARG] if kwargs.get(CACHE_KWARG) is not None else _ACTIVE_CACHE.get()
    if cache is None:
        raise ContractError(
            f"the '{ATTN_NAME}' attention runs inside an HFModel call only (its cache is none here); "
            "call the model through batchkv.models.hf.HFModel"
        )
    if query.shape[0] != 1:
        raise ContractError(f"'{ATTN_NAME}' attention packs a step into one batch row; got batch {query.shape[0]}")
    query, key, extras = deferred_rope(cache, query, key, kwargs)  # (cos, sin) for the write, or q, k rotated
    # [W, Hq, D], [W, Hkv, D], [W, Hkv, Dv] (Dv != D: MLA, the cache's value_dim): views if the last dim is
    # contiguous, which the cache takes (a fused q|k|v's value columns were copied: a launch a layer)
    rows = (x[0].transpose(0, 1) for x in (query, key, value))
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in rows)
    # softcap and sinks only when a model has them: caches that predate them keep their signature
    if kwargs.get("softcap"):  # Gemma2: attn_logit_softcapping
        extras["softcap"] = float(kwargs["softcap"])
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # gpt-oss: one logit per query head
    if sinks is not None:
        extras["sinks"] = sinks
    out = cache.update_and_attend(module.layer_idx, q, k, v, scale=scaling, **extras)
    return out[None], None


AttentionInterface.register(ATTN_NAME, batchkv_attention)


@contextlib.contextmanager
def _attention_implementation(config, name: str, cache=None) -> Iterator[None]:
    """Switch `config._attn_implementation` for one call, with `cache` the active one, and put both
    back afterwards."""
    previous = config._attn_implementation
    config._attn_implementation = name
    token = _ACTIVE_CACHE.set(cache)
    try:
        yield
    finally:
        _ACTIVE_CACHE.reset(token)
        config._attn_implementation = previous


def _head_dims(cfg) -> tuple[int, int]:
    """(head_dim, value_dim) of the cache: the config's head_dim for both, or for multi-head latent
    attention (DeepSeek-V2/V3, whose `head_dim` is the rope part alone) the expanded query/key heads'
    width (qk_nope + qk_rope) and the value heads' (`v_head_dim`)."""
    qk_dim, v_dim = getattr(cfg, "qk_head_dim", None), getattr(cfg, "v_head_dim", None)
    if qk_dim and v_dim:
        return qk_dim, v_dim
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return d, d


PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))


def quantize_decoder(hf_model: torch.nn.Module, keep: Callable[[int, str], bool] | None = None) -> int:
    """Replace the decoder layers' q/k/v/o and gate/up/down `nn.Linear`s of a transformers causal LM
    by `batchkv.models.quant.Fp8Linear`s (a row-parallel one keeps its all-reduce); the embedding
    and the LM head are left alone, and so is every projection for which `keep(layer index, name)`
    is true (e.g. sensitive layers kept in the model dtype). A fused q|k|v or gate|up
    (`batchkv.models.hf_fuse`) is quantised as one layer (ConfigError if `keep` splits it).
    Returns the number replaced (ConfigError if none)."""
    from batchkv.models.quant import quantize_layers

    decoder = getattr(hf_model, hf_model.base_model_prefix)
    fused = []  # a fused q|k|v or gate|up (`fuse_projections`) is one layer: quantised whole or not at all
    for i, _, _, group in fused_groups(hf_model):
        kept = {keep is not None and keep(i, name) for name in group.names}
        if kept == {True, False}:
            raise ConfigError(f"layer {i}: {' | '.join(group.names)} are fused, so they are quantised together or "
                              "not at all; keep all of them or none (or load with fuse=False)")  # fmt: skip
        if kept == {False}:
            fused.append(group)
    done = sum(quantize_layers(group, ["layer"]) for group in fused)
    for i, layer in enumerate(decoder.layers):
        for part, names in PROJECTIONS:
            if getattr(layer, part, None) is not None:
                chosen = [n for n in names if keep is None or not keep(i, n)]
                done += quantize_layers(getattr(layer, part), chosen)
    if not done:
        raise ConfigError(f"{hf_model.config.model_type}: no q/k/v/o or gate/up/down projections to quantise")
    return done


def _tap_hook(taps, layer: int):
    """A forward hook recording a decoder layer's output ([1, W, H], or a tuple starting with it)."""

    def hook(module: torch.nn.Module, args: object, output: object) -> None:
        h = output[0] if isinstance(output, tuple) else output
        taps.record(layer, h[0])  # type: ignore[index]

    return hook


class HFModel:
    """A transformers causal LM behind the batchkv model interface (see `batchkv.models`).

    The wrapped model stays usable on its own: the attention implementation is switched only
    inside `__call__`. Parameters are not copied; with `fuse` (the default) q/k/v and gate/up become one GEMM
    each, on CUDA RMSNorm (with the residual adds and FP8 quantisers) and Llama-form RoPE one kernel each,
    where the modules allow it (hf_fuse, hf_norms, hf_rope, hf_layers; the state dict's names stay);
    `fuse=False` leaves the modules untouched. `kv_dtype` (e.g. `torch.float8_e4m3fn`) goes into
    `cache_spec()`, so an engine or cache built from it stores K/V that way. `shard`: the tensor-parallel
    rank whose share `hf_model` holds (`batchkv.models.loading.load_hf_shard` builds one): its cache then
    holds that rank's KV heads, and the vocabulary is the config's.

    >>> hf = Qwen3ForCausalLM(Qwen3Config(...)); model = HFModel(hf)
    >>> cache = BatchedSequenceCache(CacheConfig(**model.cache_spec(), max_seqs=4, capacity=512))
    >>> logits = model(input_ids, indexes, cache, logits_rows)   # float32 [R, vocab]
    """

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
        quantization: str | None = None,
        fuse: bool = True,
    ) -> HFModel:
        """Load a transformers model directory, or a GGUF file (converted once and cached by
        `batchkv.models.gguf.transformers_dir`), onto `device`. `dtype` None: the config's.
        The EOS ids and max positions then come from its configuration; `model.directory` is the
        transformers directory (its tokenizer and chat template live there).
        `quantization="fp8"`: the decoder's q/k/v/o and gate/up/down become
        `batchkv.models.quant.Fp8Linear`s (per-channel scales computed at load); the embedding and
        the LM head keep `dtype`. A directory whose config.json carries a `quantization_config`
        (an FP8 checkpoint) loads as published (`batchkv.models.quant.checkpoints`), whatever
        `quantization` says. `fuse`: as `HFModel(..., fuse=)` (fused projections and kernels).

        >>> model = HFModel.from_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf")
        >>> model.eos_token_ids, model.max_positions   # ((2,), 8192)
        """
        from transformers import AutoModelForCausalLM

        from batchkv.models.gguf import is_gguf, transformers_dir

        source = Path(path)
        directory = transformers_dir(source) if is_gguf(source) else source
        if not (directory / "config.json").is_file():
            raise ConfigError(f"{source} is neither a GGUF file nor a transformers directory (no config.json)")
        from batchkv.models.quant import check_quantization
        from batchkv.models.quant.checkpoints import load_quantized_hf, quantization_config

        check_quantization(quantization)
        if quantization_config(directory) is not None:
            hf = load_quantized_hf(directory, device=torch.device(device), dtype=dtype)
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype or "auto").to(device)
            if quantization is not None:
                quantize_decoder(hf)
        model = cls(hf, kv_dtype=kv_dtype, fuse=fuse)
        model.directory = directory
        return model

    def __init__(
        self, hf_model: torch.nn.Module, *, kv_dtype: torch.dtype | None = None, shard=None, fuse: bool = True
    ) -> None:
        if not isinstance(hf_model, torch.nn.Module) or not hasattr(hf_model, "get_output_embeddings"):
            raise ConfigError(f"HFModel wraps a transformers causal LM (an nn.Module), not {type(hf_model).__name__}")
        refuse_unsupported(hf_model.config)
        refuse_unrouted_attention(hf_model)
        self.hf = hf_model.eval()
        self.kv_dtype = kv_dtype
        self.config = hf_model.config
        if fuse:  # after the refusals: a refused model is left as it was
            fuse_decoder(hf_model)  # projections, norms, RoPE and layers (batchkv.models.hf_layers.fuse_decoder)
        self._head = hf_model.get_output_embeddings()
        self.shard = shard  # a batchkv.models.parallel.Shard, or None: the whole model
        self.directory: Path | None = None  # set by from_pretrained

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size if self.shard is not None else self._head.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self._head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._head.weight.dtype

    @property
    def max_positions(self) -> int | None:
        """The config's max_position_embeddings (an engine's capacity when none is given), or None."""
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end a generation: the generation config's `eos_token_id`, else the model
        config's (an int or a list), else none. `Engine.submit` stops requests at them unless
        `SamplingParams(ignore_eos=True)`."""
        generation = getattr(self.hf, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def _layer_specs(self) -> tuple[LayerSpec, ...]:
        cfg = self.config
        n, window = cfg.num_hidden_layers, getattr(cfg, "sliding_window", None) or 0
        types = getattr(cfg, "layer_types", None)
        if types is None:  # older configs: one window for every layer, when switched on
            types = [
                "sliding_attention" if window and getattr(cfg, "use_sliding_window", True) else "full_attention"
            ] * n
        specs = []
        for i, kind in enumerate(types[:n]):
            if kind == "full_attention" or (kind == "sliding_attention" and not window):
                specs.append(LayerSpec())  # a sliding layer without a window attends fully, as in transformers
            elif kind == "sliding_attention" and window:
                specs.append(LayerSpec("flat", window=window))
            else:
                raise ConfigError(f"{cfg.model_type} layer {i} is {kind!r}; batchkv serves full and sliding attention")
        return tuple(specs)

    def cache_spec(self) -> dict:
        """KV geometry from the config: `CacheConfig(**model.cache_spec(), max_seqs=..., capacity=...)`;
        `value_dim` only where the values' width differs from the keys' (multi-head latent attention)."""
        cfg = self.config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        if self.shard is not None:  # this rank's share
            kv_heads = len(self.shard.heads(heads, kv_heads)[1])
        head_dim, value_dim = _head_dims(cfg)
        return {
            "num_layers": cfg.num_hidden_layers,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            **({"value_dim": value_dim} if value_dim != head_dim else {}),
            "layers": self._layer_specs(),
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
        }

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings [W, H] of int64 [W] ids, in the model dtype (a DFlash drafter's block input)."""
        return self.hf.get_input_embeddings()(input_ids)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """LM head of final-normed hidden states [R, H] -> logits [R, vocab] in the model dtype, with what
        the model's own forward does to its logits after the head: Cohere's `logit_scale`, Granite's
        `logits_scaling`, Gemma2's `final_logit_softcapping` (so a speculative verify, which calls this,
        samples what `__call__` would)."""
        logits = self._head(h)
        cfg = self.config
        scale = getattr(self.hf, "logit_scale", None)
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            logits = logits * scale
        if getattr(cfg, "logits_scaling", None):
            logits = logits / cfg.logits_scaling
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def hidden_states(
        self, input_ids: torch.Tensor, indexes: torch.Tensor, cache, logits_rows: torch.Tensor, taps=None
    ) -> torch.Tensor:
        """The decoder's final-normed hidden states [R, H] of `logits_rows` (the step of `__call__`
        without the LM head). `taps` (a `batchkv.models.taps.HiddenTaps`, or None) receives the
        states after its decoder layers, through forward hooks that select its rows. Capturable
        when the cache is.
        """
        decoder = getattr(self.hf, self.hf.base_model_prefix)
        hooks = []
        if taps is not None:
            for layer in taps.layer_ids:
                hook = _tap_hook(taps, layer)
                hooks.append(decoder.layers[layer].register_forward_hook(hook))
        try:
            with _attention_implementation(self.config, ATTN_NAME, cache):
                out = decoder(
                    input_ids=input_ids[None],
                    position_ids=indexes[0][None],
                    use_cache=False,
                    **{CACHE_KWARG: cache},
                )
        finally:
            for hook in hooks:
                hook.remove()
        return out.last_hidden_state[0].index_select(0, logits_rows)

    @torch.no_grad()
    def __call__(
        self, input_ids: torch.Tensor, indexes: torch.Tensor, cache, logits_rows: torch.Tensor
    ) -> torch.Tensor:
        """One packed step: input_ids int64 [W], indexes int64 [3, W] (row 0 = position ids),
        logits_rows int64 [R]. Returns float32 [R, vocab]. Capturable when the cache is.
        """
        with _attention_implementation(self.config, ATTN_NAME, cache):
            out = self.hf(
                input_ids=input_ids[None],
                position_ids=indexes[0][None],
                use_cache=False,
                logits_to_keep=logits_rows,
                **{CACHE_KWARG: cache},
            )
        return out.logits[0].float()
