"""MasterAdamW (ember.core.offload): every storage equals torch.optim.AdamW + clip_grad_norm_, the
storages agree bitwise (also with part of the state kept on the device), the state round-trips,
and a folder that cannot hold the state is a clear error that leaves nothing behind."""

import os
import shutil
from collections import namedtuple

import pytest
import torch

from ember.core.offload import MasterAdamW
from ember.core.optim import AdamParams

HP = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.5)
SHAPES = [(7, 5), (13,), (3, 4, 2), (40,)]
# on a GPU machine the same checks run on CUDA too (side streams, pinned memory)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_params(dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype))) for i, s in enumerate(SHAPES)]


def set_grads(params, step, skip=()):
    g = torch.Generator().manual_seed(100 + step)
    for i, (_, p) in enumerate(params):
        p.grad = None if i in skip else torch.randn(p.shape, generator=g).to(p.device, p.dtype)


def run(storage, steps=4, dtype=torch.float32, skip_at=None, device="cpu", **kw):
    """The parameters after ``steps`` steps (parameter 1 has no gradient at step ``skip_at``)."""
    params = make_params(dtype, device=device)
    opt = MasterAdamW(params, storage, chunk_bytes=32, **kw)  # 8-element pieces: parameters span several
    for s in range(steps):
        set_grads(params, s, skip=(1,) if s == skip_at else ())
        opt.step(HP)
    out = [p.detach().clone() for _, p in params]
    opt.close()
    return out, opt


@pytest.fixture(params=["none", "host", "disk", "host+device"])
def storage(request, tmp_path):
    if request.param == "disk":
        return dict(storage=f"disk:{tmp_path}", host_budget_bytes=0)  # every vector in the file
    if request.param == "host+device":
        return dict(storage="host", device_budget_bytes=4 * 3 * (35 + 13))  # p0 and p1 stay, p2 and p3 stream
    return dict(storage=request.param)


@pytest.mark.parametrize("device", DEVICES)
def test_every_storage_equals_torch_adamw_with_clipping(storage, device):
    params = make_params(device=device)
    ref = torch.optim.AdamW([p for _, p in params], lr=HP.learning_rate, betas=(HP.beta1, HP.beta2), eps=HP.eps,
                            weight_decay=HP.weight_decay, fused=True)
    for s in range(4):
        set_grads(params, s)
        torch.nn.utils.clip_grad_norm_([p for _, p in params], HP.grad_clip_norm)
        ref.step()
    got, _ = run(**storage, device=device)
    for (_, want), have in zip(params, got):
        torch.testing.assert_close(have, want.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_storages_agree_bitwise(storage, dtype, device):
    want, _ = run("none", dtype=dtype, skip_at=2, device=device)
    got, _ = run(**storage, dtype=dtype, skip_at=2, device=device)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_a_parameter_without_a_gradient_keeps_its_step_count():
    params = make_params()
    opt = MasterAdamW(params, "host")
    for s in range(3):
        set_grads(params, s, skip=(1,) if s == 1 else ())
        opt.step(HP)
    state = opt.state_dict()
    assert [float(state[f"p{i}.step"]) for i in range(len(SHAPES))] == [3, 2, 3, 3]
    assert MasterAdamW(make_params(), "none").step(HP) == {"grad_norm": 0.0}  # no gradients: nothing moves


def test_the_device_budget_keeps_the_leading_parameters_on_the_device():
    params = make_params(torch.bfloat16)
    opt = MasterAdamW(params, "host", device_budget_bytes=4 * 3 * 35 + 4)  # p0 fits, p1 would not
    assert opt.state_bytes() == {"device": 4 * 3 * 35, "host": 4 * 3 * (13 + 24 + 40), "disk": 0}
    assert {pc.param for pc in opt.pieces if pc.tier == 0} == {0}
    everything = MasterAdamW(params, "host", device_budget_bytes=1 << 30)
    assert everything.state_bytes()["host"] == 0


def test_state_round_trips_across_storages(tmp_path):
    want, _ = run("none", steps=5)
    params = make_params()
    first = MasterAdamW(params, "host", chunk_bytes=32)
    for s in range(3):
        set_grads(params, s)
        first.step(HP)
    saved = first.state_dict()
    params2 = make_params(seed=9)  # other weights: loading must set them
    second = MasterAdamW(params2, f"disk:{tmp_path}", chunk_bytes=32, host_budget_bytes=0)
    second.load_state_dict(saved)
    for s in range(3, 5):
        set_grads(params2, s)
        second.step(HP)
    for a, (_, b) in zip(want, params2):
        assert torch.equal(a, b.detach())
    second.close()


def test_a_state_of_another_model_is_refused():
    opt = MasterAdamW(make_params(), "none")
    state = opt.state_dict()
    with pytest.raises(ValueError, match="missing"):
        opt.load_state_dict({k: v for k, v in state.items() if not k.startswith("p0.")})
    state["p1.exp_avg"] = torch.zeros(14)
    with pytest.raises(ValueError, match="p1.exp_avg has shape"):
        opt.load_state_dict(state)


def test_disk_files_live_in_their_own_folder_and_are_removed(tmp_path):
    opt = MasterAdamW(make_params(), f"disk:{tmp_path}", host_budget_bytes=0)
    (folder,) = list(tmp_path.iterdir())
    assert os.path.getsize(folder / "state.bin") == 3 * 4 * opt.numel  # written in full up front
    assert opt.state_bytes()["disk"] == 3 * 4 * opt.numel
    opt.close()
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_folder_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=f"optimizer offload folder {blocker}.*GiB of optimizer state"):
        MasterAdamW(make_params(), f"disk:{blocker}", host_budget_bytes=0)


def test_a_full_disk_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 20, 1 << 20, 100))
    with pytest.raises(ValueError, match="cannot hold .* GiB of optimizer state"):
        MasterAdamW(make_params(), f"disk:{tmp_path}", host_budget_bytes=0)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_storage_names_the_allowed_ones():
    with pytest.raises(ValueError, match="none, host, disk:DIR"):
        MasterAdamW(make_params(), "gpu")
