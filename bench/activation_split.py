"""What a LoRA training forward keeps for its backward, per token and layer, split by the code that
keeps it: the memory split behind ``--activation-checkpointing auto`` (issue 17, item 3).

Every tensor that autograd saves during the forward of a ``forward_backward`` (cross-entropy, LoRA
rank --rank on attention and MLP, no checkpointing) is attributed to the innermost Ember function
on the stack when it was saved, and to the decoder layer running then; tensors sharing a storage
count once (the first to save it names it). Tensors that existed before the pass (weights, the
adapter bank) are left out. Per token is the difference of passes of --tokens and twice as many
(what does not grow with the tokens, such as the pass's bf16 copy of the adapter, is shown apart),
averaged over the layers of each kind; routed experts' rows are k per token and count k times.

Two columns: as the engine runs (``ember.core.rebuild`` on: norm and activation outputs saved as
recipes and made again in the backward) and with that off. Runs on the CPU (autograd keeps the
same tensors on every device in the dtype given; attention is made to keep what flash attention
keeps on CUDA: q, k, v, the output and the log-sum-exp; Gated DeltaNet runs Ember's PyTorch rule,
which keeps more than fla's kernels) and on the GPU:

    PYTHONPATH=. python3 bench/activation_split.py --shape qwen3-30b-a3b --layers 2 --tokens 256
    PYTHONPATH=. python3 bench/activation_split.py --shape qwen3-8b --layers 2 --tokens 256
    PYTHONPATH=. python3 bench/activation_split.py --shape inkling2-small-3l --layers 3 --experts 16

``--layers`` keeps the shape's first layers (the widths are the shape's own); the LM head and
embedding use a vocabulary of --vocab rows (they are not per layer). Each kind's line ends with
the estimate of ``ember.core.checkpointing.layer_elements``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SHAPES, random_ember_model
from ember.core import rebuild
from ember.core.adapters import LoraConfig
from ember.core.checkpointing import layer_elements
from ember.core.layers import attention
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput

EMBER = os.sep + "ember" + os.sep


def _label() -> str:
    """``file:function`` of the innermost Ember frame on the stack (the code that saved a tensor)."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if EMBER in path and not path.endswith("rebuild.py"):
            rel = path.split(EMBER, 1)[1].removesuffix(".py")
            return f"{rel}:{f.f_code.co_qualname}"
        f = f.f_back
    return "?"


class Split:
    """The distinct storages that the forward saves, by (layer, label), seen through
    ``ember.core.rebuild.observing`` (its hooks are the innermost of a training forward)."""

    def __init__(self, existing: set[int]):
        self.existing = existing
        self.layer = -1  # the decoder layer running (-1: outside the layers: embedding, head)
        self.forward = False  # in the pass's forward (not its backward's recomputes)
        self.seen: dict[int, tuple] = {}

    def __call__(self, t: torch.Tensor) -> None:
        if not self.forward:
            return
        s = t.untyped_storage()
        key = s.data_ptr()
        if key not in self.seen and key not in self.existing and s.nbytes() > 0:
            self.seen[key] = (self.layer, _label(), s.nbytes(), tuple(t.shape), str(t.dtype))


class _FlashLike(torch.autograd.Function):
    """Causal attention of one document that keeps what flash attention keeps on CUDA (q, k, v,
    the output and an fp32 log-sum-exp per head and query) and recomputes the rest in backward. On
    the CPU, SDPA's math path would keep the ``[H, n, n]`` probabilities, which no GPU run keeps."""

    @staticmethod
    def forward(ctx, q, k, v, spec, scale):
        with torch.no_grad():
            out = _sdpa_document(q, k, v, spec, scale).contiguous()  # flash's output is [n, H, D], contiguous
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.scale = spec, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, _, _ = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            out = _sdpa_document(q, k, v, ctx.spec, ctx.scale)
            gq, gk, gv = torch.autograd.grad(out, (q, k, v), g)
        return gq, gk, gv, None, None


_sdpa_document = attention.sdpa_document


def _storages() -> set[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated module attributes
        return {t.untyped_storage().data_ptr() for t in gc.get_objects() if isinstance(t, torch.Tensor)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2, help="the shape's first N layers")
    ap.add_argument("--tokens", type=int, default=256, help="tokens of the smaller pass (one sequence)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=None,
                    help="routed experts per MoE layer (default: the shape's); fewer fit the CPU's memory and "
                         "keep the same per token, but for the router's scores (4 bytes per expert)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    cfg = dict(SHAPES[args.shape])
    cfg["num_hidden_layers"] = args.layers
    for key in ("layer_types", "mlp_only_layers"):
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][: args.layers]
    cfg["vocab_size"] = args.vocab
    if "unpadded_vocab_size" in cfg:
        cfg["unpadded_vocab_size"] = args.vocab
    if args.experts is not None:
        for key in ("num_experts", "n_routed_experts"):
            if key in cfg:
                cfg[key] = args.experts
        if "n_group" in cfg:  # grouped routers: groups must divide the experts
            cfg["n_group"] = cfg["topk_group"] = 1
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = random_ember_model(cfg, args.device, dtype)
    worker = Worker(model, max_adapters=1, max_rank=max(64, args.rank), activation_checkpointing="off")
    slot = worker.create_adapter(LoraConfig(rank=args.rank, alpha=32.0, targets=frozenset(("attn", "mlp"))))
    if args.device == "cpu":  # what flash attention keeps on CUDA, not the math path's probabilities
        attention.sdpa_document = lambda q, k, v, spec, scale: _FlashLike.apply(q, k, v, spec, scale)
    layers = model.model.layers
    split = Split(_storages())
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: setattr(split, "layer", i))
        layer.register_forward_hook(lambda m, a, o: setattr(split, "layer", -1))
    logprobs = worker.logprobs

    def recorded(*a, **kw):  # the forward only: a backward's recomputes keep nothing
        split.forward = True
        try:
            return logprobs(*a, **kw)
        finally:
            split.forward = False

    worker.logprobs = recorded

    def kept(tokens: int) -> tuple[dict, dict]:
        """(layer, label) -> bytes kept by a pass of ``tokens`` tokens; label -> shapes seen."""
        split.seen = {}
        seq = np.random.default_rng(tokens).integers(0, args.vocab, tokens + 1)
        datum = Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(tokens, np.float32)})
        with rebuild.observing(split):
            worker.forward_backward([ForwardBackwardInput(slot, [datum], "cross_entropy")])
        out, shapes = collections.defaultdict(int), collections.defaultdict(set)
        for layer, label, nbytes, shape, dt in split.seen.values():
            out[layer, label] += nbytes
            shapes[label].add(f"{list(shape)} {dt.removeprefix('torch.')}")
        return out, shapes

    T = args.tokens
    per, fixed, shapes = {}, {}, collections.defaultdict(set)
    for mode in (True, False):
        rebuild.enabled = mode
        one, _ = kept(T)
        two, seen = kept(2 * T)
        for lab, s in seen.items():
            shapes[lab] |= s
        for key in set(one) | set(two):
            per[mode, key] = (two.get(key, 0) - one.get(key, 0)) / T / 1000
            fixed[mode, key] = (2 * one.get(key, 0) - two.get(key, 0)) / 1e6
    estimate = layer_elements(model)
    kinds: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, layer in enumerate(layers):
        kinds[type(layer).__name__, estimate[i]].append(i)
    print(f"{args.shape}, first {args.layers} layers, passes of {T} and {2 * T} tokens, {args.dtype}, "
          f"LoRA rank {args.rank} (attn+mlp), {args.device}: KB per token kept for backward "
          f"(as run, with ember.core.rebuild | without)")

    def kb(mode, idx, lab=None):
        return sum(v for (m, (i, lb)), v in per.items() if m == mode and i in idx and lab in (None, lb)) / len(idx)

    for (name, est), idx in kinds.items():
        labels = sorted({lb for (_, (i, lb)) in per if i in idx}, key=lambda lb: -kb(False, idx, lb))
        each = ", ".join(f"{kb(True, [i]):.1f}" for i in idx)
        print(f"\n{name} (layers {idx}): {kb(True, idx):.1f} | {kb(False, idx):.1f} KB/token (each: {each}); "
              f"estimate {est * dtype.itemsize / 1000:.1f} (checkpointing.layer_elements)")
        for lab in labels:
            mb = sum(v for (m, (i, lb)), v in fixed.items() if m and i in idx and lb == lab) / len(idx)
            extra = f"  (+{mb:.1f} MB a pass)" if abs(mb) >= 0.1 else ""
            print(f"  {kb(True, idx, lab):8.2f} | {kb(False, idx, lab):8.2f}  {lab}{extra}   "
                  f"{'; '.join(sorted(shapes[lab]))[:90]}")
    print(f"\noutside the layers (embedding, LM head; vocabulary {args.vocab}): "
          f"{kb(True, [-1]):.1f} | {kb(False, [-1]):.1f} KB/token")


if __name__ == "__main__":
    main()
