"""Check a model's K/V storage dtype on your own text: perplexity, top-1 agreement and KL.

`score(model, ids, kv_dtype=e4m3, reference_dtype=bf16)` runs the text teacher-forced through two
batchkv caches side by side, one storing K/V as `kv_dtype`, the other as `reference_dtype`, in
prompt chunks of `chunk` tokens (what serving does: each chunk writes its K/V, then attends over
the stored history). At each position it compares the two next-token distributions:

- perplexity: exp(mean negative log-likelihood of the text's next token), under each storage;
- top-1 agreement: the share of positions whose argmax token is the same under both;
- mean KL: KL(reference || tested) in nats, averaged over positions (fp32 log-softmax).

Logits are computed for every position of a chunk and dropped after it, so memory does not grow
with the text. The default comparison is e4m3 against bf16 storage: bf16 is what a model served
without `--kv-dtype fp8` stores, so the numbers say what switching to e4m3 costs. On the CPU the
attention is the torch reference, whose e4m3 arithmetic is the Triton kernels' with exact queries.

`batchkv score --model PATH FILE...` (batchkv/cli/score.py) prints this for each file. With
`--quantization fp8` the tested side is the same model with FP8 compute (`batchkv.models.quant`),
K/V stored as the reference's unless `--kv-dtype` says otherwise: what FP8 compute costs.

>>> result = score(HFModel.from_pretrained(path), ids)   # ids: int token ids of a text
>>> result.ppl_change, result.top1_agreement, result.kl_mean
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.cache.rotation import hadamard
from batchkv.cache.rounding import KeyRounding
from batchkv.checks import int_arg
from batchkv.errors import ConfigError

E4M3 = torch.float8_e4m3fn
DEFAULT_CHUNK = 64  # tokens per prompt chunk: short enough that most keys are read back from storage


@dataclass(frozen=True)
class Score:
    """One text scored under two K/V storage dtypes (see the module docstring)."""

    tokens: int  # positions scored: len(ids) - 1
    kv_dtype: str
    reference_dtype: str
    ppl: float  # under kv_dtype storage
    reference_ppl: float  # under reference_dtype storage
    top1_agreement: float  # in [0, 1]
    kl_mean: float  # nats
    kl_max: float  # nats, the worst position

    @property
    def ppl_change(self) -> float:
        """Relative perplexity change of kv_dtype against the reference (0.003 is +0.3%)."""
        return self.ppl / self.reference_ppl - 1.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "ppl_change": self.ppl_change}


def _chunk_logits(model, cache: BatchedSequenceCache, seq: int, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Write ids [n] at positions start.. and return their next-token logits, float32 [n, vocab]."""
    n = ids.shape[0]
    cache.declare_step([seq] * n)
    cache.prepare_step(width=n)
    indexes = torch.zeros(3, n, dtype=torch.int64, device=ids.device)
    indexes[0] = torch.arange(start, start + n, device=ids.device)
    logits = model(ids, indexes, cache, torch.arange(n, device=ids.device))
    cache.commit_step()
    return logits.float()


@torch.no_grad()
def score(
    model,
    ids: Sequence[int],
    *,
    kv_dtype: torch.dtype = E4M3,
    reference_dtype: torch.dtype = torch.bfloat16,
    chunk: int = DEFAULT_CHUNK,
    attention: str = "auto",
) -> Score:
    """Score token `ids` (at least 2) under `kv_dtype` against `reference_dtype` storage.

    `model` follows the batchkv model interface (an `HFModel`, a SenseNova-U1 model); both caches
    take its geometry and compute dtype. ConfigError for a text too short or a bad chunk.
    """
    chunk = int_arg("score chunk", chunk, 1, 1 << 16, why=" (tokens per prompt chunk)")
    capacity = max(len(ids), 2)
    tested, reference = (make_cache(model, dt, capacity, chunk, attention) for dt in (kv_dtype, reference_dtype))
    return score_caches(model, ids, [tested], reference, chunk)[0]


def make_cache(model, kv_dtype: torch.dtype, capacity: int, chunk: int, attention: str = "auto", **config):
    """A one-sequence cache for scoring: the model's geometry, K/V stored as `kv_dtype`; `config`
    overrides other CacheConfig fields (e.g. key_rotation=False)."""
    spec = {**model.cache_spec(), "kv_dtype": kv_dtype, **config}
    return BatchedSequenceCache(CacheConfig(**spec, max_seqs=1, capacity=capacity, max_write=chunk), model.device,
                                attention=attention)  # fmt: skip


@torch.no_grad()
def score_caches(
    model, ids: Sequence[int], tested: Sequence[BatchedSequenceCache], reference, chunk: int,
    tested_models: Sequence | None = None,
) -> list[Score]:  # fmt: skip
    """`score` of each of `tested` (fresh caches, each one sequence of capacity >= len(ids)) against
    `reference`, sharing the reference's forwards. `tested_models`: the model each tested cache runs
    (default `model` for all), e.g. the same weights with FP8 compute against `model` in bf16."""
    ids = list(ids)
    if len(ids) < 2:
        raise ConfigError(f"scoring needs at least 2 tokens (one to predict from); the text has {len(ids)}")
    caches = [*tested, reference]
    models = [*(tested_models or [model] * len(tested)), model]
    if len(models) != len(caches):
        raise ConfigError(f"{len(tested)} tested caches and {len(models) - 1} tested models; give one model each")
    seqs = [cache.seq_new() for cache in caches]
    text = torch.tensor(ids, dtype=torch.int64, device=model.device)
    n = len(tested)
    nll = torch.zeros(n + 1, dtype=torch.float64)
    agree, kl_sum, kl_max = torch.zeros(n), torch.zeros(n, dtype=torch.float64), torch.zeros(n)
    count = 0
    for start in range(0, len(ids) - 1, chunk):
        piece = text[start : min(start + chunk, len(ids) - 1)]  # the last token predicts nothing
        target = text[start + 1 : start + 1 + piece.shape[0]]
        runs = zip(models, caches, seqs, strict=True)
        logps = [_chunk_logits(m, c, s, piece, start).log_softmax(-1) for m, c, s in runs]
        ref = logps[-1]
        for i, logp in enumerate(logps):
            nll[i] -= logp.gather(1, target[:, None]).sum().double().cpu()
        for i, logp in enumerate(logps[:-1]):
            agree[i] += int((logp.argmax(-1) == ref.argmax(-1)).sum())
            kl = (ref.exp() * (ref - logp)).sum(-1)  # KL(ref || tested) per position
            kl_sum[i] += float(kl.double().sum())
            kl_max[i] = max(float(kl_max[i]), float(kl.max()))
        count += piece.shape[0]
    ppl = torch.exp(nll / count).tolist()
    name = _name(reference.config.kv_dtype)
    return [
        Score(
            count,
            _name(c.config.kv_dtype),
            name,
            ppl[i],
            ppl[-1],
            float(agree[i]) / count,
            float(kl_sum[i]) / count,
            float(kl_max[i]),
        )
        for i, c in enumerate(tested)
    ]


@torch.no_grad()
def chunk_logprobs(model, ids: Sequence[int], cache: BatchedSequenceCache, chunk: int) -> torch.Tensor:
    """Next-token log-probabilities, float32 [len(ids) - 1, vocab] on the CPU, of token `ids` teacher-forced
    through `model` in prompt chunks of `chunk` tokens (a fresh one-sequence `cache`, capacity >= len(ids)):
    one model's side of `score_caches`, kept whole so that several models compare pairwise."""
    ids = list(ids)
    if len(ids) < 2:
        raise ConfigError(f"scoring needs at least 2 tokens (one to predict from); the text has {len(ids)}")
    seq, text = cache.seq_new(), torch.tensor(ids, dtype=torch.int64, device=model.device)
    out = []
    for start in range(0, len(ids) - 1, chunk):
        piece = text[start : min(start + chunk, len(ids) - 1)]
        out.append(_chunk_logits(model, cache, seq, piece, start).log_softmax(-1).cpu())
    return torch.cat(out)


def compare_logprobs(tested: torch.Tensor, reference: torch.Tensor, target: torch.Tensor, *,
                     tested_name: str = "tested", reference_name: str = "reference") -> Score:  # fmt: skip
    """The `Score` of log-probabilities `tested` against `reference` (both [T, vocab]) at the T
    positions whose next tokens are `target` [T]: `score_caches`' arithmetic on whole texts."""
    target = target.reshape(-1, 1).to(tested.device)
    nll = -tested.gather(1, target).double().mean()
    reference_nll = -reference.gather(1, target).double().mean()
    kl = (reference.exp() * (reference - tested)).sum(-1)
    agree = (tested.argmax(-1) == reference.argmax(-1)).double().mean()
    return Score(
        int(target.shape[0]), tested_name, reference_name, float(nll.exp()), float(reference_nll.exp()),
        float(agree), float(kl.double().mean()), float(kl.max()),
    )  # fmt: skip


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _QueryMoments(BatchedSequenceCache):
    """A cache that sums q q^T per (layer, KV head) over every query it attends with, the queries of
    a GQA group pooled, rotated as an e4m3 store with `key_rotation` rotates them."""

    def __init__(self, config: CacheConfig, device, rotate: bool) -> None:
        super().__init__(config, device)
        d, hkv = config.head_dim, config.kv_heads
        self.h = hadamard(d, self.device) if rotate else None
        self.sums = torch.zeros(config.num_layers, hkv, d, d, dtype=torch.float64, device=self.device)
        self.count = 0  # queries per KV head, summed over layer 0's steps

    def update_and_attend(self, layer, q, k, v, scale=None, causal=True, **extras):
        x = q.float() if self.h is None else q.float() @ self.h
        x = x.reshape(x.shape[0], self.config.kv_heads, -1, x.shape[-1])  # [W, Hkv, group, D]
        self.sums[layer] += torch.einsum("wgid,wgie->gde", x, x).double()
        self.count += x.shape[0] * x.shape[2] if layer == 0 else 0
        return super().update_and_attend(layer, q, k, v, scale=scale, causal=causal, **extras)


@torch.no_grad()
def calibrate_key_rounding(
    model, ids: Sequence[int], *, key_rotation: bool = False, chunk: int = DEFAULT_CHUNK
) -> KeyRounding:
    """A `KeyRounding` for `model` from the queries of text `ids` (teacher-forced, bf16 storage).

    Give the result to `CacheConfig(key_rounding=...)` with the same `key_rotation` (the
    moments are taken in the stored keys' basis). A few hundred tokens of text like the served
    traffic; docs/design.md has the measured effect. ConfigError for a text shorter than 2 tokens.
    """
    chunk = int_arg("calibration chunk", chunk, 1, 1 << 16, why=" (tokens per prompt chunk)")
    if len(ids) < 2:
        raise ConfigError(f"calibrating needs at least 2 tokens; the text has {len(ids)}")
    spec = {**model.cache_spec(), "kv_dtype": torch.bfloat16}
    config = CacheConfig(**spec, max_seqs=1, capacity=len(ids), max_write=chunk)
    cache = _QueryMoments(config, model.device, key_rotation)
    seq, text = cache.seq_new(), torch.tensor(list(ids), dtype=torch.int64, device=model.device)
    for start in range(0, len(ids), chunk):
        _chunk_logits(model, cache, seq, text[start : start + chunk], start)
    return KeyRounding.calibrate((cache.sums / cache.count).float().cpu())
