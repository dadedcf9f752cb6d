"""Sampling on a model of --shape (default Qwen3-8B): Ember's sampler vs HF transformers generate +
PEFT, one run.

Workloads (random bf16 weights, LoRA rank 32 on the attention and MLP weights (q,k,v,o,gate,up,down
for Qwen3; each family's own projections and experts otherwise); temperature 1, no stop, so
every sequence generates exactly --new tokens):

* a          --prompts (64) prompts x --prompt-len (128) tokens -> --new (256) tokens, one adapter,
             adapter bank of 1 slot
* a-sync     workload a with each decode step read back before the next is queued
             (``overlap_decode`` off; a queues the next step first)
* a-32slots  the same with 32 adapter slots configured and all filled (cost of configured slots)
* b          --mixed-prompts (256) prompts over --adapters (8) adapters, round robin
* b-1        the same prompts with one adapter (b / b-1 is the cost of mixing adapters)
* b-sync     workload b with ``overlap_decode`` off
* a-par      workload a on an engine of --nproc processes (--ep / --tp), every rank running the same
             sequences as the engine samples (experts' shares all-reduced); the floor is per GPU
* hf         transformers generate on a PEFT model (same weights) for workload a, with the default
             dynamic cache and (GPU) the static cache, the faster of the two reported (both are
             printed); skipped, with the reason printed, where the installed transformers lacks
             the family
* grpo       GRPO-shaped rollouts: --grpo-prompts (64) prompts x --grpo-samples (8) samples, each
             sample its own request (as an RL client sends a group), --grpo-prompt-len (512) tokens
             -> --new (256) tokens, one adapter, prefix sharing on: a group's prompt is prefilled
             once and its pages shared (the prefix cache is emptied before the timed run); its
             floor reads a group's prompt pages once
* grpo-noshare  the same with prefix sharing off (every request prefills its whole prompt)
* grpo-nocascade  grpo with ``shared_prefix_attention`` off: the pages are shared, but each decode
             step reads a group's prompt once per sample, not once per group
* stall      chunked prefill: workload a's sequences decoding, then one --long-prompt (16384) token
             prompt arrives; the per-step budget is --step-tokens (2048): the long prompt is
             prefilled over several steps while the 64 sequences keep decoding. Reports the
             decode step before it arrived, the longest step while it was prefilled (the running
             sequences' worst inter-token gap), and its time to first token
* stall-whole  the same with chunked prefill off: the long prompt is prefilled in one step
* gap        bf16 rollout/trainer mismatch: |sampler logprob - trainer logprob| of the sampled tokens
             of workload a (the trainer's packed forward, same weights)

For each Ember workload: generated tokens/s (third run; the first two compile kernels and
capture CUDA graphs, the second with the prompts in the prefix index as the timed run finds them),
the median decode step at full batch against its memory-bandwidth floor
((weights + LoRA factors + KV cache read per step) / the GPU's measured copy bandwidth: 4.3 TB/s on the
H200, 3.0 on the H100), the same against the step's roofline (each matmul weight's bytes at that
bandwidth or its products' FLOPs at the 790 TFLOP/s bf16 matmul peak, whichever is longer, plus
the other bytes at the bandwidth: at workload b's 256 rows Qwen3-8B's products are bound by the
tensor cores, not by the bytes; bf16 rollouts only), time to the first token, where the wall time
went (admission: the adapters' factors taken for the decoders; prefill and its passes; decode) and
the prompt tokens prefilled and saved by the prefix index.
"ttft cold" is from engine construction (model already in memory) to the first sampled token of a
one-prompt request: KV allocation, Triton compilation and the first graph capture included.

--shape takes every shape of bench/common.py. The static CUDA-graph decoder is for Llama, Qwen3,
Qwen3-MoE, Qwen3-Next and Inkling-2 (routed experts at 64 rows touch nearly every expert, so the
floor counts every weight); other families decode eagerly, and a family the sampler cannot run yet is reported as an error
line for each workload (the other workloads still run).

    python bench/sample.py --out /tmp/bench            # on the GPU
    python bench/sample.py --shape tiny --new 16       # CPU smoke test
    python bench/sample.py --only grpo,grpo-noshare    # prefix sharing on the GPU
    python bench/sample.py --only stall,stall-whole    # chunked prefill on the GPU
    python bench/sample.py --shape tiny --only stall,stall-whole --prompts 4 --long-prompt 200 --step-tokens 32 --new 40
    python bench/sample.py --shape tiny --only grpo,grpo-noshare --grpo-prompts 4 --grpo-samples 2 --grpo-prompt-len 40 --new 8
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    SHAPES,
    GpuMonitor,
    copy_bandwidth,
    decode_roofline_s,
    hardware_line,
    hf_baseline_unavailable,
    hf_model_like,
    peft_model_like,
    random_ember_model,
    run_ranks,
    sync,
    token_vocab,
)
from ember.core import rollout_precision
from ember.core.adapters import AdapterBank, LoraConfig
from ember.core.batch import pack
from ember.core.layers.attention import PackedAttention
from ember.core.logprobs import token_logprobs
from ember.core.models.base import ForwardContext
from ember.core.sampling import GenerationRequest, SamplerConfig, SamplingEngine, StopRule
from ember.core.sampling.engine import EngineStats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TARGETS = frozenset({"attn", "mlp"})


def make_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length) for _ in range(n)]


def fill_adapters(bank: AdapterBank, count: int, rank: int) -> list[int]:
    """``count`` adapters with small random factors (B != 0, so every adapter changes the output)."""
    slots = []
    for i in range(count):
        a = bank.create(LoraConfig(rank=rank, alpha=32.0, targets=TARGETS, seed=i))
        with torch.no_grad():
            a.flat.normal_(0.0, 0.01, generator=torch.Generator(device=a.flat.device).manual_seed(i))
        slots.append(a.slot)
    return slots


def weight_bytes(model, bank: AdapterBank, slots: list[int]) -> int:
    """Bytes a decode step must read: every weight but the embedding tables (lookups: the token
    embedding, n-gram tables), plus the LoRA factors of the adapters in the batch (in the activation
    dtype)."""
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    lookups.discard(id(model.lm_head.weight))  # a tied head is read in full
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in lookups)
    esize = torch.finfo(DTYPE).bits // 8
    return total + sum(bank.get(s).num_parameters() * esize for s in set(slots) if s)


def _timed(engine, reqs, rows: int, floor_bytes: float, before=None, roofline: bool = True) -> tuple[dict, list]:
    """Two warm-up ``generate`` calls (kernels compiled, the batch's graphs captured): the first
    prefills prompts new to the prefix index, the second finds them cached, as the timed run does
    (a prefill of other shapes can compile other kernel variants: the fp8 expert kernel's first
    1,024-token prefill took 0.62 s, its next 0.03 s of GPU time). Then ``before()`` if given, then
    the timed one: its throughput, TTFT, prefill and median decode step of ``rows``
    running sequences against the bandwidth floor of ``floor_bytes`` per step and (``roofline``)
    against the roofline, which also counts the products' FLOPs (``decode_roofline_s``)."""
    engine.generate(reqs)
    engine.generate(reqs)
    if before is not None:
        before()
    sync()
    engine.stats = EngineStats()
    t0 = time.perf_counter()
    with GpuMonitor() as gpu:  # clocks and power: whether the GPU's power limit held the run down
        results = engine.generate(reqs)
        sync()
    wall = time.perf_counter() - t0
    st = engine.stats
    tokens = sum(len(s.tokens) for r in results for s in r.sequences)
    full = [dt for b, dt in st.step_times if b == rows]
    out = {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_s": st.first_token_time - t0,
        "prefill_s": st.prefill_seconds,
        "prefill_passes": st.prefill_passes,
        "prefill_tokens": st.prefill_tokens,
        "prefill_tokens_saved": st.prefill_tokens_saved,
        "prefix_pages_reused": st.prefix_pages_reused,
        "admit_s": st.admit_seconds,
        "decode_s": st.decode_seconds,
        "decode_steps": st.decode_steps,
        "decode_step_s": statistics.median(full) if full else float("nan"),
        "floor_step_s": floor_bytes / copy_bandwidth(),
        "floor_bytes": floor_bytes,
        "static_decode": engine.static is not None,
        "cuda_graphs": bool(engine.static is not None and engine.static.use_graphs),
        "gpu": gpu.summary,
    }
    out["step_vs_floor"] = out["decode_step_s"] / out["floor_step_s"]
    out["roofline_step_s"] = decode_roofline_s(engine.model, rows, floor_bytes) if roofline else float("nan")
    out["step_vs_roofline"] = out["decode_step_s"] / out["roofline_step_s"]
    return out, results


def run_ember(
    model,
    prompts,
    new: int,
    n_adapters: int,
    bank_slots: int,
    fill: int,
    rank: int,
    graphs: bool,
    static: bool | None,
    keep: bool = False,
    precision: str = "bf16",
    overlap: bool = True,
    dependent_launch: bool = SamplerConfig.dependent_launch,
    decode_gemm: bool = SamplerConfig.decode_gemm,
    shrink_windows: bool = SamplerConfig.shrink_windows,
    qkv_kernel: bool = SamplerConfig.qkv_kernel,
) -> dict:
    bank = AdapterBank(model, max_adapters=bank_slots, max_rank=max(64, rank))
    slots = fill_adapters(bank, fill, rank)
    used = slots[:n_adapters]
    plen = len(prompts[0])
    page = 16
    config = SamplerConfig(
        max_seqs=len(prompts),
        page_size=page,
        kv_tokens=(len(prompts) + 1) * (plen + new + page),
        max_prefill_tokens=max(16384, plen),
        cuda_graphs=graphs,
        static_decode=static,
        rollout_precision=precision,
        overlap_decode=overlap,
        dependent_launch=dependent_launch,
        decode_gemm=decode_gemm,
        shrink_windows=shrink_windows,
        qkv_kernel=qkv_kernel,
    )
    sync()
    t_start = time.perf_counter()
    engine = SamplingEngine(model, bank, config, max_seq_len=plen + new + page)
    engine.generate([GenerationRequest(prompts[0], 1, [0], slot=used[0])])
    sync()
    ttft_cold = engine.stats.first_token_time - t_start
    reqs = [
        GenerationRequest(p, new, [1000 + i], slot=used[i % len(used)], temperature=1.0, stop=StopRule())
        for i, p in enumerate(prompts)
    ]
    floor_bytes = weight_bytes(model, bank, used) + len(prompts) * (plen + new / 2) * engine.cache.nbytes_per_token()
    if precision != "bf16":  # the quantised copies are read instead of the bf16 weights they stand for
        floor_bytes += engine.rollout_bytes - sum(
            p.numel() * p.element_size() for m in rollout_precision.targets(model)
            for p in m.parameters(recurse=False))
    # the roofline counts bf16 products; the quantised copies' tensor-core rate is not measured here
    out, results = _timed(engine, reqs, len(prompts), floor_bytes, roofline=precision == "bf16")
    out.update(ttft_cold_s=ttft_cold, rollout_precision=precision, rollout_bytes=engine.rollout_bytes)
    if keep:
        out["_state"] = (bank, used, reqs, results)
    else:
        del engine, bank
    gc.collect()
    return out


def run_grpo(model, prompts, samples: int, new: int, rank: int, graphs: bool, static: bool | None,
             sharing: bool, cascade: bool = True) -> dict:
    """Workload grpo / grpo-noshare / grpo-nocascade: ``samples`` requests of one sample per prompt,
    a group's requests one after another in the queue."""
    bank = AdapterBank(model, max_adapters=1, max_rank=max(64, rank))
    (slot,) = fill_adapters(bank, 1, rank)
    plen, page = len(prompts[0]), 16
    n = len(prompts) * samples
    config = SamplerConfig(
        max_seqs=n,
        page_size=page,
        kv_tokens=(n + 1) * (plen + new + page),
        max_prefill_tokens=max(16384, plen),
        cuda_graphs=graphs,
        static_decode=static,
        prefix_sharing=sharing,
        shared_prefix_attention=cascade,
    )
    engine = SamplingEngine(model, bank, config, max_seq_len=plen + new + page)
    engine.generate([GenerationRequest(prompts[0], 1, [0], slot=slot)])  # the KV cache's layers allocated
    reqs = [
        GenerationRequest(p, new, [1000 * i + j], slot=slot, temperature=1.0, stop=StopRule())
        for i, p in enumerate(prompts)
        for j in range(samples)
    ]
    # the KV a step must read: with sharing, a group's prompt pages once for all its samples
    kv_tokens = (len(prompts) if sharing else n) * plen + n * new / 2
    floor_bytes = weight_bytes(model, bank, [slot]) + kv_tokens * engine.cache.nbytes_per_token()
    # the timed run starts cold: no prompt of it is cached yet
    out, _ = _timed(engine, reqs, n, floor_bytes, before=engine.clear_prefix_cache)
    out["ttft_cold_s"] = float("nan")
    del engine, bank
    gc.collect()
    return out


def run_stall(model, prompts, long_len: int, new: int, step_tokens: int, rank: int, graphs: bool,
              static: bool | None, chunked: bool, vocab: int) -> dict:
    """Workload stall / stall-whole (see the module doc)."""
    bank = AdapterBank(model, max_adapters=1, max_rank=max(64, rank))
    (slot,) = fill_adapters(bank, 1, rank)
    plen, page = len(prompts[0]), 16
    n = len(prompts)
    config = SamplerConfig(max_seqs=n + 1, page_size=page, kv_tokens=n * (plen + new + page) + long_len + 4 * page,
                           max_prefill_tokens=step_tokens, cuda_graphs=graphs, static_decode=static,
                           chunked_prefill=chunked, prefix_sharing=False)
    engine = SamplingEngine(model, bank, config, max_seq_len=long_len + new + page)
    long_prompt = make_prompts(vocab, 1, long_len, seed=3)[0]

    def once(engine) -> dict:
        for i, p in enumerate(prompts):
            engine.submit(GenerationRequest(p, new, [1000 + i], slot=slot, temperature=1.0, stop=StopRule()))
        while len(engine.scheduler.running) < n or engine.scheduler.prefilling:  # all decoding
            engine.step()
        for _ in range(8):
            engine.step()
        before = [r.seconds for r in list(engine.stats.steps)[-8:]]
        sync()
        mark = len(engine.stats.steps)
        t0 = time.perf_counter()
        handle = engine.submit(GenerationRequest(long_prompt, 1, [7], slot=slot, temperature=1.0, stop=StopRule()))
        done: dict = {}
        while handle not in done:
            done.update(engine.step())
        ttft = time.perf_counter() - t0
        first = done[handle].sequences[0]
        during = list(engine.stats.steps)[mark:]
        while not engine.idle:
            engine.step()
        return {"decode_step_before_s": statistics.median(before),
                "longest_step_while_prefilling_s": max(r.seconds for r in during),
                "steps_to_prefill": len(during), "long_prompt_ttft_s": ttft,
                "decode_tokens_per_step_while_prefilling": min(r.decode_tokens for r in during),
                # the long prompt's sampled token and its logprob (chunked and whole should agree)
                "long_token": int(first.tokens[0]), "long_logprob": float(first.logprobs[0])}

    once(engine)  # warm-up: kernels, graphs
    sync()
    out = once(engine)
    out.update(long_prompt=long_len, step_tokens=step_tokens, chunked=engine.scheduler.chunked, running=n)
    del engine, bank
    gc.collect()
    return out


@torch.no_grad()
def trainer_logprobs(model, bank: AdapterBank, slot: int, tokens: np.ndarray) -> np.ndarray:
    """Logprobs of ``tokens[1:]`` from the trainer's packed forward (as ``Worker.forward_backward``)."""
    batch = pack([tokens[:-1]], [(slot, False)], DEVICE)
    attn = PackedAttention(batch.doc_lengths, torch.device(DEVICE))
    ctx = ForwardContext(
        batch.positions,
        lambda i, q, k, v, s, sc: attn(q, k, v, s, sc),
        lora=bank.route(batch.groups),
        seq_lens=batch.doc_lengths,
    )
    hidden = model.hidden_states(batch.input_ids, ctx)
    lp = token_logprobs(
        hidden,
        model.unembed_weight,
        torch.as_tensor(tokens[1:], device=DEVICE),
        lora=ctx.lora,
        softcap=model.final_logit_softcap,
    )
    return lp.float().cpu().numpy()


def logprob_gap(model, state, n_seqs: int = 16) -> dict:
    """|sampler - trainer| logprobs of the sampled tokens: the trainer's packed forward (as
    ``Worker.forward_backward`` runs it) over prompt + completion."""
    bank, _, reqs, results = state
    deltas = []
    for r, res in list(zip(reqs, results))[:n_seqs]:
        seq = res.sequences[0]
        tokens = np.concatenate([np.asarray(r.prompt), seq.tokens])
        trainer = trainer_logprobs(model, bank, r.slot, tokens)[len(r.prompt) - 1 :]
        deltas.append(np.abs(trainer - seq.logprobs))
    d = np.concatenate(deltas)
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "tokens": int(d.size)}


def run_hf(model, hf_cfg, prompts, new: int, rank: int) -> dict:
    # share Ember's weights (same names), so both run the same model; LoRA on the weights an Ember
    # attn+mlp adapter adapts
    hf = hf_model_like(model, hf_cfg, DTYPE, DEVICE)
    pm = peft_model_like(hf, model, rank).eval()
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.01)
    ids = torch.tensor(np.stack(prompts), device=DEVICE)
    gen_cfg = copy.deepcopy(pm.generation_config)
    gen_cfg.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)

    def generate(n_new, cache):
        g = copy.deepcopy(gen_cfg)
        g.update(max_new_tokens=n_new, min_new_tokens=n_new, cache_implementation=cache)
        with torch.no_grad():
            return pm.generate(ids, attention_mask=torch.ones_like(ids), generation_config=g)

    # the strongest configuration a user would pick: transformers' default dynamic cache and, on
    # the GPU, the static cache (faster or slower depending on the model and PEFT); the faster counts
    runs = {}
    for cache in ("dynamic", "static") if DEVICE == "cuda" else ("dynamic",):
        implementation = None if cache == "dynamic" else cache
        try:
            generate(4, implementation)
        except Exception as e:  # noqa: BLE001 - the static cache does not work with every model/PEFT combination
            print(f"hf {cache} cache failed ({type(e).__name__}: {e})", flush=True)
            continue
        sync()
        t0 = time.perf_counter()
        out = generate(new, implementation)
        sync()
        wall = time.perf_counter() - t0
        tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
        runs[cache] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "cache": cache}
        print(f"hf {cache} cache: {tokens / wall:.0f} tok/s", flush=True)
    if not runs:
        raise RuntimeError("transformers generate failed with every cache")
    best = max(runs.values(), key=lambda r: r["tokens_per_s"])
    return {**best, "by_cache": {k: r["tokens_per_s"] for k, r in runs.items()}}


def _parallel_rank(rank: int, world: int, args, hf_cfg, prompts) -> dict:
    from ember.dist.expert_parallel import set_mode
    from ember.dist.mesh import Parallel
    from ember.dist.parallelize import parallelize

    par = Parallel(args.ep, args.tp)
    device = f"cuda:{rank}" if DEVICE == "cuda" else "cpu"
    model = random_ember_model(hf_cfg, device, DTYPE, seed=0, parallelize=lambda m: parallelize(m, par))
    set_mode(model, "replicated")  # every rank runs the same sequences, as the engine samples
    return {**run_ember(model, prompts, args.new, 1, 1, 1, args.rank, not args.no_graphs, None), "gpus": world}


def run_parallel(args, hf_cfg, prompts) -> dict:
    """a-par: workload a on --nproc processes running the same sequences (each rank its part of the
    weights: the floor is per GPU)."""
    if args.ep == 1 and args.tp == 1:
        raise SystemExit("a-par needs --ep or --tp above 1")
    return run_ranks(args.nproc, _parallel_rank, args, hf_cfg, prompts)


# SamplerConfig switches that run the a/b workloads once per value: what turning one on does, then
# the suffix of a variant's workload names with it off and on
SWITCHES = {
    "dependent_launch": ("programmatic dependent launch of the decode step's Triton kernels", "+nopdl", "+pdl"),
    "decode_gemm": (("the decode step's dense products as Ember's decode GEMM with the LoRA expand in its "
                     "epilogue, else cuBLAS"), "+cublas", "+gemm"),
    "shrink_windows": (("a step of few adapters multiplies their LoRA shrink in the base products, else shrink "
                        "kernels"), "+shrinks", "+windows"),
    "qkv_kernel": ("the q/k/v LoRA expand, norms, rotations and KV write as one kernel, else three",
                   "+threekernels", "+qkvkernel"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--mixed-prompts", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--grpo-prompts", type=int, default=64, help="grpo: prompts (groups)")
    ap.add_argument("--grpo-samples", type=int, default=8, help="grpo: samples per prompt, one request each")
    ap.add_argument("--grpo-prompt-len", type=int, default=512, help="grpo: tokens per prompt")
    ap.add_argument("--no-graphs", action="store_true", help="static decode steps without CUDA-graph capture")
    ap.add_argument(
        "--decode",
        choices=["auto", "eager", "static"],
        default="auto",
        help="decode path (auto: static shapes + CUDA graphs on the GPU for Llama, Qwen3, Qwen3-MoE, Qwen3-Next, Inkling-2)",
    )
    ap.add_argument(
        "--only", default="a,a-32slots,b,b-1,hf,gap",
        help="comma list of workloads (also: a-sync and b-sync, a and b with each decode step read back before "
        "the next is queued; a-par, grpo, grpo-noshare, grpo-nocascade, stall, stall-whole)",
    )
    ap.add_argument("--rollout-precision", default="bf16", choices=("bf16", "fp8", "mxfp8"),
                    help="workload a (and gap): the sampler's copy of the base weights (the trainer stays bf16)")
    ap.add_argument("--long-prompt", type=int, default=16384, help="stall: the long prompt's tokens")
    ap.add_argument("--step-tokens", type=int, default=2048, help="stall: max_prefill_tokens, the per-step budget")
    for option, (what, off, on) in SWITCHES.items():
        ap.add_argument("--" + option.replace("_", "-"), default=str(int(getattr(SamplerConfig, option))),
                        help=f"SamplerConfig.{option} (0/1: {what}); a comma list runs the a/b workloads once per "
                             f"value, one variant per combination of the switches (later ones named <workload>{on} "
                             f"or <workload>{off})")
    ap.add_argument("--gemm-configs", type=Path, default=None,
                    help="decode GEMM launch choices measured by bench/decode_gemm.py --out (its decode_gemm.json)")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--nproc", type=int, default=2, help="a-par: processes (GPUs)")
    ap.add_argument("--ep", type=int, default=1, help="a-par: expert-parallel degree")
    ap.add_argument("--tp", type=int, default=1, help="a-par: tensor-parallel degree")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.gemm_configs is not None:
        from ember.core.kernels import decode_gemm

        decode_gemm.load_tuned(args.gemm_configs)
        print(f"decode GEMM launch choices from {args.gemm_configs}: {decode_gemm.TUNED}", flush=True)
    hf_cfg = SHAPES[args.shape]
    torch.manual_seed(0)
    print(f"hardware: {hardware_line()}; torch {torch.__version__}", flush=True)
    vocab = token_vocab(hf_cfg)
    prompts = make_prompts(vocab, args.prompts, args.prompt_len)
    only = args.only.split(",")
    early: dict[str, dict] = {}
    if "a-par" in only:  # in its own processes, before this one puts a model on the GPU
        early["a-par"] = run_parallel(args, hf_cfg, prompts)
        only.remove("a-par")
    model = random_ember_model(hf_cfg, DEVICE, DTYPE, seed=0)
    mixed = make_prompts(vocab, args.mixed_prompts, args.prompt_len, seed=1)
    grpo_prompts = make_prompts(vocab, args.grpo_prompts, args.grpo_prompt_len, seed=2)
    graphs = not args.no_graphs
    static = {"auto": None, "eager": False, "static": True}[args.decode]
    # one variant per combination of the switches' values; the first keeps the workloads' names, the
    # others add a suffix for each switch that differs
    values = [[bool(int(v)) for v in getattr(args, k).split(",")] for k in SWITCHES]
    variants = [dict(zip(SWITCHES, combo, strict=True)) for combo in itertools.product(*values)]
    current = dict(variants[0])

    def suffix(v: dict) -> str:
        return "".join(SWITCHES[k][1 + v[k]] for k in SWITCHES if v[k] != variants[0][k])

    def ember(*a, **k):
        return run_ember(*a, **current, **k)

    plan = {
        "a": lambda: ember(model, prompts, args.new, 1, 1, 1, args.rank, graphs, static, keep="gap" in only,
                           precision=args.rollout_precision),
        "a-sync": lambda: ember(model, prompts, args.new, 1, 1, 1, args.rank, graphs, static,
                                precision=args.rollout_precision, overlap=False),
        "a-32slots": lambda: ember(model, prompts, args.new, 1, 32, 32, args.rank, graphs, static),
        "b-sync": lambda: ember(model, mixed, args.new, args.adapters, max(32, args.adapters), args.adapters,
                                args.rank, graphs, static, overlap=False),
        "b": lambda: ember(
            model, mixed, args.new, args.adapters, max(32, args.adapters), args.adapters, args.rank, graphs, static
        ),
        "b-1": lambda: ember(
            model, mixed, args.new, 1, max(32, args.adapters), args.adapters, args.rank, graphs, static
        ),
        "hf": lambda: run_hf(model, hf_cfg, prompts, args.new, args.rank),
        "grpo": lambda: run_grpo(model, grpo_prompts, args.grpo_samples, args.new, args.rank, graphs, static, True),
        "grpo-noshare": lambda: run_grpo(
            model, grpo_prompts, args.grpo_samples, args.new, args.rank, graphs, static, False
        ),
        "grpo-nocascade": lambda: run_grpo(
            model, grpo_prompts, args.grpo_samples, args.new, args.rank, graphs, static, True, cascade=False
        ),
        "stall": lambda: run_stall(model, prompts, args.long_prompt, args.new, args.step_tokens, args.rank, graphs,
                                   static, True, vocab),
        "stall-whole": lambda: run_stall(model, prompts, args.long_prompt, args.new, args.step_tokens, args.rank,
                                         graphs, static, False, vocab),
    }
    results: dict[str, dict] = {}
    hf_skip = hf_baseline_unavailable(hf_cfg)
    # with several variants the a/b workloads run once per variant; the first variant's results keep
    # the workload's name, the others are named by what differs ("a+pdl", "b+gemm", ...)
    runs = [(name, variants[0]) for name in [*early, *only]]
    for v in variants[1:]:
        runs += [(name + suffix(v), v) for name in only if name in plan and name.startswith(("a", "b"))]
    for name, v in runs:
        current.update(v)
        if name == "gap":
            continue
        if name == "hf" and hf_skip:
            print(f"{name:10s} skipped: {hf_skip}", flush=True)
            results[name] = {"skipped": hf_skip}
            continue
        try:
            r = early[name] if name in early else plan[name.split("+")[0]]()
        except Exception as e:  # noqa: BLE001 - report and go on: one failing workload must not hide the others
            traceback.print_exc()
            r = {"error": f"{type(e).__name__}: {e}"}
        results[name] = r
        if "error" in r:
            print(f"{name:10s} error: {r['error']}", flush=True)
        else:
            line = f"{name:10s}"
            if "tokens_per_s" in r:
                line += f" {r['tokens_per_s']:9.0f} tok/s  ({r['tokens']} tokens in {r['wall_s']:.2f}s)"
            if "decode_step_s" in r:
                line += (
                    f"  decode step {1e3 * r['decode_step_s']:.2f} ms vs floor {1e3 * r['floor_step_s']:.2f} ms"
                    f" ({r['step_vs_floor']:.2f}x), roofline {1e3 * r['roofline_step_s']:.2f} ms"
                    f" ({r['step_vs_roofline']:.2f}x)  ttft {r['ttft_s']:.2f}s  ttft cold {r['ttft_cold_s']:.2f}s"
                    f"  graphs={r['cuda_graphs']}"
                )
            if "admit_s" in r:
                line += (
                    f"  [wall: admission {r['admit_s']:.3f}s, prefill {r['prefill_s']:.3f}s in"
                    f" {r['prefill_passes']} passes, decode {r['decode_s']:.3f}s]"
                )
            if r.get("gpu"):
                line += f"  [gpu: {GpuMonitor.line(r['gpu'])}]"
            if "longest_step_while_prefilling_s" in r:
                line += (
                    f"  decode step {1e3 * r['decode_step_before_s']:.2f} ms before the long prompt, longest step "
                    f"{1e3 * r['longest_step_while_prefilling_s']:.1f} ms while it was prefilled over "
                    f"{r['steps_to_prefill']} steps, its TTFT {r['long_prompt_ttft_s']:.3f}s; it sampled "
                    f"{r['long_token']} (logprob {r['long_logprob']:.4f})"
                )
            if "prefix_pages_reused" in r:
                line += (
                    f"  prefilled {r['prefill_tokens']} tokens"
                    f" ({r['prefill_tokens_saved']} saved, {r['prefix_pages_reused']} pages reused)"
                )
            print(line, flush=True)
    if "gap" in only and "_state" in results.get("a", {}):
        try:
            results["gap"] = logprob_gap(model, results["a"].pop("_state"))
            g = results["gap"]
            print(
                f"logprob gap sampler vs trainer ({DTYPE}): mean |d| {g['mean_abs']:.2e}, max |d| {g['max_abs']:.2e}"
                f" over {g['tokens']} tokens",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - report it with the other results
            traceback.print_exc()
            results["gap"] = {"error": f"{type(e).__name__}: {e}"}
    elif "gap" in only:
        results["gap"] = {"error": "needs workload a, which did not run"}
        print(f"{'gap':10s} error: {results['gap']['error']}", flush=True)
    results.get("a", {}).pop("_state", None)

    def ratio(x, y):
        a, b = results.get(x, {}), results.get(y, {})
        return a["tokens_per_s"] / b["tokens_per_s"] if "tokens_per_s" in a and "tokens_per_s" in b else None

    summary = {
        "a_vs_hf": ratio("a", "hf"),
        "mixed_vs_one": ratio("b", "b-1"),
        "32slots_vs_1slot": ratio("a-32slots", "a"),
        "grpo_share_vs_noshare": ratio("grpo", "grpo-noshare"),
        "grpo_cascade_vs_not": ratio("grpo", "grpo-nocascade"),
    }
    print("\n| workload | tokens/s | decode step (ms) | floor (ms) | step/floor | roofline (ms) | step/roofline "
          "| TTFT (s) | TTFT cold (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if name == "gap" or "longest_step_while_prefilling_s" in r:  # printed above
            continue
        if "error" in r:
            print(f"| {name} | error: {r['error'][:80]} |")
        elif "skipped" in r:
            print(f"| {name} | skipped: {r['skipped'][:80]} |")
        elif "decode_step_s" in r:
            print(
                f"| {name} | {r['tokens_per_s']:.0f} | {1e3 * r['decode_step_s']:.2f} | {1e3 * r['floor_step_s']:.2f} | "
                f"{r['step_vs_floor']:.2f}x | {1e3 * r['roofline_step_s']:.2f} | {r['step_vs_roofline']:.2f}x | "
                f"{r['ttft_s']:.2f} | {r['ttft_cold_s']:.2f} |"
            )
        else:
            print(f"| {name} ({r['cache']} cache) | {r['tokens_per_s']:.0f} | | | | | | | |")
    print(
        f"\nEmber a / HF: {summary['a_vs_hf']}   b (8 adapters) / b-1 (one): {summary['mixed_vs_one']}   "
        f"32 slots / 1 slot: {summary['32slots_vs_1slot']}   grpo shared / unshared: {summary['grpo_share_vs_noshare']}   "
        f"grpo cascade / not: {summary['grpo_cascade_vs_not']}"
    )
    out = {
        "hardware": hardware_line(),
        "torch": torch.__version__,
        "shape": args.shape,
        "dtype": str(DTYPE),
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": results,
        "summary": summary,
    }
    (args.out / f"sample_{args.shape}.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
