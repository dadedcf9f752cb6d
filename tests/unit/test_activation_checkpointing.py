"""Per-layer activation checkpointing (ember.core.checkpointing): a training pass with it gives the
logprobs, LoRA gradients and MoE routing records of the pass without it (fp32), while autograd keeps
less and every layer really runs again in the backward."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from ember.core import rebuild
from ember.core.batch import pack
from ember.core.checkpointing import apply_checkpointing
from ember.core.layers.moe import Experts, RoutingRecord
from ember.engine.worker import Worker
from tests.lora_helpers import randomise
from tests.tiny_models import random_sequences
from tests.unit.test_mixed_batch import CONFIGS, _request


def _deepseek():
    from tests.parity.test_deepseek_v3 import CASES, build_hf

    family, kw = CASES["deepseek_yarn"]  # a dense layer, then MoE layers with shared experts and a grouped router
    return build_hf(family, **kw)


def _qwen3_next():
    from tests.parity.test_qwen3_next import build_hf

    return build_hf()


def _qwen4_exp():
    from tests.parity.test_qwen4_exp import build_hf

    return build_hf()  # PLE, QSA, GDN; layers take (x, input_ids, ctx)


def _inkling2():
    from tests.parity.test_inkling2 import build_hf_inkling2

    return build_hf_inkling2()  # layers take (partial, bank, run); the bank grows at layers 3 and 6


def _olmo3():
    from tests.parity.test_olmo3 import build_hf

    return build_hf()


BUILDERS = {"deepseek_v3": _deepseek, "qwen3_next": _qwen3_next, "qwen4_exp": _qwen4_exp, "inkling2": _inkling2,
            "olmo3": _olmo3}
FAMILIES = ["qwen3", "qwen3_moe", *BUILDERS]


@pytest.fixture(scope="module")
def model_dirs(hf_models, tmp_path_factory):
    out = {fam: hf_models[fam][1] for fam in ("qwen3", "qwen3_moe")}
    root = tmp_path_factory.mktemp("ckpt_models")
    for fam, build in BUILDERS.items():
        build().save_pretrained(str(root / fam))
        out[fam] = root / fam
    return out


def _worker(path) -> Worker:
    worker = Worker.from_pretrained(path, "cpu", torch.float32, logprob_chunk=16, activation_checkpointing="on")
    for i, c in enumerate(CONFIGS):
        randomise(worker.adapter(worker.create_adapter(c)), seed=100 + i, scale=0.05)
    return worker


def _requests(vocab: int):
    rng = np.random.default_rng(0)
    losses = ["cross_entropy", "ppo", "importance_sampling", "cross_entropy"]
    reqs = [_request(s, random_sequences(vocab, [9 + 3 * s, 20, 5], seed=10 + s), rng, losses[s - 1])
            for s in range(1, 5)]
    reqs.append(_request(0, random_sequences(vocab, [14, 6], seed=50), rng, forward_only=True))
    reqs.append(_request(2, random_sequences(vocab, [11], seed=51), rng, forward_only=True))
    return reqs


class _SavedBytes:
    """Bytes of the tensors autograd saves for backward outside checkpointed regions (distinct
    storages), seen through ``ember.core.rebuild`` (whose hooks are the innermost of a training
    forward). The checkpoint's own hooks take over inside a layer and keep nothing. Each storage is
    held until the measure ends: a tensor saved by a branch that the forward drops is freed, and
    its address could be given to a later one, which would then replace it in the count (by how
    the allocator happens to reuse addresses: a measure that changed from run to run)."""

    def __init__(self):
        self.storages: dict[int, torch.UntypedStorage] = {}

    def __enter__(self):
        def seen(t):
            s = t.untyped_storage()
            self.storages[s.data_ptr()] = s

        self._ctx = rebuild.observing(seen)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(s.nbytes() for s in self.storages.values())


def _step(worker: Worker, mode: str, requests):
    worker.activation_checkpointing = mode
    before = worker.checkpointing.recomputes
    saved = _SavedBytes()
    with saved:
        outs = worker.forward_backward(requests)
    grads = {}
    for s in range(1, 5):
        a = worker.adapter(s)
        grads[s] = {k: g.clone() for k, g in a.grads().items()}
        a.optimizer.zero_grad()
    return outs, grads, worker.checkpointing.recomputes - before, saved.total


def assert_same_pass(outs, grads, other_outs, other_grads, tol: float) -> None:
    """Two passes' outputs (logprobs and metrics) are equal, and their adapters' gradients within
    ``tol`` (0: bitwise)."""
    for a, b in zip(outs, other_outs):
        for x, y in zip(a.logprobs, b.logprobs):
            np.testing.assert_array_equal(y, x)
        assert b.metrics == a.metrics
    for s in grads:
        assert other_grads[s].keys() == grads[s].keys()
        for k, g in grads[s].items():
            torch.testing.assert_close(other_grads[s][k], g, atol=tol, rtol=tol, msg=f"slot {s} {k}")


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointed_pass_equals_the_plain_one(family, model_dirs):
    worker = _worker(model_dirs[family])
    requests = _requests(worker.config.vocab_size)
    plain, g_plain, n_plain, bytes_plain = _step(worker, "off", requests)
    ckpt, g_ckpt, n_ckpt, bytes_ckpt = _step(worker, "on", requests)
    assert n_plain == 0 and n_ckpt == worker.config.num_layers  # every layer recomputed once, in backward
    assert bytes_ckpt < bytes_plain / 3, (bytes_ckpt, bytes_plain)
    assert_same_pass(plain, g_plain, ckpt, g_ckpt, tol=1e-6)
    if worker.model.moe_routers():
        assert any(".experts." in k for k in g_plain[1])
    # forward-only passes and sampling never checkpoint
    worker.forward_backward([requests[-1]])
    assert worker.checkpointing.recomputes == n_ckpt


class _CountingDict(dict):
    def __init__(self):
        super().__init__()
        self.writes = 0

    def __setitem__(self, key, value):
        self.writes += 1
        super().__setitem__(key, value)


def _routed_pass(worker: Worker, on: bool, routing: RoutingRecord, perturb_router: bool = False):
    """One grad pass over a mixed batch with ``routing``; returns logprobs, the experts every MoE
    layer computed with (first forward and recompute, in order) and the adapters' gradients."""
    model = worker.model
    vocab = worker.config.vocab_size
    seqs = random_sequences(vocab, [12, 20, 9], seed=3)
    batch = pack(seqs, [(1, True), (2, True), (3, True)], "cpu")
    targets = torch.roll(batch.input_ids, -1)[:, None]
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[1].experts.clone()))
             for m in model.modules() if isinstance(m, Experts)]
    try:
        with worker.checkpointing.on(on):
            lp = worker.logprobs(batch, targets, routing=routing)
        if perturb_router:  # the live router now picks other experts: a recompute that re-routed would differ
            with torch.no_grad():
                for gate in model.moe_routers().values():
                    gate.weight.copy_(gate.weight.flip(0))
        if lp.requires_grad:
            (lp[:, 0] * torch.linspace(0.5, 1.5, lp.shape[0])).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    grads = {}
    for s in (1, 2, 3):
        a = worker.adapter(s)
        grads[s] = {k: g.clone() for k, g in (a.grads() or {}).items()}
        a.optimizer.zero_grad()
    return lp.detach(), seen, grads


def test_r3_replay_record_and_flips_under_checkpointing(model_dirs):
    """Qwen3-MoE with a partial replay (the first sequence replays other experts, the rest routes
    live), a record and flips against a reference: the checkpointed pass gives the same logprobs,
    gradients, record and flips, writes the record and flips once per layer, and recomputes every
    MoE layer with exactly the experts of its first forward, also when the router changed between
    the forward and the backward."""
    worker = _worker(model_dirs["qwen3_moe"])
    live = RoutingRecord(record={})
    with torch.no_grad():
        _routed_pass(worker, False, live)
    T = 41
    other = {k: torch.where(torch.arange(T)[:, None] < 12, (v + 1) % 8, -1) for k, v in live.record.items()}

    def routing():
        return RoutingRecord(record=_CountingDict(), replay=other, reference=other, flips=_CountingDict())

    plain_rec, ckpt_rec = routing(), routing()
    lp_plain, seen_plain, g_plain = _routed_pass(worker, False, plain_rec)
    lp_ckpt, seen_ckpt, g_ckpt = _routed_pass(worker, True, ckpt_rec)
    torch.testing.assert_close(lp_ckpt, lp_plain, atol=0, rtol=0)
    for s in g_plain:
        for k, g in g_plain[s].items():
            torch.testing.assert_close(g_ckpt[s][k], g, atol=1e-6, rtol=1e-6, msg=f"slot {s} {k}")
    layers = sorted(worker.model.moe_routers())
    for rec in (plain_rec, ckpt_rec):
        assert sorted(rec.record) == sorted(rec.flips) == layers
        assert rec.record.writes == rec.flips.writes == len(layers)  # once per layer, not again in the recompute
    for i in layers:
        torch.testing.assert_close(ckpt_rec.record[i], plain_rec.record[i], atol=0, rtol=0)
        torch.testing.assert_close(ckpt_rec.flips[i], plain_rec.flips[i], atol=0, rtol=0)
        assert ckpt_rec.flips[i][:12].all() and not ckpt_rec.flips[i][12:].any()
    # the first forward's experts, then the recompute's (backward: last layer first) are the same
    n = len(layers)
    assert len(seen_plain) == n and len(seen_ckpt) == 2 * n
    for first, again in zip(seen_ckpt[:n], reversed(seen_ckpt[n:])):
        torch.testing.assert_close(again, first, atol=0, rtol=0)

    # the router changes between forward and backward: the recompute still uses the first choice
    state = {k: v.clone() for k, v in worker.model.state_dict().items() if "mlp.gate" in k}
    try:
        _, seen, _ = _routed_pass(worker, True, None, perturb_router=True)
        moved = RoutingRecord(record={})  # what the changed router chooses: other experts
        with torch.no_grad():
            _routed_pass(worker, False, moved)
    finally:
        worker.model.load_state_dict(state, strict=False)
    assert len(seen) == 2 * n
    for i, first, again in zip(layers, seen[:n], reversed(seen[n:])):
        torch.testing.assert_close(again, first, atol=0, rtol=0)
        assert (moved.record[i] != first).any()


# kept bytes per token of each layer after a LoRA forward (bf16, rank 32 on attention and MLP, 256
# and 512 tokens, norm/rotary/activation outputs rebuilt; bench/activation_split.py on the CPU,
# 2026-12-05, attention keeping what flash attention keeps, Gated DeltaNet through Ember's rule, the
# hyper-connections eager): the calibration of ember.core.checkpointing.layer_elements. Layer 0
# keeps a little more or less: its input (the embedding) needs no gradient.
GDN, QSA = 767.6, 260.5
MEASURED_KB = {
    "qwen3-8b": [87.3] + [86.8] * 35,
    "olmo3-7b": [111.2, 110.2, 110.2, 111.2] * 8,
    "qwen3-30b-a3b": [54.1] + [53.5] * 47,
    "qwen3-next-80b-a3b-8l": [406.7, 406.7, 406.7, 64.0] * 2,
    "qwen3.8-flash-next-8l": [679.9, GDN, GDN, QSA, GDN, GDN, GDN, QSA],
    "glm-4.7-flash": [101.3] + [91.8] * 46,
    "deepseek-v3-4l": [304.5, 304.3, 304.3, 305.6],
}


def test_auto_is_off_on_cpu_and_the_estimate_follows_the_shape(model_dirs, caplog):
    worker = Worker.from_pretrained(model_dirs["qwen3"], "cpu", torch.float32, logprob_chunk=16)
    assert worker.activation_checkpointing == "auto"
    slot = worker.create_adapter(CONFIGS[0])
    before = worker.checkpointing.recomputes
    worker.forward_backward([_request(slot, random_sequences(320, [30], seed=1), np.random.default_rng(0))])
    assert worker.checkpointing.recomputes == before
    with pytest.raises(ValueError, match="activation_checkpointing"):
        Worker(worker.model, activation_checkpointing="always")
    assert Worker(worker.model, activation_checkpointing="off").checkpointing is None

    # the estimate per layer against what a LoRA forward keeps (KB per token, bf16)
    from bench.common import SHAPES, ember_config
    from ember.core.checkpointing import layer_elements
    from ember.core.models import model_class

    for name, measured in MEASURED_KB.items():
        cfg = ember_config(SHAPES[name])
        with torch.device("meta"):
            model = model_class(cfg)(cfg)
        est = [2 * e / 1000 for e in layer_elements(model)]
        assert len(est) == len(measured), name
        for i, (e, m) in enumerate(zip(est, measured)):
            assert abs(e / m - 1) < 0.12, (name, i, e, m)

    # auto on CUDA: the decision uses the estimate against the available memory (faked here), and is logged
    import ember.engine.worker as worker_mod

    worker.device = torch.device("cuda")
    caplog.set_level(logging.INFO, logger="ember.engine.worker")
    orig = worker_mod.available_bytes
    try:
        worker_mod.available_bytes = lambda device: 1 << 20
        with torch.enable_grad():
            assert worker._checkpoint_pass(100, [(slot, True)])
        worker_mod.available_bytes = lambda device: 1 << 40
        with torch.enable_grad():
            assert not worker._checkpoint_pass(100, [(slot, True)])
        with torch.no_grad():
            worker_mod.available_bytes = lambda device: 1 << 20
            assert not worker._checkpoint_pass(100, [(slot, True)])  # no grad: never
    finally:
        worker_mod.available_bytes = orig
        worker.device = torch.device("cpu")
    assert [r.message for r in caplog.records].count("activation checkpointing on: the pass would not fit") == 1


def test_wrapping_is_once_per_model_and_names_stay(model_dirs):
    worker = _worker(model_dirs["qwen3"])
    names = [n for n, _ in worker.model.named_parameters()]
    assert apply_checkpointing(worker.model) is worker.checkpointing
    assert Worker(worker.model, activation_checkpointing="on").checkpointing is worker.checkpointing
    assert [n for n, _ in worker.model.named_parameters()] == names
    assert all(n.startswith(("model.", "lm_head.")) for n in names)


def test_the_flag_reaches_the_engine(capsys):
    """``ember serve --activation-checkpointing`` -> EngineOptions -> the engine command -> its
    argparse (which takes only auto | on | off)."""
    from types import SimpleNamespace

    from ember.engine import service
    from ember.server.supervisor import EngineOptions, EngineSupervisor

    model = SimpleNamespace(path="/models/m")
    for value in ("auto", "on", "off"):
        sup = EngineSupervisor(None, {"m": model}, EngineOptions("sqlite://", "/tmp/ckpt", activation_checkpointing=value))
        cmd = sup.command("m")
        assert cmd[cmd.index("--activation-checkpointing") + 1] == value
    with pytest.raises(SystemExit):
        service.main(["--base-model", "m", "--model-path", "/x", "--database-url", "sqlite://", "--storage", "/tmp",
                      "--activation-checkpointing", "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


def test_auto_retries_a_forward_that_ran_out_of_memory(model_dirs, monkeypatch, caplog):
    """One process, ``auto`` on CUDA (faked): a forward that runs out of memory without
    checkpointing runs again with it, and later passes of that size checkpoint from the start;
    what a pass kept against its estimate scales later estimates, up or down, if the pass is not
    too short to measure. ``on`` does not retry."""
    import ember.engine.worker as worker_mod

    worker = Worker.from_pretrained(model_dirs["qwen3"], "cpu", torch.float32)
    slot = worker.create_adapter(CONFIGS[0])
    batch = pack(random_sequences(320, [40], seed=1), [(slot, True)], "cpu")
    calls, allocated, kept_per_token = [], [0], [1000]

    def logprobs(batch, targets, inv=None, routing=None, weights=None):
        calls.append(len(worker.checkpointing.active) == len(worker.model.model.layers) or
                     (False if not worker.checkpointing.active else worker.checkpointing.active))
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        allocated[0] += kept_per_token[0] * batch.num_tokens
        return torch.zeros(batch.num_tokens, 1)

    monkeypatch.setattr(worker, "logprobs", logprobs)
    monkeypatch.setattr(worker_mod, "available_bytes", lambda device: 40 << 20)
    # an estimate of 500 bytes per token however many layers are checkpointed, no head
    monkeypatch.setattr(worker_mod, "kept_bytes", lambda model, tokens, checkpointed=(), tp=1, rebuilt=True: 500 * tokens)
    monkeypatch.setattr(worker_mod, "HEAD_BYTES", 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[0])
    worker.device = torch.device("cuda")
    caplog.set_level(logging.INFO, logger="ember.engine.worker")
    keys = [(slot, True)]
    with torch.enable_grad():
        worker._checkpointed_logprobs(batch, keys, None, None, None)
        assert calls == [False, True]
        assert worker._kept_scale == (40 << 20) / (500 * 40)  # at least what was free, against the estimate
        assert worker._checkpoint_pass(40, keys)  # the next pass of this size checkpoints at once
        assert not worker._checkpoint_pass(1, keys)  # a small one does not
        worker._kept_scale = None
        worker._checkpointed_logprobs(batch, keys, None, None, None)  # fits, but too short to measure
        assert calls[-1] is False and worker._kept_scale is None
        monkeypatch.setattr(worker_mod, "MEASURE_MIN_TOKENS", 40)
        worker._checkpointed_logprobs(batch, keys, None, None, None)  # fits: measures what it kept
        assert calls[-1] is False and worker._kept_scale == 2.0
        worker._kept_scale = None
        kept_per_token[0] = 200  # a pass that keeps less than its estimate lowers later ones
        worker._checkpointed_logprobs(batch, keys, None, None, None)
        assert worker._kept_scale == 0.4
        worker._checkpointed_logprobs(batch, keys, None, None, None)
        kept_per_token[0] = 300
        worker._checkpointed_logprobs(batch, keys, None, None, None)
        assert worker._kept_scale == 0.6  # the largest ratio measured
        calls.clear()
        worker.activation_checkpointing = "off"
        with pytest.raises(torch.cuda.OutOfMemoryError):
            worker._checkpointed_logprobs(batch, keys, None, None, None)
    assert "ran out of memory without it" in caplog.text


def test_a_high_estimate_measured_checkpoints_fewer_layers(model_dirs, monkeypatch):
    """CUDA faked: the first pass checkpoints some layers on the estimate; it kept half of what was
    estimated for the layers it did not checkpoint, so the next pass of the same size needs no
    checkpointing."""
    import ember.engine.worker as worker_mod
    from ember.core.checkpointing import HEAD_BYTES, kept_bytes

    worker = Worker.from_pretrained(model_dirs["qwen3_next"], "cpu", torch.float32)
    slot = worker.create_adapter(CONFIGS[0])
    tokens = 1024
    batch = pack(random_sequences(320, [tokens], seed=1), [(slot, True)], "cpu")
    full = kept_bytes(worker.model, tokens)
    grads = worker.bank.get(slot).flat.numel() * 4
    avail = int((0.8 * full + HEAD_BYTES + grads) / 0.85)  # the estimate a little over, half of it under
    allocated, seen = [0], []

    def logprobs(batch, targets, inv=None, routing=None, weights=None):
        active = worker.checkpointing.active
        seen.append(set(active))
        allocated[0] += kept_bytes(worker.model, tokens, active) // 2
        return torch.zeros(batch.num_tokens, 1)

    monkeypatch.setattr(worker, "logprobs", logprobs)
    monkeypatch.setattr(worker_mod, "available_bytes", lambda device: avail)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[0])
    worker.device = torch.device("cuda")
    with torch.enable_grad():
        worker._checkpointed_logprobs(batch, [(slot, True)], None, None, None)
        worker._checkpointed_logprobs(batch, [(slot, True)], None, None, None)
    worker.device = torch.device("cpu")
    assert 0 < len(seen[0]) < len(worker.model.model.layers), seen
    assert abs(worker._kept_scale - 0.5) < 1e-3 and seen[1] == set()


def test_auto_checkpoints_the_fewest_layers_that_free_enough():
    """``layers_to_checkpoint`` on Qwen3-Next's shape (8 layers: GDN layers keep ~3.5x what its
    gated-attention layers keep per token): nothing to free, none; a little, GDN layers first; more
    than all layers can free, all of them; what it picks always frees the excess, net of the
    largest chosen layer's recompute."""
    from bench.common import SHAPES, ember_config
    from ember.core.checkpointing import checkpoint_order, layer_elements, layers_to_checkpoint
    from ember.core.models import model_class

    cfg = ember_config(SHAPES["qwen3-next-80b-a3b-8l"])
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    elements = layer_elements(model)
    gdn = [i for i, t in enumerate(cfg.raw["layer_types"]) if t == "linear_attention"]
    assert checkpoint_order(model)[: len(gdn)] == gdn  # the layers that keep the most come first
    tokens, b = 16384, 2  # bf16
    assert layers_to_checkpoint(model, 0, tokens, b) == []
    assert layers_to_checkpoint(model, -5, tokens, b) == []
    assert layers_to_checkpoint(model, 10 << 40, tokens, b) == list(range(8))
    for excess_gib in (1, 4, 10, 20):
        excess = excess_gib << 30
        chosen = layers_to_checkpoint(model, excess, tokens, b)
        freed = sum((elements[i] - cfg.hidden_size) * tokens * b for i in chosen)
        assert len(chosen) == 8 or freed - max(elements[i] for i in chosen) * tokens * b >= excess, excess_gib
        fewer = chosen[:-1]
        assert len(chosen) == 8 or sum((elements[i] - cfg.hidden_size) * tokens * b for i in fewer) \
            - max([elements[i] for i in fewer] or [0]) * tokens * b < excess  # the fewest
    small = layers_to_checkpoint(model, 1 << 30, tokens, b)
    assert set(small) <= set(gdn) and small
    # the measured-to-estimated ratio scales what a layer frees: twice the measure, fewer layers
    assert len(layers_to_checkpoint(model, 20 << 30, tokens, b, scale=2.0)) < len(layers_to_checkpoint(model, 20 << 30, tokens, b))


def test_a_pass_checkpointing_some_layers_equals_the_plain_one(model_dirs, monkeypatch):
    """``auto`` on CUDA may checkpoint a subset of layers: the pass's logprobs and gradients are the
    plain pass's and only those layers are recomputed."""
    worker = _worker(model_dirs["qwen3_next"])
    requests = _requests(worker.config.vocab_size)
    plain, g_plain, n_plain, _ = _step(worker, "off", requests)
    monkeypatch.setattr(worker, "_checkpoint_pass", lambda tokens, keys, weights=None: frozenset({0, 2}))
    some, g_some, n_some, _ = _step(worker, "auto", requests)
    assert n_plain == 0 and n_some == 2
    for a, b in zip(plain, some):
        for x, y in zip(a.logprobs, b.logprobs):
            np.testing.assert_array_equal(y, x)
    for s in g_plain:
        for k, g in g_plain[s].items():
            torch.testing.assert_close(g_some[s][k], g, atol=1e-6, rtol=1e-6, msg=f"slot {s} {k}")


def test_auto_on_cuda_picks_a_subset_when_a_few_layers_suffice(model_dirs):
    """The worker's decision (CUDA faked): the estimate a little over the available memory gives
    some layers (in the order of ``checkpoint_order``), far over gives all, under gives none."""
    import ember.engine.worker as worker_mod
    from ember.core.checkpointing import HEAD_BYTES, activation_bytes, checkpoint_order

    worker = Worker.from_pretrained(model_dirs["qwen3_next"], "cpu", torch.float32)
    slot = worker.create_adapter(CONFIGS[0])
    tokens = 4096
    need = activation_bytes(worker.model, tokens) + worker.bank.get(slot).flat.numel() * 4
    layers = len(worker.model.model.layers)
    orig = worker_mod.available_bytes
    worker.device = torch.device("cuda")
    try:
        decisions = {}
        for name, avail in (("under", need * 2), ("a little over", int((need - (need - HEAD_BYTES) * 0.3) / 0.85)),
                            ("far over", 1 << 20)):
            worker_mod.available_bytes = lambda device, a=avail: a
            with torch.enable_grad():
                decisions[name] = worker._checkpoint_pass(tokens, [(slot, True)])
    finally:
        worker_mod.available_bytes = orig
        worker.device = torch.device("cpu")
    assert decisions["under"] is False and decisions["far over"] is True
    some = decisions["a little over"]
    assert isinstance(some, frozenset) and 0 < len(some) < layers, some
    assert some == set(checkpoint_order(worker.model)[: len(some)])


def test_auto_rebuilds_only_a_pass_that_would_not_fit_and_checkpoints_past_that(model_dirs, monkeypatch):
    """``auto`` on CUDA (faked): a pass that fits keeps its norm and activation outputs; one that
    fits only with them rebuilt (ember.core.rebuild) rebuilds them and checkpoints nothing; one
    that does not fit even so rebuilds and checkpoints layers. Other modes always rebuild."""
    import ember.engine.worker as worker_mod
    from ember.core.checkpointing import HEAD_BYTES, kept_bytes

    worker = Worker.from_pretrained(model_dirs["qwen3"], "cpu", torch.float32)
    slot = worker.create_adapter(CONFIGS[0])
    keys, tokens = [(slot, True)], 4096
    grads = worker.adapter(slot).flat.numel() * 4
    plain = kept_bytes(worker.model, tokens, rebuilt=False) + HEAD_BYTES + grads
    rebuilt = kept_bytes(worker.model, tokens) + HEAD_BYTES + grads
    assert rebuilt < plain
    worker.device = torch.device("cuda")
    free = [0]
    monkeypatch.setattr(worker_mod, "available_bytes", lambda device: free[0])
    try:
        with torch.enable_grad():
            for room, rebuild, checkpoints in ((plain, False, False), ((plain + rebuilt) // 2, True, False),
                                               (rebuilt // 2, True, True)):
                free[0] = int(room / worker_mod.AUTO_FRACTION) + 1
                on = worker._checkpoint_pass(tokens, keys)
                assert worker._rebuild is rebuild and bool(on) is checkpoints, (room, rebuild, checkpoints)
            worker.activation_checkpointing = "off"
            worker._checkpoint_pass(tokens, keys)
            assert worker._rebuild
    finally:
        worker.device = torch.device("cpu")
