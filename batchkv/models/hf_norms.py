"""transformers' RMSNorm modules as one kernel each (`batchkv.models.fused.rms_norm`).

transformers' `LlamaRMSNorm` runs eight eager ops (cast to float32, pow, mean, + eps, rsqrt, mul,
cast back, * weight), each a kernel on the GPU, twice per decoder layer and once more at the end: at
a small model's decode step, whose time is its kernel count, that is a third of the launches.
`fuse_norms(hf_model)` (run by `HFModel` at construction while `FUSE` is on) puts a `FusedRMSNorm`
in place of every RMSNorm module whose computation is known to be one of these, exactly:

- Llama's (LlamaRMSNorm, Qwen2/Qwen3RMSNorm, MistralRMSNorm and ~140 copies in transformers):
  `weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`;
- Gemma's (Gemma/Gemma2/Gemma3RMSNorm, Qwen3-Next): `(normed * (1 + weight.float())).type_as(x)`;
- Olmo2's (and gpt-oss's, Helium's, Moshi's): `(normed * weight.float()).to(x.dtype)`.

"Known" is decided on the class's source, not its name: the `forward` (with the `_norm` it calls)
is parsed and compared, local names aside, with those forms as transformers writes them; and the
module has exactly one parameter, `weight` [n], no buffers, children or hooks, and the epsilon the
form reads. Any other class (Gemma3n's optional scale, grouped norms, unweighted ones) is left as
it is. The `FusedRMSNorm` keeps the same `weight` Parameter (nothing copied; the state dict and a
tensor-parallel rank's replicated norms are unchanged) and the epsilon under the same name; off
CUDA, and wherever autograd records, it runs transformers' op sequence, so CPU results are the
module's to the bit. On CUDA it is one Triton launch writing only its output (capturable). In FP8
models `Fp8Linear` quantises the normed rows it reads, except where `batchkv.models.hf_layers` proves
the norm's reader and the norm writes its codes too (`FusedRMSNorm.reader`, `QUANT`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

from batchkv.models.fused import norm_kernel_ok, norm_launch, norm_out_dtype, rms_norm
from batchkv.models.hf_fuse import FusedProjection, tensor_version
from batchkv.models.quant import producers
from batchkv.models.quant.fp8 import Fp8Linear

FUSE = True  # HFModel swaps the norms at construction while this is on (an A/B switch for benchmarks)
# A norm whose only reader is an FP8 fused projection (`FusedRMSNorm.reader`) writes the codes and scales
# it reads: None where `batchkv.models.quant.producers.fused` says (CUDA sm_89+, in the norm's kernel),
# True everywhere (the CPU: the norm then the quantiser's torch pass; tests), False nowhere (an A/B).
QUANT: bool | None = None


@dataclass(frozen=True)
class NormForm:
    """One RMSNorm computation: the attribute holding its epsilon and `fused.rms_norm`'s rounding."""

    eps_attr: str
    offset: float
    round_first: bool


_LLAMA = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""
_OLMO2 = _LLAMA.replace(
    "return self.weight * hidden_states.to(input_dtype)", "return (self.weight * hidden_states).to(input_dtype)"
)
_HELIUM = _LLAMA.replace(
    "return self.weight * hidden_states.to(input_dtype)",
    "return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)",
)
_NORM = """
def _norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
"""
_GEMMA = """
def forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)
"""
_MOSHI = _GEMMA.replace("(1.0 + self.weight.float())", "self.weight.float()")


def canonical_source(source: str, rename_args: bool = True) -> str:
    """A function's source with its docstring, annotations, decorators and comments dropped and its
    local names (and, with `rename_args`, its argument names but `self`) numbered by first appearance."""
    fn = ast.parse(textwrap.dedent(source)).body[0]
    if not isinstance(fn, ast.FunctionDef):
        return ""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    a = fn.args
    params = [
        *a.posonlyargs,
        *a.args,
        *([a.vararg] if a.vararg else []),
        *a.kwonlyargs,
        *([a.kwarg] if a.kwarg else []),
    ]
    names = {p.arg: f"v{i}" if rename_args else p.arg for i, p in enumerate(p for p in params if p.arg != "self")}
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in names:
            names[node.id] = f"v{len(names)}"
    for p in params:
        p.arg, p.annotation = names.get(p.arg, p.arg), None

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.Name:
            return ast.Name(id=names.get(node.id, node.id), ctx=node.ctx)

    fn.body, fn.returns, fn.decorator_list = [Rename().visit(stmt) for stmt in body], None, []
    return ast.unparse(ast.fix_missing_locations(fn))


_FORMS = {
    canonical_source(_LLAMA): NormForm("variance_epsilon", 0.0, True),
    canonical_source(_OLMO2): NormForm("variance_epsilon", 0.0, False),
    canonical_source(_HELIUM): NormForm("variance_epsilon", 0.0, False),
    canonical_source(_GEMMA) + "\n" + canonical_source(_NORM): NormForm("eps", 1.0, False),
    canonical_source(_MOSHI) + "\n" + canonical_source(_NORM): NormForm("eps", 0.0, False),
}
_by_class: dict[type, NormForm | None] = {}


def hub_wrapped(fn: object) -> object:
    """The function a `kernels` hub wrapper stands for, else `fn`. With the `kernels` package installed,
    transformers (5.25) turns module functions such as `apply_rotary_pos_emb` into an `nn.Module` whose
    forward calls that function unless the model was kernelized (which HFModel never does)."""
    forward = getattr(type(fn), "forward", None) if isinstance(fn, nn.Module) else None
    if forward is None or not getattr(type(fn), "kernel_layer_name", None) or forward.__closure__ is None:
        return fn
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__, strict=True))
    inner = cells["func"].cell_contents if "func" in cells else None
    return inner if inspect.isfunction(inner) else fn


def function_source(fn: object, rename_args: bool = True) -> str:
    """`canonical_source` of the function `fn` (or of the one a `kernels` hub wrapper stands for: `hub_wrapped`);
    "" when `fn` is not a function or has no source (built at run time): not a known form."""
    fn = hub_wrapped(fn)
    try:
        return canonical_source(inspect.getsource(fn), rename_args) if inspect.isfunction(fn) else ""
    except (OSError, TypeError, SyntaxError):
        return ""


def _class_form(cls: type) -> NormForm | None:
    """The form of `cls`'s computation, or None: its forward (and `_norm`, if it calls one) in source
    matching a known form, with `torch` its module's torch and `__call__` nn.Module's."""
    if cls not in _by_class:
        _by_class[cls] = None
        forward = getattr(cls, "forward", None)
        if (
            cls.__call__ is nn.Module.__call__
            and inspect.isfunction(forward)
            and forward.__globals__.get("torch") is torch
        ):
            key = function_source(forward)
            norm = getattr(cls, "_norm", None)
            if "self._norm(" in key and inspect.isfunction(norm) and norm.__globals__.get("torch") is torch:
                key += "\n" + function_source(norm)
            _by_class[cls] = _FORMS.get(key)
    return _by_class[cls]


def norm_form(module: nn.Module) -> NormForm | None:
    """The form of `module` if `fuse_norms` would replace it, else None (see the module docstring)."""
    form = _class_form(type(module))
    if form is None or isinstance(module, FusedRMSNorm):
        return None
    weight = module._parameters.get("weight")
    eps = module.__dict__.get(form.eps_attr)
    if (
        list(module._parameters) != ["weight"]
        or weight is None
        or weight.dim() != 1
        or module._buffers
        or module._modules
        or module._forward_hooks
        or module._forward_pre_hooks
        or isinstance(eps, bool)
        or not isinstance(eps, (int, float))
    ):
        return None
    return form


class FusedRMSNorm(nn.Module):
    """An RMSNorm of one of `hf_norms`' forms: `batchkv.models.fused.rms_norm` over the last dim with
    the replaced module's `weight` and epsilon (kept under its attribute name).

    Set by `batchkv.models.hf_layers` where a decoder layer's source proves them: `reader`, the fused
    projection that alone reads this norm's output (an FP8 one is given the output's codes and scales,
    made in the norm's launch: `FusedProjection.give`); `add(residual, delta)`, transformers' residual
    add with this norm in one launch; `add_ahead`, the same for the norm's next call (the decoder layer
    after the one that adds): the call with that very sum returns the norm already made."""

    def __init__(self, weight: nn.Parameter, eps: float, form: NormForm, replaces: str) -> None:
        super().__init__()
        self.weight = weight
        self.eps_value = float(eps)
        self.form = form
        self.replaces = replaces
        setattr(self, form.eps_attr, eps)
        object.__setattr__(self, "reader", None)  # a FusedProjection, not a submodule: its parent holds it
        self._ahead: tuple[torch.Tensor, int | None, torch.Tensor] | None = None  # (sum, its version, its norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The replaced module's output for x [..., n]: one kernel on CUDA, its own ops elsewhere."""
        ahead, self._ahead = self._ahead, None
        fresh = ahead is not None and ahead[0] is x and ahead[1] is not None and ahead[1] == tensor_version(x)
        if fresh and not self._forward_pre_hooks:
            return ahead[2]
        return self._normed(x, None)[1]

    def add(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, this norm of it), as transformers' `h = residual + delta; norm(h)` computes them."""
        return self._normed(residual, delta)

    def add_ahead(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """residual + delta, with this norm of it made in the same launch and kept for the next call."""
        h, out = self._normed(residual, delta)
        self._ahead = (h, tensor_version(h), out)
        return h

    def _normed(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        form, reader = self.form, self.reader
        if isinstance(reader, FusedProjection) and isinstance(reader.layer, Fp8Linear) and _quantising(x):
            h, out, rows = producers.rms_norm_quant(x, self.weight, self.eps_value, delta=delta, offset=form.offset,
                                                   round_first=form.round_first)  # fmt: skip
            reader.give(out, rows)
            return h, out
        if delta is None:
            return x, rms_norm(x, self.weight, self.eps_value, offset=form.offset, round_first=form.round_first)
        return residual_rms_norm(
            x, delta, self.weight, self.eps_value, offset=form.offset, round_first=form.round_first
        )

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps_value}, replaces={self.replaces}"


def _quantising(x: torch.Tensor) -> bool:
    return producers.fused(x) if QUANT is None else QUANT


def residual_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0,
    round_first: bool = True, triton_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """transformers' `h = residual + delta` then `fused.rms_norm(h, weight, eps, ...)`: (h, normed), one
    launch on CUDA for contiguous residual and delta of one shape and dtype (the sum rounded to that dtype,
    as torch's add does); elsewhere those two steps, op for op."""
    same = delta.shape == residual.shape and delta.dtype == residual.dtype and not delta.requires_grad
    if not (same and norm_kernel_ok(residual, weight, triton_kernel) and residual.is_contiguous()
            and delta.is_contiguous()):  # fmt: skip
        h = residual + delta
        return h, rms_norm(h, weight, eps, offset=offset, round_first=round_first, triton_kernel=triton_kernel)
    h = torch.empty_like(residual)
    out = torch.empty(h.shape, dtype=norm_out_dtype(h, weight, round_first), device=h.device)
    rows = (-1, h.shape[-1])
    norm_launch(residual.view(rows), weight, eps, delta=delta.view(rows), h_out=h.view(rows), out=out.view(rows),
                offset=offset, round_first=round_first)  # fmt: skip
    return h, out


def fuse_norms(model: nn.Module) -> int:
    """Put a `FusedRMSNorm` in place of every RMSNorm module under `model` of a known form (shared
    modules stay shared). Returns how many modules were replaced; does nothing when `FUSE` is off."""
    if not FUSE:
        return 0
    made: dict[int, FusedRMSNorm] = {}
    swaps = []
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is None:
                continue
            if id(child) not in made:
                form = norm_form(child)
                if form is None:
                    continue
                eps = child.__dict__[form.eps_attr]
                made[id(child)] = FusedRMSNorm(child._parameters["weight"], eps, form, type(child).__name__)
            swaps.append((parent, name, made[id(child)]))
    for parent, name, fused in swaps:
        setattr(parent, name, fused)
    return len(made)
