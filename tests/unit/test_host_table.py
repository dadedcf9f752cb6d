"""qwen4_exp's n-gram (PLE) table lives in host memory whatever the model's device, and is read
from a checkpoint by block of rows (the table of a rank under expert parallelism); a layout whose
EP does not divide the table's rows is refused, naming the numbers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from ember.core.config import load_config
from ember.core.layers.ngram_memory import NGramEmbedding, host_rows
from ember.core.loading import build_empty, host_memory, host_parameter_names, load_model
from ember.dist.host_table import shard_tables
from ember.dist.mesh import Layout

TABLE = "model.layers.1.ple.ple_embedding.ngram_embedding.weight"


@pytest.fixture(scope="module")
def qwen4_dir(tmp_path_factory):
    from tests.parity.test_qwen4_exp import build_hf

    path = tmp_path_factory.mktemp("qwen4_host") / "m"
    build_hf().save_pretrained(str(path))
    return path


def _saved_table(path) -> torch.Tensor:
    """The checkpoint's table (saved in row shards ``….shard_{i}.weight``), whole."""
    tensors = load_file(str(path / "model.safetensors"))
    prefix = TABLE[: -len(".weight")] + ".shard_"
    shards = sorted((int(k[len(prefix) :].split(".")[0]), t) for k, t in tensors.items() if k.startswith(prefix))
    assert len(shards) == 2
    return torch.cat([t for _, t in shards])


def test_the_table_stays_in_host_memory_for_another_device(qwen4_dir):
    """Loaded for another device (``meta`` here, standing for a GPU), the table alone is on the CPU,
    holding the checkpoint's values; every other parameter is on that device."""
    model = load_model(qwen4_dir, "meta", torch.float32)
    assert host_parameter_names(model) == {TABLE}
    devices = {name: p.device.type for name, p in model.named_parameters()}
    assert devices.pop(TABLE) == host_memory(torch.device("meta"))[0].type == "cpu"
    assert set(devices.values()) == {"meta"}
    table = dict(model.named_parameters())[TABLE]
    assert not table.requires_grad and table.dtype == torch.float32
    assert torch.equal(table, _saved_table(qwen4_dir))


def test_pinned_only_for_a_gpu_model(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert host_memory(torch.device("cuda", 1)) == (torch.device("cpu"), True)
    assert host_memory(torch.device("cpu")) == (torch.device("cpu"), False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert host_memory(torch.device("cuda"))[1] is False


def test_a_block_of_rows_is_read_across_the_row_shards(qwen4_dir):
    """A block of rows that straddles the two saved shards is read as those rows of the table."""
    whole = _saved_table(qwen4_dir)
    start, n = whole.shape[0] // 2 - 5, 40  # from the end of shard 0 into shard 1

    def narrow(model):
        mod = next(m for m in model.modules() if isinstance(m, NGramEmbedding))
        mod.ngram_embedding.weight = torch.nn.Parameter(mod.ngram_embedding.weight.data[:n].clone(), requires_grad=False)
        model.__dict__.setdefault("param_blocks", {})[TABLE] = (0, start, n)

    model = load_model(qwen4_dir, "cpu", torch.float32, parallelize=narrow)
    assert torch.equal(dict(model.named_parameters())[TABLE], whole[start : start + n])


def test_host_rows_are_the_table_rows():
    table = torch.randn(50, 3)
    ids = torch.tensor([4, 0, 49, 4])
    assert torch.equal(host_rows(table, ids), table[ids])
    assert host_rows(table, ids[:0]).shape == (0, 3)


def test_an_ep_that_does_not_divide_the_rows_is_refused(qwen4_dir):
    model = build_empty(load_config(qwen4_dir))
    rows = next(m for m in model.modules() if isinstance(m, NGramEmbedding)).ngram_embedding.weight.shape[0]
    ep = next(e for e in (7, 9, 11, 13) if rows % e)
    parallel = SimpleNamespace(layout=Layout(ep, 0, ep), ep_group=None)
    with pytest.raises(ValueError, match=rf"--ep {ep} must divide the rows of every n-gram table \(.*: {rows} rows\)"):
        shard_tables(model, parallel)
