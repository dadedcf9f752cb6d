"""The fp8 rollout path on a GPU: does ``F.scaled_mm`` (1x128 / 128x128 block scales) run, how far
is it from the dequantised product, and what does one decode-shaped product cost against bf16.

    python3 bench/rollout_fp8_check.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.common import event_time_ms
from ember.core import rollout_precision as rp
from ember.core.layers.lora import LoraLinear


def _time(fn, iters: int = 200) -> float:
    return event_time_ms(fn, 10, iters) * 1e3  # microseconds


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "capability", torch.cuda.get_device_capability())
    print("F.scaled_mm:", hasattr(F, "scaled_mm"), " F.ScalingType:", hasattr(F, "ScalingType"),
          " fp8 path capable:", rp._fp8_capable(dev))
    torch.manual_seed(0)
    for n, k in ((4096, 4096), (12288, 4096), (4096, 12288)):
        lin = LoraLinear(k, n, False, "mlp").to(dev, torch.bfloat16)
        torch.nn.init.normal_(lin.weight, std=0.02)
        lin.lora_name = "x"
        rp.attach(lin, "fp8")
        r = lin.rollout
        for m in (64, 2048):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, r.dequantized(torch.bfloat16)).float()
            with rp.sampling(lin):
                got = lin(x, None).float()
            err = float((got - ref).norm() / ref.norm())
            t_bf16 = _time(lambda x=x, w=lin.weight: F.linear(x, w))
            with rp.sampling(lin):
                t_fp8 = _time(lambda x=x, lin=lin: lin(x, None))
            print(f"N={n} K={k} M={m}: scaled_mm used={r.scaled}  rel err vs dequantised {err:.2e}  "
                  f"bf16 {t_bf16:.1f} us  fp8 {t_fp8:.1f} us  copy {r.nbytes() / 2**20:.1f} MiB "
                  f"(bf16 {lin.weight.numel() * 2 / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
