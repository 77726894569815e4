"""The server's logprobs through the official `openai` client (a tiny transformers Qwen3 with a
byte-level tokenizer trained here): completions' legacy `logprobs` and chat's `logprobs` /
`top_logprobs` equal torch.log_softmax of transformers' logits, streamed and not, in OpenAI's shapes;
chat's `bytes` rebuild the text where a character is split over tokens; past OpenAI's bounds is a 400."""

from __future__ import annotations

import signal

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

from tests.serve_helpers import Server, make_model_dir  # noqa: E402

MAX_NEW = 12
CHAT = [{"role": "user", "content": "x"}]
PROMPTS = ["The quick brown fox", "Emoji 🙂", "日本語の"]  # the last two end inside multi-byte characters' tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("qwen3-tiny"))


@pytest.fixture(scope="module")
def client(model_dir):
    srv = Server(str(model_dir), "--served-model-name", "tiny", "--max-seqs", "4", "--capacity", "256")
    srv.wait()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    code, out = srv.stop(signal.SIGTERM)
    assert code == 0, out


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def expected(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax rows that score `tokens`: float32 [len(tokens), vocab]."""
    logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]


def text_of(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def completion(client, prompt: str, **kwargs):
    return client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body={"return_token_ids": True}, **kwargs
    )


def test_completion_logprobs_equal_transformers_in_openais_legacy_shape(client, hf, tokenizer):
    for prompt in PROMPTS:
        choice = completion(client, prompt, logprobs=3).choices[0]
        ids, lp = choice.token_ids, choice.logprobs
        rows = expected(hf, tokenizer.encode(prompt), ids)
        assert lp.tokens == [text_of(tokenizer, t) for t in ids]
        assert lp.token_logprobs == pytest.approx([rows[i, t].item() for i, t in enumerate(ids)], abs=1e-4)
        for i, top in enumerate(lp.top_logprobs):
            best = rows[i].topk(3)
            want = {text_of(tokenizer, t): v for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)}
            want.setdefault(lp.tokens[i], lp.token_logprobs[i])  # the chosen token is always listed
            assert top == pytest.approx(want, abs=1e-4)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_streamed_completion_logprobs_equal_the_answer_in_one_piece(client):
    whole = completion(client, PROMPTS[1], logprobs=2).choices[0].logprobs
    tokens, values, tops, offsets = [], [], [], []
    for chunk in completion(client, PROMPTS[1], logprobs=2, stream=True):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            values += lp.token_logprobs
            tops += lp.top_logprobs
            offsets += lp.text_offset
    assert (tokens, values, tops) == (whole.tokens, whole.token_logprobs, whole.top_logprobs)
    assert offsets == whole.text_offset


def test_chat_logprobs_equal_transformers_streamed_or_not_and_their_bytes_rebuild_the_text(client, hf, tokenizer):
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        kwargs = {"model": "tiny", "messages": messages, "max_tokens": MAX_NEW, "temperature": 0, "logprobs": True,
                  "top_logprobs": 2, "extra_body": {"return_token_ids": True}}  # fmt: skip
        choice = client.chat.completions.create(**kwargs).choices[0]
        ids, content = choice.token_ids, choice.logprobs.content
        rows = expected(hf, prompt, ids)
        for i, (token, entry) in enumerate(zip(ids, content, strict=True)):
            assert entry.token == text_of(tokenizer, token)
            assert entry.logprob == pytest.approx(rows[i, token].item(), abs=1e-4)
            best = rows[i].topk(2)
            assert [e.token for e in entry.top_logprobs] == [text_of(tokenizer, t) for t in best.indices.tolist()]
            assert [e.logprob for e in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
        shown = [e for t, e in zip(ids, content, strict=True) if t not in tokenizer.all_special_ids]
        assert b"".join(bytes(e.bytes) for e in shown).decode("utf-8", errors="replace") == choice.message.content
        chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
        streamed = [e for c in chunks if c.logprobs for e in c.logprobs.content]
        assert streamed == content


@pytest.mark.parametrize(
    "ask",
    [
        lambda c: completion(c, "x", logprobs=6),
        lambda c: c.chat.completions.create(model="tiny", messages=CHAT, logprobs=True, top_logprobs=21),
        lambda c: c.chat.completions.create(model="tiny", messages=CHAT, top_logprobs=2),
    ],
    ids=["completions logprobs 6", "top_logprobs 21", "top_logprobs without logprobs"],
)
def test_logprobs_past_openais_bounds_are_a_400(client, ask):
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        ask(client)


def test_the_bytes_of_characters_split_over_tokens_rebuild_them(tokenizer):
    from batchkv.serve.logprobs import TokenText

    text = "日本語のテキスト 🙂 Café"
    ids = tokenizer.encode(text)
    assert any(tokenizer.decode([t]) == "\ufffd" for t in ids)  # some token holds part of a character
    tokens = TokenText(tokenizer)
    assert b"".join(bytes(tokens.bytes(t)) for t in ids) == text.encode("utf-8")
    assert tokens.bytes(tokenizer.eos_token_id) == list(b"<|im_end|>")
