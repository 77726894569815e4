"""3-D RoPE of SenseNova-U1: t on the first D/2 dims at theta 5e6, h and w on D/4 each at 1e4."""

from __future__ import annotations

import math

import pytest
import torch

from batchkv.models.sensenova import Rope3D

D = 128  # the 8B head_dim: t = dims [0, 64), h = [64, 96), w = [96, 128)
SECTIONS = {"t": (0, 64, 5e6), "h": (64, 32, 1e4), "w": (96, 32, 1e4)}
AXIS = {"t": 0, "h": 1, "w": 2}


@pytest.fixture(scope="module")
def rope() -> Rope3D:
    return Rope3D(D, 5e6, 1e4)


def _at(rope: Rope3D, x: torch.Tensor, t: int, h: int, w: int) -> torch.Tensor:
    """Rotate one vector x [D] at index (t, h, w)."""
    return rope(x[None, None], torch.tensor([[t], [h], [w]]))[0, 0]


def _unit(i: int) -> torch.Tensor:
    e = torch.zeros(D)
    e[i] = 1.0
    return e


@pytest.mark.parametrize("section", ["t", "h", "w"])
@pytest.mark.parametrize("j", [0, 1, 5])
def test_each_section_rotates_dim_j_with_dim_j_plus_half_at_its_theta(rope, section, j):
    start, size, theta = SECTIONS[section]
    freq = theta ** (-2 * j / size)
    a_idx, b_idx = [0, 0, 0], [0, 0, 0]
    a_idx[AXIS[section]], b_idx[AXIS[section]] = 37, 5
    delta = (37 - 5) * freq
    qa = _at(rope, _unit(start + j), *a_idx)
    kb = _at(rope, _unit(start + j), *b_idx)
    kb_partner = _at(rope, _unit(start + j + size // 2), *b_idx)
    assert torch.dot(qa, kb).item() == pytest.approx(math.cos(delta), abs=1e-5)
    # rotate-half sign convention: x_j -> x_j cos - x_{j+n/2} sin
    assert torch.dot(qa, kb_partner).item() == pytest.approx(math.sin(delta), abs=1e-5)


def test_q_dot_k_depends_only_on_the_index_differences_in_every_section(rope):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(D, generator=gen), torch.randn(D, generator=gen)
    base = torch.dot(_at(rope, q, 12, 3, 7), _at(rope, k, 4, 1, 2))
    shifted = torch.dot(_at(rope, q, 112, 9, 11), _at(rope, k, 104, 7, 6))
    moved_t = torch.dot(_at(rope, q, 13, 3, 7), _at(rope, k, 4, 1, 2))
    assert shifted.item() == pytest.approx(base.item(), abs=1e-3)
    assert abs(moved_t.item() - base.item()) > 1e-3


def test_text_indexes_leave_the_h_and_w_sections_unrotated(rope):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, D, generator=gen)
    idx = torch.zeros(3, 6, dtype=torch.int64)
    idx[0] = torch.tensor([0, 1, 2, 50, 4000, 123456])
    out = rope(x, idx)
    assert torch.equal(out[..., D // 2 :], x[..., D // 2 :])
    assert torch.equal(out[0], x[0])  # index (0, 0, 0) is the identity
    assert not torch.allclose(out[1:, :, : D // 2], x[1:, :, : D // 2])


def test_each_section_matches_the_transformers_rotary_embedding_at_its_theta(rope):
    """transformers' Qwen3 rotate-half RoPE over one section's width is the outside oracle."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, D, generator=gen)  # [W, H, D]
    idx = torch.randint(0, 3000, (3, 5), generator=gen)
    out = rope(x, idx)
    for name, (start, size, theta) in SECTIONS.items():
        cfg = Qwen3Config(head_dim=size, rope_parameters={"rope_type": "default", "rope_theta": theta})
        emb = Qwen3RotaryEmbedding(cfg)
        xs = x[..., start : start + size].transpose(0, 1)[None]  # [1, H, W, size]
        cos, sin = emb(xs, idx[AXIS[name]][None])
        expected, _ = apply_rotary_pos_emb(xs, xs, cos, sin)
        torch.testing.assert_close(out[..., start : start + size], expected[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
