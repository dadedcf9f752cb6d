"""Fixes for Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``), which the kernel tests run
under; they change the interpreter only, never compiled kernels. Call :func:`patch_interpreter`
before launching a kernel."""

from __future__ import annotations


def patch_interpreter() -> None:
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    # loop bounds are converted with int() of a 1-element array, which NumPy 2 refuses: take the element
    patch = interp._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched

    # tl.dot multiplies bf16 operands as their raw uint16 bits: widen them to fp32 first (exact)
    dot = interp.InterpreterBuilder.create_dot

    def widen(t):
        if t.dtype == tl.bfloat16:
            return interp.TensorHandle((t.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return t

    interp.InterpreterBuilder.create_dot = lambda self, a, b, d, *args: dot(self, widen(a), widen(b), d, *args)

    # an integer or boolean cast to bf16 keeps its integer value as the uint16 bits (1 reads as 9e-41):
    # go through fp32, which converts to bf16's bits
    cast = interp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and not src.dtype.scalar.is_floating():
            src = cast(self, src, tl.float32)
        return cast(self, src, dst_type)

    interp.InterpreterBuilder.cast_impl = cast_impl


class LaunchGrids:
    """Replaces kernel ``name`` of ``module`` with a stand-in that records each launch's grid
    (``grids``) and launches the real kernel; for the scripts that :func:`run_interpreted` runs."""

    def __init__(self, module, name: str):
        self.real, self.grids = getattr(module, name), []
        self.module, self.name = module, name
        setattr(module, name, self)

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.real[grid]

    def restore(self) -> None:
        setattr(self.module, self.name, self.real)


def run_interpreted(script: str, timeout: int = 900) -> str:
    """Run ``script`` in a fresh Python under Triton's interpreter (``TRITON_INTERPRET=1`` is read
    when Triton is imported, hence the subprocess), from the repository root; returns its stdout
    and fails the test with its output's tail if it exits non-zero."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout,
                         check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def rel_err(a, b) -> float:
    """``‖a − b‖ / ‖b‖`` in float64 (the kernel scripts' measure against their references)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_refused(*calls) -> None:
    """Each of ``calls`` (no arguments) raises ``ValueError``: bad input refused, not run."""
    for i, call in enumerate(calls):
        try:
            call()
        except ValueError:
            continue
        raise AssertionError(f"bad call {i} was accepted")


def seeded_randn(seed: int = 0):
    """``randn(*shape, scale=1.0)`` drawing from one generator seeded with ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale: float = 1.0):
        return torch.randn(*shape, generator=g) * scale

    randn.generator = g
    return randn
