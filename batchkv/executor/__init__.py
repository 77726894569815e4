"""Continuous batching over BatchedSequenceCache: scheduler, sampling, graph runner, engine.

Example:
    from batchkv.executor import Engine, Request, SamplingParams
    engine = Engine(model, max_seqs=8, capacity=512)
    engine.submit(Request(prompt_ids, SamplingParams(max_new_tokens=32)))
    for event in engine.stream(): ...
"""

from batchkv.executor.engine import Engine
from batchkv.executor.request import FINISH_REASONS, MAX_SAMPLE_ROWS, Event, Output, Request, SamplingParams, gather
from batchkv.executor.sizing import default_buckets
from batchkv.executor.speculative import SpeculativeConfig

__all__ = [
    "FINISH_REASONS",
    "MAX_SAMPLE_ROWS",
    "Engine",
    "Event",
    "Output",
    "Request",
    "SamplingParams",
    "SpeculativeConfig",
    "default_buckets",
    "gather",
]
