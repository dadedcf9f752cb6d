"""The hyper-connection kernels (CUDA path) against the eager functions in fp64, under Triton's
interpreter: read, injection gates and write, and the gradients of the stream and the sublayer
output through them."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from ember.core.kernels import fused
    from ember.core.kernels.hyper import HyperRead, HyperWrite
    from ember.core.layers.hyper_connections import hc_read, hc_write
    assert fused.use_triton(torch.zeros(1))
    torch.manual_seed(0)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    # (tokens, streams, width, rank, injection): widths below and above one column block (1024)
    for T, n, H, rank, inject in ((7, 4, 48, 5, True), (3, 2, 1100, 3, True), (5, 4, 40, 4, False)):
        x0 = torch.randn(T, n * H, dtype=torch.float64)
        y0 = torch.randn(T, H, dtype=torch.float64)
        w = torch.randn(n * H, dtype=torch.float64) * 0.1
        down = torch.randn(rank, n * H, dtype=torch.float64) * (n * H) ** -0.5
        up = torch.randn(n * H, rank, dtype=torch.float64) * rank ** -0.5
        inj = torch.randn(n, n * H, dtype=torch.float64) * (n * H) ** -0.5 if inject else None
        dout = torch.randn(T, n * H, dtype=torch.float64)
        dread = torch.randn(T, H, dtype=torch.float64)

        def run(read_fn, write_fn, dtype):
            cast = lambda t: None if t is None else t.to(dtype)
            x = x0.detach().to(dtype).clone().requires_grad_()
            y = y0.detach().to(dtype).clone().requires_grad_()
            read, gates = read_fn(x, cast(w), cast(down), cast(up), cast(inj))
            loss = (read * dread.to(dtype)).sum()
            outs = [read]
            if inject:
                out = write_fn(x, y * read, gates)
                loss = loss + (out * dout.to(dtype)).sum()
                outs += [gates, out]
            loss.backward()
            return outs + [x.grad] + ([y.grad] if inject else [])

        def kernel_read(x, w, down, up, inj):
            r, g = HyperRead.apply(x, w, down, up, inj, n, 1e-6)
            return r, (g if inj is not None else None)

        ref = run(lambda *a: hc_read(*a, n, 1e-6), hc_write, torch.float64)
        got = run(kernel_read, HyperWrite.apply, torch.float32)
        names = ["read", "gates", "write", "dx", "dy"] if inject else ["read", "dx"]
        for name, a, b in zip(names, got, ref):
            err = rel(a, b)
            assert err < 2e-5, (T, n, H, name, err)
            print(T, n, H, name, err)
    print("OK")
    """
)


def test_hyper_connection_kernels_match_the_eager_functions():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                         check=False)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr
