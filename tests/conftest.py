import gc
import os

import pytest
import torch

# Kernels run under the Triton interpreter on machines without a GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The CPU tests run tiny tensors, where torch's threads only add synchronisation: on a shared
# two-core machine two threads made the executor tests about 100x slower than one.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _heap_unfrozen():
    """Serving code run in process (`batchkv run`, the server, a replica) freezes the heap (`freeze_heap`); the
    test process unfreezes it after each test, so that cyclic garbage of one test is not kept for the rest."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
