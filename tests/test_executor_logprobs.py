"""Log-probabilities through the engine, against transformers as the oracle (a tiny Qwen3): each
generated token's logprob and top k equal torch.log_softmax of transformers' logits over the same
history, whatever the sampling parameters; prompt_logprobs give transformers' own loss, also when the
prompt's chunks are cut by the logits rows a step has; overlap changes no number; a step where nobody
asks computes and copies nothing for them; a speculating engine refuses them. With the prefix
cache: a prompt that asks for prompt_logprobs is scored whole (it reuses nothing), and a prompt that
reused a cached or shared prefix gets the same logprobs as one computed whole, 256 rows a step too."""

from __future__ import annotations

import pytest
import torch

from batchkv.errors import RequestError
from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig, gather
from batchkv.executor.logprobs import LogprobSlots
from tests.executor_helpers import working
from tests.toy_model import ToyModel

transformers = pytest.importorskip("transformers")

from batchkv.models.hf import HFModel  # noqa: E402

GEOMETRY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
}
PROMPTS = [[5, 17, 33, 9], [101, 7, 7, 250, 3, 88, 41, 19, 2, 64, 77, 12, 90, 31], [9, 200, 150]]
OPTS = {"max_seqs": 4, "capacity": 96, "max_step_tokens": 16, "prefill_chunk": 8}


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**GEOMETRY, attn_implementation="sdpa")
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # a sharper head than the default init: distinct top-k values
        model.lm_head.weight.mul_(20.0)
    return model


@torch.no_grad()
def oracle_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax over the full history, float32 [len(ids), vocab]."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def run(engine: Engine, requests: list[Request]) -> list:
    ids = [engine.submit(r) for r in requests]
    events = []
    for _ in working(engine):
        events += engine.step()
    engine.assert_idle()
    out = gather(events, {rid: r.params.n for rid, r in zip(ids, requests, strict=True)})
    return [out[rid] for rid in ids]


def assert_matches(entries, ids: list[int], start: int, expected: torch.Tensor, k: int) -> None:
    """entries[i] is the Logprobs of ids[start + i] given ids[: start + i] (row start + i - 1)."""
    for i, entry in enumerate(entries):
        row = expected[start + i - 1]
        assert entry.token == ids[start + i]
        assert entry.logprob == pytest.approx(row[entry.token].item(), abs=2e-4)
        top = row.topk(k)
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=2e-4)
        assert [row[t].item() for t, _ in entry.top] == pytest.approx(top.values.tolist(), abs=2e-4)


@pytest.mark.parametrize(
    "params",
    [{}, {"temperature": 0.9, "top_k": 5, "top_p": 0.8, "seed": 3}, {"temperature": 1.3, "seed": 1, "n": 2}],
    ids=["greedy", "filtered sampling", "n=2 sampling"],
)
def test_each_tokens_logprob_and_top_k_equal_log_softmax_of_transformers_logits(hf, params):
    requests = [Request(p, SamplingParams(max_new_tokens=6, logprobs=3, ignore_eos=True, **params)) for p in PROMPTS]
    for request, out in zip(requests, run(Engine(HFModel(hf), **OPTS), requests), strict=True):
        prompt = list(request.prompt_ids)
        for tokens, entries in zip(out.tokens, out.logprobs, strict=True):
            assert len(entries) == len(tokens) == 6 and out.prompt_logprobs is None
            history = prompt + tokens
            assert_matches(entries, history, len(prompt), oracle_logprobs(hf, history), 3)


def test_prompt_logprobs_give_transformers_own_loss_with_chunks_cut_by_the_logits_rows(hf):
    """Three logits rows a step (max_seqs=3) against a 40-token prompt and two requests decoding beside it."""
    rng = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, GEOMETRY["vocab_size"], (40,), generator=rng).tolist()
    engine = Engine(HFModel(hf), **{**OPTS, "max_seqs": 3})
    rows = []
    launch = engine.runner.launch
    engine.runner.launch = lambda batch, width, previous=None: (
        rows.append(batch.logits_rows) or launch(batch, width, previous)
    )
    requests = [Request(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in PROMPTS[:2]]
    requests.append(Request(prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=2, logprobs=0)))
    out = run(engine, requests)[2]
    scored = out.prompt_logprobs
    assert len(scored) == len(prompt) and scored[0] is None
    expected = oracle_logprobs(hf, prompt)
    assert_matches(scored[1:], prompt, 1, expected, 2)
    with torch.no_grad():
        loss = hf(torch.tensor([prompt]), labels=torch.tensor([prompt])).loss.item()
    assert -sum(e.logprob for e in scored[1:]) / (len(prompt) - 1) == pytest.approx(loss, abs=1e-5)
    assert max(rows) == 3  # every step within the engine's logits rows, and some used them all
    first = out.logprobs[0][0]  # the first generated token is scored from the prompt's last row
    assert first.logprob == pytest.approx(expected[-1][first.token].item(), abs=2e-4) and first.top == ()


def test_overlap_on_and_off_give_the_same_numbers(hf):
    def requests():
        out = [Request(p, SamplingParams(max_new_tokens=5, logprobs=2, ignore_eos=True)) for p in PROMPTS]
        out.append(Request(PROMPTS[1], SamplingParams(max_new_tokens=3, prompt_logprobs=4, ignore_eos=True)))
        out.append(Request(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=0.7, seed=2, n=2, logprobs=1)))
        out.append(Request(PROMPTS[2], SamplingParams(max_new_tokens=4)))  # asks for nothing
        return out

    plain = run(Engine(HFModel(hf), overlap=False, **OPTS), requests())
    piped = run(Engine(HFModel(hf), overlap=True, **OPTS), requests())
    for a, b in zip(plain, piped, strict=True):
        assert a.tokens == b.tokens
        for xs, ys in ((a.logprobs, b.logprobs), ([a.prompt_logprobs or []], [b.prompt_logprobs or []])):
            for x, y in zip(xs, ys, strict=True):
                assert [e and e.token for e in x] == [e and e.token for e in y]
                assert [e and e.logprob for e in x] == pytest.approx([e and e.logprob for e in y], abs=1e-5)
    assert plain[3].prompt_logprobs is not None and plain[5].logprobs == [[]]


class AtenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The names of the aten ops run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_step_where_nobody_asks_runs_no_logprob_op_and_copies_nothing_to_their_slots(hf):
    engine = Engine(HFModel(hf), **OPTS)
    slots = engine.runner.logprob_slots
    for buffer in (slots._values, slots._ids, slots.select):
        buffer.fill_(-7)
    ops: list[list[str]] = []
    launch = engine.runner.launch

    def traced(batch, width, previous=None):
        with AtenOps() as mode:
            result = launch(batch, width, previous)
        ops.append(mode.names)
        return result

    engine.runner.launch = traced
    run(engine, [Request(p, SamplingParams(max_new_tokens=4)) for p in PROMPTS])
    quiet = len(ops)
    assert all("logsumexp" not in names and "topk" not in names for names in ops)
    for buffer in (slots._values, slots._ids, slots.select):
        assert bool((buffer == -7).all()), "a logprob buffer was written in a step where nobody asked"
    run(engine, [Request(PROMPTS[0], SamplingParams(max_new_tokens=2, logprobs=1))])
    assert all("logsumexp" in names and "topk" in names for names in ops[quiet:])  # the check can see them


def test_a_request_asking_for_logprobs_is_refused_by_a_speculating_engine_which_stays_as_it_was():
    engine = Engine(ToyModel(seed=0), speculative=SpeculativeConfig("ngram", block_size=4), **OPTS)
    for params in ({"logprobs": 0}, {"prompt_logprobs": 1}):
        with pytest.raises(RequestError, match="speculative"):
            engine.submit(Request([1, 2, 3], SamplingParams(max_new_tokens=4, **params)))
    assert not engine.has_work and engine.metrics.submitted == 0
    assert run(engine, [Request([1, 2, 3], SamplingParams(max_new_tokens=4))])[0].tokens[0]


@pytest.mark.parametrize("value", [-1, 21, 2.0, True, "3"])
def test_logprobs_outside_0_to_20_or_not_an_integer_are_refused(value):
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(RequestError, match=name):
            SamplingParams(**{name: value})


def test_the_logprob_slots_are_counted_in_the_runners_bytes():
    rows = 8
    slots = LogprobSlots(rows, torch.device("cpu"))
    held = sum(t.numel() * t.element_size() for t in (slots._values, slots._ids))
    held += 2 * slots._plan.device_buffers[torch.int64].numel() * 8  # host and device
    assert LogprobSlots.nbytes(rows) == held


def test_a_scoring_prompt_takes_half_the_logits_rows_from_a_step_full_of_decoding_samples():
    engine = Engine(ToyModel(seed=0), max_seqs=8, capacity=96, max_step_tokens=8, prefill_chunk=8)
    for i in range(7):
        engine.submit(Request([1 + i, 2], SamplingParams(max_new_tokens=60)))
    while len(engine.scheduler.running) < 7:
        engine.step()
    seen = []
    launch = engine.runner.launch

    def spy(batch, width, previous=None):
        seen.append((batch.decode_tokens, len(batch.score_rows), batch.logits_rows))
        return launch(batch, width, previous)

    engine.runner.launch = spy
    rid = engine.submit(Request(list(range(3, 23)), SamplingParams(max_new_tokens=1, prompt_logprobs=0)))
    events = []
    for _ in working(engine):
        events += engine.step()
    prompt = gather(events)[rid].prompt_logprobs
    assert len(prompt) == 20 and all(e.top == () for e in prompt[1:])
    scoring = [s for s in seen if s[1]]
    assert scoring[0] == (4, 4, 8)  # 4 rows decode (of 7 samples), 4 score the prompt
    assert len(scoring) == 5 and all(rows <= 8 for _, _, rows in seen)  # 19 scored tokens, 4 a step


def test_a_prompt_the_prefix_cache_holds_is_still_scored_whole_when_it_asks_for_prompt_logprobs(hf):
    prompt = PROMPTS[1] * 3  # 42 tokens: past the prefix cache's 16-token blocks
    engine = Engine(HFModel(hf), prefix_cache=True, **OPTS)
    plain = run(engine, [Request(prompt, SamplingParams(max_new_tokens=2))])[0]
    again = run(engine, [Request(prompt, SamplingParams(max_new_tokens=2))])[0]
    assert engine.metrics.prefix_hits == 1 and again.tokens == plain.tokens  # the cache held the prompt
    scored = run(engine, [Request(prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=1))])[0]
    assert engine.metrics.prefix_hits == 1 and engine.metrics.prefix_admitted == 3
    assert len(scored.prompt_logprobs) == len(prompt) and scored.tokens == plain.tokens
    assert_matches(scored.prompt_logprobs[1:], prompt, 1, oracle_logprobs(hf, prompt), 1)


def test_a_prompt_scored_for_prompt_logprobs_is_kept_for_later_requests_to_reuse(hf):
    prompt = PROMPTS[1] * 3
    engine = Engine(HFModel(hf), **OPTS)
    scored = run(engine, [Request(prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=0))])[0]
    plain = run(engine, [Request(prompt, SamplingParams(max_new_tokens=2))])[0]
    assert engine.metrics.prefix_hits == 1 and engine.metrics.prefix_reused == len(prompt) - 1
    assert plain.tokens == scored.tokens


def test_logprobs_of_a_prompt_that_hit_the_prefix_cache_equal_those_of_its_first_computation(hf):
    prompt = PROMPTS[1] * 3
    engine = Engine(HFModel(hf), **OPTS)
    params = SamplingParams(max_new_tokens=6, logprobs=3, ignore_eos=True)
    first = run(engine, [Request(prompt, params)])[0]
    again = run(engine, [Request(prompt, params)])[0]
    assert engine.metrics.prefix_hits == 1 and engine.metrics.prefix_reused == len(prompt) - 1
    assert again.tokens == first.tokens
    for a, b in zip(first.logprobs[0], again.logprobs[0], strict=True):
        assert (a.token, [t for t, _ in a.top]) == (b.token, [t for t, _ in b.top])
        assert [a.logprob, *(v for _, v in a.top)] == pytest.approx([b.logprob, *(v for _, v in b.top)], abs=1e-5)
    history = prompt + first.tokens[0]
    assert_matches(again.logprobs[0], history, len(prompt), oracle_logprobs(hf, history), 3)
    turn = [*history, 7]  # the conversation goes on: it adopts a cached column whole (no copy)
    reused, copies = engine.metrics.prefix_reused, []
    clone = engine.cache.seq_clone
    engine.cache.seq_clone = lambda *a, **k: copies.append(a) or clone(*a, **k)
    later = run(engine, [Request(turn, params)])[0]
    assert engine.metrics.prefix_hits == 2 and engine.metrics.prefix_reused - reused == len(history) - 1
    assert copies == []
    history = turn + later.tokens[0]
    assert_matches(later.logprobs[0], history, len(turn), oracle_logprobs(hf, history), 3)


def test_256_samples_decoding_in_one_step_beside_a_cloned_prefix_get_transformers_logprobs(hf):
    system = (PROMPTS[1] * 3)[:40]
    prompts = [[*system, 200 + s, s] for s in range(8)]  # 8 histories (greedy), 32 requests each
    engine = Engine(HFModel(hf), max_seqs=256, capacity=64, max_step_tokens=512, prefill_chunk=8)
    rows = []
    launch = engine.runner.launch
    engine.runner.launch = lambda batch, width, previous=None: (
        rows.append(len(batch.rows)) or launch(batch, width, previous)
    )
    params = SamplingParams(max_new_tokens=10, logprobs=2, ignore_eos=True)
    outs = run(engine, [Request(prompts[i % 8], params) for i in range(256)])
    assert max(rows) == 256  # one step's 256 sampling rows all asked
    assert engine.metrics.prefix_hits == 255  # all but the first cloned the shared prefix
    expected = {}
    for i, out in enumerate(outs):
        history = prompts[i % 8] + out.tokens[0]
        if tuple(history) not in expected:
            expected[tuple(history)] = oracle_logprobs(hf, history)
        assert_matches(out.logprobs[0], history, len(prompts[i % 8]), expected[tuple(history)], 2)
    assert len(expected) == 8  # equal prompts decoded equal tokens
