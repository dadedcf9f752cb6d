"""Bodies of the expert-parallel tests, run on every rank (:mod:`tests.parallel.launch`).

Each rank loads its block of experts, runs its share of a batch that mixes adapters, and checks
against the single-process model, which every rank also builds (fp32, tolerance 1e-5)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ember.core.adapters import AdapterBank, LoraConfig
from ember.core.batch import pack
from ember.core.layers.attention import PackedAttention
from ember.core.layers.moe import Experts, RoutingRecord
from ember.core.loading import load_model
from ember.core.logprobs import token_logprobs
from ember.core.models.base import ForwardContext
from ember.core.optim import AdamParams
from ember.dist import adapters as dist_adapters
from ember.dist import comm, fsdp
from ember.dist.expert_parallel import set_mode
from ember.dist.mesh import Parallel
from ember.dist.parallelize import parallelize
from tests.lora_helpers import randomise

CONFIGS = [
    LoraConfig(rank=4, alpha=8.0, seed=1),
    LoraConfig(rank=8, alpha=16.0, seed=2, targets=frozenset({"mlp"})),
    LoraConfig(rank=2, alpha=4.0, seed=3, targets=frozenset({"attn", "mlp", "unembed"})),
]
TOL = dict(atol=1e-5, rtol=1e-5)


def _sequences(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 24, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lengths]


def _forward(model, bank, seqs, keys, step_keys=None, routing=None, chunk=16):
    """Per-sequence target logprobs (grad-tracking) of ``seqs`` packed by ``keys``."""
    batch = pack([s[:-1] for s in seqs], keys, "cpu") if seqs else None
    if batch is None:  # a rank with no sequences still enters every collective
        batch = pack([[0]], [keys and keys[0] or 0], "cpu")
    attention = PackedAttention(batch.doc_lengths, torch.device("cpu"))
    ctx = ForwardContext(
        positions=batch.positions,
        attend=lambda layer, q, k, v, spec, scale: attention(q, k, v, spec, scale),
        lora=bank.route(batch.groups, step_keys=step_keys),
        seq_lens=batch.doc_lengths,
        routing=routing(batch) if routing else None,
    )
    hidden = model.hidden_states(batch.input_ids, ctx)
    targets = batch.gather([torch.tensor(s[1:]) for s in seqs]) if seqs else torch.zeros(1, dtype=torch.long)
    lp = token_logprobs(hidden, model.unembed_weight, targets, lora=ctx.lora, softcap=model.final_logit_softcap,
                        chunk=chunk, vocab=model.vocab_split)
    return lp, batch


def _loss(per_seq: list[torch.Tensor]) -> torch.Tensor:
    return sum(lp.sum() * (1 + i % 3) for i, lp in enumerate(per_seq))


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    """``|got - want| / |want| <= rtol`` (L2 over the tensor: gradients, whose scale varies)."""
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e}"


def expert_parallel_step(
    rank: int, world: int, model_dir: str, ep: int, replay_first_experts: bool = False, grad_rtol: float = 1e-5,
    tp: int = 1, expert_fsdp: bool = False, seed: int = 5,
):
    """Logprobs, LoRA gradients (mixed adapters, a forward-only one, the base model), one clipped
    AdamW step and the gathered checkpoint tensors equal one process's; then a decode-style pass
    through the all-gather dispatcher equals the all-to-all one.

    ``expert_fsdp``: the experts also sharded over the ranks that hold the same ones
    (:func:`ember.dist.fsdp.shard_expert_weights`); each rank must then hold ``1/efsdp`` of its
    block between passes and the whole block inside every :meth:`Experts.compute`.

    ``seed``: of the batch's sequences (their lengths decide where sequence parallelism splits
    the pass: at a document boundary or inside a document).

    Logprobs and weights: elementwise 1e-5. Gradients: relative L2 error ``grad_rtol``."""
    ref = load_model(model_dir, "cpu", torch.float32)
    ref_bank = AdapterBank(ref, max_adapters=4, max_rank=16)
    slots = [ref_bank.create(c).slot for c in CONFIGS]
    for i, s in enumerate(slots):
        randomise(ref_bank.get(s), seed=10 + i, scale=0.05)

    par = Parallel(ep, tp)
    dp, dp_rank = par.layout.dp, par.layout.dp_rank
    model = load_model(model_dir, "cpu", torch.float32, parallelize=lambda m: parallelize(m, par))
    lookups = _check_host_tables(ref, model, par) if ep > 1 else []
    if expert_fsdp:
        _watch_compute()
        assert fsdp.shard_expert_weights(model, par) > 0
        _assert_sharded(model, par.layout.efsdp)
    bank = AdapterBank(model, max_adapters=4, max_rank=16)
    if tp > 1:  # the LM head split by vocabulary
        vocab = model.vocab_split
        assert (vocab.start, vocab.stop) == par.layout.tp_range(ref.config.vocab_size)
        assert vocab.local(model.unembed_weight).shape[0] == ref.config.vocab_size // tp
    for c, s in zip(CONFIGS, slots):
        a = bank.create(c)
        assert a.slot == s
        with torch.no_grad():
            for name, t in dist_adapters.local_tensors(ref_bank.get(s).tensors(), par).items():
                a.tensors()[name].copy_(t)

    vocab = model.config.vocab_size
    seqs = _sequences(vocab, 9, seed=seed)
    # slots 1-3 train, slot 2 also appears forward-only, slot 0 is the base model
    keys = [(s, True) for s in (1, 2, 3, 1, 3)] + [(2, False), (0, False), (0, False), (1, True)]
    step_keys = sorted(set(keys))
    routing = None
    if replay_first_experts:
        # R3 replay of experts 0..k-1 everywhere: every row goes to rank 0's experts, the other
        # ranks of the expert group receive none
        k = next(iter(ref.moe_routers().values())).top_k
        layers = sorted(ref.moe_routers())

        def routing(batch):
            T = batch.num_tokens
            fixed = torch.arange(k).expand(T, k)
            return RoutingRecord(replay={layer: fixed for layer in layers}, record={})

    lp_ref, batch_ref = _forward(ref, ref_bank, seqs, keys, routing=routing)
    per_ref = batch_ref.split(lp_ref)
    _loss(per_ref).backward()

    mine = [i for i in range(len(seqs)) if i % dp == dp_rank]
    rows = []  # under TP, sequence parallelism: this rank's slice of the pass's tokens
    hook = model.model.embed_tokens.register_forward_hook(lambda mod, args, out: rows.append(out.shape[0]))
    lp, _ = _forward(model, bank, [seqs[i] for i in mine], [keys[i] for i in mine], step_keys, routing)
    hook.remove()
    if tp > 1:
        total = sum(len(seqs[i]) - 1 for i in mine) or 1
        assert rows == [len(torch.arange(total).tensor_split(tp)[par.layout.tp_rank])], (rows, total)
    assert all(c.calls for c in lookups)  # the n-gram rows came through the sharded lookup
    if expert_fsdp:  # freed after the forward: the backward gathers the blocks again
        _assert_sharded(model, par.layout.efsdp)
    sizes = [sum(len(seqs[i]) - 1 for i in range(len(seqs)) if i % dp == r) for r in range(dp)]
    if not mine:
        lp = lp[:0]
    full = comm.gather_rows(lp, sizes, par.dp_group)
    # gathered rows: share by share, each share's sequences in its packed order
    per_seq, cursor = {}, 0
    for r in range(dp):
        ids = [i for i in range(len(seqs)) if i % dp == r]
        local_keys = [keys[i] for i in ids]
        order = sorted(range(len(ids)), key=lambda j: local_keys[j])
        for j in order:
            n = len(seqs[ids[j]]) - 1
            per_seq[ids[j]] = full[cursor : cursor + n]
            cursor += n
    per = [per_seq[i] for i in range(len(seqs))]
    for got, want in zip(per, per_ref):
        torch.testing.assert_close(got, want, **TOL)
    _loss(per).backward()
    if expert_fsdp:
        _assert_sharded(model, par.layout.efsdp)

    trained = [bank.get(s) for s in slots]
    dist_adapters.reduce_gradients(trained, par)
    for s in slots:
        got = dist_adapters.full_tensors(bank.get(s).grads(), par)
        want = ref_bank.get(s).grads()
        assert set(got) == set(want)
        for name in want:
            _close(got[name], want[name], grad_rtol, name)
    if ep > 1:
        assert any(".experts." in n for n in ref_bank.get(1).grads())

    # eps=1: the update stays linear in the gradient (with eps~0 it is ±lr, and a gradient within
    # rounding of zero could flip its sign)
    hp = AdamParams(learning_rate=1e-2, eps=1.0, grad_clip_norm=0.5)
    for s in slots:
        want = ref_bank.get(s).optimizer.step(hp)["grad_norm"]
        got = dist_adapters.optim_step(bank.get(s), hp, par)["grad_norm"]
        assert abs(got - want) <= max(1e-5, grad_rtol) * max(1.0, want), (got, want)
        values = dist_adapters.full_tensors(bank.get(s).tensors(), par)
        for name, t in ref_bank.get(s).tensors().items():
            torch.testing.assert_close(values[name], t, **TOL)

    if ep == 1:
        if tp > 1:  # sampling keeps plain TP: every rank of a group runs the same sequences
            same, skeys = [seqs[0][:7], seqs[1][:4]], [(1, False), (3, False)]
            with torch.no_grad():
                set_mode(model, "replicated")
                plain, _ = _forward(model, bank, same, skeys, sorted(set(skeys)))
                set_mode(model, "all_to_all")
                single, _ = _forward(ref, ref_bank, same, skeys)
            torch.testing.assert_close(plain, single, **TOL)
        return
    # decode: every rank holds the same number of tokens, dispatched by all-gather + reduce-scatter
    decode = [[(7 * dp_rank + j) % vocab for j in range(6)], seqs[0][:3] * 2]  # the same within a TP group
    dkeys = [(1, False), (3, False)]
    with torch.no_grad():
        a2a, _ = _forward(model, bank, decode, dkeys, sorted(set(dkeys)))
        set_mode(model, "gather")
        gathered, _ = _forward(model, bank, decode, dkeys, sorted(set(dkeys)))
        set_mode(model, "all_to_all")
        single, _ = _forward(ref, ref_bank, decode, dkeys)
    torch.testing.assert_close(gathered, a2a, **TOL)
    torch.testing.assert_close(gathered, single, **TOL)

    # sampling: every rank runs the same sequences; experts' shares summed by an all-reduce
    # (with expert FSDP: gathered once for the whole run, as ShardedWorker.sample does)
    same = [seqs[0][:7], seqs[1][:4]]
    with torch.no_grad():
        with fsdp.unsharded(model):
            if expert_fsdp:
                _assert_sharded(model, 1)
            set_mode(model, "replicated")
            replicated, _ = _forward(model, bank, same, dkeys, sorted(set(dkeys)))
            replicated2, _ = _forward(model, bank, same, dkeys, sorted(set(dkeys)))
            set_mode(model, "all_to_all")
            if expert_fsdp:  # still gathered: not freed after each pass
                _assert_sharded(model, 1)
        single, _ = _forward(ref, ref_bank, same, dkeys)
    torch.testing.assert_close(replicated, single, **TOL)
    torch.testing.assert_close(replicated2, single, **TOL)
    if expert_fsdp:
        _assert_sharded(model, par.layout.efsdp)
        assert _COMPUTE_SAW and all(_COMPUTE_SAW), "an Experts.compute ran on a sharded block"


_COMPUTE_SAW: list[bool] = []  # per Experts.compute call: did it see its whole expert block?


def _watch_compute() -> None:
    """Record, for every :meth:`Experts.compute` call of this process (the reference model's too,
    whose weights are whole), whether its weights were gathered: plain tensors holding the block."""
    orig = Experts.compute

    def compute(self, *args, **kwargs):
        whole = all(not isinstance(p, DTensor) and p.shape[0] == self.num_experts
                    for p in (self.gate_up_proj, self.down_proj))
        _COMPUTE_SAW.append(whole)
        return orig(self, *args, **kwargs)

    Experts.compute = compute


def _assert_sharded(model, efsdp: int) -> None:
    """Every expert weight holds ``1/efsdp`` of its block here (``efsdp`` 1: gathered whole), and a
    sharded one keeps no gathered copy (FSDP frees the gathered storage)."""
    n = 0
    for mod in model.modules():
        if not isinstance(mod, Experts):
            continue
        state = fully_shard.state(mod)
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]  # torch < 2.13: one
        gathered = {id(fp._unsharded_param): fp for g in groups for fp in g.fsdp_params if hasattr(fp, "_unsharded_param")}
        for p in (mod.gate_up_proj, mod.down_proj):
            block = p.numel() * p.element_size()  # a DTensor's: its global shape's
            if efsdp == 1:
                assert not isinstance(p, DTensor) and p.untyped_storage().nbytes() >= block
                continue
            assert isinstance(p, DTensor), type(p)
            held = p.to_local().untyped_storage().nbytes()
            assert held * efsdp == block, (held, block, efsdp)
            assert all(fp._unsharded_param.untyped_storage().nbytes() == 0 for fp in gathered.values())
        n += 1
    assert n


class _Counted:
    def __init__(self, lookup):
        self.lookup, self.calls = lookup, 0

    def __call__(self, *args):
        self.calls += 1
        return self.lookup(*args)


def _check_host_tables(ref, model, par: Parallel) -> list[_Counted]:
    """Each rank holds, in host memory, its block of ``rows / ep`` rows of every n-gram table (equal
    to the one-process table's), and its lookup returns exactly the one-process rows of any ids, also
    of none (while the others ask). Returns the layers' lookups, counting their calls."""
    from ember.core.layers.ngram_memory import NGramEmbedding
    from ember.dist.host_table import ShardedRows

    ep, ep_rank = par.layout.ep, par.layout.ep_rank
    whole = {n: m.ngram_embedding.weight for n, m in ref.named_modules() if isinstance(m, NGramEmbedding)}
    counted = []
    for name, mod in model.named_modules():
        if not isinstance(mod, NGramEmbedding):
            continue
        table, full = mod.ngram_embedding.weight, whole[name]
        n = full.shape[0] // ep
        assert table.device.type == "cpu" and table.shape[0] * ep == full.shape[0], (table.shape, full.shape)
        assert torch.equal(table, full[ep_rank * n : (ep_rank + 1) * n])
        assert isinstance(mod.lookup, ShardedRows)
        g = torch.Generator().manual_seed(par.rank)
        for size in (37, 0 if par.rank % 2 else 5):
            ids = torch.randint(0, full.shape[0], (size,), generator=g)
            assert torch.equal(mod.lookup(table, ids, False), full[ids])
        mod.lookup = _Counted(mod.lookup)
        counted.append(mod.lookup)
    assert len(counted) == len(whole)
    return counted


def expert_fsdp_step(rank: int, world: int, model_dir: str, tmp: str, ep: int):
    """Expert FSDP, in one launch: :func:`expert_parallel_step`; the engine's worker
    (``ShardedWorker.from_pretrained(expert_fsdp=True)``, rank 0 a ``FanOut``) against one process,
    sampling included; then :func:`ember.dist.fsdp.shard_modules` on a trainable module: after a
    backward each rank holds its piece of the SUM over the group of every rank's gradient (no
    mean), and a step on the pieces gives the next forward the updated weights."""
    from pathlib import Path

    from ember.engine.ranks import FanOut, follow
    from ember.engine.sharded import ShardedWorker
    from ember.engine.worker import Worker
    from tests.parallel import worker_cases

    expert_parallel_step(rank, world, model_dir, ep, expert_fsdp=True)

    kw = worker_cases.KW
    worker = ShardedWorker.from_pretrained(model_dir, Parallel(ep), "cpu", torch.float32, expert_fsdp=True, **kw)
    efsdp = worker.parallel.layout.efsdp
    _assert_sharded(worker.model, efsdp)
    if rank:
        follow(worker)
    else:
        fan, ref = FanOut(worker), Worker.from_pretrained(model_dir, "cpu", torch.float32, **kw)
        try:
            worker_cases._check(fan, ref, Path(tmp))
        finally:
            fan.stop()
    _assert_sharded(worker.model, efsdp)  # sharded again after sampling

    group = worker.parallel.efsdp_group
    members = dist.get_process_group_ranks(group)

    def inputs(r):
        return torch.randn(3, 8, generator=torch.Generator().manual_seed(100 + r))

    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 6)
    lin = torch.nn.Linear(8, 6)
    lin.load_state_dict(ref.state_dict())
    fsdp.shard_modules([lin], group)
    assert isinstance(lin.weight, DTensor) and lin.weight.to_local().shape[0] * len(members) == 6
    for r in members:
        (ref(inputs(r)) ** 2).sum().backward()
    (lin(inputs(rank)) ** 2).sum().backward()
    for name, p in ref.named_parameters():
        got = getattr(lin, name).grad.full_tensor()
        torch.testing.assert_close(got, p.grad, **TOL)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            q = getattr(lin, name)
            q.to_local().sub_(0.1 * q.grad.to_local())
            p.sub_(0.1 * p.grad)
        torch.testing.assert_close(lin(inputs(rank)), ref(inputs(rank)), **TOL)


def inkling2_tp(rank: int, world: int, model_dir: str, tmp: str, ep: int):
    """Inkling2 under TP=2 (sequence parallelism in training passes, plain TP when sampling), in one
    launch: :func:`expert_parallel_step` (``seed`` 6: the token split of every TP group cuts a
    document, so the residual-side short convolutions read rows of the rank before); with EP=1 the
    engine's worker too (seeded sampling through the KV cache's relative attention), with 4 ranks
    the convolutions' history at TP=4 (:func:`conv_history`)."""
    from tests.parallel import worker_cases

    expert_parallel_step(rank, world, model_dir, ep, False, 1e-5, 2, False, 6)
    if ep == 1:
        worker_cases.sharded_worker_matches_one_process(rank, world, model_dir, tmp, 1, 2)
    if world == 4:
        conv_history(rank, world)


def conv_history(rank: int, world: int):
    """A short convolution over this rank's slice of the tokens and the rows before it
    (:meth:`SequenceParallel.with_history`, TP = ``world``) equals the convolution of the whole pass,
    gradients included: slices shorter than the window (history from several ranks), an empty
    slice, documents that start inside a slice or span several."""
    from ember.core.layers.short_conv import ShortConvolution
    from ember.dist.sequence_parallel import SequenceParallel

    torch.manual_seed(0)
    conv = ShortConvolution(5, 4, 0, "c")
    sp = SequenceParallel(Parallel(1, world))
    g = torch.Generator().manual_seed(1)
    for lens in ([4, 2], [3], [5, 8], [1] * 7, [2, 9, 1, 4]):
        T = sum(lens)
        x, up = torch.randn(T, 5, generator=g), torch.randn(T, 5, generator=g)
        sp.split(T)
        start, end = sp.bounds()
        mine = x[start:end].clone().requires_grad_()
        rows, window = sp.with_history(mine, lens, conv.kernel - 1)
        y = conv(rows, window)[rows.shape[0] - (end - start) :]
        (y * up[start:end]).sum().backward()
        whole = x.clone().requires_grad_()
        want = conv(whole, lens)
        (want * up).sum().backward()
        torch.testing.assert_close(y, want[start:end], **TOL)
        torch.testing.assert_close(mine.grad, whole.grad[start:end], **TOL)
