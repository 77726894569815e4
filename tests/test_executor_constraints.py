"""Constrained decoding (xgrammar) on the engine: the bitmask against a plain-Python reference on a
tiny byte-level tokenizer, every generated token allowed at every step; overlap and n-gram
speculation decode the same constrained tokens; mixed steps (n = 2, unconstrained neighbours,
many constraints in one step); JSON that validates with jsonschema; finishes and refusals."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest
import regex
import torch

from batchkv.errors import RequestError
from batchkv.executor import Engine, Request, SamplingParams
from batchkv.executor.constraints import Constraint, Grammars, accept, allowed
from batchkv.executor.speculative import SpeculativeConfig
from tests.executor_helpers import drive
from tests.serve_helpers import make_tokenizer
from tests.toy_model import ToyModel

PATTERN = r"(yes|no|[0-9]{1,3}(, [0-9]{1,3}){0,4})\."
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "colour", "size"],
    "additionalProperties": False,
}
PROMPT = [5, 17, 33, 60, 61, 62, 9]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return ToyModel(vocab=len(tokenizer) + 4, seed=1)  # a model vocabulary wider than the tokenizer's


def engine_for(model, tokenizer, **kwargs) -> Engine:
    engine = Engine(model, max_seqs=8, capacity=128, max_step_tokens=32, prefill_chunk=16, **kwargs)
    engine.use_tokenizer(tokenizer)
    return engine


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(kept, codes, strict=True)}


def token_bytes(tokenizer) -> dict[int, bytes]:
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    return {
        i: bytes(decoder[c] for c in piece)
        for piece, i in tokenizer.get_vocab().items()
        if i not in tokenizer.all_special_ids
    }


def reference_allowed(pattern: str, text: bytes, pieces: dict[int, bytes], eos: int, vocab: int) -> set[int]:
    """Tokens after `text` that keep it a prefix of a full match of the ASCII `pattern` (plain
    Python, the `regex` module's partial matching), and EOS once `text` matches whole."""
    out = set()
    for token, piece in pieces.items():
        candidate = text + piece
        if candidate.isascii() and regex.fullmatch(pattern, candidate.decode(), partial=True) is not None:
            out.add(token)
    if regex.fullmatch(pattern, text.decode()) is not None:
        out.add(eos)
    return out


def test_every_generated_token_is_allowed_and_the_bitmask_matches_a_python_reference(model, tokenizer):
    eos, vocab = tokenizer.eos_token_id, model.vocab_size
    pieces = token_bytes(tokenizer)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, n=3, stop_token_ids=(eos,))
    request = Request(PROMPT, SamplingParams(**{**params.__dict__, "constraint": Constraint.regex(PATTERN)}))
    engine = engine_for(model, tokenizer)
    out, ids = drive(engine, [(0, request)])
    grammars = Grammars(tokenizer, vocab)
    compiled = grammars.compile(Constraint.regex(PATTERN))
    host = torch.zeros(1, grammars.words, dtype=torch.int32)
    checked = 0
    for tokens, finish in zip(out[ids[0]].tokens, out[ids[0]].finish_reasons, strict=True):
        assert finish == "stop" and tokens[-1] == eos
        matcher, text = grammars.matcher(compiled, [eos]), b""
        for token in tokens:
            grammars.fill(matcher, host, 0)
            mask = set(allowed(host, vocab)[0].nonzero().flatten().tolist())
            assert mask == reference_allowed(PATTERN, text, pieces, eos, vocab)
            assert token in mask
            assert accept(matcher, token) in (None, "stop")
            text += pieces.get(token, b"")
            checked += 1
        assert regex.fullmatch(PATTERN, text.decode())
    assert checked >= 6


def test_overlap_decodes_the_same_constrained_tokens(model, tokenizer):
    c = Constraint.json_schema(SCHEMA)
    eos = tokenizer.eos_token_id
    params = SamplingParams(max_new_tokens=60, temperature=0.8, n=2, constraint=c, stop_token_ids=(eos,))
    schedule = [(0, Request(PROMPT, replace(params, seed=s))) for s in range(2)]
    schedule.append((1, Request(PROMPT[:3], SamplingParams(max_new_tokens=20, temperature=0.8, seed=9))))
    plain, ids = drive(engine_for(model, tokenizer, overlap=False), schedule)
    ahead, ids2 = drive(engine_for(model, tokenizer, overlap=True), schedule)
    assert [plain[i].tokens for i in ids] == [ahead[i].tokens for i in ids2]
    for rid in ids[:2]:
        for tokens, finish in zip(plain[rid].tokens, plain[rid].finish_reasons, strict=True):
            assert finish == "stop"
            jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)


def test_ngram_speculation_keeps_each_matcher_in_step_with_its_rewinds(model, tokenizer):
    c = Constraint.regex(r"(ab ){2,12}end\.")
    params = SamplingParams(max_new_tokens=48, constraint=c, stop_token_ids=(tokenizer.eos_token_id,))
    prompt = tokenizer.encode("ab ab ab ab ab ab ab ")
    plain, ids = drive(engine_for(model, tokenizer), [(0, Request(prompt, params))])
    spec = engine_for(model, tokenizer, speculative=SpeculativeConfig("ngram", block_size=4))
    drafted, ids2 = drive(spec, [(0, Request(prompt, params))])
    assert drafted[ids2[0]].tokens == plain[ids[0]].tokens
    assert spec.metrics.spec_proposed > spec.metrics.spec_accepted > 0  # drafts were accepted and rejected
    assert regex.fullmatch(r"(ab ){2,12}end\.", tokenizer.decode(plain[ids[0]].tokens[0], skip_special_tokens=True))


def test_many_requests_in_one_step_each_decode_to_their_own_constraint(model, tokenizer):
    eos = tokenizer.eos_token_id
    constraints = {
        "regex": (Constraint.regex(r"[a-z]{2,6}!"), lambda t: regex.fullmatch(r"[a-z]{2,6}!", t)),
        "choice": (
            Constraint.choice(["alpha", "beta", "gamma delta"]),
            lambda t: t in ("alpha", "beta", "gamma delta"),
        ),
        "schema": (Constraint.json_schema(SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        "object": (Constraint.json_schema(None), lambda t: isinstance(json.loads(t), dict)),
        "grammar": (Constraint.grammar('root ::= "(" [xy]+ ")"'), lambda t: regex.fullmatch(r"\([xy]+\)", t)),
    }
    # the random model would write one endless key: a bias toward closing quotes and braces (a
    # logit_bias row in the same step as the constraint's mask) ends the object
    closing = {tokenizer.convert_tokens_to_ids(t): 6.0 for t in ('"', "}")}
    schedule = [
        (0, Request(PROMPT, SamplingParams(max_new_tokens=60, temperature=0.7, seed=i, constraint=c,
                                           stop_token_ids=(eos,), logit_bias=closing if name == "object" else {})))
        for i, (name, (c, _)) in enumerate(constraints.items())
    ]  # fmt: skip
    free = Request(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.7, seed=99, n=2))
    schedule.append((0, free))
    out, ids = drive(engine_for(model, tokenizer), schedule)
    for rid, (name, (_, check)) in zip(ids, constraints.items(), strict=False):
        (tokens,), (finish,) = out[rid].tokens, out[rid].finish_reasons
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert finish == "stop" and check(text), (name, text)
    alone, alone_ids = drive(engine_for(model, tokenizer), [(0, free)])
    assert out[ids[-1]].tokens == alone[alone_ids[0]].tokens  # the unconstrained request is untouched


def test_without_a_stop_id_the_sample_ends_when_its_grammar_does(model, tokenizer):
    params = SamplingParams(max_new_tokens=30, constraint=Constraint.choice(["first", "second one"]))
    out, ids = drive(engine_for(model, tokenizer), [(0, Request(PROMPT, params))])
    assert out[ids[0]].finish_reasons == ["stop"]
    assert tokenizer.decode(out[ids[0]].tokens[0]) in ("first", "second one")


def test_a_sample_no_token_can_continue_ends_with_finish_reason_grammar(model, tokenizer, monkeypatch):
    import batchkv.executor.constraints as constraints_module

    real_fill = constraints_module.Grammars.fill

    def empty_after_three(self, matcher, out, index, ahead=()):
        ok = real_fill(self, matcher, out, index, ahead)
        calls.append(index)
        if len(calls) > 3:
            out[index] = 0  # nothing allowed: the grammar cannot go on
        return ok

    calls: list[int] = []
    monkeypatch.setattr(constraints_module.Grammars, "fill", empty_after_three)
    params = SamplingParams(max_new_tokens=30, constraint=Constraint.regex("[a-z]{10,20}"))
    out, ids = drive(engine_for(model, tokenizer), [(0, Request(PROMPT, params))])
    assert out[ids[0]].finish_reasons == ["grammar"]
    assert len(out[ids[0]].tokens[0]) == 3  # the refused token is not emitted


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (lambda: Constraint.json_schema('{"type": '), "not valid JSON"),
        (
            lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}),
            "not supported",
        ),
        (lambda: Constraint.regex("(unclosed"), "not supported"),
        (lambda: Constraint.grammar("root ::= undefined_rule"), "not supported"),
        (lambda: Constraint.choice([]), "non-empty list"),
        (lambda: Constraint.regex("a" * 70_000), "characters; at most"),
    ],
)
def test_malformed_or_unsupported_constraints_are_refused_and_nothing_starts(model, tokenizer, constraint, message):
    engine = engine_for(model, tokenizer)
    with pytest.raises(RequestError, match=message):
        engine.submit(Request(PROMPT, SamplingParams(constraint=constraint())))
    assert not engine.has_work


def test_a_constraint_that_compiles_too_long_is_refused(model, tokenizer):
    engine = engine_for(model, tokenizer)
    big = {"type": "object", "properties": {f"k{i}": {"type": "array", "items": SCHEMA} for i in range(40)}}
    with pytest.raises(RequestError, match="took more than"):
        engine.grammars.compile(Constraint.json_schema(big, field="response_format"), timeout=0.0)


def test_a_constraint_needs_the_tokenizer_and_a_plain_or_ngram_engine(model, tokenizer):
    params = SamplingParams(constraint=Constraint.regex("[a-z]+"))
    engine = Engine(model, max_seqs=2, capacity=64)
    with pytest.raises(RequestError, match="use_tokenizer"):
        engine.submit(Request(PROMPT, params))
    assert not engine.has_work
