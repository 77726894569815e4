"""A tiny transformers Qwen3 with a tokenizer trained here, and a `batchkv serve` subprocess over it."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

# Accents, CJK and emoji: byte-level tokens that split multi-byte characters.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello batchkv! How are you today?",
    "Café crème brûlée, naïve façade, über straße.",
    "日本語のテキストです。中文也可以。",
    "Emoji 🙂🚀✨ are multi-byte characters.",
    "Stop strings may span tokens: END OF TEXT.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEOMETRY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
}


def make_tokenizer(special: tuple[str, ...] = ()):
    """ByteLevel BPE trained on CORPUS (offline), wrapped with a chat template; eos <|im_end|>;
    `special`: more special tokens (e.g. fill-in-the-middle markers), after the three."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    extra = {"additional_special_tokens": list(special)} if special else {}  # read as one token each in text
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False,
        **extra,
    )  # fmt: skip
    hf.chat_template = CHAT_TEMPLATE
    return hf


@torch.no_grad()
def make_model_dir(
    path: Path, max_positions: int = GEOMETRY["max_position_embeddings"], special: tuple[str, ...] = ()
) -> Path:
    """Qwen3 with random, peaky weights (clear greedy winners) and the tokenizer (`make_tokenizer`),
    saved to `path`."""
    import transformers

    tokenizer = make_tokenizer(special)
    geometry = {**GEOMETRY, "max_position_embeddings": max_positions}
    cfg = transformers.Qwen3Config(
        **geometry, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, dtype="float32"
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            std = 8.0 / math.sqrt(p.shape[1]) if "lm_head" in name else 1.0 / math.sqrt(p.shape[1])
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "embed" in name else std))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`batchkv serve` in a subprocess on a free port. Starts at construction; `wait()` returns
    once /health answers, so the caller can do other work while it boots. `launcher`: what runs
    `serve ...` (a script that takes the CLI's arguments, such as bench/serve_trace.py); `env`: added
    to the environment it runs in."""

    def __init__(
        self,
        model: str,
        *args: str,
        device: str = "cpu",
        launcher: tuple[str, ...] = ("-m", "batchkv.cli"),
        env: dict[str, str] | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # A file, not a pipe: a full pipe would stall the server. Closed with the object.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        command = [sys.executable, *launcher, "serve", "--model", model, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*command, "--device", device, "--threads", "1", *args], env=env, stdout=self.log, stderr=subprocess.STDOUT
        )

    def wait(self, timeout: float = 120.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"batchkv serve exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"batchkv serve did not answer /health within {timeout} s")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self, sig: int | None = signal.SIGTERM, timeout: float = 30.0) -> tuple[int, str]:
        """Send `sig` (None: one was sent already) and wait; returns (exit status, all it printed)."""
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode, self.output()


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in bytes (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def polling_health(url: str, work, *, headers: dict[str, str] | None = None, most: int = 10_000):
    """Run `work()` while another thread times GET /health round trips back to back (at most `most`
    of them); returns (what work returned, the round-trip seconds, at least one)."""
    import threading

    done, times = threading.Event(), []

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            for _ in range(most):
                start = time.perf_counter()
                assert client.get(url + "/health", headers=headers).status_code == 200
                times.append(time.perf_counter() - start)
                if done.wait(0.01):
                    return

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        time.sleep(0.05)  # a few round trips before the work starts
        result = work()
    finally:
        done.set()
        thread.join()
    return result, times


# /health round trips while a hostile request is refused or served. The server once stalled for
# 9-88 s; on an idle machine a round trip takes a few ms. Generous for a loaded two-core machine.
HEALTH_MAX_S = 0.5
HEALTH_MEDIAN_S = 0.1


def assert_health_answered(times: list[float]) -> None:
    """No /health round trip stalled (see HEALTH_MAX_S)."""
    import statistics

    assert max(times) < HEALTH_MAX_S and statistics.median(times) < HEALTH_MEDIAN_S, times


def error(r: httpx.Response, status: int) -> dict:
    """The OpenAI error body of `r`, which must have `status`."""
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def chat_text(client, args: dict, stream: bool) -> tuple[str, str]:
    """(text, finish reason) of one chat completion through the openai client, streamed or not."""
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish
