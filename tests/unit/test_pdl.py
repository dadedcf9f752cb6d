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
    "ember.core.kernels.qkv_decode": ("_qkv_rope_write",),
    "ember.core.kernels.sampling": ("_partials", "_finish"),
    "ember.core.kernels.paged_decode": ("_paged_decode_kernel", "_paged_decode_combine", "_shared_prefix_kernel"),
    "ember.core.kernels.fp8_quant": ("_quant_act",),
    "ember.core.kernels.fp8_gemm": ("_fp8_gemm_kernel", "_sum_splits_kernel"),
}


def _kernels():
    import importlib

    for module, names in PARTICIPANTS.items():
        mod = importlib.import_module(module)
        for name in names:
            yield module, name, getattr(mod, name)


# the arguments a participant reads before its wait ("read early" in ``kernels.pdl``): written
# before the step (weights, LoRA factors) or at its start (row groups, the active-group list),
# never by the kernel just before it; every other argument is only touched after the wait
READ_EARLY = {
    "_lora_shrink_kernel": {"A", "OFFS", "ROWS", "ACTIVE", "N_ACTIVE"},
    "_lora_expand_kernel": {"B", "OFFS", "ROWS", "ACTIVE", "N_ACTIVE", "COL0"},
    "_swiglu_lora": {"OFFS", "ROWS", "ACTIVE", "N_ACTIVE"},
    "_qkv_rope_write": {"OFFS", "ROWS", "ACTIVE", "N_ACTIVE"},
}
WAIT = "if PDL:\n    gdc_wait()\n    gdc_launch_dependents()"


def _body(fn) -> list[ast.stmt]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body


def _scalar(kernel, name: str) -> bool:
    """A launch argument that is no tensor: a constexpr, a stride, or an upper-case size."""
    param = kernel.params[kernel.arg_names.index(name)]
    return param.is_constexpr or name.startswith("stride_") or name in {"K", "R", "N_OUT", "N", "I", "RD", "M", "H", "D"}


def test_every_participant_waits_before_touching_memory():
    """A kernel launched early must read nothing the kernel before it writes (nor write what that
    one reads) before the wait: ``if PDL: gdc_wait(); gdc_launch_dependents()`` is a top-level
    statement of each participant; before it, no store or atomic, and no tensor argument outside
    the kernel's :data:`READ_EARLY` (most kernels: nothing at all comes before it)."""
    for module, name, kernel in _kernels():
        body = _body(kernel.fn)
        at = next((i for i, stmt in enumerate(body) if ast.unparse(stmt) == WAIT), None)
        assert at is not None, f"{module}.{name} has no top-level wait block"
        early = READ_EARLY.get(name, set())
        if not early:
            assert at == 0, f"{module}.{name} starts with {ast.unparse(body[0])!r}"
        before = ast.Module(body=body[:at], type_ignores=[])
        names = {n.id for n in ast.walk(before) if isinstance(n, ast.Name)}
        touched = {n for n in names & set(kernel.arg_names) if not _scalar(kernel, n)}
        assert touched <= early, f"{module}.{name} touches {sorted(touched - early)} before its wait"
        calls = {ast.unparse(n.func) for n in ast.walk(before) if isinstance(n, ast.Call)}
        assert not {c for c in calls if "store" in c or "atomic" in c}, f"{module}.{name} writes before its wait"
        assert "PDL" in kernel.arg_names and kernel.params[kernel.arg_names.index("PDL")].is_constexpr


def test_read_early_sees_the_kernels_arguments():
    """The check above reads names: the kernels that read early do so by these argument names, and
    the names it forbids (the inputs the kernel before writes) are arguments of theirs."""
    from ember.core.kernels.lora_decode import _lora_expand_kernel, _lora_shrink_kernel

    for kernel, written_before in ((_lora_shrink_kernel, {"X", "H"}), (_lora_expand_kernel, {"H", "Y"})):
        assert READ_EARLY[kernel.fn.__name__] <= set(kernel.arg_names)
        assert written_before <= set(kernel.arg_names) and not written_before & READ_EARLY[kernel.fn.__name__]


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
        except triton.compiler.errors.CompilationError:
            raise  # our kernel does not compile: a failure, not a missing tool chain
        except Exception as e:  # noqa: BLE001 - a Triton install without its CUDA tool chain
            pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {e}")
        ptx = compiled.asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == on
        assert bool(compiled.metadata.launch_pdl) == on
        if on:
            assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
