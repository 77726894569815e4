"""Fused q/k/v and gate/up projections for transformers decoders: one GEMM where the model runs three or two.

transformers' attention modules call `q_proj(x)`, `k_proj(x)` and `v_proj(x)` one after the other on
the same normed hidden states, and their MLPs `gate_proj(x)` and `up_proj(x)`: three and two GEMMs a
layer (and under FP8 compute three and two activation quantisations). `fuse_projections` puts, in each
decoder layer where the modules allow it, one `FusedProjection` beside them (`fused_qkv` on the
attention module, `fused_gate_up` on the MLP) holding the concatenated weight, and replaces the
projections by `ProjectionSlice`s of it:

- the first slice called with an input computes the whole product [..., Nq + Nk + Nv] (one GEMM; in
  FP8 one quantisation of x and one scaled GEMM, the per-output-channel scales concatenated) and
  returns its columns; the other slices called with the same tensor return theirs without computing;
- a slice called with another tensor, or twice with the same one, computes the product anew: the
  result never depends on the order the model calls them in, only the number of GEMMs does;
- nothing is computed on the host or read back, so a forward stays capturable (the slices' Python
  state decides what is recorded during capture; a replay runs the recorded kernels).

The model's own forward runs unchanged (the batchkv attention interface included); it sees column
views of the fused output, which every `view`/`transpose` of the head split accepts. One module is
replaced: an MLP whose forward is transformers' gated SiLU MLP (`down_proj(act_fn(gate_proj(x)) *
up_proj(x))`, read from its source, `act_fn` a SiLU) becomes a `SiluGatedMLP` over the same modules,
which runs one SiLU-mul over the fused [gate | up] output (and in FP8 on the GPU quantises for the
down projection in the same kernels, `batchkv.models.quant.producers.silu_mul_linear`). The fused layer
is an `nn.Linear` (the float model) or an `batchkv.models.quant.Fp8Linear` (per-output-channel scales,
so concatenating the layers' codes and scales is exactly the quantisation of the concatenated
weight); `quantize_decoder` on a fused model quantises the fused layers. Under tensor parallelism the
projections are column-parallel slices of this rank (q's heads, k's and v's, this rank's MLP
columns), concatenated after slicing, so a rank's fused weight is [q_r | k_r | v_r]. `state_dict()` and
`load_state_dict()` keep the unfused names (`q_proj.weight`, ...), so a fused model saves and loads
as the model it was.

Fused where a module holds `q_proj`, `k_proj`, `v_proj` (or `gate_proj`, `up_proj`) that are all plain
`nn.Linear`s or all `Fp8Linear`s without an all-reduce, with one input width, dtype, device and bias
presence, and no hooks of their own: Llama, Mistral, Qwen2/3 (their q/k/v biases concatenated),
Gemma 1-3, OLMo2, Granite, Cohere, SmolLM3, EXAONE-4, ERNIE-4.5, StableLM, GLM-4's attention, the
dense layers of DeepSeek-V3 and the attention of the MoE models (Qwen3-MoE, Mixtral, gpt-oss; their
experts are left alone). Left as they are: models that already fuse (Phi3's `qkv_proj` and
`gate_up_proj`, GPT-2's `c_attn`, GPT-NeoX's `query_key_value`, GLM-4's `gate_up_proj`), MLPs without
a gate (Starcoder2, Phi), DeepSeek-V3's latent attention (no `k_proj`), and any projection wrapped by
an adapter or hooked (LoRA layers keep their own arithmetic).
"""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn

from batchkv.models.quant.fp8 import Fp8Linear, Fp8Rows

# (parent module, the fused module's attribute on it, the projections it replaces)
GROUPS = (
    ("self_attn", "fused_qkv", ("q_proj", "k_proj", "v_proj")),
    ("mlp", "fused_gate_up", ("gate_proj", "up_proj")),
)


class FusedProjection(nn.Module):
    """One layer computing several projections of the same input: `layer` ([sum(sizes), K], an
    `nn.Linear` or an `Fp8Linear`) and the output widths `sizes` of the projections, in order.
    `take(i, x)` is projection i of x (see the module docstring); `forward(x)` the whole product."""

    def __init__(self, layer: nn.Module, names: tuple[str, ...], sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.layer = layer
        self.names, self.sizes = names, sizes
        self.starts = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        self._input: torch.Tensor | None = None  # the tensor whose product `_parts` holds
        self._parts: tuple[torch.Tensor, ...] = ()
        self._taken: set[int] = set()
        self._given: tuple[torch.Tensor, int, Fp8Rows] | None = None  # `give`: a tensor, its version, its codes

    @classmethod
    def of(cls, layers: list[nn.Module], names: tuple[str, ...]) -> FusedProjection:
        """The fused layer of `layers` (all `nn.Linear` or all `Fp8Linear`; checked by `fusable`)."""
        sizes = tuple(layer.out_features for layer in layers)
        first = layers[0]
        with torch.no_grad():
            bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])
            if isinstance(first, Fp8Linear):
                fused: nn.Module = Fp8Linear(torch.cat([layer.weight for layer in layers]),
                                             torch.cat([layer.weight_scale for layer in layers]), bias,
                                             dtype=first.dtype)  # fmt: skip
            else:
                w = first.weight
                fused = nn.Linear(first.in_features, sum(sizes), bias=bias is not None, device="meta", dtype=w.dtype)
                fused.weight = nn.Parameter(torch.cat([layer.weight for layer in layers]), requires_grad=False)
                if bias is not None:
                    fused.bias = nn.Parameter(bias, requires_grad=False)
        return cls(fused, names, sizes)

    def forward(self, x: torch.Tensor, *, given: torch.Tensor | None = None) -> torch.Tensor:
        """The whole product of x [..., K]; `given`: the tensor x was reshaped from, if it was."""
        rows = self.claim(x if given is None else given)
        if rows is None:
            return self.layer(x)
        return self.layer(rows).reshape(*x.shape[:-1], self.layer.out_features)

    def give(self, x: torch.Tensor, rows: Fp8Rows) -> None:
        """Hand over x's e4m3 codes and per-row scales, made by the kernel that wrote x (an FP8 layer's
        quantisation of x, bit for bit: `batchkv.models.quant.producers.rms_norm_quant`): the next product
        computed uses them if it is of x itself (the same tensor, not changed in place since), and
        quantises as usual otherwise. Either way they are dropped then."""
        self._given = (x, tensor_version(x), rows)

    def claim(self, x: torch.Tensor) -> Fp8Rows | None:
        """The codes given for x (`give`) if this layer is an FP8 layer, else None; drops what was given."""
        given, self._given = self._given, None
        if given is None or given[0] is not x or given[1] is None or given[1] != tensor_version(x):
            return None
        if not isinstance(self.layer, Fp8Linear):
            return None
        return given[2]

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Projection `index` of x [..., K] -> [..., sizes[index]], a column view of the fused product."""
        if self._input is not x or index in self._taken:
            self._parts = tuple(self.forward(x).split(self.sizes, dim=-1))
            self._input, self._taken = x, set()
        self._taken.add(index)
        part = self._parts[index]
        if len(self._taken) == len(self.sizes):  # every projection of x handed out: hold nothing
            self._input, self._parts = None, ()
        return part

    def rows(self, index: int, tensor: str) -> torch.Tensor | None:
        """The rows of the fused layer's `tensor` ("weight", "bias", "weight_scale") of projection `index`."""
        t = getattr(self.layer, tensor, None)
        return None if t is None else t[self.starts[index] : self.starts[index] + self.sizes[index]]

    def extra_repr(self) -> str:
        return f"{' | '.join(self.names)}: {' + '.join(map(str, self.sizes))}"


class ProjectionSlice(nn.Module):
    """Projection `index` of a `FusedProjection`, in place of the layer it replaced: called as that
    layer was (x [..., K] -> [..., N]); `weight`, `bias` (and an FP8 layer's `weight_scale`) are views
    of its rows of the fused tensors."""

    def __init__(self, fused: FusedProjection, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a submodule: its parent holds it, once
        self.index = index
        self.in_features, self.out_features = fused.layer.in_features, fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.take(self.index, x)

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.rows(self.index, "weight")  # type: ignore[return-value]

    @property
    def bias(self) -> torch.Tensor | None:
        return self.fused.rows(self.index, "bias")

    @property
    def weight_scale(self) -> torch.Tensor | None:
        return self.fused.rows(self.index, "weight_scale")

    def extra_repr(self) -> str:
        names = self.fused.names
        return f"{names[self.index]} of the fused {' | '.join(names)}, out_features={self.out_features}"


class SiluGatedMLP(nn.Module):
    """A transformers gated MLP `down_proj(silu(gate_proj(x)) * up_proj(x))` whose gate|up is fused, run as
    one GEMM, one SiLU-mul over its [gate | up] output (`batchkv.models.fused.silu_mul`: one launch on CUDA
    where silu then mul were two) and the down projection; with an `Fp8Linear` down on a GPU that runs
    it, the SiLU-mul also quantises its output for it (`batchkv.models.quant.producers.silu_mul_linear`),
    in place of the layer's separate quantiser. It holds the MLP's own modules under their names (the
    slices, `down_proj`, `act_fn`, `fused_gate_up`), so state dicts are the MLP's."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        for name, child in mlp.named_children():
            setattr(self, name, child)
        self.register_state_dict_post_hook(_state_dict_hook)
        self.register_load_state_dict_pre_hook(_load_pre_hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from batchkv.models.fused import silu_mul
        from batchkv.models.quant.producers import silu_mul_linear

        lead = x.shape[:-1]
        gate_up = self.fused_gate_up(x.reshape(-1, x.shape[-1]), given=x)  # [M, 2I], contiguous
        if isinstance(self.down_proj, Fp8Linear):
            y = silu_mul_linear(gate_up, self.down_proj)
        else:  # nn.Linear, or a row-parallel one (its all-reduce included)
            y = self.down_proj(silu_mul(gate_up))
        return y.reshape(*lead, y.shape[-1])


# The body of transformers' gated MLP forward (Llama, Mistral, Qwen2/3, OLMo2, ...), whitespace removed.
_GATED_MLP_BODY = "down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj"


def _silu_gated(mlp: nn.Module) -> bool:
    """Whether `mlp`'s forward is transformers' gated MLP with a SiLU (read from its source) and nothing hooked."""
    act = getattr(mlp, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or (type(act).__name__ == "SiLUActivation" and
                                         type(act).__module__ == "transformers.activations")  # fmt: skip
    if not silu or _hooked(mlp) or _hooked(act):
        return False
    try:
        source = inspect.getsource(type(mlp).forward)
    except (OSError, TypeError):
        return False
    head, _, body = source.partition("):")
    return re.sub(r"\s+", "", head) == "defforward(self,x" and re.sub(r"\s+", "", body) == _GATED_MLP_BODY


def tensor_version(x: torch.Tensor) -> int | None:
    """x's in-place version counter; None for an inference tensor, which keeps none: a hand-over of x
    (`FusedProjection.give`, `FusedRMSNorm.add_ahead`) is then never taken, since a hook could have
    changed x in place unseen (the engine runs under no_grad, where the counter exists)."""
    return None if x.is_inference() else x._version


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


def fusable(layers: list[nn.Module | None]) -> bool:
    """Whether `layers` can be one `FusedProjection`: all plain `nn.Linear`s or all `Fp8Linear`s
    without an all-reduce, one input width, dtype and device, biases on all or none, no hooks."""
    if any(layer is None or _hooked(layer) for layer in layers):
        return False
    kind = type(layers[0])
    if kind not in (nn.Linear, Fp8Linear) or any(type(layer) is not kind for layer in layers):
        return False
    first = layers[0]
    if kind is Fp8Linear and (any(layer.reduce is not None for layer in layers) or
                              any(layer.dtype != first.dtype for layer in layers)):  # fmt: skip
        return False
    same = all(
        layer.in_features == first.in_features
        and layer.weight.dtype == first.weight.dtype
        and layer.weight.device == first.weight.device
        and (layer.bias is None) == (first.bias is None)
        for layer in layers
    )
    return same


def _state_dict_hook(module: nn.Module, state: dict, prefix: str, local_metadata: object) -> None:
    """Name a fused module's tensors as the projections it replaced (`q_proj.weight`, ...)."""
    for attr in _fused_attrs(module):
        fused: FusedProjection = getattr(module, attr)
        for tensor in ("weight", "bias", "weight_scale"):
            whole = state.pop(f"{prefix}{attr}.layer.{tensor}", None)
            if whole is None:
                continue
            for name, start, size in zip(fused.names, fused.starts, fused.sizes, strict=True):
                state[f"{prefix}{name}.{tensor}"] = whole[start : start + size]


def _load_pre_hook(module: nn.Module, state: dict, prefix: str, *args: object) -> None:
    """Read the projections' own names (`q_proj.weight`, ...) into a fused module's tensors."""
    for attr in _fused_attrs(module):
        fused: FusedProjection = getattr(module, attr)
        for tensor in ("weight", "bias", "weight_scale"):
            keys = [f"{prefix}{name}.{tensor}" for name in fused.names]
            if all(k in state for k in keys):
                state[f"{prefix}{attr}.layer.{tensor}"] = torch.cat([state.pop(k) for k in keys])


def _fused_attrs(module: nn.Module) -> list[str]:
    return [name for name, child in module.named_children() if isinstance(child, FusedProjection)]


def fuse_projections(hf_model: nn.Module) -> dict[str, int]:
    """Fuse each decoder layer's q/k/v and gate/up of a transformers causal LM where the modules allow
    it (module docstring), in place; the float weights of the fused layers are freed. A fused gate|up
    whose MLP is transformers' gated SiLU MLP runs as a `SiluGatedMLP`. Returns how many layers had
    each done, e.g. {"fused_qkv": 32, "fused_gate_up": 32, "silu_mul": 32} (0: nowhere). Idempotent:
    fused groups are left alone."""
    decoder = getattr(hf_model, hf_model.base_model_prefix, hf_model)
    done = {attr: 0 for _, attr, _ in GROUPS} | {"silu_mul": 0}
    for layer in getattr(decoder, "layers", ()):
        for part, attr, names in GROUPS:
            parent = getattr(layer, part, None)
            if parent is None or hasattr(parent, attr):
                continue
            layers = [getattr(parent, name, None) for name in names]
            if not fusable(layers):
                continue
            fused = FusedProjection.of(layers, names)  # type: ignore[arg-type]
            for i, name in enumerate(names):
                delattr(parent, name)
                setattr(parent, name, ProjectionSlice(fused, i))
            if not _fused_attrs(parent):
                parent.register_state_dict_post_hook(_state_dict_hook)
                parent.register_load_state_dict_pre_hook(_load_pre_hook)
            setattr(parent, attr, fused)
            done[attr] += 1
        mlp = getattr(layer, "mlp", None)
        if isinstance(getattr(mlp, "fused_gate_up", None), FusedProjection) and _silu_gated(mlp):
            layer.mlp = SiluGatedMLP(mlp)
            done["silu_mul"] += 1
    return done


def fused_groups(hf_model: nn.Module) -> list[tuple[int, nn.Module, str, FusedProjection]]:
    """(layer index, parent module, attribute, fused projection) of every fused group of a model."""
    decoder = getattr(hf_model, hf_model.base_model_prefix, hf_model)
    found = []
    for i, layer in enumerate(getattr(decoder, "layers", ())):
        for part, attr, _ in GROUPS:
            fused = getattr(getattr(layer, part, None), attr, None)
            if isinstance(fused, FusedProjection):
                found.append((i, getattr(layer, part), attr, fused))
    return found
