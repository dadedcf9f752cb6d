"""Tiny checkpoints the parallel tests share (built once per session)."""

import pytest

from tests.tiny_models import build_hf_model, save_hf_model


@pytest.fixture(scope="session")
def qwen3_moe_dir(tmp_path_factory):
    return str(save_hf_model(build_hf_model("qwen3_moe"), tmp_path_factory.mktemp("qwen3_moe")))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return str(save_hf_model(build_hf_model("qwen3"), tmp_path_factory.mktemp("qwen3")))
