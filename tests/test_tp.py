"""Tensor parallelism on the CPU (gloo): an engine sharded over 2 or 3 processes emits, token for
token, what the one-process engine emits, for SenseNova tiny (with its KV heads split, and with one
KV head replicated), a tiny transformers Qwen3 and a tied Llama with biases (fp32), with arrivals,
n > 1, a cancellation, sampling, overlap, e4m3 storage, speculation and a warm-up; the transformers
models' greedy tokens equal their own `generate`; and one step's logits agree within fp32 rounding."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig, gather
from batchkv.models import build_model
from batchkv.models.dflash import build_drafter
from batchkv.models.parallel import Shard
from tests.executor_helpers import drive, random_prompt
from tests.tp_helpers import hf_greedy, hf_last_logits, one_kv_head, save_hf, save_qwen3

ENGINE = {"max_seqs": 4, "capacity": 64, "max_step_tokens": 32, "prefill_chunk": 16}


def schedule(seed: int, vocab: int, *, sampled: bool = False) -> tuple[list[tuple[int, Request]], dict]:
    """Requests arriving over the first steps, every fourth with n = 2, request 2 cancelled at step 5."""
    rng = random.Random(seed)
    out = []
    for i in range(7):
        extra = {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": i} if sampled and i % 2 else {}
        params = SamplingParams(max_new_tokens=rng.randint(2, 14), n=2 if i % 4 == 1 else 1, **extra)
        out.append((rng.randint(0, 6), Request(random_prompt(rng, 1, 30, vocab=vocab), params)))
    out[2] = (0, Request(random_prompt(rng, 20, 20, vocab=vocab), SamplingParams(max_new_tokens=30)))
    return out, {5: [2]}


def outputs(engine: Engine, plan: tuple[list, dict]) -> list[tuple]:
    got, ids = drive(engine, *plan)
    engine.assert_idle()
    return [(got[i].tokens, got[i].finish_reasons) for i in ids]


def first_logits(engine: Engine, prompt: list[int], max_steps: int = 8) -> torch.Tensor:
    """The logits [vocab] of the step that emits `prompt`'s first greedy token (on an idle engine:
    the step's only row), checked against that token."""
    rid = engine.submit(Request(prompt, SamplingParams(max_new_tokens=1)))
    for _ in range(max_steps):  # the first step admits; a later one runs the prompt and samples
        tokens = [e.token for e in engine.step() if e.request_id == rid and e.token is not None]
        if tokens:
            logits = engine.runner.logits[0].clone()
            assert int(logits.argmax()) == tokens[0]  # the row the token was sampled from
            engine.assert_idle()
            return logits
    pytest.fail(f"{max_steps} steps and no token for a {len(prompt)}-token prompt")


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """`n` greedy tokens of each prompt, submitted together (EOS ignored, as `hf_greedy` does)."""
    ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))) for p in prompts]
    events = engine.run_until_done()
    return [[e.token for e in events if e.request_id == i and e.token is not None] for i in ids]


def tp_engine(source, world: int, **options) -> Engine:
    engine = Engine(source, tensor_parallel=world, **ENGINE, **options)
    assert engine.role.world == world and dist.get_world_size() == world
    return engine


DRAFTER = functools.partial(build_drafter, num_layers=1, target_layer_ids=(0, 2), block_size=4, seed=1)
CASES = {  # plain greedy steps: the replicated-KV-head test below
    "sampled, overlap, e4m3": ({"overlap": True, "kv_dtype": torch.float8_e4m3fn}, True),
    "ngram speculation": ({"speculative": SpeculativeConfig("ngram", block_size=4)}, False),
    "dflash speculation": ({"speculative": SpeculativeConfig("dflash", block_size=4, drafter=DRAFTER)}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_serve_sensenova_tiny_as_one_process_does(case):
    options, sampled = CASES[case]
    plan = schedule(3, 512, sampled=sampled)
    expected = outputs(Engine(build_model("sensenova-u1-tiny", "cpu", seed=0), **ENGINE, **options), plan)
    with tp_engine("sensenova-u1-tiny", 2, **options) as engine:
        assert engine.cache.config.kv_heads == 1  # this rank's share of the 2 KV heads
        assert outputs(engine, plan) == expected
        assert any(finish == ["cancelled"] for _, finish in expected)
    assert not dist.is_initialized()  # closing stopped the group


def test_two_ranks_replicate_a_single_kv_head_and_agree_with_one_process_to_fp32_rounding():
    requests, cancels = schedule(4, 512)
    rng, system = random.Random(11), random_prompt(random.Random(10), 20, 20, vocab=512)
    for arrival in (8, 14, 20):  # a shared prefix: the prefix cache's clone, rewind and reserve run on every rank
        requests.append(
            (arrival, Request(system + random_prompt(rng, 1, 6, vocab=512), SamplingParams(max_new_tokens=4)))
        )
    plan = (requests, cancels)
    model = one_kv_head(Shard())
    reference = Engine(model, **ENGINE)
    expected = outputs(reference, plan)
    prompt = random_prompt(random.Random(9), 12, 12, vocab=512)
    want = first_logits(reference, prompt)
    with tp_engine(one_kv_head, 2) as engine:
        assert engine.cache.config.kv_heads == 1 and model.config.kv_heads == 1  # one head, held by both ranks
        environ = Path(f"/proc/{engine.role.group.procs[0].pid}/environ").read_bytes().split(b"\0")
        assert {b"NCCL_NVLS_ENABLE=0", b"TORCH_SYMM_MEM_DISABLE_MULTICAST=1", b"NVSHMEM_DISABLE_NVLS=1"} <= set(environ)
        assert outputs(engine, plan) == expected
        assert engine.metrics.prefix_hits >= 2 and engine.metrics.prefix_hits == reference.metrics.prefix_hits
        got = first_logits(engine, prompt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.shape == (512,)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("qwen3")
    return path, save_qwen3(path)


@pytest.mark.parametrize("world, speculative", [(2, SpeculativeConfig("ngram", block_size=4)), (3, None)],
                         ids=["2 ranks, ngram speculation", "3 ranks"])  # fmt: skip
def test_ranks_serve_a_transformers_qwen3_read_by_slices_as_one_process_and_transformers_do(
    qwen3_dir, world, speculative
):
    from batchkv.models.hf import HFModel

    path, hf = qwen3_dir
    plan = schedule(5, 250)
    reference = Engine(HFModel(hf), **ENGINE, speculative=speculative)
    expected = outputs(reference, plan)
    prompt = random_prompt(random.Random(7), 9, 9, vocab=250)
    want = first_logits(reference, prompt) if speculative is None else None  # (a verify runner keeps no logits)
    prompts = [random_prompt(random.Random(s), 3, 17, vocab=250) for s in range(3)]
    with tp_engine(path, world, speculative=speculative) as engine:
        assert engine.cache.config.kv_heads == 6 // world
        assert outputs(engine, plan) == expected
        if speculative is not None:
            assert engine.metrics.spec_accepted > 0 and engine.metrics.spec_accepted == reference.metrics.spec_accepted
        got = first_logits(engine, prompt) if speculative is None else None
        tokens = greedy(engine, prompts, 8)
    assert tokens == [hf_greedy(hf, p, 8) for p in prompts]
    if speculative is None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # 250 is not a multiple of 3: padded, then cut
        assert got.shape == (250,)
        torch.testing.assert_close(got, hf_last_logits(hf, prompt), rtol=1e-4, atol=1e-4)  # transformers' attention


LLAMA = {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 24, "attention_bias": True,
         "mlp_bias": True, "tie_word_embeddings": True}  # fmt: skip


def test_two_ranks_serve_a_tied_llama_with_biases_and_a_replicated_kv_head_as_transformers_does(tmp_path):
    from batchkv.models.hf import HFModel

    hf = save_hf(tmp_path, "llama", **LLAMA)
    plan = schedule(6, 250)
    expected = outputs(Engine(HFModel(hf), **ENGINE), plan)
    prompts = [random_prompt(random.Random(s), 3, 17, vocab=250) for s in range(3)]
    with tp_engine(tmp_path, 2) as engine:
        part = engine.runner.model.hf  # rank 0's share: half the query heads, the one KV head, a tied head
        assert engine.cache.config.kv_heads == 1 and part.lm_head.weight is part.model.embed_tokens.weight
        assert part.model.layers[0].self_attn.o_proj.bias.shape == (96,)  # a row-parallel bias, held whole
        fused, whole = part.model.layers[0].self_attn.fused_qkv.layer, hf.model.layers[0].self_attn
        for tensor in ("weight", "bias"):  # q, k and v sliced for rank 0 (2 of 4 query heads of 24), then joined
            rows = [getattr(getattr(whole, f"{name}_proj"), tensor) for name in "qkv"]
            assert torch.equal(getattr(fused, tensor), torch.cat([rows[0][:48], rows[1], rows[2]]))
        assert part.model.layers[0].mlp.fused_gate_up.layer.weight.shape == (192, 96)  # gate's 96 rows, up's 96
        assert outputs(engine, plan) == expected
        tokens = greedy(engine, prompts, 8)
        got = first_logits(engine, prompts[0])
    assert tokens == [hf_greedy(hf, p, 8) for p in prompts]
    torch.testing.assert_close(got, hf_last_logits(hf, prompts[0]), rtol=1e-4, atol=1e-4)


def test_warming_every_width_on_two_ranks_changes_nothing_they_serve_after():
    # Engine.warm_up's steps (sequences made for them and removed) run on every rank through the
    # mirrored verbs; on the CPU (no graphs) the runner's warm is called directly.
    plan = schedule(8, 512)
    expected = outputs(Engine(build_model("sensenova-u1-tiny", "cpu", seed=0), **ENGINE), plan)
    with tp_engine("sensenova-u1-tiny", 2) as engine:
        engine.runner.warm(engine.buckets)
        assert not engine.cache.sequences  # removed (the followers' removals travel with the next plan)
        assert outputs(engine, plan) == expected


def test_three_ranks_give_transformers_logprobs_over_a_vocabulary_padded_to_the_ranks(qwen3_dir):
    # 250 rows of lm_head over 3 ranks: the gathered logits are padded to 252 and cut before sampling
    # and log_softmax, so a padding column would shift every logprob; rank 0 alone computes them.
    path, hf = qwen3_dir
    prompt = random_prompt(random.Random(12), 11, 11, vocab=250)
    params = SamplingParams(max_new_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    with tp_engine(path, 3) as engine:
        rid = engine.submit(Request(prompt, params))
        events = engine.run_until_done()
    out = gather(events, {rid: 1})[rid]
    ids = prompt + out.tokens[0]
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    scored = [(i, e) for i, e in enumerate(out.prompt_logprobs[1:], start=1)] + [
        (len(prompt) + i, e) for i, e in enumerate(out.logprobs[0])
    ]
    assert out.prompt_logprobs[0] is None and len(scored) == len(ids) - 1
    for position, entry in scored:  # the entry of ids[position], given ids[:position]
        row = expected[position - 1]
        assert entry.token == ids[position]
        assert entry.logprob == pytest.approx(row[entry.token].item(), abs=2e-4)
        assert [v for _, v in entry.top] == pytest.approx(row.topk(len(entry.top)).values.tolist(), abs=2e-4)


def test_two_ranks_with_fp8_projections_agree_with_one_fp8_process_to_the_scales_rounding(qwen3_dir):
    """Each rank quantises its own slices (a row-parallel slice has its own per-channel scales), so
    the sharded model is not bit-identical to the whole one; its logits agree to e4m3's rounding."""
    from batchkv.models.hf import HFModel, quantize_decoder
    from batchkv.models.loading import load

    path, hf = qwen3_dir
    whole = type(hf)(hf.config)
    whole.load_state_dict(hf.state_dict())
    quantize_decoder(whole.eval())
    prompt = random_prompt(random.Random(7), 9, 9, vocab=250)
    exact = first_logits(Engine(HFModel(hf), **ENGINE), prompt)
    want = first_logits(Engine(HFModel(whole), **ENGINE), prompt)
    with tp_engine(functools.partial(load, str(path), quantization="fp8"), 2) as engine:
        got = first_logits(engine, prompt)
    assert not torch.equal(got, want)  # the o and down slices' scales are the ranks' own
    assert (got - want).norm() <= 1.5 * (want - exact).norm()  # no further than fp8 is from float
    assert (got - exact).norm() / exact.norm() < 0.1


def adjusted_schedule(vocab: int) -> tuple[list[tuple[int, Request]], dict]:
    """Penalties, logit_bias, min_tokens and min_p (greedy and seeded) and constraints beside plain
    requests, arriving over the first steps."""
    from batchkv.executor.constraints import Constraint

    rng = random.Random(21)
    params = [
        {"repetition_penalty": 1.8, "frequency_penalty": 0.7, "presence_penalty": 0.5},
        {"logit_bias": {7: 5.0, 9: -100.0}, "min_tokens": 4, "temperature": 0.8, "seed": 2, "n": 2},
        {"min_p": 0.2, "temperature": 1.1, "seed": 3, "presence_penalty": -1.0},
        {"constraint": Constraint.regex(TP_PATTERN)},
        {"constraint": Constraint.choice(["red", "green", "blue"]), "temperature": 0.9, "seed": 4},
        {},
    ]
    out = []
    for i, extra in enumerate(params):
        request = Request(random_prompt(rng, 3, 20, vocab=vocab), SamplingParams(max_new_tokens=10, **extra))
        out.append((i % 3, request))
    return out, {}


TP_PATTERN = r"[0-9]{2,4}-[a-c]{1,3}\."  # at most 9 tokens: done within max_new_tokens


@pytest.mark.parametrize("options", [{"overlap": True}, {"speculative": SpeculativeConfig("ngram", block_size=3)}],
                         ids=["overlap", "ngram speculation"])  # fmt: skip
def test_two_ranks_apply_penalties_and_constraints_as_one_process_does(options):
    import regex

    from tests.serve_helpers import make_tokenizer

    tokenizer = make_tokenizer()  # 320 tokens inside sensenova-tiny's 512
    plan = adjusted_schedule(512)
    reference = Engine(build_model("sensenova-u1-tiny", "cpu", seed=0), **ENGINE, **options)
    reference.use_tokenizer(tokenizer)
    expected = outputs(reference, plan)
    with tp_engine("sensenova-u1-tiny", 2, **options) as engine:
        engine.use_tokenizer(tokenizer)
        assert outputs(engine, plan) == expected
        proposed = engine.metrics.spec_proposed
        assert proposed == reference.metrics.spec_proposed and (proposed > 0) == ("speculative" in options)
    pairs = zip(plan[0], expected, strict=True)
    texts = {r.params.constraint.kind: tokenizer.decode(out[0]) for (_, r), (out, _) in pairs if r.params.constraint}
    assert regex.fullmatch(TP_PATTERN, texts["regex"]) and texts["choice"] in ("red", "green", "blue")
