"""Programmatic dependent launch (``ember.core.kernels.pdl``): every kernel that takes part waits for
the grid before it ahead of any memory access, compiles to the Hopper instructions, and the option
is scoped to the static decoder's steps. (The GPU check ``bench/gpu_checks.py pdl`` and the sample
bench's token comparison run it on the device.)"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

from ember.core.kernels import pdl

pytestmark = pytest.mark.skipif(not pdl.HAVE_TRITON, reason="needs Triton")

# every kernel launched with ``**pdl.options()``
PARTICIPANTS = {
    "ember.core.kernels.fused": ("_rmsnorm_fwd", "_qk_norm_rope"),
    "ember.core.kernels.kv_write": ("_kv_write",),
    "ember.core.kernels.lora_decode": ("_lora_shrink_kernel", "_lora_expand_kernel"),
    "ember.core.kernels.swiglu_decode": ("_swiglu_lora",),
    "ember.core.kernels.sampling": ("_partials", "_finish"),
    "ember.core.sampling.attention": ("_paged_decode_kernel", "_paged_decode_combine"),
}


def _kernels():
    import importlib

    for module, names in PARTICIPANTS.items():
        mod = importlib.import_module(module)
        for name in names:
            yield module, name, getattr(mod, name)


def _first_statement(fn) -> ast.stmt:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body[0]


def test_every_participant_waits_before_touching_memory():
    """A kernel launched early must read nothing the kernel before it writes (nor write what that
    one reads) before the wait: ``if PDL: gdc_wait(); gdc_launch_dependents()`` is each
    participant's first statement."""
    expected = "if PDL:\n    gdc_wait()\n    gdc_launch_dependents()"
    for module, name, kernel in _kernels():
        stmt = _first_statement(kernel.fn)
        assert ast.unparse(stmt) == expected, f"{module}.{name} starts with {ast.unparse(stmt)!r}"
        assert "PDL" in kernel.arg_names and kernel.params[kernel.arg_names.index("PDL")].is_constexpr


def test_launches_use_it_only_inside_the_block():
    assert pdl.options() == {"PDL": False}
    with pdl.launches(True):
        assert pdl.options() == {"PDL": True, "launch_pdl": True}
        with pdl.launches(False):
            assert pdl.options() == {"PDL": False}
        assert pdl.options()["PDL"]
    assert pdl.options() == {"PDL": False}
    assert not pdl.supported(torch.device("cpu"))


@pytest.mark.skipif(not pdl.HAVE_GDC, reason="Triton without griddepcontrol")
def test_kernel_compiles_to_the_wait_for_hopper():
    """``_kv_write`` with ``PDL`` compiled for sm_90 (no GPU needed): the grid dependency wait comes
    before its first global load, the launch is marked programmatic; without ``PDL`` neither."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ember.core.kernels.kv_write import _kv_write

    signature = {"K": "*bf16", "V": "*bf16", "KC": "*bf16", "VC": "*bf16", "SLOTS": "*i64",
                 "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32", "H": "i32",
                 "D": "i32", "BLOCK_H": "constexpr", "BLOCK_D": "constexpr", "PDL": "constexpr"}
    for on in (True, False):
        try:
            compiled = triton.compile(
                triton.compiler.ASTSource(fn=_kv_write, signature=signature,
                                          constexprs={"BLOCK_H": 8, "BLOCK_D": 128, "PDL": on}),
                target=GPUTarget("cuda", 90, 32), options={"launch_pdl": on})
        except Exception as e:  # noqa: BLE001 - a Triton install without its CUDA tool chain
            pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {e}")
        ptx = compiled.asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == on
        assert bool(compiled.metadata.launch_pdl) == on
        if on:
            assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
