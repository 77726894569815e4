"""e4m3 K/V accuracy of a real trained model on the CPU: key-quantisation variants against bf16 storage.

Teacher-forces each text through SmolLM2-135M-Instruct (float32 compute, the torch reference's
e4m3 arithmetic, 64-token prompt chunks) with one bf16-storage cache as the reference and one
cache per variant, all fed the same chunks (as `batchkv.score.score_caches`), and prints / writes
perplexity, top-1 agreement and mean KL against bf16 storage:

- `e4m3`: today's quantisation before key rotation (a scale per position and KV head);
- `e4m3-hadamard`: q and k rotated per head by the normalised Walsh-Hadamard matrix
  (`CacheConfig(key_rotation=True)`);
- `e4m3-hadamard-gptq`: that, and keys rounded with query-weighted error feedback
  (`CacheConfig(key_rounding=...)`, `batchkv.cache.rounding`), calibrated on the other text;
- `e4m3-signs`: the Hadamard matrix times a random +-1 diagonal (QuaRot's randomised Hadamard);
- `e4m3-orthogonal`: a random orthogonal matrix (QR of a Gaussian, seed 0);
- `e4m3-smooth`: keys divided per channel by sqrt(amax) of the text's first chunk and queries
  multiplied by it (SmoothQuant's alpha 0.5, folded into q; no rotation);
- `fp32`: float32 storage (bf16's own distance from exact);
- `fq-...`: fake-quantised variants on an fp32 store (`bench/kv_variants.py`: key centring,
  calibrated means, GPTQ-style rounding, bf16 attention sinks, K or V alone).

Besides perplexity, top-1 and KL, each variant reports where its top-1 disagreements sit: the
share whose bf16-storage top-2 log-probability margin is below each of `NEAR_TIE` (nats), next to
the share of all positions below it, and top-1 agreement on the positions above it.

    python bench/kv_accuracy.py --out bench/results/kv-accuracy-cpu.json
    python bench/kv_accuracy.py --tokens 512 --variants e4m3,e4m3-hadamard   # a quicker look
    python bench/kv_accuracy.py --variants e4m3,fq-centre-had,fq-centrecal-had-gptq
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import kv_variants  # noqa: E402

from batchkv.cache import CacheConfig, rotation  # noqa: E402
from batchkv.score import DEFAULT_CHUNK, E4M3, _chunk_logits, calibrate_key_rounding, make_cache  # noqa: E402

TEXTS = {"prose": "tests/fixtures/prose.txt", "python": "tests/fixtures/source.py.txt"}
VARIANTS = ("e4m3", "e4m3-hadamard", "e4m3-hadamard-gptq", "e4m3-signs", "e4m3-orthogonal", "e4m3-smooth", "fp32")
NEAR_TIE = (0.05, 0.1, 0.25, 0.5)  # nats between the bf16-storage top-2 log-probabilities


class Smooth(rotation.KeyRotation):
    """Per-channel key smoothing folded into q: k / s, q * s (q . k unchanged), s set per layer and
    KV head from the first chunk's keys (s = sqrt(amax over positions), SmoothQuant alpha 0.5)."""

    def __init__(self, layers: int) -> None:
        self.scales: list[torch.Tensor | None] = [None] * layers
        self.layer = 0

    def rotate(self, q, k):
        layer, self.layer = self.layer, (self.layer + 1) % len(self.scales)
        if self.scales[layer] is None:
            self.scales[layer] = k.float().abs().amax(0).clamp_min(1e-6).sqrt()  # [Hkv, D]
        s = self.scales[layer]
        group = q.shape[1] // k.shape[1]
        return (q.float() * s.repeat_interleave(group, 0)).to(q.dtype), (k.float() / s).to(k.dtype)


def _matrix(variant: str, d: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if variant == "e4m3-signs":
        signs = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
        return signs[:, None] * rotation.hadamard(d)  # diag(s) H: orthonormal
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    return q


def _cache(model, variant: str, capacity: int, calib=None, calib_ids=()):
    spec = model.cache_spec()
    if variant == "e4m3-hadamard-gptq":
        rounding = calibrate_key_rounding(model, calib_ids, key_rotation=True)
        return make_cache(model, E4M3, capacity, DEFAULT_CHUNK, key_rotation=True, key_rounding=rounding)
    if variant.startswith("fq"):
        flags = set(variant.split("-")[1:])
        plan = kv_variants.Plan(flags, spec["num_layers"], spec["head_dim"], calib)
        if "vgptq" in flags:
            grams = kv_variants.output_grams(model, spec["kv_heads"], spec["head_dim"])
            plan.uv = [kv_variants._cholesky_inverse_upper(g) for g in grams]
        spec = {**spec, "kv_dtype": torch.float32}
        config = CacheConfig(**spec, max_seqs=1, capacity=capacity, max_write=DEFAULT_CHUNK)
        return kv_variants.FakeQuantCache(config, model.device, plan)
    if variant == "fp32":
        return make_cache(model, torch.float32, capacity, DEFAULT_CHUNK)
    if variant in ("e4m3", "e4m3-hadamard"):
        return make_cache(model, E4M3, capacity, DEFAULT_CHUNK, key_rotation=variant == "e4m3-hadamard")
    cache = make_cache(model, E4M3, capacity, DEFAULT_CHUNK, key_rotation=False)
    if variant == "e4m3-smooth":
        cache._rotation = Smooth(spec["num_layers"])
    else:
        cache._rotation = rotation.KeyRotation(_matrix(variant, spec["head_dim"]))
    return cache


def _calibrated(variant: str) -> bool:
    """Whether the variant uses statistics calibrated on the other text."""
    fake = variant.startswith("fq") and bool(set(variant.split("-")) & {"centrecal", "gptq", "search"})
    return fake or variant == "e4m3-hadamard-gptq"


@torch.no_grad()
def calibrate(model, ids: list[int]) -> kv_variants.Calibration:
    """Key means and query second moments of `ids` run through a bf16-equivalent fp32 cache."""
    cache = _cache(model, "fq-bf16", len(ids))
    cache.plan.record = kv_variants.Calibration(model.cache_spec()["num_layers"])
    seq, text = cache.seq_new(), torch.tensor(ids)
    for start in range(0, len(ids), DEFAULT_CHUNK):
        _chunk_logits(model, cache, seq, text[start : start + DEFAULT_CHUNK], start)
    return cache.plan.record


@torch.no_grad()
def score_positions(model, ids: list[int], tested: list, reference, chunk: int = DEFAULT_CHUNK) -> list[dict]:
    """Per variant: perplexity, top-1, KL against `reference` (as `batchkv.score.score_caches`
    computes them) and the near-tie split of its top-1 disagreements."""
    caches = [*tested, reference]
    seqs = [cache.seq_new() for cache in caches]
    text = torch.tensor(ids)
    nll, agree, kl, margin = [[] for _ in caches], [[] for _ in tested], [[] for _ in tested], []
    for start in range(0, len(ids) - 1, chunk):
        piece = text[start : min(start + chunk, len(ids) - 1)]
        target = text[start + 1 : start + 1 + piece.shape[0]]
        logps = [_chunk_logits(model, c, s, piece, start).log_softmax(-1) for c, s in zip(caches, seqs, strict=True)]
        ref = logps[-1]
        top2 = ref.topk(2, -1).values
        margin.append(top2[:, 0] - top2[:, 1])
        for i, logp in enumerate(logps):
            nll[i].append(-logp.gather(1, target[:, None])[:, 0].double())
        for i, logp in enumerate(logps[:-1]):
            agree[i].append(logp.argmax(-1) == ref.argmax(-1))
            kl[i].append((ref.exp() * (ref - logp)).sum(-1).double())
    margin = torch.cat(margin)
    ref_ppl = float(torch.cat(nll[-1]).mean().exp())
    out = []
    for i in range(len(tested)):
        a, k = torch.cat(agree[i]), torch.cat(kl[i])
        ppl = float(torch.cat(nll[i]).mean().exp())
        miss = ~a
        ties = {f"{t}": {"share_of_disagreements": float((miss & (margin < t)).sum() / max(int(miss.sum()), 1)),
                         "share_of_positions": float((margin < t).float().mean()),
                         "top1_above": float(a[margin >= t].float().mean())} for t in NEAR_TIE}  # fmt: skip
        out.append({"tokens": a.numel(), "ppl": ppl, "reference_ppl": ref_ppl, "ppl_change": ppl / ref_ppl - 1,
                    "top1_agreement": float(a.float().mean()), "kl_mean": float(k.mean()), "kl_max": float(k.max()),
                    "disagreements": int(miss.sum()), "near_ties": ties})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--texts", default=",".join(TEXTS))
    parser.add_argument("--tokens", type=int, default=0, help="score only the first N tokens (0: all)")
    parser.add_argument("--calib-tokens", type=int, default=0, help="calibrate on the other text's first N (0: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here (merged into an existing file)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from batchkv.models.gguf import packaged_gguf
    from batchkv.models.hf import HFModel

    model = HFModel.from_pretrained(packaged_gguf(), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model.directory)
    variants = args.variants.split(",")
    results = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, float32)", "chunk": DEFAULT_CHUNK,
               "reference": "bfloat16 storage", "texts": {}}  # fmt: skip
    if args.out and Path(args.out).exists():  # runs accumulate: a variant measured again replaces its entry
        results["texts"] = json.loads(Path(args.out).read_text())["texts"]
    texts = {name: tokenizer(ROOT.joinpath(path).read_text()).input_ids for name, path in TEXTS.items()}
    calibrating = any(_calibrated(v) and v.startswith("fq") for v in variants)
    for name in args.texts.split(","):
        ids = texts[name][: args.tokens] if args.tokens else texts[name]
        start = time.perf_counter()
        other = next(o for o in TEXTS if o != name)  # calibrated on the other text (its first --calib-tokens)
        calib_ids = texts[other][: args.calib_tokens or None]
        calib = calibrate(model, calib_ids) if calibrating else None
        tested = [_cache(model, v, len(ids), calib, calib_ids) for v in variants]
        reference = make_cache(model, torch.bfloat16, len(ids), DEFAULT_CHUNK)
        scores = score_positions(model, ids, tested, reference)
        key = f"{name}[:{args.tokens}]" if args.tokens else name
        calibrated = f"{other}[:{args.calib_tokens}]" if args.calib_tokens else other
        for v, s in zip(variants, scores, strict=True):
            s.update({"calibrated_on": calibrated} if _calibrated(v) else {})
            results["texts"].setdefault(key, {})[v] = s
        for v, s in zip(variants, scores, strict=True):
            tie = s["near_ties"]["0.1"]
            print(f"{name:7} {v:22} ppl {s['ppl']:8.4f} ({s['ppl_change']:+.3%}) top-1 {s['top1_agreement']:.2%} "
                  f"KL {s['kl_mean']:.5f} (max {s['kl_max']:.3f}) misses {s['disagreements']} "
                  f"<0.1 nat {tie['share_of_disagreements']:.0%} (of all {tie['share_of_positions']:.0%}) "
                  f"top-1 above {tie['top1_above']:.2%}  bf16 ppl {s['reference_ppl']:.4f}", flush=True)  # fmt: skip
        print(f"{name}: {len(ids)} tokens in {time.perf_counter() - start:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
