"""`batchkv serve --model FILE.gguf` on a real trained chat model (SmolLM2-135M-Instruct), driven by
the official `openai` client: its real tokenizer and chat template, with transformers' own
`generate` of the same messages as the oracle (and its logits for the logprobs)."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from tests.real_model import CHATS, chat_ids, gguf_path, hf_greedy, hf_model, model_dir, threads, tokenizer  # noqa: E402
from tests.serve_helpers import Server  # noqa: E402

pytestmark = pytest.mark.slow
MAX_NEW = 20


@pytest.fixture(scope="module")
def server():
    path = gguf_path()  # skips without the package
    model_dir()  # converted here, so the server finds it cached
    engine = ("--max-seqs", "8", "--capacity", "512", "--max-step-tokens", "128", "--prefill-chunk", "64")
    srv = Server(str(path), "--served-model-name", "smollm2", *engine, "--threads", "2", "--dtype", "float32")
    yield srv.wait(timeout=300)
    code, out = srv.stop(signal.SIGINT)
    assert code == 0, out


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _oracle(text: str, max_new: int = MAX_NEW) -> tuple[list[int], str]:
    with threads():
        ids = hf_greedy(chat_ids(text), max_new)
    return ids, tokenizer().decode(ids, skip_special_tokens=True)


def _chat(client, text: str, **kwargs):
    messages = [{"role": "user", "content": text}]
    return client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                          **kwargs)  # fmt: skip


def test_a_chat_answer_is_what_transformers_generates_and_stops_at_im_end(client):
    ids, text = _oracle(CHATS[0])
    assert ids[-1] == tokenizer().convert_tokens_to_ids("<|im_end|>")
    out = _chat(client, CHATS[0])
    choice = out.choices[0]
    assert choice.message.content == text and choice.finish_reason == "stop"
    assert out.usage.prompt_tokens == len(chat_ids(CHATS[0])) and out.usage.completion_tokens == len(ids)


def test_streamed_chats_from_concurrent_clients_equal_transformers(client):
    def stream(text: str) -> str:
        chunks = _chat(client, text, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(stream, CHATS[1:5]))
    assert got == [_oracle(text)[1] for text in CHATS[1:5]]


def test_a_stop_string_cuts_the_answer_before_it(client):
    _, text = _oracle(CHATS[2])
    stop = text.split()[2]  # a word inside the answer
    out = _chat(client, CHATS[2], stop=[stop])
    assert out.choices[0].message.content == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_a_completion_of_the_raw_template_text_with_n_2_greedy_gives_two_equal_answers(client):
    _, text = _oracle(CHATS[6])
    prompt = tokenizer().decode(chat_ids(CHATS[6]))
    out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_NEW, temperature=0, n=2)
    assert [c.text for c in out.choices] == [text, text]


def test_ignore_eos_answers_past_im_end(client):
    out = _chat(client, CHATS[0], extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == MAX_NEW


def test_a_chat_answers_logprobs_equal_log_softmax_of_transformers_logits(client):
    ids, text = _oracle(CHATS[1])
    out = _chat(client, CHATS[1], logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.token_ids == ids and choice.message.content == text
    prompt = chat_ids(CHATS[1])
    with threads(), torch.no_grad():
        logits = hf_model()(torch.tensor([prompt + ids])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    content = choice.logprobs.content
    assert [e.token for e in content] == [tokenizer().decode([t]) for t in ids]
    assert [e.logprob for e in content] == pytest.approx([rows[i, t].item() for i, t in enumerate(ids)], abs=1e-4)
    for i, entry in enumerate(content):
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(rows[i].topk(3).values.tolist(), abs=1e-4)
