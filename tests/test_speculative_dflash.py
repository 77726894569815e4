"""The DFlash proposer in the engine: a random drafter (drafts mostly rejected) and the same drafter
with its drafts overwritten by the known continuation (long accepted runs, whole blocks), on
SenseNova-U1 tiny and a transformers Qwen3 with sliding-window layers, against decoding without
speculation: staggered arrivals, n > 1, stop ids, capacity and cancellation."""

from __future__ import annotations

import random

import pytest

from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig
from batchkv.models import build_model
from batchkv.models.dflash import build_drafter
from tests.executor_helpers import drive
from tests.spec_helpers import forced_dflash, known_continuations

OPTS = {"max_seqs": 4, "capacity": 48, "max_step_tokens": 16, "prefill_chunk": 8}


def schedule_for(vocab: int, seed: int, count: int = 7, stop: int | None = None) -> list[tuple[int, Request]]:
    rng = random.Random(seed)
    schedule = []
    for i in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 26))] + [i]
        stops = (stop,) if stop is not None and i % 3 == 0 else ()
        params = SamplingParams(max_new_tokens=rng.randint(3, 40), n=2 if i == 1 else 1, stop_token_ids=stops)
        schedule.append((rng.randint(0, 6), Request(prompt, params)))
    return schedule


def run_pair(model, drafter, schedule, *, force: bool, cancels=None, block: int = 5, plain=None, **overrides):
    opts = OPTS | overrides
    outputs, ids = plain or drive(Engine(model, **opts), schedule, cancels)
    engine = Engine(model, speculative=SpeculativeConfig("dflash", block_size=block, drafter=drafter), **opts)
    if force:
        forced_dflash(engine.speculator.proposer, known_continuations(schedule, outputs, ids))
    got, got_ids = drive(engine, schedule, cancels)
    engine.assert_idle()
    return [outputs[i] for i in ids], [got[i] for i in got_ids], engine


@pytest.fixture(scope="module")
def sensenova():
    model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    return model, build_drafter(model, num_layers=2, target_layer_ids=(0, 2), block_size=6, seed=1)


@pytest.mark.parametrize("force", [False, True])
def test_sensenova_tiny_with_a_dflash_drafter_decodes_exactly_as_without(sensenova, force):
    model, drafter = sensenova
    schedule = schedule_for(model.vocab_size, 1, stop=7)
    plain, fast, engine = run_pair(model, drafter, schedule, force=force)
    assert fast == plain
    m = engine.metrics
    assert m.spec_proposed > 0
    if force:  # known drafts: every one accepted, whole blocks verified
        assert m.spec_accepted == m.spec_proposed and m.summary()["spec_accept_len_mean"] > 3
    assert {r for out in fast for r in out.finish_reasons} >= {"length", "capacity"}


def test_dflash_blocks_near_capacity_and_cancellation_leave_no_trace(sensenova):
    model, drafter = sensenova
    schedule = schedule_for(model.vocab_size, 2)
    schedule[3] = (0, Request(list(range(30, 60)), SamplingParams(max_new_tokens=40)))
    plain, fast, engine = run_pair(model, drafter, schedule, force=True, cancels={3: [3]}, capacity=40)
    for index in range(len(schedule)):
        if index == 3:
            assert fast[3].finish_reasons == ["cancelled"]
        else:
            assert fast[index] == plain[index]
    assert engine.speculator.proposer.cache.sequences == [] and engine.cache.sequences == []


def test_a_transformers_qwen3_with_sliding_layers_and_a_dflash_drafter_decodes_exactly_as_without():
    pytest.importorskip("transformers")
    from batchkv.models.hf import HFModel
    from tests.test_executor_models import _qwen3

    model = HFModel(_qwen3(use_sliding_window=True, sliding_window=6, max_window_layers=1))
    drafter = build_drafter(model, num_layers=1, target_layer_ids=(0, 1), block_size=4, seed=2)
    schedule = schedule_for(model.vocab_size, 3, count=5)
    reference = drive(Engine(model, **OPTS), schedule)
    plain, fast, engine = run_pair(model, drafter, schedule, force=True, block=4, plain=reference)
    assert fast == plain
    assert engine.metrics.spec_accepted == engine.metrics.spec_proposed > 0
    plain, fast, _ = run_pair(model, drafter, schedule, force=False, block=4, plain=reference)
    assert fast == plain


def test_the_proposers_drafts_equal_the_dense_reference_over_the_targets_own_hidden_states(sensenova):
    """Every block the engine drafts equals the eager DFlash forward (tests/test_dflash.py) over the
    context features recomputed from scratch: the target's taps of the whole history at once."""
    import torch

    from batchkv.models.taps import HiddenTaps
    from tests.model_loop import make_cache, text_idx
    from tests.test_dflash import reference_block

    model, drafter = sensenova
    engine = Engine(model, speculative=SpeculativeConfig("dflash", block_size=6, drafter=drafter), **OPTS)
    proposer = engine.speculator.proposer
    seen = []
    plain_propose = proposer.propose

    def propose(batch, samples, counts):
        drafts = plain_propose(batch, samples, counts)
        for sample, src in zip(samples, drafts.src, strict=True):
            if src:
                history = [*sample.owner.prompt, *sample.tokens]
                seen.append((history, proposer.drafts[src].tolist()))
        return drafts

    proposer.propose = propose
    engine.submit(Request([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9], SamplingParams(max_new_tokens=14)))
    engine.submit(Request([2, 7, 1, 8, 2, 8], SamplingParams(max_new_tokens=9)))
    engine.run_until_done()
    assert len(seen) >= 6
    c = drafter.config
    for history, drafts in seen:
        context, anchor = history[:-1], history[-1]
        taps = HiddenTaps(c.target_layer_ids, c.hidden, 64, "cpu", torch.float32)
        cache = make_cache(model, max_seqs=1, capacity=64, max_write=64)
        s = cache.seq_new()
        cache.declare_step([s] * len(context))
        cache.prepare_step(len(context))
        model.hidden_states(torch.tensor(context), text_idx(0, len(context)), cache, torch.tensor([0]),
                            taps=taps.bind(len(context)))  # fmt: skip
        length, k = len(context), len(drafts)
        block = torch.tensor([anchor] + [c.mask_token_id] * k)
        out = reference_block(
            drafter, taps.out[:length], torch.arange(length), block, torch.arange(length, length + k + 1)
        )
        assert model.head(out[1:]).argmax(-1).tolist() == drafts


def test_lm_head_chunks_change_no_draft_and_no_token(sensenova, monkeypatch):
    """Greedy verify and drafting run the LM head in row chunks; chunks of 3 rows (every block
    split across chunks) give the same drafts, acceptances and tokens as one chunk per step."""
    import batchkv.executor.speculative.dflash as dflash_module
    import batchkv.executor.speculative.verify as verify_module

    model, drafter = sensenova
    schedule = schedule_for(model.vocab_size, 4, count=5)
    spec = SpeculativeConfig("dflash", block_size=5, drafter=drafter, adaptive=False)

    def run() -> tuple[list, list[list[int]], Engine]:
        engine = Engine(model, speculative=spec, **OPTS)
        proposer, drafts = engine.speculator.proposer, []
        plain_propose = proposer.propose

        def propose(batch, samples, counts):
            out = plain_propose(batch, samples, counts)
            drafts.extend(proposer.drafts[src].tolist() for src in out.src if src)
            return out

        proposer.propose = propose
        outputs, ids = drive(engine, schedule)
        return [outputs[i] for i in ids], drafts, engine

    whole = run()
    monkeypatch.setattr(verify_module, "GREEDY_HEAD_CHUNK", 3)
    monkeypatch.setattr(dflash_module, "HEAD_CHUNK", 3)
    chunked = run()
    assert chunked[:2] == whole[:2]
    counts = ("spec_segments", "spec_proposed", "spec_accepted")
    assert [getattr(chunked[2].metrics, n) for n in counts] == [getattr(whole[2].metrics, n) for n in counts]
    assert chunked[2].metrics.spec_proposed > 3 * chunked[2].metrics.spec_segments  # blocks past 3 rows
