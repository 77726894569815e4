"""GraphSet on a real GPU: captures, replays, and a pool that survives dropping every graph."""

from __future__ import annotations

import pytest
import torch

from batchkv.executor.graphs import GraphSet, graph_pool

pytestmark = pytest.mark.gpu


def test_capturing_again_after_every_graph_was_dropped_works_and_replays_new_inputs():
    device = torch.device("cuda")
    graphs = GraphSet(device)
    x = torch.zeros(4, device=device)
    out = graphs.run(("a", 0), lambda: x * 2 + 1)
    x.copy_(torch.arange(4.0, device=device))
    out = graphs.run(("a", 0), lambda: x * 2 + 1)
    torch.testing.assert_close(out, torch.arange(4.0, device=device) * 2 + 1)
    graphs.retain(lambda key: False)  # every graph of the pool is gone
    assert len(graphs) == 0
    out = graphs.run(("a", 1), lambda: x * 3)  # used to fail an allocator assert
    torch.testing.assert_close(out, torch.arange(4.0, device=device) * 3)
    assert graphs.captures == 2 and graphs.replays == 3


def test_every_graph_set_on_a_gpu_shares_one_pool():
    device = torch.device("cuda")
    assert GraphSet(device).pool == GraphSet(device).pool == graph_pool(device)
