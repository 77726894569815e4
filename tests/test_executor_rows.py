"""More rows per step: 1,024 sequences sample in one step (the cap was 256), each with the tokens it
gets in a small group; the LM head past 256 rows runs in chunks whose tokens and logprobs equal the
whole head's (unused logits rows poisoned with NaN); a transformers model's greedy tokens at 320
rows equal its own generate; two tensor-parallel ranks at 258 rows give what one process does;
max_seqs="auto" takes 1,024 rows when the store holds them; constrained and penalised rows past 256
decode as with the whole head."""

from __future__ import annotations

import math
import random

import pytest
import torch

from batchkv.cache import CacheConfig
from batchkv.executor import MAX_SAMPLE_ROWS, Engine, Request, SamplingParams
from batchkv.executor.rows import HEAD_CHUNK, head_chunks
from tests.executor_helpers import drive, oracle
from tests.toy_model import ToyModel


@pytest.fixture(scope="module")
def toy():
    return ToyModel(seed=0)


class WholeHead:
    """The toy model through its forward only (no hidden_states/head): the runner keeps the whole
    [R, vocab] logits buffer and the unchunked path at every row count."""

    def __init__(self, model: ToyModel) -> None:
        self.model, self.vocab_size, self.device = model, model.vocab_size, model.device

    def cache_spec(self) -> dict:
        return self.model.cache_spec()

    def __call__(self, input_ids, indexes, cache, logits_rows):
        return self.model(input_ids, indexes, cache, logits_rows)


def mixed(count: int, seed: int, max_new: int = 3, scores: bool = False, longest: int = 3, n: int = 1) -> list[Request]:
    """Short requests of `n` samples with greedy, top-k, top-p and min_p sampling, penalties and
    logit_bias mixed in (with `scores`, logprobs on every other request and prompt_logprobs on every
    fifth)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = i % 5
        params: dict = {"max_new_tokens": max_new, "seed": i, "n": n}
        if kind == 1:
            params |= {"temperature": 0.8, "top_k": 20}
        elif kind == 2:
            params |= {"temperature": 1.0, "top_p": 0.9, "min_p": 0.05}
        elif kind == 3:
            params |= {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "logit_bias": {7: 5.0}}
        if scores and i % 2:
            params["logprobs"] = 3
        if scores and kind == 4:
            params["prompt_logprobs"] = 2
        prompt = [rng.randrange(97) for _ in range(rng.randint(1, longest))]
        out.append(Request(prompt, SamplingParams(**params)))
    return out


def run(engine: Engine, requests: list[Request], rows: list[int] | None = None, poison: bool = False):
    """Every request's output (tokens, finish reasons, logprobs, prompt logprobs), submitted at once;
    `rows` collects each launch's sampling rows; `poison` fills the logits buffer with NaN first."""
    launch = engine.runner.launch

    def spy(batch, width, previous=None):
        if rows is not None:
            rows.append(len(batch.rows))
        if poison:
            engine.runner.logits.fill_(float("nan"))
        return launch(batch, width, previous)

    engine.runner.launch = spy
    outputs, ids = drive(engine, [(0, r) for r in requests])
    engine.assert_idle()
    return [outputs[i] for i in ids]


def test_head_chunks_are_even_at_most_256_rows_and_cover_every_row():
    assert head_chunks(256) == [(0, 256)]
    assert head_chunks(257) == [(0, 129), (129, 257)]
    assert head_chunks(320) == [(0, 160), (160, 320)]
    assert head_chunks(1024) == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    for rows in range(1, 2100, 7):
        chunks = head_chunks(rows)
        assert [lo for lo, _ in chunks] == [0] + [hi for _, hi in chunks[:-1]] and chunks[-1][1] == rows
        assert len(chunks) == math.ceil(rows / HEAD_CHUNK) and all(hi - lo <= HEAD_CHUNK for lo, hi in chunks)
        sizes = [hi - lo for lo, hi in chunks]  # equal but the last, which falls short by less than a row per chunk
        assert set(sizes[:-1]) <= {sizes[0]} and sizes[0] - len(chunks) < sizes[-1] <= sizes[0]


def test_1024_sequences_sample_in_one_step_with_the_tokens_they_get_in_smaller_groups(toy):
    # 256 one-token prompts of 4 samples each: one step takes every prompt and samples 1,024 rows
    requests = mixed(256, seed=1, max_new=2, longest=1, n=4)
    rows: list[int] = []
    engine = Engine(toy, max_seqs=1024, capacity=8, max_step_tokens=1024, prefill_chunk=8, prefix_cache=False)
    assert engine.runner.chunked and engine.scheduler.sample_rows == MAX_SAMPLE_ROWS == 1024
    together = run(engine, requests, rows)
    assert rows == [1024, 1024]  # every sequence sampled in every step (the old cap held steps to 256)
    grouped = []
    for start in range(0, len(requests), 64):  # the same requests 64 at a time: the unchunked head
        small = Engine(toy, max_seqs=256, capacity=8, max_step_tokens=256, prefill_chunk=8, prefix_cache=False)
        assert not small.runner.chunked
        grouped += run(small, requests[start : start + 64])
    for i, (a, b) in enumerate(zip(together, grouped, strict=True)):
        assert (a.tokens, a.finish_reasons) == (b.tokens, b.finish_reasons), f"request {i}"
    for i in range(0, len(requests), 5 * 11):  # greedy ones against the model decoding them alone
        assert [(t, r) for t, r in zip(together[i].tokens, together[i].finish_reasons, strict=True)] == [
            oracle(toy, requests[i], 8)
        ] * 4


class CountingHead(WholeHead):
    """The toy model with its trunk and head (chunkable), recording the rows of every head call."""

    def __init__(self, model: ToyModel) -> None:
        super().__init__(model)
        self.head_rows: list[int] = []

    def hidden_states(self, input_ids, indexes, cache, logits_rows):
        return self.model.hidden_states(input_ids, indexes, cache, logits_rows)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        self.head_rows.append(h.shape[0])
        return self.model.head(h)


def test_a_padded_chunked_step_makes_logits_for_its_real_rows_only(toy):
    # Graph steps pad their rows to min(width, max_seqs); past 256 the head runs eagerly in chunks, and
    # a prefill step of few real rows at a wide width made every padded row's logits before (1,024
    # rows of float32 logits for a handful of finishing prompts)
    rng = random.Random(3)
    requests = [Request([rng.randrange(97) for _ in range(40)], SamplingParams(max_new_tokens=2)) for _ in range(24)]
    opts = {"max_seqs": 600, "capacity": 48, "max_step_tokens": 1024, "prefill_chunk": 40, "prefix_cache": False}
    model = CountingHead(toy)
    padded = Engine(model, **opts)
    padded.runner.pad_rows = True  # as on CUDA, where the graphs need one row count per width
    steps: list[tuple[int, int]] = []  # (the rows the width pads to, the real logits rows) per launch
    launch = padded.runner.launch
    padded.runner.launch = lambda batch, width, previous=None: (
        steps.append((min(width, 600), batch.logits_rows)),
        launch(batch, width, previous),
    )[1]
    got = run(padded, requests)
    chunked = [real for rows, real in steps if rows > HEAD_CHUNK]
    assert chunked and min(chunked) < HEAD_CHUNK  # wide steps of few real rows ran the chunked head
    assert model.head_rows == chunked  # one chunk of the real rows each, no padding row
    want = run(Engine(toy, **opts), requests)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a.tokens, a.finish_reasons) == (b.tokens, b.finish_reasons), f"request {i}"


def test_a_chunked_head_samples_and_scores_what_the_whole_head_does_with_nan_in_unused_rows(toy):
    requests = mixed(300, seed=2, max_new=2, scores=True, n=2)
    opts = {"max_seqs": 600, "capacity": 8, "max_step_tokens": 1024, "prefill_chunk": 8, "prefix_cache": False}
    chunked, whole = Engine(toy, **opts), Engine(WholeHead(toy), **opts)
    assert chunked.runner.logits.shape[0] == HEAD_CHUNK and whole.runner.logits.shape[0] == 600
    rows: list[int] = []
    a_out, b_out = run(chunked, requests, rows, poison=True), run(whole, requests, poison=True)
    assert max(rows) > 2 * HEAD_CHUNK  # three chunks
    for i, (a, b) in enumerate(zip(a_out, b_out, strict=True)):
        assert (a.tokens, a.finish_reasons) == (b.tokens, b.finish_reasons), f"request {i}"
        for mine, theirs in ((a.logprobs, b.logprobs), ([a.prompt_logprobs], [b.prompt_logprobs])):
            assert (mine is None) == (theirs is None)
            flat_a = [x for x in _flatten(mine)]
            flat_b = [x for x in _flatten(theirs)]
            assert [t for t, _ in flat_a] == [t for t, _ in flat_b], f"request {i}"
            torch.testing.assert_close(torch.tensor([v for _, v in flat_a]), torch.tensor([v for _, v in flat_b]))
            assert all(math.isfinite(v) for _, v in flat_a)
    assert any(out.logprobs for out in a_out) and any(out.prompt_logprobs for out in a_out)


def _flatten(entries) -> list[tuple[int, float]]:
    """(token, logprob) pairs of nested lists of `Logprobs` (None entries skipped)."""
    out: list[tuple[int, float]] = []
    for entry in entries or []:
        if entry is None:
            continue
        if isinstance(entry, list):
            out += _flatten(entry)
        else:
            out.append((entry.token, entry.logprob))
            out += [(t, v) for t, v in entry.top]
    return out


def test_auto_max_seqs_samples_1024_rows_when_the_store_holds_them_and_fewer_past_the_step_budget(monkeypatch, toy):
    from batchkv.executor import sizing

    per = CacheConfig(**toy.cache_spec(), max_seqs=1, capacity=48).bytes_per_position()
    monkeypatch.setattr(sizing, "device_memory", lambda device: (10**7 * per, 0))
    engine = Engine(toy, max_seqs="auto", capacity=48, max_step_tokens=1024, prefill_chunk=8)
    assert engine.cache.max_seqs == engine.scheduler.sample_rows == engine.runner.rows == 1024
    assert engine.sizing.positions == 1024 * 48  # what 1,024 sequences can reach, no more
    narrow = Engine(toy, max_seqs="auto", capacity=48, max_step_tokens=300, prefill_chunk=8)
    assert narrow.cache.max_seqs == narrow.scheduler.sample_rows == 300  # a step decodes at most 300


transformers = pytest.importorskip("transformers")


def test_a_transformers_model_at_320_rows_a_step_decodes_greedily_as_its_own_generate():
    from batchkv.models.hf import HFModel

    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # clear greedy winners: the default init gives near-ties
        hf.lm_head.weight.mul_(20.0)
    rng = random.Random(3)
    requests = [Request([rng.randrange(256) for _ in range(rng.randint(2, 4))], SamplingParams(max_new_tokens=3))
                for _ in range(320)]  # fmt: skip
    engine = Engine(HFModel(hf), max_seqs=320, capacity=16, max_step_tokens=1024, prefill_chunk=8)
    assert engine.runner.chunked
    rows: list[int] = []
    outputs = run(engine, requests, rows, poison=True)
    assert max(rows) > HEAD_CHUNK  # two chunks
    for i in range(0, 320, 53):
        prompt = torch.tensor([requests[i].prompt_ids])
        with torch.no_grad():
            full = hf.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
        assert outputs[i].tokens == [full[0, prompt.shape[1] :].tolist()], f"request {i}"


@pytest.mark.parametrize("adjusted", [False, True], ids=["plain", "penalised"])
def test_two_ranks_sample_and_score_258_rows_a_step_as_one_process_does(tmp_path, adjusted):
    # Under tensor parallelism every rank replays the chunked step (its head gathers the vocabulary
    # per chunk); rank 0 alone takes the logprobs and, in a step with penalties, adjusts and samples
    # every chunk, the other ranks taking its tokens.
    from batchkv.models.hf import HFModel
    from tests.tp_helpers import save_qwen3

    hf = save_qwen3(tmp_path)
    rng = random.Random(4)
    requests = []
    for i in range(129):
        extra = [{}, {"temperature": 0.9, "top_k": 40}, {"temperature": 1.0, "top_p": 0.9}][i % 3]
        if adjusted and i % 4 == 0:
            extra = {**extra, "presence_penalty": 1.5, "repetition_penalty": 1.3}
        params = SamplingParams(max_new_tokens=2, n=2, seed=i, logprobs=2 if i % 2 else None, **extra)
        requests.append(Request([rng.randrange(250)], params))
    opts = {"max_seqs": 258, "capacity": 8, "max_step_tokens": 1024, "prefill_chunk": 8, "prefix_cache": False}
    expected = run(Engine(HFModel(hf), **opts), requests)
    rows: list[int] = []
    with Engine(str(tmp_path), tensor_parallel=2, **opts) as engine:
        assert engine.role.world == 2 and engine.runner.chunked
        got = run(engine, requests, rows, poison=True)
    assert max(rows) == 258  # two chunks of 129
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert (a.tokens, a.finish_reasons) == (b.tokens, b.finish_reasons), f"request {i}"
        assert [t for t, _ in _flatten(a.logprobs)] == [t for t, _ in _flatten(b.logprobs)], f"request {i}"
        want, have = [v for _, v in _flatten(a.logprobs)], [v for _, v in _flatten(b.logprobs)]
        assert have == pytest.approx(want, abs=1e-4)


def test_auto_max_seqs_with_given_positions_takes_the_rows_those_positions_hold(toy):
    engine = Engine(toy, max_seqs="auto", kv_positions=4096, capacity=48, max_step_tokens=1024, prefill_chunk=8)
    assert engine.cache.max_seqs == engine.scheduler.sample_rows == 4096 // 48  # requests of 48 positions
    assert engine.sizing is None and engine.cache.config.pool_rows == 4096 + engine.cache.config.scratch_rows


def test_constrained_and_penalised_rows_past_256_decode_as_with_the_whole_head():
    pytest.importorskip("xgrammar")
    import regex

    from batchkv.executor.constraints import Constraint
    from tests.serve_helpers import make_tokenizer

    tokenizer = make_tokenizer()
    model = ToyModel(vocab=len(tokenizer) + 4, seed=1)
    eos, rng = tokenizer.eos_token_id, random.Random(5)
    word = Constraint.regex(r"[a-z]{2,6}!")
    requests = []
    for i in range(300):  # every third constrained, every fifth penalised: the rows of both in every chunk
        extra = {"constraint": word} if i % 3 == 0 else {}
        if i % 5 == 1:
            extra |= {"repetition_penalty": 1.5, "min_p": 0.1}
        params = SamplingParams(max_new_tokens=8, temperature=0.9, seed=i, stop_token_ids=(eos,), **extra)
        requests.append(Request([rng.randrange(len(tokenizer))], params))
    opts = {"max_seqs": 300, "capacity": 16, "max_step_tokens": 1024, "prefill_chunk": 8, "prefix_cache": False}
    outs = []
    for m in (model, WholeHead(model)):
        engine = Engine(m, **opts)
        engine.use_tokenizer(tokenizer)
        rows: list[int] = []
        outs.append(run(engine, requests, rows, poison=True))
        assert max(rows) == 300
    assert [o.tokens for o in outs[0]] == [o.tokens for o in outs[1]]
    for i in range(0, 300, 3):
        (tokens,), (finish,) = outs[0][i].tokens, outs[0][i].finish_reasons
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert finish == "stop" and regex.fullmatch(r"[a-z]{2,6}!", text), (i, text)  # 8 tokens always reach eos
