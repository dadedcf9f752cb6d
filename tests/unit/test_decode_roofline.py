"""The decode roofline of ``bench/sample.py`` (``bench.common.decode_roofline_s``) against the same
sum written out by hand over the tiny MoE shape's weights: few rows leave every product bound by
its weight's bytes, many rows by its FLOPs, routed experts at their ``top_k / num_experts`` share."""

import pytest
import torch

from bench import common
from bench.common import PEAK_BF16_FLOPS, SHAPES, decode_roofline_s, ember_config
from ember.core.loading import build_empty

BW = 4.3e12


@pytest.fixture
def model(monkeypatch):
    monkeypatch.setattr(common, "copy_bandwidth", lambda: BW)
    m = build_empty(ember_config(SHAPES["tiny-moe"])).to(torch.bfloat16)  # on the meta device
    assert any(type(x).__name__ == "Experts" for x in m.modules()) and not m.config.raw.get("tie_word_embeddings")
    return m


def _share(model, name: str) -> float:
    raw = model.config.raw
    return raw["num_experts_per_tok"] / raw["num_experts"] if ".experts." in name else 1.0


def _matmul(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The matmul weights by name: 2-D, not the token embedding (the shape's LM head is untied)."""
    return [(n, p) for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n]


def _by_hand(model, rows: int, floor_bytes: float) -> tuple[float, float]:
    """(roofline, bytes of the matmul weights) summed over named parameters."""
    total = matmul_bytes = 0.0
    for name, p in _matmul(model):
        b = 2 * p.numel()
        matmul_bytes += b
        total += max(b / BW, 2 * rows * _share(model, name) * p.numel() / PEAK_BF16_FLOPS)
    return total + (floor_bytes - matmul_bytes) / BW, matmul_bytes


@pytest.mark.parametrize("rows", [1, 64, 256, 4096, 10**6])
def test_roofline_matches_the_sum_by_hand(model, rows):
    _, matmul_bytes = _by_hand(model, 1, 0.0)
    floor_bytes = matmul_bytes + 12345.0  # plus what a step reads besides the weights (KV cache, ...)
    expected, _ = _by_hand(model, rows, floor_bytes)
    assert decode_roofline_s(model, rows, floor_bytes) == pytest.approx(expected, rel=1e-12)


def test_regimes(model):
    _, matmul_bytes = _by_hand(model, 1, 0.0)
    floor_bytes = matmul_bytes + 1000.0
    # one row a step: every product is bound by its bytes, so the roofline is the bandwidth floor
    assert decode_roofline_s(model, 1, floor_bytes) == pytest.approx(floor_bytes / BW, rel=1e-12)
    # a million rows: every product is bound by its FLOPs, experts at their share
    rows = 10**6
    flops = sum(2 * rows * _share(model, n) * p.numel() for n, p in _matmul(model))
    assert decode_roofline_s(model, rows, floor_bytes) == pytest.approx(flops / PEAK_BF16_FLOPS + 1000.0 / BW,
                                                                        rel=1e-12)
