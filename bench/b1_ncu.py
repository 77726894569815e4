"""One decoding sequence under Nsight Compute: sdpa_varlen and SDPA's flash decode at 1,024 and 9,100 keys.

Each call runs once to compile and warm up, then once between cudaProfilerStart/Stop, so
`ncu --profile-from-start off` sees exactly one launch of each kernel (and the split kernel's
merge inside it). Run on the GPU:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --csv --page details \
        python3 bench/b1_ncu.py > $OUT/b1-ncu.csv

`--config '{"warp_split": 4, "prefetch": 4}'` profiles sdpa_varlen with those SdpaConfig overrides.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchkv.ops.sdpa_varlen_triton import SdpaConfig, sdpa_varlen

HQ, HKV, D = 32, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="{}", help="SdpaConfig overrides as JSON")
    config = SdpaConfig(**json.loads(ap.parse_args().config))
    torch.manual_seed(0)
    k = torch.randn(16384, 1, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16)
    for n in (1024, 9100):
        info = torch.tensor([[0, 1, 0, n]], dtype=torch.int32, device="cuda")
        kk, vv = (x[:n, 0].transpose(0, 1)[None].contiguous() for x in (k, v))

        def sdpa(kk=kk, vv=vv):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, enable_gqa=True)

        for fn in (lambda info=info: sdpa_varlen(q, k, v, info, config=config), sdpa):
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
