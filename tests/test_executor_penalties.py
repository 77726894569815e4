"""Per-row logit adjustments (presence/frequency/repetition penalties, min_p, min_tokens,
logit_bias) against transformers' own logits processors, greedy and seeded, with and without
overlap; their refusals; and that a step with no row using them runs the plain path."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from batchkv.errors import RequestError
from batchkv.executor import Engine, Request, SamplingParams
from batchkv.executor.request import MAX_LOGIT_BIAS
from batchkv.executor.sampling import uniform
from batchkv.executor.speculative import SpeculativeConfig
from tests.executor_helpers import drive
from tests.toy_model import ToyModel

PROMPT = [4, 8, 15, 16, 23, 42, 4, 8]


@pytest.fixture(scope="module")
def model():
    return ToyModel(seed=3)


@torch.no_grad()
def transformers_decode(model: ToyModel, prompt: list[int], params: SamplingParams, seed: int) -> list[int]:
    """Decode alone from scratch with transformers' processors (vLLM's order: logit_bias and
    min_tokens, repetition penalty, then OpenAI's frequency/presence formula; then the warpers) and
    inverse-CDF draws `uniform(seed, 0, i)` over the stably sorted warped softmax."""
    ids, out = list(prompt), []
    stops = list(params.stop_token_ids)
    for i in range(params.max_new_tokens):
        scores = model.reference_logits(ids)[-1][None].clone()
        input_ids = torch.tensor([ids])
        if params.logit_bias:
            scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias])(input_ids, scores)
        if params.min_tokens and stops:
            scores = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, stops)(input_ids, scores)
        if params.repetition_penalty != 1.0:
            scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(input_ids, scores)
        counts = collections.Counter(out)
        for token, c in counts.items():
            scores[0, token] -= params.frequency_penalty * c + params.presence_penalty
        if params.greedy:
            token = int(scores.argmax())
        else:
            scores = TemperatureLogitsWarper(params.temperature)(input_ids, scores)
            if params.top_k:
                scores = TopKLogitsWarper(params.top_k)(input_ids, scores)
            if params.min_p:
                scores = MinPLogitsWarper(params.min_p)(input_ids, scores)
            probs = torch.softmax(scores[0], -1)
            ordered, order = probs.sort(descending=True, stable=True)
            cum = ordered.cumsum(-1)
            choice = int((cum < uniform(seed, 0, i) * cum[-1]).sum())
            token = int(order[min(choice, int((ordered > 0).sum()) - 1)])
        out.append(token)
        ids.append(token)
        if token in stops:
            break
    return out


CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "repetition below one": dict(repetition_penalty=0.6),
    "frequency and presence": dict(frequency_penalty=1.5, presence_penalty=0.7),
    "negative presence": dict(presence_penalty=-1.2),
    "logit bias": dict(logit_bias={3: 4.0, 7: -100.0, 11: 2.5}),
    "min tokens": dict(min_tokens=12, stop_token_ids=(0, 1, 2, 3, 5, 8, 13)),
    "everything": dict(
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={9: 3.0},
        min_tokens=4,
        stop_token_ids=(21, 34),
    ),
}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("case", list(CASES))
def test_adjusted_decoding_matches_transformers_logits_processors(model, case, sampled, overlap):
    extra = dict(temperature=0.9, top_k=40, seed=77) if sampled else {}
    params = SamplingParams(max_new_tokens=16, **CASES[case], **extra)
    plain = Request([9, 9, 1], SamplingParams(max_new_tokens=10, temperature=0.8, seed=5))  # shares the steps
    engine = Engine(model, max_seqs=4, capacity=64, max_step_tokens=16, prefill_chunk=8, overlap=overlap)
    out, ids = drive(engine, [(0, Request(PROMPT, params)), (0, plain)])
    assert out[ids[0]].tokens[0] == transformers_decode(model, PROMPT, params, 77)
    alone, alone_ids = drive(Engine(model, max_seqs=4, capacity=64, max_step_tokens=16, prefill_chunk=8), [(0, plain)])
    assert out[ids[1]].tokens == alone[alone_ids[0]].tokens  # a neighbour without them is untouched


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_matches_transformers_min_p_warper(model, min_p):
    params = SamplingParams(max_new_tokens=16, temperature=1.5, min_p=min_p, seed=123)
    out, ids = drive(Engine(model, max_seqs=2, capacity=64, max_step_tokens=16), [(0, Request(PROMPT, params))])
    assert out[ids[0]].tokens[0] == transformers_decode(model, PROMPT, params, 123)


def test_the_penalties_change_what_is_decoded(model):
    def run(**kw):
        engine = Engine(model, max_seqs=2, capacity=64)
        out, ids = drive(engine, [(0, Request(PROMPT, SamplingParams(max_new_tokens=24, **kw)))])
        return out[ids[0]].tokens[0]

    plain, penalised = run(), run(frequency_penalty=2.0, repetition_penalty=2.0)
    assert plain != penalised
    assert max(collections.Counter(penalised).values()) <= max(collections.Counter(plain).values())


def test_a_step_without_adjusting_rows_never_stages_them(model, monkeypatch):
    import batchkv.executor.rows as rows_module  # where the runner's steps stage them
    import batchkv.executor.speculative.verify as verify_module

    def refuse(*args, **kwargs):
        raise AssertionError("a plain step staged penalties")

    monkeypatch.setattr(rows_module, "stage_penalties", refuse)
    monkeypatch.setattr(verify_module, "stage_verify_penalties", refuse)
    params = SamplingParams(max_new_tokens=8, temperature=0.7, seed=1)
    for speculative in (None, SpeculativeConfig("ngram", block_size=4)):
        engine = Engine(model, max_seqs=2, capacity=64, speculative=speculative)
        out, ids = drive(engine, [(0, Request(REPEATING, params))])
        assert len(out[ids[0]].tokens[0]) == 8
    assert engine.metrics.spec_proposed > 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_tokens=17), "min_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(logit_bias={3: 101.0}), "logit_bias[3]"),
        (dict(logit_bias={-1: 1.0}), "logit_bias token id"),
        (dict(logit_bias={"3": 1.0}), "logit_bias token id"),
        (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias has"),
        (dict(logit_bias=[1, 2]), "logit_bias entry"),
        (dict(constraint="{}"), "constraint is a str"),
    ],
)
def test_out_of_range_sampling_parameters_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(RequestError, match=field.replace("[", r"\[")):
        SamplingParams(max_new_tokens=16, **kwargs)


def test_the_engine_refuses_logit_bias_past_the_vocabulary_and_penalties_under_dflash(model):
    import functools

    from batchkv.models import build_model
    from batchkv.models.dflash import build_drafter

    engine = Engine(model, max_seqs=2, capacity=64)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.submit(Request(PROMPT, SamplingParams(logit_bias={model.vocab_size: 1.0})))
    drafter = functools.partial(build_drafter, num_layers=1, target_layer_ids=(0, 2), block_size=4, seed=1)
    config = SpeculativeConfig("dflash", block_size=4, drafter=drafter)
    dflash = Engine(build_model("sensenova-u1-tiny", "cpu", seed=0), max_seqs=2, capacity=64, speculative=config)
    for params in (SamplingParams(repetition_penalty=1.2), SamplingParams(min_p=0.1, temperature=1.0)):
        with pytest.raises(RequestError, match=r"under dflash speculation .*n-gram speculation or none"):
            dflash.submit(Request(PROMPT, params))
    assert not engine.has_work and not dflash.has_work


REPEATING = [4, 8, 15, 16, 23, 42] * 3  # n-gram lookup finds drafts in it


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_penalties_under_ngram_speculation_decode_what_transformers_and_plain_decoding_do(model, case):
    params = SamplingParams(max_new_tokens=16, **CASES[case])
    plain = Request([9, 9, 1, 9, 9, 1], SamplingParams(max_new_tokens=10))  # a neighbour without them
    spec = Engine(model, max_seqs=4, capacity=96, speculative=SpeculativeConfig("ngram", block_size=4))
    out, ids = drive(spec, [(0, Request(REPEATING, params)), (0, plain)])
    expected = transformers_decode(model, REPEATING, params, 0)
    assert out[ids[0]].tokens[0] == expected
    alone, alone_ids = drive(Engine(model, max_seqs=4, capacity=96), [(0, Request(REPEATING, params)), (0, plain)])
    assert [out[i].tokens for i in ids] == [alone[i].tokens for i in alone_ids]  # as without speculation
    # verify steps judged drafts under the adjustments (a 1.8 repetition penalty repeats nothing to look up)
    assert spec.metrics.spec_proposed > 0 or case == "repetition"


def test_penalties_under_ngram_speculation_accept_drafts_they_agree_with(model):
    # A logit_bias that makes token 42 win everywhere: every draft of 42 after the first is accepted.
    params = SamplingParams(max_new_tokens=24, logit_bias={42: 100.0}, frequency_penalty=0.0)
    spec = Engine(model, max_seqs=2, capacity=96, speculative=SpeculativeConfig("ngram", block_size=4))
    out, ids = drive(spec, [(0, Request(REPEATING, params))])
    assert out[ids[0]].tokens[0] == [42] * 24 == transformers_decode(model, REPEATING, params, 0)
    assert spec.metrics.spec_accepted > 0


@pytest.mark.parametrize("case", ["everything", "min p", "logit bias"])
def test_seeded_penalties_under_ngram_speculation_only_emit_tokens_the_processors_keep(model, case):
    extra = {"min p": dict(min_p=0.3), "everything": CASES["everything"], "logit bias": CASES["logit bias"]}[case]
    params = SamplingParams(max_new_tokens=20, temperature=1.3, top_k=40, seed=8, **extra)
    spec = Engine(model, max_seqs=2, capacity=96, speculative=SpeculativeConfig("ngram", block_size=4))
    out, ids = drive(spec, [(0, Request(REPEATING, params))])
    tokens = out[ids[0]].tokens[0]
    again, again_ids = drive(
        Engine(model, max_seqs=2, capacity=96, speculative=SpeculativeConfig("ngram", block_size=4)),
        [(0, Request(REPEATING, params))],
    )
    assert again[again_ids[0]].tokens[0] == tokens  # seeded: reproducible
    for i, token in enumerate(tokens):  # the processed distribution at each position keeps the token
        support = processed_probs(model, REPEATING, tokens[:i], params)
        assert support[token] > 0, (i, token)
    assert spec.metrics.spec_proposed > 0


@torch.no_grad()
def processed_probs(model: ToyModel, prompt: list[int], out: list[int], params: SamplingParams) -> torch.Tensor:
    """transformers' processors and warpers (vLLM's order, as `transformers_decode`) after `out`."""
    ids = list(prompt) + list(out)
    scores = model.reference_logits(ids)[-1][None].clone()
    input_ids = torch.tensor([ids])
    if params.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias])(input_ids, scores)
    if params.min_tokens and params.stop_token_ids:
        stops = list(params.stop_token_ids)
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, stops)(input_ids, scores)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(input_ids, scores)
    for token, c in collections.Counter(out).items():
        scores[0, token] -= params.frequency_penalty * c + params.presence_penalty
    scores = TemperatureLogitsWarper(params.temperature)(input_ids, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(input_ids, scores)
    if params.min_p:
        scores = MinPLogitsWarper(params.min_p)(input_ids, scores)
    return torch.softmax(scores[0], -1)


def test_a_jsonl_workload_line_carries_the_adjustments_and_bad_values_name_the_line(tmp_path):
    import json

    from batchkv.cli.workload import load_jsonl
    from batchkv.errors import WorkloadError

    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1, 2], "repetition_penalty": 1.2, "logit_bias": {"5": -3}}) + "\n")
    params = load_jsonl(path)[0].request.params
    assert params.repetition_penalty == 1.2 and params.logit_bias == ((5, -3.0),)
    path.write_text(json.dumps({"prompt_ids": [1], "min_p": 3}) + "\n")
    with pytest.raises(WorkloadError, match=r"w.jsonl:1: min_p is 3.0"):
        load_jsonl(path)
