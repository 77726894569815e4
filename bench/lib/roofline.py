"""Serving rooflines for bench/decode.py: the time an ideal machine needs for the steps that ran.

Fair roofline: for each step the engine actually ran, max(bytes the step must read / read
bandwidth, FLOPs it must do / matmul peak), summed over steps; tokens/s = generated tokens / that
sum. A step must read every weight once (not the embedding table: one row per token) and, for
each segment, the K and V of its whole prefix (kv_end positions, every layer). It must do
2 FLOPs per weight-matrix element per real token for the body (every projection and MLP matrix),
2 per LM-head element per row that samples (only those rows need logits), and 4 * D * Hq FLOPs per
attended (query, key) pair per layer; norms, RoPE and softmax are left out (well under 0.1%).
Bandwidth and peak are measured in the same run (bench/lib/ceilings.py).

Workload limit (from the request list alone, not the engine's schedule): the FLOPs every request
needs (its prompt and every generated token but the last through the body, every generated token
through the LM head, each attended pair) at the matmul peak, and the bytes (each fed decode token
reads its KV prefix once, with every request resident; the weights once per step over the steps the
longest output needs) at the read bandwidth; tokens/s with the two times perfectly overlapped
(their max) and not at all (their sum). With FP8 projections (`fp8_weights`) the body's FLOPs run at
the e4m3 GEMM rate (`body_tflops`, bench/lib/ceilings.py `matmul_peak(fp8=True)`) and its weights read one byte.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

# transformers LlamaConfig arguments: the Llama-3.1-8B shape (anchors, model_step) and a tiny one (smoke runs)
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
            "rope_theta": 500000.0}  # fmt: skip
TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512}  # fmt: skip


@dataclass(frozen=True)
class ModelCost:
    """What one token, one sampled row and one attended pair cost a model."""

    body_params: int  # weight-matrix elements every real token multiplies: all but the embedding and the LM head
    head_params: int  # LM head parameters, multiplied by sampling rows only
    weight_bytes: int  # bytes one step reads: body and LM head (the embedding table excluded)
    kv_bytes_per_pos: int  # K and V of one position over every layer
    attn_flops_per_pair: int  # 4 * head_dim * q_heads * layers


@dataclass
class Step:
    """One step as the engine ran it: (q_len, kv_end) per segment, and its sampling rows."""

    segments: list[tuple[int, int]] = field(default_factory=list)
    sampled: int = 0

    @property
    def tokens(self) -> int:
        return sum(q for q, _ in self.segments)


def segments(seq_ids: Sequence[int], pos: Callable[[int], int]) -> list[tuple[int, int]]:
    """Run-length segments of a packed step: (q_len, kv_end) per run of one sequence id.

    `pos(seq)` is the committed length before the step; a sequence's second run in the same step
    continues after its first (kv_end is one past the run's last position, as in seq_info).
    """
    out: list[tuple[int, int]] = []
    written: dict[int, int] = {}
    for i, seq in enumerate(seq_ids):
        if i and seq_ids[i - 1] == seq:
            continue
        q_len = 1
        while i + q_len < len(seq_ids) and seq_ids[i + q_len] == seq:
            q_len += 1
        written[seq] = written.get(seq, 0) + q_len
        out.append((q_len, pos(seq) + written[seq]))
    return out


def causal_pairs(q_len: int, kv_end: int) -> int:
    """(query, key) pairs of one causal segment: query i attends kv_end - q_len + i + 1 keys."""
    return q_len * (kv_end - q_len) + q_len * (q_len + 1) // 2


def step_bytes(step: Step, cost: ModelCost) -> int:
    return cost.weight_bytes + cost.kv_bytes_per_pos * sum(kv_end for _, kv_end in step.segments)


def step_flops(step: Step, cost: ModelCost) -> int:
    pairs = sum(causal_pairs(q, kv_end) for q, kv_end in step.segments)
    return 2 * cost.body_params * step.tokens + 2 * cost.head_params * step.sampled + cost.attn_flops_per_pair * pairs


def fair_seconds(steps: Sequence[Step], cost: ModelCost, read_gbps: float, matmul_tflops: float) -> float:
    """Sum over steps of max(bytes / read bandwidth, FLOPs / matmul peak), in seconds."""
    bandwidth, peak = read_gbps * 1e9, matmul_tflops * 1e12  # bytes/s, FLOP/s
    return sum(max(step_bytes(s, cost) / bandwidth, step_flops(s, cost) / peak) for s in steps)


def workload_limit(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[int],
    cost: ModelCost,
    read_gbps: float,
    matmul_tflops: float,
    body_tflops: float | None = None,
) -> dict:
    """The workload's own limit (module docstring): {"overlap", "no_overlap"} tokens/s and the terms;
    the body's FLOPs at `body_tflops` (default `matmul_tflops`)."""
    body_flops = flops = kv_bytes = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        p, fed = len(prompt), out - 1  # the last generated token is never fed back
        body_flops += 2 * cost.body_params * (p + fed)
        flops += 2 * cost.head_params * out
        flops += cost.attn_flops_per_pair * (causal_pairs(p, p) + fed * p + fed * (fed + 1) // 2 + fed)
        kv_bytes += cost.kv_bytes_per_pos * (fed * (p + 1) + fed * (fed + 1) // 2)  # decode token i reads p + i + 1
    steps = max(outputs)  # the longest output's decode steps, one weight read each
    flop_s = body_flops / ((body_tflops or matmul_tflops) * 1e12) + flops / (matmul_tflops * 1e12)
    flops += body_flops
    byte_s = (kv_bytes + steps * cost.weight_bytes) / (read_gbps * 1e9)
    tokens = sum(outputs)
    return {"overlap": tokens / max(flop_s, byte_s), "no_overlap": tokens / (flop_s + byte_s), "flops": flops,
            "body_flops": body_flops, "flop_s": flop_s, "kv_read_bytes": kv_bytes, "weight_steps": steps,
            "byte_s": byte_s, "output_tokens": tokens}  # fmt: skip


def fp8_weights(cost: ModelCost) -> ModelCost:
    """`cost` with the body's weights in e4m3 (one byte each) and the LM head in bf16."""
    return replace(cost, weight_bytes=cost.body_params + 2 * cost.head_params)


def shape_cost(config: dict, kv_bytes_per_pos: int) -> ModelCost:
    """ModelCost of a Llama-like decoder from its transformers config keys, bf16 weights."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = h // hq
    body = layers * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i)
    head = config["vocab_size"] * h
    return ModelCost(body, head, 2 * (body + head), kv_bytes_per_pos, 4 * d * hq * layers)


def model_cost(model, q_heads: int) -> ModelCost:
    """ModelCost of a batchkv model (parameters `embed_tokens` and `lm_head`) or of an `HFModel` (its
    transformers model's input and output embeddings; a tied head read once), from `cache_spec()`."""
    hf = getattr(model, "hf", None)
    params = dict((hf or model).named_parameters())  # a tied head appears once, as the embedding
    embed = hf.get_input_embeddings().weight if hf else params["embed_tokens"]
    head = hf.get_output_embeddings().weight if hf else params["lm_head"]
    matrices = [p for n, p in params.items() if p.dim() >= 2 and "norm" not in n and p is not embed and p is not head]
    body = sum(p.numel() for p in matrices)
    weights = sum(p.numel() * p.element_size() for p in params.values() if p is not embed or p is head)
    spec = model.cache_spec()
    widths = spec["head_dim"] + spec.get("value_dim", spec["head_dim"])  # K and V (multi-head latent attention: apart)
    kv = spec["num_layers"] * spec["kv_heads"] * widths * spec["dtype"].itemsize
    return ModelCost(body, head.numel(), weights, kv, 4 * spec["head_dim"] * q_heads * spec["num_layers"])


class StepLog:
    """Records every step an engine runs, by wrapping its runner's `launch(batch, width, previous)`.

    The cache has been given the step's declaration but not its commit when `launch` is called, so
    `cache.pos(seq)` is each sequence's length before the step. Host only; nothing is synchronised.
    """

    def __init__(self, engine) -> None:
        self.steps: list[Step] = []
        runner, cache = engine.runner, engine.cache
        launch = runner.launch

        def logged(batch, width, previous=None):
            self.steps.append(Step(segments(batch.seq_ids, cache.pos), len(batch.rows)))
            return launch(batch, width, previous)

        runner.launch = logged
