"""Registers, local memory (spills), shared memory and software pipelining of the decode kernels
(paged attention, the SwiGLU LoRA kernel), compiled for sm_90a (Hopper) on this machine: no GPU is
needed, only Triton's CUDA tool chain (it ships ``cuobjdump``). A register count at the 255 limit
with a stack means spills; at 4 warps, 255 registers a thread leave room for two programs an SM
(65,536 registers an SM). ``async`` counts the loads Triton turned into asynchronous copies (what
its software pipelining of a loop issues, ``num_stages``): 0 means each block's loads are waited
for in its own iteration.

    python bench/kernel_resources.py               # Qwen3-8B's decode shapes (Hq=32, Hkv=8, D=128)
    python bench/kernel_resources.py --variants    # compile every variant of the split kernel

The numbers are those of the installed Triton. The GPU machine's version may compile differently
or fail where this one does not (a Triton 3.6 failure in the QSA variant was found that way), so
check with its version beside this one:

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python bench/kernel_resources.py --variants
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from ember.core.kernels import paged_decode as pd


def resources(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 2,
              unaligned: tuple[str, ...] = ()) -> dict:
    """``{"regs", "stack", "shared", "async"}`` of ``fn`` compiled for sm_90a (bytes for stack and
    shared; ``async``: asynchronous copies in its TTGIR). As a launch specialises them, pointers and
    integer arguments are taken as multiples of 16, except those named in ``unaligned``."""
    aligned = [i for i, (name, kind) in enumerate(signature.items())
               if name not in unaligned and (kind.startswith("*") or kind == "i32")]
    for name in constexprs:
        signature[name] = "constexpr"
    compiled = triton.compile(
        triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                  attrs={(i,): [["tt.divisibility", 16]] for i in aligned}),
        target=GPUTarget("cuda", 90, 128), options={"num_warps": num_warps, "num_stages": num_stages},
    )
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {
        "regs": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "shared": compiled.metadata.shared,
        "async": len(re.findall(r"async_copy_global_to_local", compiled.asm["ttgir"])),
    }


def _strides(*names: str) -> dict:
    return {n: "i32" for n in names}


ROW = "{:72s} {:5d} {:5d} {:10d} {:11d} {:6d}"


def _row(name: str, warps: int, r: dict) -> str:
    return ROW.format(name, warps, r["regs"], r["stack"], r["shared"], r["async"])


def main() -> None:
    shape = {"D": 128, "D_PAD": 128, "DV": 128, "DV_PAD": 128, "PAGE": 16, "PRE_BLOCK_N": 64, "DOT_PRECISION": "tf32",
             "PDL": False}
    split_sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "ACC": "*fp32", "ML": "*fp32", "BT": "*i32",
                 "LENS": "*i32", "P": "*bf16", "SINK": "*bf16", "SEL": "*i64", "PRE": "*i32", "qk_scale": "fp32",
                 "window": "i32", "rel_extent": "i32", "sel_block": "i32", "sel_span": "i32",
                 **_strides("stride_qb", "stride_qh", "stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs",
                            "stride_vh", "stride_ob", "stride_oh", "stride_bt", "stride_pb", "stride_ph", "stride_sb",
                            "stride_selb")}
    prefix_sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "ACC": "*fp32", "ML": "*fp32", "BT": "*i32", "PRE": "*i32",
                  "MEM": "*i32", "qk_scale": "fp32",
                  **_strides("stride_qb", "stride_qh", "stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs",
                             "stride_vh", "stride_bt", "stride_mem")}
    # a block table's width is any number of pages; lengths and windows any number of tokens
    scalars = ("stride_bt", "stride_selb", "window", "rel_extent", "sel_block", "sel_span")
    print(f"triton {triton.__version__}")
    print(f"{'kernel (Hq=32 Hkv=8 D=128 bf16, pages of 16; SwiGLU: intermediate columns)':72s} warps  regs  "
          "stack (B)  shared (B)  async")
    for prefix, heads, warps in itertools.product((False, True), (1, 2, 4), (4, 8)):
        consts = {**shape, "REP": 4, "REP_P": 4, "HEADS": heads, "HKV": 8, "M_PAD": max(16, 4 * heads),
                  "BLOCK_N": 64 // heads, "NUM_SPLITS": 1, "PRE_SPLITS": 2, "SLOTS": 3 if prefix else 1,
                  "HAS_BIAS": False, "HAS_SINK": False, "HAS_SELECT": False, "HAS_PREFIX": prefix}
        r = resources(pd._paged_decode_kernel, dict(split_sig), consts, warps, unaligned=scalars)
        name = f"split kernel, {heads} KV head{'s' if heads > 1 else ''} a program, one split" + (
            ", after a shared prefix" if prefix else "")
        print(_row(name, warps, r))
    for rows in (16, 32, 64):
        for warps in (4, 8):
            consts = {**shape, "REP": 4, "REP_P": 4, "MB": rows // 4, "GROUP": pd.PREFIX_GROUP, "NUM_SPLITS": 1,
                      "PRE_SPLITS": 2, "SLOTS": 3}
            r = resources(pd._shared_prefix_kernel, dict(prefix_sig), consts, warps, unaligned=("stride_bt",))
            name = f"prefix kernel, {rows} query heads a program"
            print(_row(name, warps, r))
    swiglu()
    qkv()
    if "--variants" in sys.argv:
        variants(split_sig, scalars)


def swiglu() -> None:
    """The SwiGLU LoRA kernel at ``swiglu_config``'s launch shapes and the check's wider ones, rank 32."""
    from ember.core.kernels import swiglu_decode as sw

    sig = {"GU": "*bf16", "HGU": "*fp32", "BGU": "*bf16", "AD": "*bf16", "HD": "*fp32", "ACT": "*bf16",
           "OFFS": "*i32", "ROWS": "*i32", "ACTIVE": "*i32", "N_ACTIVE": "*i32",
           **_strides("stride_gu", "stride_hgu", "stride_hj", "stride_bg", "stride_bo", "stride_ag", "stride_ar", "stride_hd",
                      "stride_act"),
           "N": "i32", "I": "i32", "R": "i32", "RD": "i32"}
    for block_m, block_k in (sw.swiglu_config(64), (64, 256), (32, 512)):
        consts = {"HAS_ROWS": True, "HAS_GU": True, "HAS_DOWN": True, "BLOCK_M": block_m, "BLOCK_K": block_k,
                  "R_PAD": 32, "RD_PAD": 32, "PREC": "tf32", "G_PAD": 16, "PDL": True}
        r = resources(sw._swiglu_lora, dict(sig), consts, 8, num_stages=3, unaligned=("N", "R", "RD"))
        print(_row(f"swiglu kernel, {block_m} rows x {block_k} columns", 8, r))


def qkv() -> None:
    """The q/k/v kernel (``qkv_decode``) at Qwen3-8B's heads, rank 32, with and without LoRA."""
    from ember.core.kernels import qkv_decode as qd

    sig = {"Y": "*bf16", "H": "*fp32", "B": "*bf16", "QW": "*bf16", "KW": "*bf16", "COS": "*bf16", "SIN": "*bf16",
           "QO": "*bf16", "KC": "*bf16", "VC": "*bf16", "SLOTS": "*i64", "OFFS": "*i32", "ROWS": "*i32",
           "ACTIVE": "*i32", "N_ACTIVE": "*i32",
           **_strides("stride_y", "stride_hm", "stride_hj", "stride_bg", "stride_bo", "stride_c", "stride_qt",
                      "stride_qh"),
           "N": "i32", "HQ": "i32", "HK": "i32", "D": "i32", "R": "i32", "rot_half": "i32", "eps_q": "fp32",
           "eps_k": "fp32"}
    for lora in (True, False):
        consts = {"HAS_LORA": lora, "HAS_ROWS": True, "NORM": True, "ZERO_CENTRED": False, "HAS_REST": False,
                  "BLOCK_M": 16, "HALF": 64, "BLOCK_D": 16, "R_PAD": 32, "PREC": "tf32", "G_PAD": 2, "PDL": True}
        for warps in (4, 8):
            r = resources(qd._qkv_rope_write, dict(sig), consts, warps, unaligned=("N", "R", "HQ", "HK"))
            print(_row(f"q/k/v kernel, 16 rows, {'LoRA rank 32' if lora else 'no LoRA'}", warps, r))


def variants(split_sig: dict, scalars: tuple[str, ...]) -> None:
    """Compile every variant of the split kernel a model can launch: KV heads a program, head dims 64
    (MHA), 128 (GQA 4) and 256 (GQA 8), one split and several, the relative bias with sinks, the QSA
    selection, the shared prefix. Raises on the first one that fails."""
    count = 0
    for (d, rep, hkv), heads, splits, extra in itertools.product(
            ((64, 1, 4), (128, 4, 8), (256, 8, 2)), (1, 2, 4), (1, 4), ("", "bias", "select", "prefix")):
        cols = pd._decode_block_n(d, d)
        if heads > min(cols // 16, 16 // pd._pow2(rep), hkv):
            continue  # never chosen (_decode_heads)
        consts = {"D": d, "D_PAD": d, "DV": d, "DV_PAD": d, "PAGE": 16, "PRE_BLOCK_N": cols, "DOT_PRECISION": "tf32",
                  "PDL": True, "REP": rep, "REP_P": pd._pow2(rep), "HEADS": heads, "HKV": hkv,
                  "M_PAD": max(16, heads * pd._pow2(rep)), "BLOCK_N": cols // heads, "NUM_SPLITS": splits,
                  "PRE_SPLITS": 2, "SLOTS": splits + (2 if extra == "prefix" else 0), "HAS_BIAS": extra == "bias",
                  "HAS_SINK": extra == "bias", "HAS_SELECT": extra == "select", "HAS_PREFIX": extra == "prefix"}
        r = resources(pd._paged_decode_kernel, dict(split_sig), consts, 4, unaligned=scalars)
        print(_row(f"split kernel D={d} GQA {rep}, {heads} heads, {splits} splits {extra}", 4, r), flush=True)
        count += 1
    print(f"{count} variants compiled")


if __name__ == "__main__":
    main()
