"""The stability record and ``stable_reinforce`` on the GPU (issue 13, ``shared/spec/stability.md``):
what replay buys, and what recording and the loss cost. Engine level (``Worker``), random bf16
weights, LoRA rank 32 on attention and MLP (every expert for MoE), one run per shape.

For each shape (default: Qwen3-8B and Qwen3-30B-A3B reduced to 12 layers):

* **recording cost**: sampling tokens/s of --prompts x --prompt-len -> --new tokens (temperature 1,
  no stop) with and without ``record_stability`` (second run of each; the first compiles and captures);
* **rollout/trainer gap** of the sampled tokens, mean and max |sampler - trainer| logprob, for
  untruncated sampling (τ = 1) and truncated sampling (τ = 1, top_k 64, top_p 0.95):
  - ``plain``: the trainer's full-vocabulary logprob under live routing (``importance_sampling``'s
    logprobs) against the sampler's processed log q of the token (the distribution it was drawn
    from); ``plain_vs_returned``: against the logprob Ember's sampler returns (the model's own);
  - ``+support``: log p_S (the trainer renormalised over the recorded support) against the sampler's
    processed log q, live routing (``stable_reinforce`` with ``routing_replay=0``);
  - ``+R3``: the same with the recorded experts replayed (``stable_reinforce``; MoE shapes);
  and the fraction of (token, MoE layer) pairs whose live routing differs from the sampler's;
* **loss cost**: ``forward_backward`` (forward + backward, the same batch) with ``stable_reinforce``
  against ``importance_sampling``.

    python bench/stability.py --out /tmp/bench                       # on the GPU
    python bench/stability.py --shapes tiny,tiny-moe --new 8          # CPU smoke test
    python bench/stability.py --shapes qwen3-8b --parts gap --rollout-precision fp8   # an fp8 rollout's gap
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SHAPES, hardware_line, random_ember_model, sync, token_vocab
from ember.core.adapters import LoraConfig
from ember.core.sampling import SamplerConfig
from ember.core.sampling.engine import EngineStats
from ember.core.sampling.logits import head_support
from ember.engine.stability import StabilityRecord, StabilityStore, resolve_datum
from ember.engine.worker import Worker
from ember.lossdefs import STABILITY_HEAD
from ember.types import Datum, ForwardBackwardInput, SampleInput, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
SESSION = "bench"


def build(shape: str, prompts: int, plen: int, new: int, precision: str = "bf16") -> tuple[Worker, int]:
    name, _, layers = shape.partition(":")
    cfg = dict(SHAPES[name])
    if layers:
        cfg["num_hidden_layers"] = int(layers)
    model = random_ember_model(cfg, DEVICE, DTYPE)
    page = 16
    sampler = SamplerConfig(max_seqs=prompts, page_size=page, kv_tokens=(prompts + 1) * (plen + new + page),
                            max_prefill_tokens=max(16384, plen))
    worker = Worker(model, max_adapters=2, max_rank=32, max_seq_len=plen + new + page, sampler_config=sampler,
                    rollout_precision=precision)
    slot = worker.create_adapter(LoraConfig(rank=32, alpha=32.0, targets=frozenset({"attn", "mlp"}), seed=0))
    with torch.no_grad():  # B != 0, so the adapter changes the output
        a = worker.adapter(slot)
        a.flat.normal_(0.0, 0.01, generator=torch.Generator(device=a.flat.device).manual_seed(0))
    return worker, slot


def sample(worker, slot, prompts, params, record) -> tuple[list, float]:
    inputs = [SampleInput(slot=slot, prompt=p, params=params, record_stability=record) for p in prompts]
    sync()
    t0 = time.perf_counter()
    outs = worker.sample(inputs)
    sync()
    return list(zip(inputs, outs)), time.perf_counter() - t0


def recording_cost(worker, slot, prompts, new) -> dict:
    """Tokens/s and the median full-batch decode step (sampling and recording included), with and
    without the record; and ``head_support`` alone on one step's logits (its device work plus
    its one copy to the host), the rest of the difference being host-side bookkeeping."""
    params = SamplingParams(max_tokens=new, temperature=1.0, seed=1, stop=[])
    out = {}
    for record in (False, True):
        key = "record" if record else "plain"
        sample(worker, slot, prompts, params, record)  # warm-up
        runs, steps = [], []
        for _ in range(2):
            worker.sampler.stats = EngineStats()
            runs.append(sample(worker, slot, prompts, params, record)[1])
            steps += [dt for b, dt in worker.sampler.stats.step_times if b == len(prompts)]
        out[key] = len(prompts) * new / statistics.median(runs)
        out[f"{key}_step_ms"] = 1e3 * statistics.median(steps)
    out["slowdown"] = out["plain"] / out["record"] - 1
    vocab = worker.model.unembed_weight.shape[0]
    raw = torch.randn(len(prompts), vocab, device=DEVICE) * 2
    inv_t = np.ones(len(prompts))
    tokens = torch.randint(0, vocab, (len(prompts),), device=DEVICE)
    times = []
    for _ in range(30):
        sync()
        t0 = time.perf_counter()
        head_support(raw, worker.model.final_logit_softcap, inv_t, tokens, STABILITY_HEAD)
        times.append(time.perf_counter() - t0)
    out["head_support_ms"] = 1e3 * statistics.median(times[5:])
    return out


def datums_of(worker, results) -> tuple[StabilityStore, list[Datum], list[Datum], list[np.ndarray]]:
    """Records of every sample, the cookbook-shaped datums resolved against them, the same datums
    for importance_sampling, and the sampler's logprobs of each sampled token."""
    store = StabilityStore()
    resolved, plain, sampler_lp = [], [], []
    rng = np.random.default_rng(0)
    for r, (inp, out) in enumerate(results):
        for i, seq in enumerate(out.sequences):
            sid = f"{r}:{i}"
            store.put(sid, StabilityRecord.of_sample(SESSION, "s", inp, seq, out.routing_layers))
            P, G = len(inp.prompt), len(seq.tokens)
            tokens = np.concatenate([inp.prompt, seq.tokens[:-1]])
            targets = np.concatenate([inp.prompt[1:], seq.tokens])
            adv = np.concatenate([np.zeros(P - 1), np.full(G, rng.choice([-1.0, 1.0]))]).astype(np.float32)
            lp = np.concatenate([np.zeros(P - 1), seq.logprobs]).astype(np.float32)
            d = Datum(tokens, {"target_tokens": targets, "advantages": adv, "logprobs": lp})
            resolved.append(resolve_datum(store, SESSION, d, [("prompt", sid, 0, P), ("sampled", sid, 0, G - 1)],
                                          [("prompt", sid, 1, P - 1), ("sampled", sid, 0, G)], "bench"))
            plain.append(d)
            sampler_lp.append((P - 1, seq.logprobs, seq.support.logprob))
    return store, resolved, plain, sampler_lp


def gaps(worker, slot, prompts, new, moe: bool) -> dict:
    out = {}
    for mode, params in (("untruncated", SamplingParams(max_tokens=new, temperature=1.0, seed=2, stop=[])),
                         ("truncated", SamplingParams(max_tokens=new, temperature=1.0, top_k=64, top_p=0.95, seed=3,
                                                      stop=[]))):
        results, _ = sample(worker, slot, prompts, params, True)
        _, resolved, plain, ref = datums_of(worker, results)
        row = {}
        (o,) = worker.forward_backward([ForwardBackwardInput(slot, plain, "importance_sampling", forward_only=True)])
        # against the distribution the token was drawn from (processed: truncated, at τ), and
        # against the logprob Ember's sampler returns (the model's own, full vocabulary)
        row["plain"] = _diff([lp[s:] - q for lp, (s, _, q) in zip(o.logprobs, ref)])
        row["plain_vs_returned"] = _diff([lp[s:] - q for lp, (s, q, _) in zip(o.logprobs, ref)])
        variants = [("+support", 0.0)] + ([("+R3", 1.0)] if moe else [])
        for name, replay in variants:
            (o,) = worker.forward_backward([ForwardBackwardInput(slot, resolved, "stable_reinforce",
                                                                 {"routing_replay": replay}, forward_only=True)])
            row[name] = _diff([lp[s:] - q for lp, (s, _, q) in zip(o.logprobs, ref)])
            row[name]["server_gap"] = o.metrics["stability/gap:mean"]
            if moe:
                row[name]["route_flips"] = o.metrics["stability/route_flips:mean"]
                row[name]["route_flip_tokens"] = o.metrics["stability/route_flip_tokens:mean"]
            row["sampler_mass"] = o.metrics["stability/sampler_mass:mean"]
        out[mode] = row
    out["_datums"] = (resolved, plain)
    return out


def _diff(parts: list[np.ndarray]) -> dict:
    d = np.abs(np.concatenate(parts))
    return {"mean": float(d.mean()), "max": float(d.max())}


def loss_cost(worker, slot, resolved, plain, reps: int = 3) -> dict:
    out = {}
    for name, loss, data in (("importance_sampling", "importance_sampling", plain),
                             ("stable_reinforce", "stable_reinforce", resolved)):
        times = []
        for _ in range(reps + 1):
            worker.adapter(slot).flat.grad = None
            sync()
            t0 = time.perf_counter()
            (out_,) = worker.forward_backward([ForwardBackwardInput(slot, data, loss)])
            assert not hasattr(out_, "message"), out_
            sync()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[1:])
    out["ratio"] = out["stable_reinforce"] / out["importance_sampling"]
    out["tokens"] = int(sum(len(d.tokens) for d in plain))
    return out


def profile_steps(worker, slot, prompts, new) -> dict:
    """Where a decode step's time goes, with and without the record: host wall time (each part
    synchronised) of the decoder, the token draw + record (``_sample_into``), ``head_support``
    within it, and the engine step around them, per full-batch step."""
    import ember.core.sampling.engine as eng

    params = SamplingParams(max_tokens=new, temperature=1.0, seed=1, stop=[])
    parts: dict[str, list[float]] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            sync()
            t0 = time.perf_counter()
            r = fn(*a, **k)
            sync()
            parts.setdefault(name, []).append(time.perf_counter() - t0)
            return r
        return wrapper

    originals = (eng.SamplingEngine._run_decoder, eng.SamplingEngine._sample_into, eng.head_support,
                 eng.SamplingEngine._decode)
    out = {}
    try:
        eng.SamplingEngine._run_decoder = timed("decoder", originals[0])
        eng.SamplingEngine._sample_into = timed("sample_into", originals[1])
        eng.head_support = timed("head_support", originals[2])
        eng.SamplingEngine._decode = timed("decode_step", originals[3])
        for record in (False, True):
            parts.clear()
            sample(worker, slot, prompts, params, record)
            out["record" if record else "plain"] = {k: round(1e3 * statistics.median(v), 3) for k, v in parts.items()}
    finally:
        (eng.SamplingEngine._run_decoder, eng.SamplingEngine._sample_into, eng.head_support,
         eng.SamplingEngine._decode) = originals
    # the pieces of head_support on this model's own decode logits (CUDA events, median of 20)
    if DEVICE == "cuda":
        from ember.core.logprobs import row_logsumexp

        hidden = torch.randn(len(prompts), worker.model.config.hidden_size, device=DEVICE, dtype=DTYPE)
        raw = worker.model.model.norm(hidden) @ worker.model.unembed_weight.T
        raw = raw.float()
        t = torch.ones(raw.shape[0], device=DEVICE)
        tokens = torch.zeros(raw.shape[0], dtype=torch.long, device=DEVICE)
        pieces = {"torch.topk": lambda: torch.topk(raw, STABILITY_HEAD, dim=-1),
                  "row_logsumexp": lambda: row_logsumexp(raw, None, t),
                  "head_support": lambda: head_support(raw, None, np.ones(raw.shape[0]), tokens, STABILITY_HEAD)}
        for name, fn in pieces.items():
            times = []
            for _ in range(25):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            out[f"{name}_ms"] = round(statistics.median(times[5:]), 4)
    return out


def run_shape(shape: str, args) -> dict:
    vocab_shape = shape.partition(":")[0]
    worker, slot = build(shape, args.prompts, args.prompt_len, args.new, args.rollout_precision)
    moe = bool(worker.model.moe_routers())
    rng = np.random.default_rng(0)
    vocab = token_vocab(SHAPES[vocab_shape])
    prompts = [rng.integers(0, vocab, args.prompt_len) for _ in range(args.prompts)]
    res = {"shape": shape, "moe": moe, "static_decode": worker.sampler.static is not None,
           "rollout_precision": args.rollout_precision}
    parts = args.parts.split(",")
    if "sampling" in parts:
        res["sampling_tokens_per_s"] = recording_cost(worker, slot, prompts, args.new)
    if args.profile:
        res["step_profile_ms"] = profile_steps(worker, slot, prompts, args.new)
        if args.profile == "only":
            return res
    if "gap" in parts or "loss" in parts:
        g = gaps(worker, slot, prompts[: args.gap_prompts], args.gap_new, moe)
        resolved, plain = g.pop("_datums")
        res["gap"] = g
        if "loss" in parts:
            res["loss_seconds"] = loss_cost(worker, slot, resolved, plain)
    del worker
    torch.cuda.empty_cache() if DEVICE == "cuda" else None
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-8b,qwen3-30b-a3b:12",
                    help="comma-separated bench/common.py shapes, NAME:LAYERS to reduce the layer count")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--gap-prompts", type=int, default=32, help="prompts of the gap and loss measurements")
    ap.add_argument("--gap-new", type=int, default=128)
    ap.add_argument("--profile", choices=("", "also", "only"), default="",
                    help="time the parts of a decode step with and without the record (only: nothing else)")
    ap.add_argument("--rollout-precision", default="bf16", choices=("bf16", "fp8", "mxfp8"),
                    help="the sampler's copy of the base weights (the trainer stays bf16)")
    ap.add_argument("--parts", default="sampling,gap,loss",
                    help="comma list: sampling (recording cost), gap, loss (loss cost; measures the gap too)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    print(hardware_line(), flush=True)
    results = []
    for shape in args.shapes.split(","):
        try:
            results.append(run_shape(shape, args))
        except Exception as e:  # noqa: BLE001 - report the shape's failure and go on
            results.append({"shape": shape, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(results[-1], indent=1), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stability.json").write_text(json.dumps(results, indent=1))
    print("\nshape | sampling tok/s plain / recording (slowdown) | gap mode: plain / +support / +R3 (mean, max) | "
          "flips | fb s IS / SR (ratio)")
    for r in results:
        if "error" in r:
            print(f"{r['shape']} | {r['error']}")
            continue
        if "step_profile_ms" in r:
            print(f"{r['shape']} step parts (ms): {r['step_profile_ms']}")
        if "gap" not in r:
            continue
        s = r.get("sampling_tokens_per_s")
        line = [f"{r['shape']} ({r['rollout_precision']})",
                f"{s['plain']:.0f} / {s['record']:.0f} ({100 * s['slowdown']:+.1f} %)" if s else "-"]
        for mode, row in r["gap"].items():
            cells = " / ".join(f"{row[k]['mean']:.2e}, {row[k]['max']:.2e}" for k in ("plain", "+support", "+R3")
                               if k in row)
            flips = row.get("+support", {}).get("route_flips")
            line.append(f"{mode}: {cells}" + (f" | flips live {flips:.3f}" if flips is not None else ""))
        c = r.get("loss_seconds")
        if c:
            line.append(f"{c['importance_sampling']:.3f} / {c['stable_reinforce']:.3f} ({c['ratio']:.2f}x, "
                        f"{c['tokens']} tokens)")
        print(" | ".join(line))


if __name__ == "__main__":
    main()
