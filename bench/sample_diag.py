"""Diagnostics for the sampler on the GPU: where a decode step's time goes, and where the bf16
rollout/trainer log-probability gap comes from.

Part ``steps`` (workload a of bench/sample.py: 64 prompts x 128 tokens, one LoRA adapter; workload b
with ``--prompts 256 --adapters 8 --bank-slots 32``; ``--decode-gemm 1 [--gemm-configs F]`` with the
dense products through Ember's decode GEMM): splits the
engine's decode step into the decoder (CUDA-graph replay), log-softmax + sampling, and the host's
bookkeeping (each part timed with a device sync); times the captured graph alone with CUDA events;
and lists the GPU kernels of decode steps run without graphs (torch.profiler, ms per step).
``--group-samples G`` sends each prompt G times, one request each, as an RL client sends a group:
the G sequences share the prompt's pages (workload grpo: ``--prompts 64 --prompt-len 512
--group-samples 8``). ``--rollout-precision fp8`` runs the steps on the fp8 rollout copies.

Part ``gemm``: one layer's base GEMMs at the batch's row count, alone and with q/k/v and gate/up
fused into one product, under cuBLAS and cuBLASLt (µs and the bandwidth reached).

Part ``prefill`` (workload b's: ``--prompts 256 --adapters 8``, a bank of ``--bank-slots``, default
32): the prefill of ``--adapters`` busy adapters against one, over prompts the prefix index holds (as
bench/sample.py's timed run finds them), over unseen ones, and over the first again after each adapter
was written in place (as by an optimizer step: copied again, prompts not reused); wall time, the
engine's admission and prefill time, the engine's steps (prompt tokens, decode tokens, prompts still
prefilling, seconds), and for the first the kernels' count and device time, the operators that take
the most host time and the kernels that take the most device time.

Part ``sampling``: device-synced wall time of the sampling pieces of a step (log-softmax, the
token draw with and without top-p, the host's uniform numbers) on [64, vocab] logits.

Part ``gap``: the same 16 prompts sampled through each decode path (CUDA graphs, static shapes
without graphs, the eager decoder, the eager decoder with the PyTorch paged attention instead of the
Triton kernel); for each, |sampler - trainer| over the sampled tokens, with the trainer in bf16 and
in fp32 (same weights), and the trainer's own bf16-vs-fp32 difference on those tokens. The first
sampled token comes from the prefill pass, the rest from decode steps: both are reported.

    python bench/sample_diag.py --out $OUT                  # on the GPU
    python bench/sample_diag.py --only steps --prompts 256 --adapters 8 --bank-slots 32 --out $OUT
    python bench/sample_diag.py --only prefill --prompts 256 --adapters 8 --out $OUT
    python bench/sample_diag.py --only steps --prompts 64 --prompt-len 512 --group-samples 8 --out $OUT
    python bench/sample_diag.py --shape tiny --new 8        # CPU smoke test
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import hardware_line, random_ember_model, sync, token_vocab
from bench.sample import DEVICE, DTYPE, SHAPES, fill_adapters, make_prompts, trainer_logprobs
from ember.core.adapters import AdapterBank
from ember.core.sampling import GenerationRequest, SamplerConfig, SamplingEngine, StopRule
from ember.core.sampling import attention as sampling_attention
from ember.core.sampling.engine import EngineStats


def make_engine(model, bank, n_prompts: int, plen: int, new: int, static: bool | None, graphs: bool,
                overlap: bool = True, **options):
    page = 16
    cfg = SamplerConfig(
        max_seqs=n_prompts,
        page_size=page,
        kv_tokens=(n_prompts + 1) * (plen + new + page),
        max_prefill_tokens=max(16384, plen),
        cuda_graphs=graphs,
        static_decode=static,
        overlap_decode=overlap,
        **options,  # dependent_launch, decode_gemm, shared_prefix_attention, qkv_kernel, rollout_precision
    )
    return SamplingEngine(model, bank, cfg, max_seq_len=plen + new + page)


def requests(prompts, new: int, slot: int | list[int]) -> list[GenerationRequest]:
    """One request per prompt, on ``slot`` (or the slots of a list, round-robin)."""
    slots = slot if isinstance(slot, list) else [slot]
    return [
        GenerationRequest(p, new, [1000 + i], slot=slots[i % len(slots)], temperature=1.0, stop=StopRule())
        for i, p in enumerate(prompts)
    ]


def timed(fn, acc: list[float]):
    """Wrap ``fn`` so each call's wall time (ending in a device sync) is appended to ``acc``."""

    def run(*args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        acc.append(time.perf_counter() - t0)
        return out

    return run


def step_breakdown(model, prompts, new: int, rank: int, adapters: int = 1, bank_slots: int | None = None,
                   **options) -> dict:
    """The decode step's wall time split into decoder, draw and host; the graph's replay; and the
    GPU kernels of one step without graphs. ``adapters`` busy adapters share the rows round-robin
    (workload b: 8, in a bank of ``bank_slots`` = 32)."""
    bank = AdapterBank(model, max_adapters=bank_slots or adapters, max_rank=max(64, rank))
    slot = fill_adapters(bank, adapters, rank)
    # each step read back before the next (overlap_decode off): the step's parts are timed apart
    engine = make_engine(model, bank, len(prompts), len(prompts[0]), new, None, True, overlap=False, **options)
    reqs = requests(prompts, new, slot)
    engine.generate(reqs)  # compile + capture
    decoder, sampler = [], []
    engine._run_decoder = timed(engine._run_decoder, decoder)
    engine._sample_into = timed(engine._sample_into, sampler)
    engine.stats.step_times.clear()
    engine.generate(reqs)
    steps = [dt for b, dt in engine.stats.step_times if b == len(prompts)]
    n = len(prompts)
    # the sampler list also holds the prefill's sampling call (first); decode calls follow
    out = {
        "decode_step_ms": 1e3 * statistics.median(steps),
        "decoder_ms": 1e3 * statistics.median(decoder[-len(steps):]),
        "sample_ms": 1e3 * statistics.median(sampler[-len(steps):]),
        "rows": n,
    }
    out["host_ms"] = out["decode_step_ms"] - out["decoder_ms"] - out["sample_ms"]
    static = engine.static
    if static is not None and static.use_graphs:
        key = next(k for k in static._graphs if k[0] >= n and k[1])
        graph = static._graphs[key][0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        sync()
        out["graph_replay_ms"] = start.elapsed_time(end) / 20
        del graph
    # the timing wrappers hold bound methods of the engine: a cycle, so free its cache by collecting
    del engine, static
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    # kernels of 8 decode steps (no prefill) without graphs: GPU time per kernel, per step
    # enough new tokens that no sequence ends while later prompts still prefill (chunks of 16,384)
    short_new = 16 + -(-sum(map(len, prompts)) // 16384)
    engine = make_engine(model, bank, len(prompts), len(prompts[0]), short_new, True, False, **options)
    short = requests(prompts, short_new, slot)
    engine.generate(short)  # compile
    for r in short:
        engine.submit(r)
    engine.step()
    while engine.scheduler.waiting or engine.scheduler.prefilling:  # every row decoding
        engine.step()
    if DEVICE == "cuda":
        from torch.profiler import ProfilerActivity, profile

        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                engine.step()
            sync()
        rows = sorted(
            ((e.key, e.device_time_total / 8 / 1e3, e.count // 8) for e in prof.key_averages() if e.device_time_total),
            key=lambda r: -r[1],
        )
        total = sum(ms for _, ms, _ in rows)
        lines = [f"GPU kernels of one decode step (no graphs), total {total:.2f} ms:"]
        lines += [f"  {ms:7.3f} ms  {n:5d} calls  {name[:90]}" for name, ms, n in rows[:25]]
        table = "\n".join(lines)
        print(table, flush=True)
        out["profile_top"] = table
    while not engine.idle:
        engine.step()
    del engine, bank
    return out


def _top(events, key: str, n: int = 12) -> list[tuple[str, int, float]]:
    """The ``n`` profiler rows with the most ``key`` (µs): ``(name, count, ms)``."""
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    return [(e.key[:60], e.count, round(getattr(e, key) / 1e3, 3)) for e in rows]


def prefill_parts(model, prompts, rank: int, adapters: int, bank_slots: int, precision: str = "bf16") -> dict:
    """Workload b's prefill with ``adapters`` busy adapters against one (round-robin over the
    prompts, one request each, a bank of ``bank_slots``): the wall, admission and prefill time and
    the engine's steps of a run over prompts the prefix index holds (as ``bench/sample.py``'s timed
    run finds them), over prompts it has not seen, and over the first again after an in-place write
    to each adapter (the copy round an optimizer step costs); on the GPU, a profile of the first
    (launches and device time, the top host operators, kernels, and operators by input shapes).
    ``precision``: the engine's rollout precision (``SamplerConfig.rollout_precision``)."""
    bank = AdapterBank(model, max_adapters=bank_slots, max_rank=max(64, rank))
    slots = fill_adapters(bank, adapters, rank)
    out = {}
    for busy in sorted({1, adapters}):
        engine = make_engine(model, bank, len(prompts), len(prompts[0]), 1, None, True, rollout_precision=precision)
        reqs = requests(prompts, 1, slots[:busy])
        engine.generate(reqs)  # compile, capture, and the prompts into the prefix index
        part = {}
        fresh = requests([p[::-1].copy() for p in prompts], 1, slots[:busy])
        for name, batch in (("cached", reqs), ("fresh", fresh), ("updated", reqs)):
            if name == "updated":  # an optimizer step's in-place write (same values): the adapters are
                with torch.no_grad():  # copied into the decoder's stacks again, the prompts prefilled again
                    for s in slots[:busy]:
                        bank.get(s).flat.mul_(1.0)
            engine.stats = EngineStats()
            sync()
            t0 = time.perf_counter()
            engine.generate(batch)
            sync()
            st = engine.stats
            part[name] = {"wall_ms": 1e3 * (time.perf_counter() - t0), "prefill_ms": 1e3 * st.prefill_seconds,
                          "admit_ms": 1e3 * st.admit_seconds, "passes": st.prefill_passes,
                          "tokens": st.prefill_tokens, "saved": st.prefill_tokens_saved,
                          "steps": [list(r) for r in st.steps]}
        if DEVICE == "cuda":
            from torch.autograd import DeviceType
            from torch.profiler import ProfilerActivity, profile

            sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                engine.generate(reqs)
                sync()
            events = prof.key_averages()
            kernels = [e for e in events if e.device_type == DeviceType.CUDA]
            part["cached"]["kernels"] = sum(e.count for e in kernels)
            part["cached"]["gpu_ms"] = sum(e.device_time_total for e in kernels) / 1e3
            # where the host's time goes (operators by their own CPU time) and the device's
            part["cached"]["host_ops"] = _top(events, "self_cpu_time_total")
            part["cached"]["device_ops"] = _top(kernels, "device_time_total")
            # the operators whose own kernels took the most device time, by input shapes
            by_shape = [e for e in prof.key_averages(group_by_input_shape=True) if e.device_type == DeviceType.CPU]
            by_shape = sorted(by_shape, key=lambda e: e.self_device_time_total, reverse=True)[:12]
            part["cached"]["ops_by_shape"] = [(e.key[:60], str(e.input_shapes)[:120], e.count,
                                               round(e.self_device_time_total / 1e3, 3)) for e in by_shape]
        print(f"prefill, {precision}, {busy} adapter(s) of {bank_slots} slots: {part}", flush=True)
        out[f"adapters_{busy}"] = part
        del engine
    return out


def sampling_parts(vocab: int, rows: int = 64, reps: int = 20) -> dict:
    """Wall time (ms, device-synced) of the per-step sampling pieces on ``[rows, vocab]`` fp32 logits."""
    from ember.core.sampling.logits import capped, log_softmax, sample_rows, sample_tokens, seeded_uniform

    raw = torch.randn(rows, vocab, device=DEVICE) * 3
    ones, minus, full = [1.0] * rows, [-1] * rows, [1.0] * rows
    us = [seeded_uniform(7, i) for i in range(rows)]
    inv_t = torch.ones(rows, dtype=torch.float64, device=DEVICE)
    u = torch.tensor(us, dtype=torch.float64, device=DEVICE)
    parts = {
        "log_softmax": lambda: log_softmax(raw, None),
        "capped": lambda: capped(raw, None),
        "sample_plain": lambda: sample_tokens(raw, ones, minus, full, us),
        "sample_top_p_0.9": lambda: sample_tokens(raw, ones, minus, [0.9] * rows, us),
        "sample_plain_tolist": lambda: sample_tokens(raw, ones, minus, full, us).tolist(),
        "uniforms_host": lambda: [seeded_uniform(7, i) for i in range(rows)],
        "sample_rows_kernel": lambda: sample_rows(raw, inv_t, u),
    }
    out = {}
    for name, fn in parts.items():
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        out[name] = 1e3 * (time.perf_counter() - t0) / reps
    return out


def gemm_parts(model, rows: int = 64, reps: int = 200) -> dict:
    """The base GEMMs of one decoder layer at ``rows`` rows (bf16, CUDA events over ``reps``
    back-to-back launches): each projection alone, and q/k/v and gate/up as one product over
    concatenated weights (what a fused decode weight would cost), with cuBLAS and with cuBLASLt.
    Returns µs per product and the bandwidth it reaches (weight bytes / time)."""
    import torch.nn.functional as F

    if DEVICE != "cuda":
        return {}
    layer = model.model.layers[0]
    att, mlp = layer.self_attn, layer.mlp
    w = {n: getattr(att, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    w.update({n: getattr(mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj")})
    w["qkv (fused)"] = torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]])
    w["gate_up (fused)"] = torch.cat([w["gate_proj"], w["up_proj"]])
    out: dict = {}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, weight in w.items():
            x = torch.randn(rows, weight.shape[1], device=DEVICE, dtype=weight.dtype)
            for _ in range(3):
                F.linear(x, weight)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                F.linear(x, weight)
            end.record()
            sync()
            us = 1e3 * start.elapsed_time(end) / reps
            out[f"{lib} {name}"] = {"us": round(us, 2), "TB/s": round(weight.numel() * weight.element_size() / us / 1e6, 2)}
    torch.backends.cuda.preferred_blas_library("cublas")
    for k, v in out.items():
        print(f"  {k:28s} {v['us']:8.2f} us  {v['TB/s']:5.2f} TB/s", flush=True)
    return out


def gap_paths(model, prompts, new: int, rank: int) -> dict:
    """|sampler - trainer| per decode path; trainer in bf16 and in fp32 (same weights)."""
    bank = AdapterBank(model, max_adapters=1, max_rank=max(64, rank))
    (slot,) = fill_adapters(bank, 1, rank)
    model32 = copy.deepcopy(model).float()
    bank32 = AdapterBank(model32, max_adapters=1, max_rank=max(64, rank))
    (slot32,) = fill_adapters(bank32, 1, rank)
    with torch.no_grad():
        bank32.get(slot32).flat.copy_(bank.get(slot).flat)
    paths = {"graphs": (True, True), "static-nograph": (True, False), "eager": (False, True), "eager-torch-attn": (False, True)}
    out = {}
    for name, (static, graphs) in paths.items():
        sampling_attention._TRITON_DECODE["ok"] = name != "eager-torch-attn"
        engine = make_engine(model, bank, len(prompts), len(prompts[0]), new, static, graphs)
        results = engine.generate(requests(prompts, new, slot))
        d16, d32, d_tt = [], [], []
        for p, res in zip(prompts, results):
            seq = res.sequences[0]
            tokens = np.concatenate([np.asarray(p), seq.tokens])
            t16 = trainer_logprobs(model, bank, slot, tokens)[len(p) - 1 :]
            t32 = trainer_logprobs(model32, bank32, slot32, tokens)[len(p) - 1 :]
            s = np.asarray(seq.logprobs)
            d16.append(np.abs(s - t16))
            d32.append(np.abs(s - t32))
            d_tt.append(np.abs(t16 - t32))
        r = {}
        for label, d in (("sampler_vs_trainer_bf16", d16), ("sampler_vs_trainer_fp32", d32), ("trainer_bf16_vs_fp32", d_tt)):
            first = np.array([x[0] for x in d])
            rest = np.concatenate([x[1:] for x in d])
            r[label] = {"first_mean": float(first.mean()), "decode_mean": float(rest.mean()), "decode_max": float(rest.max())}
        out[name] = r
        print(f"gap {name:17s} " + "  ".join(
            f"{k}: first {v['first_mean']:.2e} decode mean {v['decode_mean']:.2e} max {v['decode_max']:.2e}"
            for k, v in r.items()), flush=True)
        del engine
    sampling_attention._TRITON_DECODE["ok"] = True
    del model32, bank32
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--gap-prompts", type=int, default=16)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--only", default="steps,gemm,sampling,gap", help="comma list of parts (also: prefill)")
    ap.add_argument("--dependent-launch", type=int, choices=(0, 1), default=int(SamplerConfig.dependent_launch),
                    help="steps: SamplerConfig.dependent_launch (programmatic dependent launch)")
    ap.add_argument("--adapters", type=int, default=1, help="steps: busy adapters sharing the rows (workload b: 8)")
    ap.add_argument("--bank-slots", type=int, default=None,
                    help="steps: adapter bank slots (default --adapters); prefill: (default 32)")
    ap.add_argument("--decode-gemm", type=int, choices=(0, 1), default=int(SamplerConfig.decode_gemm),
                    help="steps: SamplerConfig.decode_gemm (Ember's decode GEMM for the dense products)")
    ap.add_argument("--gemm-configs", type=Path, default=None,
                    help="steps: decode GEMM launch choices measured by bench/decode_gemm.py --out")
    ap.add_argument("--group-samples", type=int, default=1,
                    help="steps: requests per prompt, sharing its pages (GRPO's group size)")
    ap.add_argument("--shared-prefix-attention", type=int, choices=(0, 1),
                    default=int(SamplerConfig.shared_prefix_attention),
                    help="steps: SamplerConfig.shared_prefix_attention (a group's shared prompt read once a step)")
    ap.add_argument("--qkv-kernel", type=int, choices=(0, 1), default=int(SamplerConfig.qkv_kernel),
                    help="steps: SamplerConfig.qkv_kernel (the q/k/v LoRA expand, norms, rotations and KV write "
                         "as one kernel)")
    ap.add_argument("--rollout-precision", default="bf16", choices=("bf16", "fp8", "mxfp8"),
                    help="steps and prefill: the sampler's rollout precision (SamplerConfig.rollout_precision)")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"hardware: {hardware_line()}; torch {torch.__version__}", flush=True)
    model = random_ember_model(SHAPES[args.shape], DEVICE, DTYPE, seed=0)
    vocab = token_vocab(SHAPES[args.shape])
    prompts = make_prompts(vocab, args.prompts, args.prompt_len)
    results: dict = {"hardware": hardware_line(), "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}
    only = args.only.split(",")
    if "steps" in only:
        if args.gemm_configs is not None:
            from ember.core.kernels import decode_gemm

            decode_gemm.load_tuned(args.gemm_configs)
        grouped = [p for p in prompts for _ in range(args.group_samples)]  # a group's requests in a row
        r = step_breakdown(model, grouped, args.new, args.rank, args.adapters, args.bank_slots,
                           dependent_launch=bool(args.dependent_launch), decode_gemm=bool(args.decode_gemm),
                           shared_prefix_attention=bool(args.shared_prefix_attention),
                           qkv_kernel=bool(args.qkv_kernel), rollout_precision=args.rollout_precision)
        print({k: v for k, v in r.items() if k != "profile_top"}, flush=True)
        results["steps"] = r
    if "prefill" in only:
        results["prefill"] = prefill_parts(model, prompts, args.rank, args.adapters, args.bank_slots or 32,
                                           args.rollout_precision)
    if "gemm" in only:
        results["gemm"] = gemm_parts(model, args.prompts)
    if "sampling" in only:
        results["sampling"] = sampling_parts(vocab)
        print("sampling parts (ms):", {k: round(v, 3) for k, v in results["sampling"].items()}, flush=True)
    if "gap" in only:
        results["gap"] = gap_paths(model, prompts[: args.gap_prompts], args.new, args.rank)
    (args.out / f"sample_diag_{args.shape}.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
