"""A GGUF file becomes a transformers directory once per machine; anything else is refused."""

from __future__ import annotations

import json

import pytest

from batchkv.errors import CheckpointError, ConfigError
from batchkv.models.gguf import DONE, is_gguf, transformers_dir
from tests.real_model import gguf_path, model_dir


def test_a_file_that_is_not_gguf_is_refused_and_nothing_is_written(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    root = tmp_path / "cache"
    with pytest.raises(CheckpointError):
        transformers_dir(bogus, root=root)
    assert not root.exists() and not is_gguf(bogus) and not is_gguf(tmp_path)


def test_serve_refuses_a_file_that_is_neither_gguf_nor_a_directory(tmp_path):
    pytest.importorskip("transformers")
    from batchkv.serve.loading import load_served_model

    bogus = tmp_path / "weights.bin"
    bogus.write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError):
        load_served_model(str(bogus), "cpu")
    with pytest.raises(ConfigError):
        load_served_model(str(tmp_path / "missing"), "cpu")


def test_the_converted_directory_is_reused_and_holds_config_tokenizer_and_eos():
    path = gguf_path()
    first = model_dir()
    assert transformers_dir(path) == first  # a cache hit: same key, same folder
    assert json.loads((first / DONE).read_text())["key"] == first.name
    generation = json.loads((first / "generation_config.json").read_text())
    config = json.loads((first / "config.json").read_text())
    assert generation["eos_token_id"] == 2 and config["max_position_embeddings"] == 8192
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 3
    assert "<|im_start|>" in (first / "chat_template.jinja").read_text()
