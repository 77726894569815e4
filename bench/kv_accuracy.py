"""e4m3 K/V accuracy of a real trained model on the CPU: key-quantisation variants against bf16 storage.

Teacher-forces each text through SmolLM2-135M-Instruct (float32 compute, the torch reference's
e4m3 arithmetic, 64-token prompt chunks) with one bf16-storage cache as the reference and one
cache per variant, all fed the same chunks (`batchkv.score.score_caches`), and prints / writes
perplexity, top-1 agreement and mean KL against bf16 storage:

- `e4m3`: today's quantisation before key rotation (a scale per position and KV head);
- `e4m3-hadamard`: q and k rotated per head by the normalised Walsh-Hadamard matrix (the default);
- `e4m3-signs`: the Hadamard matrix times a random +-1 diagonal (QuaRot's randomised Hadamard);
- `e4m3-orthogonal`: a random orthogonal matrix (QR of a Gaussian, seed 0);
- `e4m3-smooth`: keys divided per channel by sqrt(amax) of the text's first chunk and queries
  multiplied by it (SmoothQuant's alpha 0.5, folded into q; no rotation);
- `fp32`: float32 storage (bf16's own distance from exact).

    python bench/kv_accuracy.py --out bench/results/kv-accuracy-cpu.json
    python bench/kv_accuracy.py --tokens 512 --variants e4m3,e4m3-hadamard   # a quicker look
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

from batchkv.cache import rotation  # noqa: E402
from batchkv.score import DEFAULT_CHUNK, E4M3, make_cache, score_caches  # noqa: E402

TEXTS = {"prose": "tests/fixtures/prose.txt", "python": "tests/fixtures/source.py.txt"}
VARIANTS = ("e4m3", "e4m3-hadamard", "e4m3-signs", "e4m3-orthogonal", "e4m3-smooth", "fp32")


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


def _cache(model, variant: str, capacity: int):
    if variant == "fp32":
        return make_cache(model, torch.float32, capacity, DEFAULT_CHUNK)
    if variant in ("e4m3", "e4m3-hadamard"):
        return make_cache(model, E4M3, capacity, DEFAULT_CHUNK, key_rotation=variant == "e4m3-hadamard")
    cache = make_cache(model, E4M3, capacity, DEFAULT_CHUNK, key_rotation=False)
    spec = model.cache_spec()
    if variant == "e4m3-smooth":
        cache._rotation = Smooth(spec["num_layers"])
    else:
        cache._rotation = rotation.KeyRotation(_matrix(variant, spec["head_dim"]))
    return cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--texts", default=",".join(TEXTS))
    parser.add_argument("--tokens", type=int, default=0, help="score only the first N tokens (0: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here")
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
    for name in args.texts.split(","):
        ids = tokenizer(ROOT.joinpath(TEXTS[name]).read_text()).input_ids
        ids = ids[: args.tokens] if args.tokens else ids
        start = time.perf_counter()
        tested = [_cache(model, v, len(ids)) for v in variants]
        reference = make_cache(model, torch.bfloat16, len(ids), DEFAULT_CHUNK)
        scores = score_caches(model, ids, tested, reference, DEFAULT_CHUNK)
        results["texts"][name] = {v: s.as_dict() for v, s in zip(variants, scores, strict=True)}
        for v, s in zip(variants, scores, strict=True):
            print(f"{name:7} {v:16} ppl {s.ppl:8.4f} ({s.ppl_change:+.3%}) top-1 {s.top1_agreement:.2%} "
                  f"KL {s.kl_mean:.5f} (max {s.kl_max:.3f})  bf16 ppl {s.reference_ppl:.4f}", flush=True)  # fmt: skip
        print(f"{name}: {len(ids)} tokens in {time.perf_counter() - start:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
