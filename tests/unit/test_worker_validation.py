"""Bad requests fail alone with a message naming the problem; the rest of the batch still runs."""

import numpy as np
import pytest
import torch

from ember.core.adapters import AdapterBankFull, LoraConfig
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput, ForwardBackwardOutput, RequestError


@pytest.fixture
def worker(hf_models):
    _, path = hf_models["qwen3"]
    return Worker.from_pretrained(path, "cpu", torch.float32, max_adapters=3, max_rank=16, max_seq_len=64)


def _datum(n=6, **inputs):
    tokens = np.arange(n) % 300
    base = {"target_tokens": (tokens + 1) % 300}
    base.update(inputs)
    return Datum(tokens, base)


BAD = [
    (dict(loss_fn="nope"), "unknown loss_fn"),
    (dict(loss_fn="dro"), "beta"),
    (dict(datums=[]), "no datums"),
    (dict(datums=[Datum(np.array([], dtype=np.int64), {"target_tokens": np.array([], dtype=np.int64)})]), "non-empty"),
    (dict(datums=[Datum(np.array([1, 2, 999]), {"target_tokens": np.array([1, 2, 3])})]), "token ids"),
    (dict(datums=[Datum(np.array([1, 2, 3]), {"target_tokens": np.array([1, 2, 400])})]), "target_tokens must be in"),
    (dict(datums=[Datum(np.array([1, 2, 3]), {"target_tokens": np.array([1, 2])})]), "shape"),
    (dict(datums=[Datum(np.array([1.5, 2.0]), {"target_tokens": np.array([1, 2])})]), "token ids"),
    (dict(datums=[_datum(weights=np.ones(5))]), "weights shape"),
    (dict(datums=[_datum(weights=np.array([1, 1, np.nan, 1, 1, 1]))]), "finite"),
    (dict(datums=[_datum(n=65)]), "maximum sequence length"),
    (dict(loss_fn="ppo", datums=[_datum(logprobs=np.zeros(6))]), "advantages"),
    (dict(loss_fn="ppo", datums=[_datum(target_tokens=np.zeros((6, 2), dtype=np.int64), logprobs=np.zeros(6),
                                        advantages=np.zeros(6))]), "target_tokens shape"),
    (dict(slot=3), "slot 3 is empty"),
    (dict(slot=0), "cannot be trained"),
]


@pytest.mark.parametrize("fields,message", BAD)
def test_bad_request_fails_alone(worker, fields, message):
    slot = worker.create_adapter(LoraConfig(rank=4))
    good = ForwardBackwardInput(slot, [_datum()], "cross_entropy")
    kwargs = dict(slot=slot, datums=[_datum()], loss_fn="cross_entropy")
    kwargs.update(fields)
    bad = ForwardBackwardInput(**kwargs)
    out_good, out_bad = worker.forward_backward([good, bad])
    assert isinstance(out_bad, RequestError) and message in out_bad.message, out_bad
    assert isinstance(out_good, ForwardBackwardOutput)
    (alone,) = worker.forward_backward([good])
    np.testing.assert_allclose(out_good.logprobs[0], alone.logprobs[0], atol=1e-5)


def test_bank_limits(worker):
    with pytest.raises(ValueError, match="rank 17"):
        worker.create_adapter(LoraConfig(rank=17))
    with pytest.raises(ValueError, match="targets"):
        worker.create_adapter(LoraConfig(rank=4, targets=frozenset({"embed"})))
    with pytest.raises(ValueError, match="alpha"):
        worker.create_adapter(LoraConfig(rank=4, alpha=0))
    slots = [worker.create_adapter(LoraConfig(rank=2)) for _ in range(3)]
    assert slots == [1, 2, 3]
    with pytest.raises(AdapterBankFull):
        worker.create_adapter(LoraConfig(rank=2))
    worker.free_adapter(2)
    assert worker.create_adapter(LoraConfig(rank=8)) == 2
    with pytest.raises(KeyError):
        worker.free_adapter(7)


def test_reset_restores_the_seeded_initial_state(worker):
    slot = worker.create_adapter(LoraConfig(rank=4, seed=9))
    initial = {k: t.detach().clone() for k, t in worker.adapter(slot).tensors().items()}
    assert all(torch.count_nonzero(v) == 0 for k, v in initial.items() if k.endswith("lora_B"))
    worker.forward_backward([ForwardBackwardInput(slot, [_datum()], "cross_entropy")])
    from ember.core.optim import AdamParams

    worker.optim_step(slot, AdamParams(learning_rate=0.1))
    worker.reset_adapter(slot)
    assert worker.adapter(slot).grads() is None
    for k, t in worker.adapter(slot).tensors().items():
        assert torch.equal(t, initial[k])
    assert worker.adapter(slot).optimizer.opt.state == {}


def test_read_back_in_one_copy_keeps_shapes_and_values():
    """``_to_host``: the tensors on one device through one concatenated copy, split back to their
    shapes with their values exact (fp32 and fp64, ints, empty ones); tensors elsewhere alone."""
    import numpy as np
    import torch

    from ember.engine.worker import _to_host

    values = [torch.tensor(1.5), torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7,
              torch.tensor([0.1], dtype=torch.float64), torch.zeros(0, 2), torch.tensor(3), torch.randn(4).to(torch.bfloat16)]
    for device in (torch.device("cpu"), None):  # cpu: as if it were the accelerator (the one-copy path)
        got = _to_host(values, device)
        assert len(got) == len(values)
        for g, v in zip(got, values):
            assert g.shape == tuple(v.shape) and g.dtype == np.float64
            assert np.array_equal(g, v.double().numpy())
