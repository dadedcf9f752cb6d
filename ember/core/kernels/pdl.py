"""Programmatic dependent launch (Hopper) for the decode step's small Triton kernels.

A decode step is a chain of a few hundred kernels, most of them a few microseconds long (norms,
LoRA shrinks and expands, the q/k rotations, the KV write, attention). Between two of them the GPU
drains one grid and only then starts launching the next. With programmatic dependent launch the
next grid is launched while the previous one runs, and waits on the device (``griddepcontrol.wait``)
for the previous grid to finish and its memory to be visible; the launch latency is hidden.

Every kernel that takes part has a ``PDL: tl.constexpr`` argument and begins with::

    if PDL:
        gdc_wait()  # the grid before this one has finished and its writes are visible
        gdc_launch_dependents()  # the next grid may launch now; it waits the same way

before its first load or store. Transitively that also orders it after every earlier kernel (each
one waited for its own predecessor before it could finish).

**Read early.** A kernel may load, before the wait, what no kernel close before it writes: the
weights and LoRA factors (written before the step) and the step's row groups (offsets, row count,
the active-group list: copied in before the step or computed at its very start, see
``StaticDecoder._step``). The next grid launches once every program of this one has passed its
wait, so at that point the grid two before it has finished: whatever was written three or more
launches back is complete and visible. Those loads then overlap the previous kernel instead of
following it (a LoRA kernel's chain of loads: the group list, the group's rows, its factors).
Nothing is stored before the wait, and ``tests/unit/test_pdl.py`` lists, per kernel, the
arguments it may read early. The block is written out in each
kernel rather than called as a helper: under the Triton interpreter (the CPU tests) a nested
``@triton.jit`` call costs more than many of the kernels' bodies.

Launches use it only inside :func:`launches` ``(True)`` (the static decoder's steps, when its
config asks), on a Hopper or newer GPU with a Triton that has the instructions:
``kernel[grid](..., **pdl.options())``. Elsewhere ``options()`` is ``{"PDL": False}`` and the
kernels are what they were.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("ember_pdl", default=False)
HAVE_TRITON = HAVE_GDC = False
try:  # imported by ``fused``, so this module cannot take these from it
    import triton

    HAVE_TRITON = True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except ImportError:  # pragma: no cover - no Triton, or one without the grid dependency control instructions
    pass

if HAVE_TRITON and not HAVE_GDC:  # pragma: no cover - the kernels name them; PDL is never on then

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


def supported(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` can use programmatic dependent launch."""
    return (
        HAVE_GDC
        and os.environ.get("TRITON_INTERPRET") != "1"
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


@contextlib.contextmanager
def launches(on: bool) -> Iterator[None]:
    """Launches of the kernels that take part use programmatic dependent launch inside this block
    when ``on`` (the caller checks :func:`supported`)."""
    token = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


def options() -> dict:
    """The extra launch arguments of a kernel that takes part: its ``PDL`` constexpr and, when on,
    Triton's ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if _ON.get() else {"PDL": False}
