"""GPU check: Inkling-2's FlexAttention path against the exact eager path (forward and gradients).

Run on a CUDA machine (the CPU tests cannot: torch 2.13 runs FlexAttention on the CPU only
uncompiled and without backward)::

    python bench/inkling_flex_check.py            # all checks, ~1-2 min on one H200
    python bench/inkling_flex_check.py --only=kernel,timing   # some of the parts below

1. Kernel: ``PackedRelativeAttention`` with ``backend="flex"`` (compiled) vs ``"eager"`` on packed
   documents (some longer than the window and the relative extent), for a sliding layer
   (window = extent) and a global one, GQA, fp32 and bf16: the output and the gradients of q, k, v,
   the relative profiles and the sinks. Plus central finite differences of the flex path (fp32)
   along random directions of the profiles and the sinks (the tensors that only reach the kernel
   through ``score_mod`` and the log-sum-exp).
2. Model: a small random Inkling-2 on the GPU, logprobs and LoRA gradients with the flex backend
   vs the eager backend: in fp32 against each other; in bf16 each against the fp32 pass over the
   same rounded weights (flex no worse than eager).
3. Timing (information only): forward + backward of one sliding and one global layer's attention
   at 16k tokens, flex vs eager.
4. Dynamic shapes (information only): forward + backward at Inkling-2-Small's training shape,
   compiled for static shapes, for dynamic ones, and as the flex path runs (dynamic, padded to
   the tile, ``IS_DIVISIBLE``), for two batch compositions.
5. Compile (information only; run it alone, ``--only=compile``, so nothing is compiled before it):
   the wall time of each first use at Inkling-2-Small's attention shape (48/8 heads × 128,
   extent 1024) over 8 documents of 2048 tokens: the block masks, a no-grad forward, a training
   pass whose bias needs no gradient (the first layer's, whose input needs none), one whose bias
   does, another window (global), then other batch compositions (which should reuse the code).

Prints every error with its tolerance; exits 1 if one fails. ``--dry-run`` exercises this script
on the CPU with the eager backend standing in for flex (smaller sizes, no timing): it checks the
script, not FlexAttention.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ember.core.adapters import LoraConfig
from ember.core.config import config_from_hf
from ember.core.layers.relative_attention import PackedRelativeAttention, RelativeAttentionSpec
from ember.core.loading import build_empty
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput

FAILED: list[str] = []
DRY = "--dry-run" in sys.argv
DEVICE = "cpu" if DRY else "cuda"
FLEX = "eager" if DRY else "flex"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def report(name: str, err: float, tol: float) -> None:
    ok = err <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {err:.2e} (tol {tol:.0e})", flush=True)
    if not ok:
        FAILED.append(name)


def attention_inputs(seq_lens, hq, hkv, d, r, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    T = sum(seq_lens)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype).requires_grad_()

    q, k, v = rnd(T, hq, d), rnd(T, hkv, d), rnd(T, hkv, d)
    profiles, sinks = rnd(T, hq, r), rnd(T, hq, scale=2.0)
    positions = torch.cat([torch.arange(n, device=DEVICE) for n in seq_lens])
    return [q, k, v, profiles, sinks], positions


def run_attention(backend, inputs, positions, seq_lens, spec, scale, dout):
    for t in inputs:
        t.grad = None
    out = PackedRelativeAttention(seq_lens, positions, backend=backend)(*inputs, spec, scale)
    out.backward(dout)
    return out.detach(), [t.grad.detach().clone() for t in inputs]


def check_kernel() -> None:
    seq_lens = [150, 70, 210, 37, 30] if DRY else [1500, 700, 2100, 37, 300]
    hq, hkv, d = 8, 2, 128
    window, extent = (51, 76) if DRY else (512, 768)
    specs = {
        "sliding": RelativeAttentionSpec(window=window, rel_extent=window),
        "global": RelativeAttentionSpec(window=None, rel_extent=extent),
    }
    names = ["out", "dq", "dk", "dv", "dprofiles", "dsinks"]
    for label, spec in specs.items():
        r = spec.rel_extent
        ref_in, pos = attention_inputs(seq_lens, hq, hkv, d, r, torch.float32)
        g = torch.Generator(device=DEVICE).manual_seed(1)
        dout = torch.randn(sum(seq_lens), hq, d, generator=g, device=DEVICE)
        ref_out, ref_grads = run_attention("eager", ref_in, pos, seq_lens, spec, d**-0.5, dout)
        refs = [ref_out, *ref_grads]
        # fp32: flex against eager, same inputs
        out, grads = run_attention(FLEX, ref_in, pos, seq_lens, spec, d**-0.5, dout)
        for n, a, b in zip(names, [out, *grads], refs):
            report(f"{label} fp32 flex vs eager {n}", rel(a, b), 2e-4)
        # bf16: flex and eager both against the fp32 eager result; flex must be no worse
        bf_in = [t.detach().to(torch.bfloat16).requires_grad_() for t in ref_in]
        e_out, e_grads = run_attention("eager", bf_in, pos, seq_lens, spec, d**-0.5, dout.bfloat16())
        f_out, f_grads = run_attention(FLEX, bf_in, pos, seq_lens, spec, d**-0.5, dout.bfloat16())
        for n, fe, ee, b in zip(names, [f_out, *f_grads], [e_out, *e_grads], refs):
            report(f"{label} bf16 flex err {n} (bf16 eager err {rel(ee, b):.1e})", rel(fe, b), 2 * rel(ee, b) + 1e-2)


def check_finite_differences() -> None:
    """d/dε of <dout, flex(x + ε u)> by central differences vs autograd, for profiles and sinks."""
    seq_lens = [300, 200]
    spec = RelativeAttentionSpec(window=None, rel_extent=128)
    inputs, pos = attention_inputs(seq_lens, 4, 2, 64, 128, torch.float32, seed=3)
    g = torch.Generator(device=DEVICE).manual_seed(4)
    dout = torch.randn(sum(seq_lens), 4, 64, generator=g, device=DEVICE)
    _, grads = run_attention(FLEX, inputs, pos, seq_lens, spec, 0.125, dout)
    attn = PackedRelativeAttention(seq_lens, pos, backend=FLEX)
    for idx, name in ((3, "profiles"), (4, "sinks")):
        u = torch.randn(inputs[idx].shape, generator=g, device=DEVICE)
        eps = 1e-2
        with torch.no_grad():
            vals = []
            for sign in (1, -1):
                shifted = [t.detach() for t in inputs]
                shifted[idx] = shifted[idx] + sign * eps * u
                vals.append(float((attn(*shifted, spec, 0.125).double() * dout.double()).sum()))
        fd = (vals[0] - vals[1]) / (2 * eps)
        ad = float((grads[idx].double() * u.double()).sum())
        report(f"finite differences d{name} (fd {fd:.4e}, autograd {ad:.4e})", abs(fd - ad) / max(abs(ad), 1e-6), 2e-2)


TINY = {
    "model_type": "inkling2_text",
    "vocab_size": 512,
    "unpadded_vocab_size": 500,
    "hidden_size": 256,
    "num_hidden_layers": 7,
    "layer_types": ["hybrid"] + ["hybrid_sliding"] * 4 + ["hybrid", "hybrid_sliding"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 1,
    "swa_head_dim": 64,
    "sliding_window_size": 64,
    "d_rel": 16,
    "rel_extent": 96,
    "log_scaling_n_floor": 100,
    "qk_l2_clip_threshold": 8.0,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_layers_per_attn_res_block": 3,
    "final_logit_softcapping": 30.0,
}


def random_inkling(dtype: torch.dtype, seed: int = 0, std: float = 0.1, rounded: bool = False):
    """A random tiny Inkling-2 in ``dtype`` (its fp32 parameters stay fp32). ``rounded``: the
    weights go through bf16 first, so an fp32 model computes exactly what the bf16 one holds."""
    cfg = config_from_hf(dict(TINY))
    model = build_empty(cfg)
    model.to_empty(device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", ".scale")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g, device=DEVICE))
            elif name.endswith("e_score_correction_bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=DEVICE) * std)
    for name, p in model.named_parameters():
        if rounded:
            p.data = p.data.to(torch.bfloat16).float()
        if not name.endswith(model.fp32_parameters):
            p.data = p.data.to(dtype)
    return model.eval()


def model_run(model, backend: str, seqs, weights, memory: str = "auto"):
    """Logprobs and LoRA gradients of one pass. ``memory`` is the worker's activation policy:
    ``auto`` keeps everything where the pass fits, ``off`` always rebuilds norm and activation
    outputs in the backward (ember.core.rebuild), so the compiled kernel runs under its hooks."""
    model.attention_backend = backend
    worker = Worker(model, activation_checkpointing=memory)
    slot = worker.create_adapter(LoraConfig(rank=8, alpha=16.0, seed=1))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for t in worker.adapter(slot).tensors().values():
            t.copy_(torch.randn(t.shape, generator=g) * 0.05)
    datums = [Datum(np.array(s[:-1]), {"target_tokens": np.array(s[1:]), "weights": w}) for s, w in zip(seqs, weights)]
    (out,) = worker.forward_backward([ForwardBackwardInput(slot, datums, "cross_entropy")])
    lps = torch.cat([torch.from_numpy(x) for x in out.logprobs])
    return lps, {k: v.detach().float().cpu() for k, v in worker.adapter(slot).grads().items()}


def check_model() -> None:
    """fp32: flex against eager on the same model. bf16: flex and eager both against the fp32
    eager pass over the same (bf16-rounded) weights, and flex must be no worse, as in the kernel
    check. Comparing the two bf16 passes with each other measures nothing useful: this random
    model amplifies rounding (bf16 weights alone move its logprobs by up to 3.4 at std 0.1), so the
    bf16 part uses std 0.02 and judges the mean logprob error."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 500, n).tolist() for n in (300, 45, 700, 128)]
    weights = [rng.random(len(s) - 1).astype(np.float32) for s in seqs]

    model = random_inkling(torch.float32)
    lp_e, g_e = model_run(model, "eager", seqs, weights)
    lp_f, g_f = model_run(model, FLEX, seqs, weights, memory="off")  # flex, rebuilt, vs eager, kept
    report("model float32 logprobs flex vs eager (max abs)", float((lp_f - lp_e).abs().max()), 1e-4)
    name = max(g_e, key=lambda k: rel(g_f[k], g_e[k]))
    report(f"model float32 LoRA grads flex vs eager (worst: {name})", rel(g_f[name], g_e[name]), 1e-3)

    lp_ref, g_ref = model_run(random_inkling(torch.float32, std=0.02, rounded=True), "eager", seqs, weights)
    model = random_inkling(torch.bfloat16, std=0.02, rounded=True)
    lp_e, g_e = model_run(model, "eager", seqs, weights)
    lp_f, g_f = model_run(model, FLEX, seqs, weights, memory="off")
    err_e, err_f = float((lp_e - lp_ref).abs().mean()), float((lp_f - lp_ref).abs().mean())
    report(f"model bf16 logprobs flex err (mean abs; bf16 eager err {err_e:.1e})", err_f, 2 * err_e + 1e-3)
    # each LoRA tensor's gradient: flex's error against fp32 no worse than twice eager's
    margin = {k: rel(g_f[k], g_ref[k]) - 2 * rel(g_e[k], g_ref[k]) for k in g_ref}
    name = max(margin, key=margin.get)
    err_e = rel(g_e[name], g_ref[name])
    report(f"model bf16 LoRA grads flex err (tightest: {name}; bf16 eager err {err_e:.1e})",
           rel(g_f[name], g_ref[name]), 2 * err_e + 1e-2)


# Inkling-2-Small's two kinds of attention layer (window and relative extent 1024)
SMALL_SPECS = {
    "sliding": RelativeAttentionSpec(window=1024, rel_extent=1024),
    "global": RelativeAttentionSpec(window=None, rel_extent=1024),
}


def timed(fn, *args, iters: int = 3) -> float:
    """Milliseconds per call of ``fn(*args)`` after one warm-up (compile) call."""
    fn(*args)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def timing() -> None:
    """Forward + backward times (information only). The eager path materialises chunked score
    matrices and keeps them for backward, so it runs at 4k tokens; flex also at 16k."""
    for label, spec in SMALL_SPECS.items():
        for tokens, backends in ((4096, ("flex", "eager")), (16384, ("flex",))):
            seq_lens = [tokens]
            inputs, pos = attention_inputs(seq_lens, 48, 8, 128, spec.rel_extent, torch.bfloat16)
            dout = torch.randn(tokens, 48, 128, device=DEVICE, dtype=torch.bfloat16)
            for backend in backends:
                ms = timed(run_attention, backend, inputs, pos, seq_lens, spec, 128**-0.5, dout)
                print(f"time {label} {tokens} tokens, 48/8 heads x 128, bf16, fwd+bwd, {backend}: {ms:.1f} ms")


def dynamic_shapes() -> None:
    """Forward + backward of the compiled flex path at Inkling-2-Small's training shape (16k
    tokens in documents, 48/8 heads × 128, extent 1024), each mode from a clean slate
    (information only):

    * ``static``: compiled for static shapes (Dynamo's first compilation of a batch composition,
      the only one a bench repeating one batch runs);
    * ``dynamic``: dynamic shapes, no promise about the length (what Dynamo's default ran for
      every later composition);
    * ``ember``: dynamic shapes over a length padded to a multiple of 128, with
      ``relative_attention.FLEX_KERNEL_OPTIONS`` (what the flex path runs now)."""
    from torch.nn.attention.flex_attention import flex_attention

    from ember.core.layers import relative_attention

    defaults = relative_attention._compiled_flex, relative_attention.FLEX_KERNEL_OPTIONS
    for mode in ("static", "dynamic", "ember"):
        torch._dynamo.reset()
        # one compiled wrapper per mode, as relative_attention._compiled_flex keeps one
        relative_attention._compiled_flex = functools.cache(
            functools.partial(torch.compile, flex_attention, dynamic=mode != "static")
        )
        relative_attention.FLEX_KERNEL_OPTIONS = defaults[1] if mode == "ember" else {}
        for lens in ([2048] * 8, [3000] * 5 + [1300]):
            for label, spec in SMALL_SPECS.items():
                inputs, pos = attention_inputs(lens, 48, 8, 128, spec.rel_extent, torch.bfloat16)
                dout = torch.randn(sum(lens), 48, 128, device=DEVICE, dtype=torch.bfloat16)
                ms = timed(run_attention, "flex", inputs, pos, lens, spec, 128**-0.5, dout)
                print(f"time {mode} {label} {len(lens)} documents, {sum(lens)} tokens, fwd+bwd: {ms:.2f} ms")
    relative_attention._compiled_flex, relative_attention.FLEX_KERNEL_OPTIONS = defaults
    torch._dynamo.reset()


def compile_split() -> None:
    """Wall seconds of each first use of the compiled FlexAttention (information only)."""
    sliding, glob = SMALL_SPECS["sliding"], SMALL_SPECS["global"]

    def stage(label, fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        print(f"compile {label}: {time.perf_counter() - t:.1f} s", flush=True)

    def train(seq_lens, spec, bias_grad=True):
        inputs, pos = attention_inputs(seq_lens, 48, 8, 128, spec.rel_extent, torch.bfloat16)
        if not bias_grad:
            inputs[3] = inputs[3].detach()
            inputs[4] = inputs[4].detach()
        out = PackedRelativeAttention(seq_lens, pos, backend="flex")(*inputs, spec, 128**-0.5)
        out.backward(torch.ones_like(out))

    def forward(seq_lens, spec):
        inputs, pos = attention_inputs(seq_lens, 48, 8, 128, spec.rel_extent, torch.bfloat16)
        with torch.no_grad():
            PackedRelativeAttention(seq_lens, pos, backend="flex")(*inputs, spec, 128**-0.5)

    eight = [2048] * 8
    pos = torch.cat([torch.arange(n, device=DEVICE) for n in eight])
    stage("block mask, sliding", lambda: PackedRelativeAttention(eight, pos).block_mask(1024))
    stage("block mask, global", lambda: PackedRelativeAttention(eight, pos).block_mask(None))
    stage("forward, no grad", lambda: forward(eight, sliding))
    stage("train, bias without grad", lambda: train(eight, sliding, bias_grad=False))
    stage("train, bias with grad", lambda: train(eight, sliding))
    stage("train again (cached)", lambda: train(eight, sliding))
    stage("train, global window", lambda: train(eight, glob))
    stage("train, 6 x 2048 + 1000 (new shape)", lambda: train([2048] * 6 + [1000], sliding))
    stage("train, 3 x 3000 (another shape)", lambda: train([3000] * 3, sliding))
    stage("forward, no grad, another shape", lambda: forward([3000] * 3, sliding))


def main() -> int:
    if not DRY and not torch.cuda.is_available():
        print("needs a CUDA device (or --dry-run)")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # This script compiles many variants in one process (dtypes, head counts, gradient modes).
    # Past Dynamo's limit of 8 it would silently run flex_attention unfused and check that instead.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    print(torch.__version__, "dry run on the CPU" if DRY else torch.cuda.get_device_name())
    parts = {"kernel": check_kernel, "fd": check_finite_differences, "model": check_model, "timing": timing,
             "dynamic": dynamic_shapes, "compile": compile_split}
    default = [p for p in parts if p != "compile"]  # compile: alone, in a fresh process
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--only=")), default)
    for name in only:
        if name in ("timing", "dynamic", "compile") and DRY:
            continue
        parts[name]()
    print("FAILED:" if FAILED else "all checks passed", *FAILED, sep="\n  ")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
