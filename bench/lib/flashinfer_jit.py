"""FlashInfer's JIT on the GPU machine: its environment, and the peer's modules built once, in parallel.

The pruned FlashInfer 0.7.4 (in `.fi/`: bench/results/README.md) compiles its CUDA kernels with the
machine's nvcc; its wrappers would each build their module when first planned, in the middle of the
benchmark. `load` builds every module the peer plans with before anything is timed, in one ninja
run with a time limit (94 s on the H200's 16 cores), then points FlashInfer's AOT folder at its JIT
folder so each wrapper loads the built library as a prebuilt one (a wrapper's own ninja run would
rebuild every object). `environment` sets what FlashInfer reads at import, each only where not set:
its workspace, CUDA_HOME, the GPU's arch, the curand headers and libcudart/libcuda links the
toolkit may lack.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

WORKSPACE = "/tmp/batchkv-flashinfer"


def cuda_home() -> str | None:
    """The CUDA toolkit to compile with: $CUDA_HOME, else the one nvcc on PATH belongs to, else /usr/local/cuda;
    the first with bin/nvcc and cuda_runtime.h (an nvcc on PATH may be a script that calls another)."""
    homes = [os.environ.get("CUDA_HOME", "")]
    if nvcc := shutil.which("nvcc"):
        homes.append(str(Path(nvcc).resolve().parents[1]))
    homes.append("/usr/local/cuda")
    headers = ("include/cuda_runtime.h", "targets/*/include/cuda_runtime.h")
    return next((h for h in homes if h and Path(h, "bin", "nvcc").exists() and _first([f"{h}/{x}" for x in headers])),
                None)  # fmt: skip


def _first(patterns: list[str]) -> str | None:
    """The first file matching any of `patterns`, in order."""
    return next((hits[-1] for p in patterns if (hits := sorted(glob.glob(p)))), None)


def environment(home: str, package: Path, base: str) -> dict[str, str]:
    """FlashInfer's JIT variables for this machine (`package`: the flashinfer folder; `base`: caches)."""
    env = {"FLASHINFER_WORKSPACE_BASE": base, "CUDA_HOME": home, "FLASHINFER_LOGGING_LEVEL": "warning"}
    major, minor = torch.cuda.get_device_capability()
    env["FLASHINFER_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    if not any(hasattr(torch.Tensor, a) for a in ("__dlpack_c_exchange_api__", "__c_dlpack_exchange_api__")):
        env["TVM_FFI_DISABLE_TORCH_C_DLPACK"] = "1"  # else tvm-ffi compiles a torch extension at import
    nvidia = [d for site in sys.path if site.endswith("-packages") for d in glob.glob(f"{site}/nvidia/*")]
    if not _first([f"{home}/include/curand_kernel.h", f"{home}/targets/*/include/curand_kernel.h"]):
        header = _first([f"{d}/include/curand_kernel.h" for d in nvidia])
        headers = Path(header).parent if header else package.parent / "extra_include"
        env["FLASHINFER_EXTRA_CUDAFLAGS"] = f"-isystem {headers}"
    sources = {  # FlashInfer links -L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda
        "libcudart.so": [f"{home}/targets/*/lib/libcudart.so*", *(f"{d}/lib/libcudart.so*" for d in nvidia)],
        "libcuda.so": [f"{home}/targets/*/lib/stubs/libcuda.so", "/usr/local/nvidia/lib64/libcuda.so*",
                       "/usr/lib/x86_64-linux-gnu/libcuda.so*"],
    }  # fmt: skip
    links = Path(base, "link")
    for lib, patterns in sources.items():
        if _first([f"{home}/lib64/{lib}", f"{home}/lib64/stubs/{lib}"]) or not (found := _first(patterns)):
            continue
        links.mkdir(parents=True, exist_ok=True)
        (links / lib).unlink(missing_ok=True)
        (links / lib).symlink_to(found)
        env["FLASHINFER_EXTRA_LDFLAGS"] = f"-L{links}"
    return env


def module_specs(dtype: torch.dtype, head_dim: int) -> dict:
    """FlashInfer's JitSpecs for what the peer plans, by use, longest first (the wrappers' own generator calls)."""
    from flashinfer.jit.attention import modules as m

    plain = (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False)  # no RoPE, window, soft cap
    specs = {}
    if torch.cuda.get_device_capability() == (9, 0):
        specs["prefill fa3"] = m.gen_batch_prefill_module("fa3", *plain, False, False)
    # FA2 with equal K and V strides (one K/V tensor); the tensor-core decode plans on it too
    specs["prefill fa2, decode on tensor cores"] = m._gen_batch_prefill_primary_module("fa2", *plain, False, False)
    specs["decode on CUDA cores"] = m.gen_batch_decode_module(*plain)
    specs["single decode"] = m.gen_single_decode_module(dtype, dtype, dtype, head_dim, head_dim, 0, False, False)
    return specs


def build(specs: dict, timeout_s: float) -> float:
    """Every spec in one ninja run, killed (with its nvcc jobs) after `timeout_s`; seconds it took."""
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.core import get_tmpdir

    ninja_bin = shutil.which("ninja") or str(Path(sys.executable).with_name("ninja"))  # the ninja package's
    for spec in specs.values():
        spec.write_ninja()
    top = get_tmpdir() / "batchkv_peer.ninja"
    lines = ["ninja_required_version = 1.3", *(f"subninja {s.ninja_path}" for s in specs.values())]
    top.write_text("\n".join(lines) + "\n")
    log = top.with_suffix(".log")
    start = time.perf_counter()
    with log.open("w") as out:
        ninja = subprocess.Popen([ninja_bin, "-v", "-C", str(jit_env.FLASHINFER_JIT_DIR), "-f", str(top)], stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            code = ninja.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(ninja.pid, signal.SIGKILL)
            ninja.wait()
            raise TimeoutError(f"the compile ran past {timeout_s:.0f} s (log {log}); "
                               "raise --flashinfer-compile-s") from None  # fmt: skip
    if code != 0:
        raise RuntimeError(f"ninja exited {code}; the end of {log}:\n{log.read_text(errors='replace')[-3000:]}")
    if missing := [s.name for s in specs.values() if not s.jit_library_path.exists()]:
        raise RuntimeError(f"ninja finished but did not link {missing} (log {log})")
    return time.perf_counter() - start


def _missing(dtype: torch.dtype, device: torch.device, timeout_s: float) -> str | None:
    """Why the peer cannot run here, or None."""
    found = importlib.util.find_spec("flashinfer")
    if timeout_s <= 0:
        return "left out (--flashinfer-compile-s 0)"
    if device.type != "cuda":
        return "no CUDA device (the cases are on the CPU)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashInfer has no {dtype} kernels"
    if found is None or found.origin is None:
        return "flashinfer is not importable: put the pruned FlashInfer on PYTHONPATH (bench/results/README.md)"
    return "nvcc not found: set CUDA_HOME" if cuda_home() is None else None


def load(dtype: torch.dtype, head_dim: int, device: torch.device, timeout_s: float) -> tuple[ModuleType | None, dict]:
    """FlashInfer with the peer's modules built, and what the report says of it; None (and why) where it cannot run."""
    why = _missing(dtype, device, timeout_s)
    if why is not None:
        return None, {"available": False, "why": why}
    found = importlib.util.find_spec("flashinfer")
    package = Path(found.origin).parent
    info: dict = {"available": False, "path": str(package)}
    try:
        env = environment(cuda_home(), package, os.environ.get("FLASHINFER_WORKSPACE_BASE", WORKSPACE))
        for key, value in env.items():
            os.environ.setdefault(key, value)
        info["env"] = {key: os.environ[key] for key in env}
        import flashinfer
        from flashinfer.jit import env as jit_env

        info["version"] = flashinfer.__version__
        specs = module_specs(dtype, head_dim)
        info["modules"] = {use: spec.name for use, spec in specs.items()}
        print(f"FlashInfer {flashinfer.__version__}: compiling {len(specs)} modules (about 95 s on 16 cores)...",
              flush=True)  # fmt: skip
        info["compile_s"] = round(build(specs, timeout_s), 1)
        jit_env.FLASHINFER_AOT_DIR = jit_env.FLASHINFER_JIT_DIR  # the wrappers load <dir>/<name>/<name>.so as built
        info["available"] = True
        print(f"FlashInfer: modules ready in {info['compile_s']} s", flush=True)
        return flashinfer, info
    except Exception as exc:  # a failed import or compile leaves the peer out, the rest of the run goes on
        info["why"] = f"{type(exc).__name__}: {exc}"[:3000]
        print(f"FlashInfer left out: {info['why'][:300]}", flush=True)
        return None, info
