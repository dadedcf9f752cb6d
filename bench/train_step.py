"""LoRA training step on a model of --shape (default Qwen3-8B): Ember vs HF transformers + PEFT, one run.

Each configuration runs forward_backward (cross_entropy) + optim_step over 8 sequences x 2048
tokens in ONE pass:

* ember-1     one adapter (bank of 1 slot)
* ember-8     8 adapters, one sequence each (bank of 32 slots, all 32 filled)
* ember-32x1  one adapter used, bank of 32 slots all filled (cost of configured slots)
* ember-1u    one adapter that also adapts the LM head (Tinker's default ``train_unembed``)
* ember-par   one adapter on an engine of --nproc processes with --ep expert or --tp tensor
              parallelism (one GPU each; gloo on the CPU), the whole batch in one pass; per-GPU tokens/s and MFU, and the
              time in collectives per step (NCCL kernels of one profiled step); runs first, in its
              own processes, before the one-process configurations take the GPU
* hf-peft     transformers + PEFT, same weights and batch, LoRA on the same weights as Ember's
              attn+mlp adapter (gradient checkpointing: it does not fit in memory without it);
              skipped, with the reason printed, where the installed transformers lacks the family

With --full, full fine-tuning instead (every weight of a run's own copy of the model; the base
model stays loaded beside it, as in a served engine):

* full-none   Ember's rank-0 run, fp32 master weights and Adam moments on the GPU
* full-host   the same with --optimizer-offload host (pinned host memory, streamed in chunks)
* full-host-gN  the same with --optimizer-device-gib N: the first N GiB of the state stay on the GPU,
              the rest streams (e.g. full-host-g80)
* full-disk   the same with --optimizer-offload disk:DIR (DIR: --offload-dir)
* torch-full  plain PyTorch on the same model code: the weights trained in place (bf16), fused
              torch.optim.AdamW with its state resident on the GPU, clip_grad_norm_; no second copy
              of the weights (the fastest thing a plain-PyTorch user runs; bf16 moments)

Each full configuration reports the optimizer step's share of the step (``optim_s``); MFU counts
6·N·T + attention.

Prints step time, tokens/s, peak and activation memory, MFU (4·N·T + attention FLOPs at 790
TFLOP/s), and writes a JSON (and with --profile a torch.profiler table) under --out;
--sync-points lists where one ember-1 step makes the host wait for the GPU. --shape takes every shape of
bench/common.py (the families' full-size or layer-reduced shapes, and tiny-* CPU smoke shapes). Run:

    python bench/train_step.py --out /tmp/bench
    python bench/train_step.py --shape glm-4.7-flash --micro 4 --out /tmp/bench   # see its shape's note
    python bench/train_step.py --shape tiny-olmo3 --seqs 2 --seq-len 16 --warmup 0 --iters 1   # CPU smoke test
    python bench/train_step.py --shape qwen3-30b-a3b --nproc 2 --ep 2 --only ember-par,ember-1 --micro 2 --out /tmp/b
    python bench/train_step.py --full --shape qwen3-8b --only full-host,torch-full --out /tmp/b
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import shutil
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    PEAK_BF16_FLOPS,
    SHAPES,
    MemoryMeter,
    compile_seconds,
    full_train_flops,
    hardware_line,
    hf_baseline_unavailable,
    hf_model_like,
    median,
    peft_model_like,
    random_ember_model,
    run_ranks,
    sync,
    sync_points,
    time_steps,
    token_vocab,
    train_flops,
)
from ember.core.adapters import LoraConfig
from ember.core.optim import AdamParams
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
HP = AdamParams(learning_rate=1e-4)


def ember_model(hf_cfg: dict):
    """Random weights (std 0.02, norms at identity) in DTYPE; the parameters a family keeps in fp32
    (router correction biases) stay fp32."""
    return random_ember_model(hf_cfg, DEVICE, DTYPE, seed=0)


def make_batch(vocab: int, n_seq: int, seq_len: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, seq_len + 1) for _ in range(n_seq)]


def requests(slots: list[int], seqs: list[np.ndarray]) -> list[ForwardBackwardInput]:
    per = {s: [] for s in slots}
    for i, seq in enumerate(seqs):
        per[slots[i % len(slots)]].append(
            Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(len(seq) - 1, np.float32)})
        )
    return [ForwardBackwardInput(s, d, "cross_entropy") for s, d in per.items() if d]


def gpu_idle(prof, top: int = 20) -> str:
    """Where the GPU waited in a profiled step: its kernels' span against their busy time, and the
    longest gaps between one kernel's end and the next one's start, with the kernels on each side
    (a gap after a host wait, or where the host launches slower than the GPU runs)."""
    from torch.autograd import DeviceType

    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if not kernels:
        return "no GPU kernels profiled"
    gaps, end, busy, last = [], kernels[0].time_range.start, 0, kernels[0]
    for k in kernels:  # the union of the kernels' intervals (concurrent kernels count once)
        if k.time_range.start > end:
            gaps.append((k.time_range.start - end, last.name, k.name))
        busy += max(0, k.time_range.end - max(k.time_range.start, end))
        if k.time_range.end > end:
            end, last = k.time_range.end, k
    span = end - kernels[0].time_range.start
    head = (f"GPU: {len(kernels)} kernels over {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle "
            f"{(span - busy) / 1e3:.1f} ms in {len(gaps)} gaps ({sum(g > 20 for g, _, _ in gaps)} over 20 us)")
    lines = [head]
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap:8.0f} us  after {before[:60]}  before {after[:60]}")
    return "\n".join(lines)


def run_ember(model, hf_cfg, seqs, n_adapters: int, bank_slots: int, fill: int, rank: int, warmup, iters,
              profile_dir=None, targets=("attn", "mlp"), micro: int = 1, sync_check: bool = False):
    worker = Worker(model, max_adapters=bank_slots, max_rank=max(64, rank))
    config = LoraConfig(rank=rank, alpha=32.0, targets=frozenset(targets))
    slots = [worker.create_adapter(LoraConfig(rank=rank, alpha=32.0, targets=config.targets, seed=i)) for i in range(fill)]
    used = slots[:n_adapters]
    # micro > 1: the batch as several forward_backward calls whose gradients accumulate (Tinker's
    # chunked forward_backward), then one optim_step per adapter
    n = len(seqs) // micro
    parts = [requests(used[i * len(used) // micro :] if len(used) > 1 else used, seqs[i * n : (i + 1) * n])
             for i in range(micro)]
    losses = []
    # the layers auto checkpointing chose in each pass (the memory split of the report)
    decisions, decide = [], worker._checkpoint_pass

    def spied(*args, **kwargs):
        decisions.append(decide(*args, **kwargs))
        return decisions[-1]

    worker._checkpoint_pass = spied

    def step():
        total = 0.0
        for reqs in parts:
            outs = worker.forward_backward(reqs)
            total += sum(o.metrics["loss:sum"] for o in outs)
        losses.append(total)
        for s in used:
            worker.optim_step(s, HP)

    gc.collect()
    meter = MemoryMeter()
    meter.start()
    times = time_steps(step, warmup, iters)
    mem = meter.stop()
    compiled = compile_seconds()
    if compiled:
        print(f"    torch.compile so far: {compiled.get('total', 0):.1f} s "
              f"(backend {compiled.get('backend', 0):.1f} s)", flush=True)
    if sync_check:
        waits = sync_points(step)
        print(f"    host waits for the GPU in one step: {sum(n for _, n in waits)}", flush=True)
        for where, n in waits:
            print(f"      {n:4d}  {where}", flush=True)
    if profile_dir is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            step()
            sync()
        averages = prof.key_averages()
        # kernels by their own GPU time (where the step goes), then operators with their children,
        # then operators by input shapes (which tensor an elementwise share comes from)
        table = averages.table(sort_by="self_cuda_time_total", row_limit=60)
        nested = averages.table(sort_by="cuda_time_total", row_limit=40)
        shapes = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cuda_time_total", row_limit=150, max_shapes_column_width=90)
        idle = gpu_idle(prof)
        (profile_dir / f"profile_ember_{n_adapters}x{bank_slots}.txt").write_text(
            idle + "\n\n" + table + "\n\n" + nested + "\n\n" + shapes)
        trace = profile_dir / f"trace_ember_{n_adapters}x{bank_slots}.json"
        prof.export_chrome_trace(str(trace))  # the timeline, gzipped (chrome://tracing, Perfetto)
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        print(idle)
        print(table[:6000])
        print(shapes[:9000])
    trainable = worker.adapter(used[0]).num_parameters()
    for s in list(slots):
        worker.free_adapter(s)
    return {
        "step_s": median(times),
        "times": times,
        **mem,
        "first_loss_per_token": losses[0] / sum(len(s) - 1 for s in seqs),
        "trainable_params_per_adapter": trainable,
        "checkpointed_layers": _layers(decisions[-1], len(model.model.layers)) if decisions else 0,
        "compile_s": compiled,
    }


def _layers(decision, n_layers: int) -> int:
    """How many layers a ``Worker._checkpoint_pass`` decision checkpoints."""
    return n_layers if decision is True else 0 if decision is False else len(decision)


def _parallel_rank(rank: int, world: int, args, hf_cfg, seqs) -> dict | None:
    from ember.dist.mesh import Parallel
    from ember.dist.parallelize import parallelize
    from ember.engine.ranks import FanOut, follow
    from ember.engine.sharded import ShardedWorker

    par = Parallel(args.ep, args.tp)
    device = f"cuda:{rank}" if DEVICE == "cuda" else "cpu"
    model = random_ember_model(hf_cfg, device, DTYPE, seed=0, parallelize=lambda m: parallelize(m, par))
    worker = ShardedWorker(model, par, max_adapters=1, max_rank=max(64, args.rank))
    if rank:
        follow(worker)
        return None
    fan = FanOut(worker)
    slot = fan.create_adapter(LoraConfig(rank=args.rank, alpha=32.0, targets=frozenset(("attn", "mlp"))))
    reqs = requests([slot], seqs)
    losses = []

    def step():
        losses.append(sum(o.metrics["loss:sum"] for o in fan.forward_backward(reqs)))
        fan.optim_step(slot, HP)

    meter = MemoryMeter()
    meter.start()
    times = time_steps(step, args.warmup, args.iters)
    mem = meter.stop()
    comm_s = None
    if DEVICE == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            sync()
        comm_s = sum(e.self_device_time_total for e in prof.key_averages() if "nccl" in e.key.lower()) / 1e6
    fan.stop()
    return {"step_s": median(times), "times": times, **mem, "comm_s_per_step": comm_s, "gpus": world,
            "first_loss_per_token": losses[0] / sum(len(s) - 1 for s in seqs)}


def run_parallel(args, hf_cfg, seqs) -> dict:
    """ember-par: the step on --nproc processes (rank 0 drives, the others follow)."""
    if args.ep == 1 and args.tp == 1:
        raise SystemExit("ember-par needs --ep or --tp above 1")
    return run_ranks(args.nproc, _parallel_rank, args, hf_cfg, seqs)


def run_full(model, seqs, offload: str, warmup, iters, micro: int = 1, device_gib: float = 0.0):
    """Ember full fine-tuning: a rank-0 run beside the base model, ``micro`` forward_backward calls
    and one optim_step per step (the optimizer step timed on its own as ``optim_s``)."""
    worker = Worker(model, max_adapters=1, full_finetune=True, optimizer_offload=offload,
                    optimizer_device_bytes=int(device_gib * 2**30))
    slot = worker.create_adapter(LoraConfig(rank=0))
    n = len(seqs) // micro
    parts = [requests([slot], seqs[i * n : (i + 1) * n]) for i in range(micro)]
    losses, optim = [], []

    def step():
        losses.append(sum(o.metrics["loss:sum"] for reqs in parts for o in worker.forward_backward(reqs)))
        sync()
        t0 = time.perf_counter()
        worker.optim_step(slot, HP)
        sync()
        optim.append(time.perf_counter() - t0)

    return _timed_full(step, warmup, iters, losses, optim, seqs, lambda: worker.free_adapter(slot),
                       trainable=sum(p.numel() for p in worker.full.get(slot).tensors().values()),
                       offload=offload, state_gib={k: v / 2**30 for k, v in
                                                   worker.full.get(slot).optimizer.state_bytes().items()})


def run_torch_full(model, seqs, warmup, iters):
    """Plain PyTorch full fine-tuning on the same model code (see the module doc)."""
    from ember.core.full_ft import trainable_parameters

    params = [p for _, p in trainable_parameters(model)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, fused=DEVICE == "cuda")
    worker = Worker(model, max_adapters=1)
    losses, optim = [], []
    batch = [requests([0], seqs)[0]]

    def step():
        # the base model's slot 0 "forward only" pass would run under no_grad: run the worker's
        # pass by hand with grad on (the same packed forward and chunked logprobs)
        seq_in = [d.tokens for d in batch[0].datums]
        targets = [torch.as_tensor(d.loss_inputs["target_tokens"])[:, None] for d in batch[0].datums]
        per_seq, _ = worker._pass(seq_in, [(0, True)] * len(seq_in), targets, None, None)
        loss = -torch.cat(per_seq).sum()
        loss.backward()
        losses.append(float(loss))
        sync()
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        optim.append(time.perf_counter() - t0)

    def release():
        opt.state.clear()
        for p in params:
            p.requires_grad_(False)
            p.grad = None

    return _timed_full(step, warmup, iters, losses, optim, seqs, release, trainable=sum(p.numel() for p in params))


def _timed_full(step, warmup, iters, losses, optim, seqs, release, **extra) -> dict:
    gc.collect()
    meter = MemoryMeter()
    meter.start()
    try:
        times = time_steps(step, warmup, iters)
    finally:
        mem = meter.stop()
        release()
        gc.collect()
    return {"step_s": median(times), "times": times, **mem, "optim_s": median(optim[warmup:]),
            "first_loss_per_token": losses[0] / sum(len(s) - 1 for s in seqs), **extra}


def run_hf(model, hf_cfg, seqs, rank, warmup, iters, checkpointing=True):
    # the same weights (shared with Ember, same names), so both run the same model; LoRA on the
    # weights an Ember attn+mlp adapter adapts (MoE experts through PEFT's target_parameters)
    moe = any(t.num_experts for t in model.lora_targets())
    hf = hf_model_like(model, hf_cfg, DTYPE, DEVICE, "grouped_mm" if moe and DEVICE == "cuda" else None)
    if checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf.enable_input_require_grads()
    pm = peft_model_like(hf, model, rank)
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, fused=DEVICE == "cuda")
    ids = torch.tensor(np.stack([s[:-1] for s in seqs]), device=DEVICE)
    labels = torch.tensor(np.stack([s[1:] for s in seqs]), device=DEVICE)
    losses = []

    def step():
        with torch.autocast(DEVICE, dtype=DTYPE, enabled=DEVICE == "cuda"):
            logits = pm(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        losses.append(float(loss))
        opt.step()
        opt.zero_grad(set_to_none=True)

    gc.collect()
    meter = MemoryMeter()
    meter.start()
    times = time_steps(step, warmup, iters)
    mem = meter.stop()
    trainable = sum(p.numel() for p in params)
    gc.collect()
    return {
        "step_s": median(times),
        "times": times,
        **mem,
        "first_loss_per_token": losses[0],
        "trainable_params_per_adapter": trainable,
        "gradient_checkpointing": checkpointing,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro", type=int, default=1, help="Ember: split the batch into this many forward_backward calls")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--only", default="ember-1,ember-8,ember-32x1,hf-peft", help="comma list of configurations")
    ap.add_argument("--profile", action="store_true", help="write a torch.profiler table of one Ember step")
    ap.add_argument("--sync-points", action="store_true",
                    help="list where one Ember step makes the host wait for the GPU (torch.cuda.set_sync_debug_mode)")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--nproc", type=int, default=2, help="ember-par: processes (GPUs) of the engine")
    ap.add_argument("--ep", type=int, default=1, help="ember-par: expert-parallel degree (divides --nproc)")
    ap.add_argument("--tp", type=int, default=1, help="ember-par: tensor-parallel degree (divides --nproc)")
    ap.add_argument("--no-rebuild", action="store_true",
                    help="keep every saved activation (ember.core.rebuild off): the baseline of its cost")
    ap.add_argument("--full", action="store_true", help="full fine-tuning configurations (see the module doc)")
    ap.add_argument("--offload-dir", default="/tmp/ember-optimizer", help="full-disk: the folder of its files")
    args = ap.parse_args()
    if args.full and args.only == ap.get_default("only"):
        args.only = "full-none,full-host,torch-full"
    args.out.mkdir(parents=True, exist_ok=True)
    if args.no_rebuild:
        from ember.core import rebuild

        rebuild.enabled = False
    hf_cfg = SHAPES[args.shape]
    torch.manual_seed(0)
    print(f"hardware: {hardware_line()}; torch {torch.__version__}")
    seqs = make_batch(token_vocab(hf_cfg), args.seqs, args.seq_len)
    tokens = args.seqs * args.seq_len
    flops = (full_train_flops if args.full else train_flops)(hf_cfg, [args.seq_len] * args.seqs)
    print(f"shape {args.shape}: {tokens} tokens/step, {flops / 1e12:.1f} TFLOP/step model FLOPs")
    results = {}
    names = args.only.split(",")
    if "ember-par" in names:  # before this process puts a model on the GPU
        r = run_parallel(args, hf_cfg, seqs)
        results["ember-par"] = _report("ember-par", r, tokens, flops)
        names.remove("ember-par")
    model = ember_model(hf_cfg) if names else None
    plan = {
        "ember-1": lambda: run_ember(model, hf_cfg, seqs, 1, 1, 1, args.rank, args.warmup, args.iters,
                                     args.out if args.profile else None, micro=args.micro,
                                     sync_check=args.sync_points),
        "ember-8": lambda: run_ember(model, hf_cfg, seqs, 8, 32, 32, args.rank, args.warmup, args.iters,
                                     args.out if args.profile else None, micro=args.micro),
        "ember-32x1": lambda: run_ember(model, hf_cfg, seqs, 1, 32, 32, args.rank, args.warmup, args.iters),
        "ember-1u": lambda: run_ember(model, hf_cfg, seqs, 1, 1, 1, args.rank, args.warmup, args.iters,
                                      targets=("attn", "mlp", "unembed")),
        "hf-peft": lambda: run_hf(model, hf_cfg, seqs, args.rank, args.warmup, args.iters),
        "full-none": lambda: run_full(model, seqs, "none", args.warmup, args.iters, args.micro),
        "full-host": lambda: run_full(model, seqs, "host", args.warmup, args.iters, args.micro),
        "full-disk": lambda: run_full(model, seqs, f"disk:{args.offload_dir}", args.warmup, args.iters, args.micro),
        "torch-full": lambda: run_torch_full(model, seqs, args.warmup, args.iters),
    }
    for name in names:
        if name.startswith("full-host-g"):
            plan[name] = partial(run_full, model, seqs, "host", args.warmup, args.iters, args.micro,
                                 float(name.removeprefix("full-host-g")))
    hf_skip = hf_baseline_unavailable(hf_cfg)
    for name in names:
        if name == "hf-peft" and hf_skip:
            print(f"{name:12s} skipped: {hf_skip}", flush=True)
            results[name] = {"skipped": hf_skip}
            continue
        try:
            r = plan[name]()
        except Exception as e:  # noqa: BLE001 - report and go on: one failing configuration must not hide the others
            traceback.print_exc()
            r = {"error": f"{type(e).__name__}: {e}"}
        results[name] = _report(name, r, tokens, flops)
        gc.collect()  # the configuration's worker (its optimizer state, a reference cycle) before the next
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    out = {"hardware": hardware_line(), "torch": torch.__version__, "shape": args.shape, "tokens": tokens,
           "model_tflop": flops / 1e12, "results": results}
    (args.out / f"train_step_{args.shape}.json").write_text(json.dumps(out, indent=2))
    print("\n| config | GPUs | step (s) | tokens/s per GPU | MFU | peak GiB | activations GiB | collectives (s) "
          "| optimizer step (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "step_s" in r:
            comm, opt = r.get("comm_s_per_step"), r.get("optim_s")
            print(f"| {name} | {r.get('gpus', 1)} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {100 * r['mfu']:.1f}% | "
                  f"{r['peak_gib']:.1f} | {r['activation_gib']:.1f} | {'' if comm is None else f'{comm:.3f}'} "
                  f"| {'' if opt is None else f'{opt:.3f}'} |")
        elif "skipped" in r:
            print(f"| {name} | skipped: {r['skipped'][:80]} |")
        else:
            print(f"| {name} | error: {r['error'][:80]} |")


def _report(name: str, r: dict, tokens: int, flops: float) -> dict:
    """Add tokens/s and MFU per GPU to a configuration's result and print its line."""
    if "step_s" in r:
        gpus = r.get("gpus", 1)
        r["tokens_per_s"] = tokens / r["step_s"] / gpus
        r["mfu"] = flops / r["step_s"] / PEAK_BF16_FLOPS / gpus
        print(f"{name:12s} step {r['step_s']:.3f}s  {r['tokens_per_s']:8.0f} tok/s/GPU  MFU {100 * r['mfu']:5.1f}%  "
              f"peak {r['peak_gib']:.1f} GiB  activations {r['activation_gib']:.1f} GiB  "
              f"loss/token {r['first_loss_per_token']:.4f}"
              + (f"  checkpointed layers {r['checkpointed_layers']}" if "checkpointed_layers" in r else ""), flush=True)
    return r


if __name__ == "__main__":
    main()
