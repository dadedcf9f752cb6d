"""Correctness of the parallel engine against one process (issue 15, item 1): the same random
weights, the same adapter and the same batch, on ``--nproc`` ranks (NCCL on GPUs, gloo on the CPU)
and in one process.

Reported, each next to the noise it should be judged by (one process in the model's dtype
against one process in fp32, the same weights):

* per-token target logprobs of a LoRA ``forward_backward`` (max and mean |Δ|);
* the LoRA gradients, every tensor of the adapter (relative error of the largest, and overall);
* the gradient norm that ``optim_step`` reports (and the fp64 norm of the exported gradient);
* sampled tokens with fixed seeds (sequences identical, mean length of the common prefix) and the
  logprobs of the tokens both drew, and whether each decoded through the static (CUDA-graph)
  decoder (by default the engine does not use it for sharded models; ``--static-decode`` makes
  both sides use it: the split projections' collectives, and under expert parallelism the
  experts' all-reduce, are then captured in the graphs).

The gradients leave each worker through its own export: every rank copies its adapter's
gradient into the adapter's weights, and ``export_peft`` gathers them into a PEFT folder as it
would the weights.

    python3 bench/parallel_check.py --shape qwen3-30b-a3b --layers 2 --nproc 2 --ep 2     # GPUs, NCCL
    python3 bench/parallel_check.py --shape qwen3-8b --layers 2 --nproc 2 --tp 2
    python3 bench/parallel_check.py --shape qwen3-8b --layers 2 --nproc 2 --tp 2 --static-decode
    python3 bench/parallel_check.py --shape qwen3-30b-a3b --layers 2 --nproc 2 --ep 2 --static-decode
    python3 bench/parallel_check.py --shape tiny-moe --nproc 2 --ep 2 --seq-len 24     # CPU, gloo
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SHAPES, hardware_line, hf_model_like, random_ember_model, run_ranks, token_vocab
from ember.core.adapters import LoraConfig
from ember.core.loading import load_model
from ember.core.optim import AdamParams
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput, ForwardBackwardOutput, SampleInput, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
HP = AdamParams(learning_rate=1e-4)


def _inputs(args, vocab: int):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, vocab, args.seq_len + 1) for _ in range(args.seqs)]
    prompts = [rng.integers(0, vocab, args.prompt_len) for _ in range(args.prompts)]
    return seqs, prompts


def _run(worker, slot: int, seqs, prompts, args, grads_dir: Path | None) -> dict:
    """The checks' outputs of one worker (every rank of a sharded one runs this in step)."""
    data = [Datum(s[:-1], {"target_tokens": s[1:], "weights": np.ones(len(s) - 1, np.float32)}) for s in seqs]
    out = worker.forward_backward([ForwardBackwardInput(slot, data, "cross_entropy")])[0]
    if not isinstance(out, ForwardBackwardOutput):
        raise TypeError(f"the pass failed: {out}")
    result = {"logprobs": np.concatenate([np.asarray(lp, np.float64) for lp in out.logprobs])}
    if grads_dir is not None:  # the gradient, exported as if it were the adapter's weights
        adapter = worker.bank.get(slot)
        with torch.no_grad():
            weights = adapter.flat.detach().clone()
            adapter.flat.copy_(adapter.flat.grad)
        worker.export_peft(slot, grads_dir, "check")
        with torch.no_grad():
            adapter.flat.copy_(weights)
    result["grad_norm"] = worker.optim_step(slot, HP)["grad_norm"]
    params = SamplingParams(max_tokens=args.new, temperature=1.0, seed=7)
    outs = worker.sample([SampleInput(slot, p, params) for p in prompts])
    result["samples"] = [(o.sequences[0].tokens.tolist(), o.sequences[0].logprobs.tolist()) for o in outs]
    # whether the decode steps ran through the static (CUDA-graph) decoder
    result["static_decoder"] = worker.sampler.static is not None
    return result


def _sampler(args):
    """The sampler's configuration: the engine's default, or the static decoder on both sides."""
    from ember.core.sampling import SamplerConfig

    return SamplerConfig(static_decode=True) if args.static_decode else None


def _reference(args, cfg, seqs, prompts, tmp: Path) -> tuple[dict, dict]:
    """One process in the model's dtype and in fp32 (the noise). Writes what the ranks load: the
    model as a Hugging Face folder (through transformers, so that each rank reads its shards of
    the same weights as a served model does) and the adapter."""
    model = random_ember_model(cfg, DEVICE, DTYPE, seed=0)
    hf_model_like(model, cfg, DTYPE, DEVICE).save_pretrained(str(tmp / "model"))
    worker = Worker(model, max_adapters=2, max_rank=max(64, args.rank), sampler_config=_sampler(args))
    slot = worker.create_adapter(LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=frozenset(("attn", "mlp"))))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B too, so that the adapter changes the logprobs
        flat = worker.bank.get(slot).flat
        flat.copy_((torch.randn(flat.shape, generator=gen) * 0.02).to(flat.device, flat.dtype))
    worker.export_peft(slot, tmp / "adapter", "check")
    worker.free_adapter(slot)
    ref = _run(worker, worker.import_peft(tmp / "adapter"), seqs, prompts, args, tmp / "grads_ref")
    del worker
    fp32 = copy.deepcopy(model).float() if DTYPE != torch.float32 else model
    del model
    worker = Worker(fp32, max_adapters=2, max_rank=max(64, args.rank), sampler_config=_sampler(args))
    noise = _run(worker, worker.import_peft(tmp / "adapter"), seqs, prompts, args, tmp / "grads_fp32")
    del worker, fp32
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return ref, noise


def _rank(rank: int, world: int, args, cfg, seqs, prompts, tmp: str) -> dict | None:
    from ember.dist.mesh import Parallel
    from ember.dist.parallelize import parallelize
    from ember.engine.sharded import ShardedWorker

    par = Parallel(args.ep, args.tp)
    device = f"cuda:{rank}" if DEVICE == "cuda" else "cpu"
    model = load_model(Path(tmp) / "model", device, DTYPE, parallelize=lambda m: parallelize(m, par))
    worker = ShardedWorker(model, par, max_adapters=2, max_rank=max(64, args.rank), sampler_config=_sampler(args))
    slot = worker.import_peft(Path(tmp) / "adapter")
    out = _run(worker, slot, seqs, prompts, args, Path(tmp) / "grads_par")
    return out if rank == 0 else None


def _grads(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}


def _grad_errors(got: dict, want: dict) -> tuple[float, float]:
    """(largest relative error of a tensor, relative error of all of them together)."""
    if set(got) != set(want):
        raise RuntimeError(f"the exports hold different tensors: {sorted(set(got) ^ set(want))[:4]}")
    worst = max(float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)) for k in want)
    total = sum(float((got[k] - want[k]).norm() ** 2) for k in want) ** 0.5
    return worst, total / sum(float(want[k].norm() ** 2) for k in want) ** 0.5


def _samples(got: list, want: list) -> dict:
    same = sum(g[0] == w[0] for g, w in zip(got, want))
    prefixes, deltas = [], []
    for (gt, glp), (wt, wlp) in zip(got, want):
        n = next((i for i, (a, b) in enumerate(zip(gt, wt)) if a != b), min(len(gt), len(wt)))
        prefixes.append(n)
        deltas += [abs(a - b) for a, b in zip(glp[:n], wlp[:n])]
    return {"identical": f"{same}/{len(want)}", "mean_common_prefix": float(np.mean(prefixes)),
            "max_logprob_delta_on_common_tokens": max(deltas) if deltas else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--static-decode", action="store_true",
                    help="decode through the static (CUDA-graph) decoder on both sides")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args()
    if args.ep == 1 and args.tp == 1:
        raise SystemExit("--ep or --tp must be above 1")
    cfg = dict(SHAPES[args.shape])
    if args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
        for key in ("layer_types", "mlp_only_layers"):  # per-layer lists follow the cut
            if isinstance(cfg.get(key), list):
                cfg[key] = cfg[key][: args.layers]
    print(hardware_line(), flush=True)
    seqs, prompts = _inputs(args, token_vocab(cfg))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ref, noise = _reference(args, cfg, seqs, prompts, tmp)
        par = run_ranks(args.nproc, _rank, args, cfg, seqs, prompts, tmp_name)
        if "error" in par:
            raise SystemExit(f"parallel run failed: {par['error']}")
        g_ref, g_fp32, g_par = (_grads(tmp / n) for n in ("grads_ref", "grads_fp32", "grads_par"))
    lp = {"parallel": np.abs(par["logprobs"] - ref["logprobs"]), "noise": np.abs(noise["logprobs"] - ref["logprobs"])}
    report = {
        "shape": args.shape, "layers": cfg["num_hidden_layers"], "nproc": args.nproc, "ep": args.ep, "tp": args.tp,
        "dtype": str(DTYPE), "device": DEVICE,
        "logprobs": {k: {"max": float(v.max()), "mean": float(v.mean())} for k, v in lp.items()},
        "grads": {"parallel": _grad_errors(g_par, g_ref), "noise": _grad_errors(g_fp32, g_ref)},
        # what optim_step reports (ember.core.optim.total_norm: fp32 partial sums on CUDA, float64
        # on the CPU), and the fp64 norm of the one process's exported gradient
        "grad_norm": {"one process": ref["grad_norm"], "parallel": par["grad_norm"], "fp32": noise["grad_norm"],
                      "exact": sum(float(v.norm() ** 2) for v in g_ref.values()) ** 0.5},
        "samples": {"parallel": _samples(par["samples"], ref["samples"]),
                    "noise": _samples(noise["samples"], ref["samples"])},
        "static_decoder": {"one process": ref["static_decoder"], "parallel": par["static_decoder"]},
    }
    print(json.dumps(report, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"parallel_check_{args.shape}_ep{args.ep}_tp{args.tp}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
