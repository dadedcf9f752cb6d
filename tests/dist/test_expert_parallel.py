"""Expert parallelism on gloo (2 and 4 CPU processes) equals one process (fp32, 1e-5)."""

import pytest

from tests.dist import ep_cases
from tests.dist.launch import run
from tests.tiny_models import build_hf_model, save_hf_model


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    return str(save_hf_model(build_hf_model("qwen3_moe"), tmp_path_factory.mktemp("qwen3_moe")))


def test_qwen3_moe_ep2(qwen3_moe_dir):
    run(2, ep_cases.expert_parallel_step, qwen3_moe_dir, 2)


def test_qwen3_moe_ep2_replayed_routes_leave_a_rank_without_rows(qwen3_moe_dir):
    run(2, ep_cases.expert_parallel_step, qwen3_moe_dir, 2, True)
