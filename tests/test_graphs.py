"""The module fingerprint behind graph keys, on CPU."""

from __future__ import annotations

import torch
from torch import nn

from batchkv.executor.graphs import ModuleFingerprint


def test_the_fingerprint_changes_when_a_submodule_is_replaced_or_added():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    fingerprint = ModuleFingerprint(model)
    first = fingerprint()
    assert fingerprint() == first
    model[1] = nn.GELU()
    second = fingerprint()
    model.extra = nn.Identity()
    third = fingerprint()
    model.extra = nn.Identity()  # replacing with an equal-looking module is still another module
    assert len({first, second, third, fingerprint()}) == 4


def test_module_registrations_inside_a_compiled_forward_do_not_cause_recompiles():
    from torch._dynamo.testing import CompileCounter

    class Sliced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers[:2]:  # builds a new ModuleList: registrations while tracing
                x = layer(x)
            return x

    torch._dynamo.reset()
    counter = CompileCounter()
    model = Sliced()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for _ in range(4):
        compiled(torch.randn(2, 4))
    assert counter.frame_count == 1
