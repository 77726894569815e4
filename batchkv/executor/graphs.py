"""CUDA graphs keyed by what they bind: ((width bucket, short), storage generation, module fingerprint).

One `GraphSet` holds every graph of one runner in a single shared memory pool. A graph is captured
after a warm-up on a side stream (cuBLAS workspaces and lazy allocations happen outside the
capture), and replayed after the caller has copied the step's inputs into the static buffers the
captured function reads. Nothing here reads lengths: a new mix of sequence lengths replays the same
graph, because the cache keeps them in device tensors.

A graph records the module tree and the branches that ran during capture. `module_fingerprint`
changes when a submodule is added, removed or replaced anywhere under a model (an adapter wrapper
bound or unbound), so a graph never outlives the tree it was captured with.
"""

from __future__ import annotations

import atexit
import gc
import sys
from collections.abc import Callable, Hashable

import torch
from torch import nn

_unfreeze_at_exit = False  # freeze_heap has registered gc.unfreeze with atexit
_registrations = 0  # bumped on every submodule registration anywhere; cheap "maybe changed" flag


def _count_registration(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    # Registrations while torch.compile traces a forward (transformers slices its ModuleList
    # there) are temporaries of the traced code, not changes to a served tree; counting them would
    # make dynamo guard on this global and recompile on every call.
    if torch.compiler.is_compiling():
        return
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


def freeze_heap() -> int:
    """Collect cyclic garbage once, then move every object alive into the cycle collector's permanent
    generation (`gc.freeze`, as vLLM's engine does after startup), so that its full passes stop walking
    the model, the libraries and the graphs' Python state. Such a pass took 243 ms of the first step of
    the SmolLM2-shape run on the H200 (bench/results/smol-gc-h200.json). Objects still die by reference
    count as before, but garbage in reference cycles (a model dropped later: transformers' adapted
    modules hold bound methods of themselves) stays until `gc.unfreeze()`. So it is for processes that
    own their lifetime, once their model is loaded and warm: `batchkv run` and `serve`, a Ray replica, a
    tensor-parallel rank, a benchmark; `Engine` never calls it. `gc.unfreeze()` also runs at exit
    (bindings that count their live objects at shutdown, nanobind's, would otherwise report the frozen
    ones as leaked). Returns the frozen count."""
    global _unfreeze_at_exit
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class ModuleFingerprint:
    """A cheap, exact fingerprint of a module tree: names, types and identities of submodules.

    The full walk runs only after some module registration happened since the last call, so the
    per-step cost is one integer comparison (a walk of a 42-layer transformers model costs ~0.4 ms).
    Registrations are what adapter managers do when they bind or unbind (they set a wrapper or the
    base layer in place); a bare `del model.sub` registers nothing and is not seen.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._seen = -1
        self._value: int = 0

    def __call__(self) -> int:
        if self._seen != _registrations:
            self._seen = _registrations
            tree = tuple((name, type(m).__qualname__, id(m)) for name, m in self.module.named_modules())
            self._value = hash(tree)
        return self._value


# ---- adapter wrappers ------------------------------------------------------------------------
# (module, class) of the wrapper layers known to be swapped into a model at run time. Looked up in
# sys.modules only: an instance cannot exist before its class's module is imported, and importing
# vLLM or peft just to ask would cost seconds.
_KNOWN_WRAPPERS = (("vllm.lora.layers", "BaseLayerWithLoRA"), ("peft.tuners.lora", "LoraLayer"))
_registered: list[type] = []
_registry_version = 0  # bumped on registration, so runners re-check their model


def registry_version() -> int:
    """Moves whenever `register_adapter_wrapper` adds a class (runners then re-check their model)."""
    return _registry_version


def register_adapter_wrapper(cls: type) -> type:
    """Treat instances of `cls` under a model as dynamic adapter wrappers (usable as a decorator)."""
    global _registry_version
    if cls not in _registered:
        _registered.append(cls)
        _registry_version += 1
    return cls


def adapter_wrapper_classes() -> tuple[type, ...]:
    """The registered wrapper classes, plus vLLM's and peft's LoRA layers when they are imported."""
    found = list(_registered)
    for module_name, attr in _KNOWN_WRAPPERS:
        cls = getattr(sys.modules.get(module_name), attr, None)
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return tuple(found)


def dynamic_lora_wrappers_present(module: nn.Module) -> bool:
    """True once adapter wrapper layers (LoRA) have been installed anywhere under `module`.

    A LoRA manager replaces linear layers with wrappers, then binds, rescales or resets adapters
    per request, and the wrappers stay in the tree afterwards. Capture records the module tree and
    the branches that ran during it, so a graph taken before an adapter was bound would replay
    without the adapter's matmuls and one taken with it bound would survive its removal -- both
    silently, and neither visible in the shape, dtype and bucket that decide reuse. So nothing
    captured may be used once these exist. Adapters fused into the weights leave no wrapper and
    do not count.
    """
    classes = adapter_wrapper_classes()
    return bool(classes) and any(isinstance(m, classes) for m in module.modules())


class AdapterGuard:
    """`dynamic_lora_wrappers_present` over some modules, re-walked only when their module tree or
    the wrapper registry moved (so a step costs a fingerprint comparison)."""

    def __init__(self, fingerprint: Callable[[], int], modules: Callable[[], list[nn.Module]]) -> None:
        self._fingerprint, self._modules = fingerprint, modules
        self._seen: tuple[int, int] | None = None
        self._present = False

    def __call__(self) -> bool:
        seen = (self._fingerprint(), _registry_version)
        if seen != self._seen:
            self._seen = seen
            self._present = any(dynamic_lora_wrappers_present(m) for m in self._modules())
        return self._present


_POOLS: dict[int, tuple[object, torch.cuda.CUDAGraph, torch.cuda.Stream]] = {}


def graph_pool(device: torch.device) -> object:
    """The one graph memory pool of a GPU, shared by every `GraphSet` on it.

    A pool whose graphs have all been destroyed keeps its entry in the allocator with a use count
    of 0, and capturing into that id again fails an internal assert; runners drop all their graphs
    whenever storage grows. So the pool is created with a one-op keeper graph that lives as long as
    the process and holds the pool open. One pool per GPU also keeps memory flat when runners are
    rebuilt (a pool per runner is never given back while anything references it).
    """
    return _pool_entry(device)[0]


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream of a GPU that every `GraphSet` warms up and captures on. cuBLAS keeps a
    workspace per (handle, stream) for as long as the process lives, so a stream per runner would
    leave one behind for every engine ever built; with one stream the warm-up creates the workspace
    the capture uses (none is allocated while capturing), once."""
    return _pool_entry(device)[2]


def _pool_entry(device: torch.device) -> tuple[object, torch.cuda.CUDAGraph, torch.cuda.Stream]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOLS:
        handle = torch.cuda.graph_pool_handle()
        counter = torch.zeros(1, device=torch.device("cuda", index))
        side = torch.cuda.Stream(index)
        side.wait_stream(torch.cuda.current_stream(index))
        keeper = torch.cuda.CUDAGraph()
        with torch.cuda.graph(keeper, pool=handle, stream=side):
            counter.add_(1)
        torch.cuda.current_stream(index).wait_stream(side)
        _POOLS[index] = (handle, keeper, side)
    return _POOLS[index]


class GraphSet:
    """Captured graphs of one step function, one per key, all in one memory pool.

    `run(key, fn)` captures `fn` the first time a key is seen and replays it afterwards; `fn` must
    read its inputs from static tensors and return static outputs (the tensors replay writes).
    Keys whose storage generation has passed can be dropped with `retain(predicate)`.
    """

    def __init__(self, device: torch.device, warmup: int = 2, capture_error_mode: str = "global") -> None:
        self.device = device
        self.warmup = warmup
        self.capture_error_mode = capture_error_mode  # "thread_local" when other threads use CUDA (NCCL's watchdog)
        self.pool = graph_pool(device)
        self._side = capture_stream(device)  # the device's one: see `capture_stream`
        self.captures = 0
        self.replays = 0
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, object]] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def run(self, key: Hashable, fn: Callable[[], object]) -> object:
        """Replay the graph for `key` (capturing it first if needed); returns its static outputs."""
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(fn)
            self._graphs[key] = entry
        entry[0].replay()
        self.replays += 1
        return entry[1]

    def _capture(self, fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode=self.capture_error_mode):
            outputs = fn()
        self.captures += 1
        return graph, outputs

    def retain(self, keep: Callable[[Hashable], bool]) -> None:
        """Drop every graph whose key fails `keep` (e.g. an older storage generation)."""
        for key in [k for k in self._graphs if not keep(k)]:
            del self._graphs[key]


class ModelFingerprint:
    """`ModuleFingerprint` of the model's module tree; for a wrapper that is not itself a module,
    of every module among its attributes (so rebinding `HFModel.hf` also changes it)."""

    def __init__(self, model: object) -> None:
        self.model = model
        self._prints: dict[int, ModuleFingerprint] = {}

    def modules(self) -> list[tuple[str, nn.Module]]:
        """The model itself when it is a module, else the modules among its attributes."""
        model = self.model
        if isinstance(model, nn.Module):
            return [("", model)]
        return [(name, m) for name, m in vars(model).items() if isinstance(m, nn.Module)]

    def __call__(self) -> int:
        parts = []
        for name, module in self.modules():
            print_ = self._prints.get(id(module))
            if print_ is None or print_.module is not module:
                print_ = self._prints[id(module)] = ModuleFingerprint(module)
            parts.append((name, id(module), print_()))
        return hash(tuple(parts))
