"""The fp8 rollout product's activation quantisation on a GPU: the PyTorch version
(``rollout_precision._quantize_act_torch``, several kernels) against the Triton kernel
(``ember.core.kernels.fp8_quant``, one launch), and what each makes of the whole fp8 product
(quantisation + ``scaled_mm``) next to bf16 ``F.linear``, at Qwen3-8B's projection shapes. Checks
first that the kernel's bytes and scales equal PyTorch's on the GPU, bit for bit.

    PYTHONPATH=. python3 bench/fp8_act_quant.py
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import graph_us
from bench.rollout_fp8_check import _time
from ember.core import rollout_precision as rp
from ember.core.kernels import fp8_quant
from ember.core.layers.lora import LoraLinear

# Qwen3-8B (hidden 4096, intermediate 12288): (name, K, N)
SHAPES = (("q/o 4096->4096", 4096, 4096), ("down 12288->4096", 12288, 4096),
          ("gate+up 4096->24576", 4096, 24576))
ROWS = (64, 256, 2048)


@contextlib.contextmanager
def _torch_quant(dev: torch.device):
    """``rp._quantize_act`` takes the PyTorch path inside."""
    old = rp._TRITON_QUANT_OK.get(dev, True)
    rp._TRITON_QUANT_OK[dev] = False
    try:
        yield
    finally:
        rp._TRITON_QUANT_OK[dev] = old


@contextlib.contextmanager
def _fixed_quant(xq: torch.Tensor, xs: torch.Tensor):
    """``rp._scaled_mm_fp8`` multiplies precomputed ``(xq, xs)``: ``scaled_mm`` alone."""
    old = rp._quantize_act
    rp._quantize_act = lambda x, outer_major_scales=False: (xq, xs)
    try:
        yield
    finally:
        rp._quantize_act = old


def _diff(q, s, rq, rs) -> tuple[int, int]:
    """(bytes that differ, scales that differ)."""
    q, rq = q.view(torch.uint8).cpu(), rq.view(torch.uint8).cpu()
    return int((q != rq).sum()), int((s.cpu().view(torch.int32) != rs.cpu().view(torch.int32)).sum())


def _same(x: torch.Tensor, what) -> bool:
    """The kernel's bytes and scales (both layouts) equal the PyTorch version's on the GPU, and the
    PyTorch version's on the GPU equal its on the CPU; prints the counts of what differs."""
    rq, rs = rp._quantize_act_torch(x)
    cq, cs = rp._quantize_act_torch(x.cpu())
    bad = {"torch GPU vs CPU": _diff(rq, rs, cq, cs)}
    layout = True
    for outer in (False, True):
        q, s = fp8_quant.quantize_act_fp8(x, outer)
        bad[f"triton{' outer' if outer else ''} vs torch GPU"] = _diff(q, s, rq, rs)
        layout = layout and (s.t().is_contiguous() if outer else s.is_contiguous())
    bad = {k: v for k, v in bad.items() if v != (0, 0)}
    if bad or not layout:
        print(f"  MISMATCH {what}: (bytes, scales) differing {bad}, layout ok {layout}")
    return not bad and layout


def _time_graph(fn, reps: int = 20, iters: int = 20) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of ``reps`` calls: GPU time
    without the host's launch overhead."""
    try:
        return graph_us([fn] * reps, iters)
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"  graph capture failed: {e}")
        return float("nan")


def _special(k: int, dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Rows of zeros (signed), huge and tiny values, e4m3 ties and the whole e4m3 grid."""
    g = torch.Generator(device=dev).manual_seed(1)
    top = 30 if dtype != torch.float16 else 3
    x = torch.randn(8, k, device=dev, generator=g) * torch.logspace(-top, top, 8, device=dev)[:, None]
    x[0] = 0.0
    x[0, :128] = -0.0
    fin = torch.finfo(dtype)
    x[1, :64] = fin.max
    x[1, 64:] = -fin.tiny / 4  # subnormals next to the largest value: signed zeros
    ties = torch.tensor([448.0, 1.0625, 1.1875, 1.9375, 2.0**-10, 3 * 2.0**-10, 15 * 2.0**-10, 432.0, 248.0], device=dev)
    x[2, : len(ties)] = ties
    codes = torch.arange(256, device=dev, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)
    x[3, : len(codes)] = codes.view(torch.float8_e4m3fn).float()
    x[3, 0] = 448.0
    x[4, :128] = 1e-30
    return x.to(dtype)


def main() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())  # the key rp._TRITON_QUANT_OK is read with
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "capability", torch.cuda.get_device_capability())
    print("fp8 path capable:", rp._fp8_capable(dev), " triton quantiser available:",
          fp8_quant.available(torch.zeros(1, device=dev)))
    torch.manual_seed(0)

    ok = True
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m in (1, 3, 64, 130, 2048):
            for k in (128, 512, 4096, 12288):
                x = torch.randn(m, k, device=dev) * torch.exp(torch.randn(m, 1, device=dev) * 3)
                ok = _same(x.clamp(-6e4, 6e4).to(dtype), (dtype, m, k)) and ok  # finite in fp16 too
        ok = _same(_special(4096, dev, dtype), (dtype, "special")) and ok
    x = torch.randn(9, 1024, device=dev, dtype=torch.bfloat16)
    ok = _same(x[::2, 256:768], "strided rows") and ok
    print(f"Triton quantisation == PyTorch quantisation, bitwise on the GPU: {ok}")
    x = torch.randn(4, 256, device=dev)
    x[0, 5], x[1, 3], x[2, 7], x[3, 200] = float("nan"), float("inf"), -float("inf"), float("nan")
    q, s = fp8_quant.quantize_act_fp8(x)
    rq, rs = rp._quantize_act_torch(x)
    qb, rqb = q.view(torch.uint8), rq.view(torch.uint8)
    print(f"  NaN/inf blocks: scales {s.tolist()} vs {rs.tolist()}, bytes equal {torch.equal(qb, rqb)}, "
          f"equal but for NaN signs {torch.equal(qb & 0x7F, rqb & 0x7F)}")

    rows = []
    for name, k, n in SHAPES:
        lin = LoraLinear(k, n, False, "mlp").to(dev, torch.bfloat16)
        torch.nn.init.normal_(lin.weight, std=0.02)
        lin.lora_name = "x"
        rp.attach(lin, "fp8")
        r = lin.rollout
        if not r.scaled:
            print(f"{name}: scaled_mm path off on this device; no fp8 product to time")
            continue
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            quant_t = lambda x=x: rp._quantize_act_torch(x)
            quant_k = lambda x=x: fp8_quant.quantize_act_fp8(x, True)
            prod = lambda x=x, r=r: rp._scaled_mm_fp8(x, r.q, r.scale_inv, torch.bfloat16)
            lin_bf = lambda x=x, w=lin.weight: F.linear(x, w)
            times = [(_time(quant_t), _time_graph(quant_t)), (_time(quant_k), _time_graph(quant_k))]
            with _torch_quant(x.device):
                y_t = prod()
                times.append((_time(prod), _time_graph(prod)))
            y_k = prod()
            times.append((_time(prod), _time_graph(prod)))
            with _fixed_quant(*quant_k()):
                times.append((_time(prod), _time_graph(prod)))
            times.append((_time(lin_bf), _time_graph(lin_bf)))
            rows.append((name, m, times, torch.equal(y_t, y_k)))
        del lin, r
        torch.cuda.empty_cache()

    print()
    print("Each cell: eager (host launches included: what the eager fp8 decoder pays) / "
          "CUDA-graph replay (GPU time), microseconds.")
    print()
    print("| shape (K->N) | M | quant PyTorch | quant Triton | fp8 product, PyTorch quant "
          "| fp8 product, Triton quant | scaled_mm alone | bf16 F.linear | products equal |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, m, times, same in rows:
        cells = " | ".join(f"{e:.1f} / {g:.1f}" for e, g in times)
        print(f"| {name} | {m} | {cells} | {same} |")


if __name__ == "__main__":
    main()
