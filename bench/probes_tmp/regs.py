"""Registers/spills of split_kernel variants at a given S_POW2 (env S), for an A/B of two trees."""
import os, sys
sys.path.insert(0, os.getcwd())
import bench.lib.compile_sm90 as c
S = int(os.environ.get("S", "2048"))
real = c.build
def build(fn, types, consts, warps, stages, label):
    consts["S_POW2"] = S
    return real(fn, types, consts, warps, stages, f"S{S} " + label)
c.build = build
print("triton", c.triton.__version__)
c.split(store="fp8e4nv", block_n=128)                     # 8B e4m3 default
c.split(heads=1, block_n=64)                               # 8B bf16 
c.split(heads=4, block_n=16, warps=4)
c.split(store="fp8e4nv", D=64, G=3, block_n=128, warps=2, stages=2)  # SmolLM2 e4m3
c.split(D=64, G=3, block_n=128, warps=2, stages=2)         # SmolLM2 bf16 small-head default
