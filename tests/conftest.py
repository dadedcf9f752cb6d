import pytest
import torch

from tests.tiny_models import build_hf_model, save_hf_model

FAMILIES = ["llama", "qwen3", "qwen3_moe"]


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """family -> (transformers model, saved folder); built once per session."""
    out = {}
    root = tmp_path_factory.mktemp("models")
    for fam in FAMILIES:
        m = build_hf_model(fam)
        out[fam] = (m, save_hf_model(m, root / fam))
    return out


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: intra-op threads only add contention on a small shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
