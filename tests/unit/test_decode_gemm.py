"""The decode GEMM (``ember.core.kernels.decode_gemm``): its products, bias and LoRA epilogue equal a
float64 reference for every launch shape (K split or not, several row blocks, ragged edges), the
split-K workspace is left at zero, and a static decode step through it gives the eager decoder's
tokens and logprobs (run on the CPU through Triton's interpreter). Compiled for sm_90 (no GPU
needed), its weight prefetch comes before the dependency wait and its main loop is pipelined."""

import dataclasses
import json
import textwrap

import pytest

from tests.triton_interp import run_interpreted
from tests.unit.test_sampler import INTERPRETED_FIRST_TOKENS, assert_equals_eager

pytest.importorskip("triton")

KERNEL_SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.triton_interp import assert_refused, patch_interpreter
    patch_interpreter()

    from ember.core.kernels import decode_gemm as dg, lora_decode as ld

    def reference(x, W, bias, lora):
        ref = x.double() @ W.double().T
        if bias is not None:
            ref += bias.double()
        if lora is not None:
            h, B, offs, n_rows, _ = lora
            end_rows = int(n_rows[0]) if n_rows is not None else x.shape[0]
            start = 0
            for g, end in enumerate(offs.tolist()):
                lo, hi = min(start, end_rows), min(end, end_rows)
                if g and hi > lo:  # group 0 (zero factors) skipped, as the decoder asks
                    ref[lo:hi] += h[lo:hi].to(B.dtype).double() @ B[g].double().T
                start = end
        return ref

    gen = torch.Generator().manual_seed(0)
    # (M, N, K, config, bias, LoRA groups' sizes or None)
    cases = [
        (20, 96, 256, dg.Config(block_n=32, block_m=32, block_k=64), False, None),
        (37, 80, 256, dg.Config(block_n=32, block_m=16, block_k=64, split_k=2), True, [3, 0, 20, 14]),
        (64, 128, 512, dg.Config(block_n=64, block_m=64, block_k=64, split_k=4), True, [0, 30, 0, 34]),
        (50, 72, 128, dg.Config(block_n=16, block_m=16, block_k=32, split_k=2), False, [5, 0, 0, 45]),
        (9, 40, 96, None, True, [9, 0]),  # the default configuration, K of 32-column blocks
        (37, 80, 256, dg.Config(block_n=32, block_m=16, block_k=64, split_k=2, tma=True), True, [3, 0, 20, 14]),
        # stream-K: runs of K blocks that end inside tiles (3 programs over 12 units), across tiles
        (40, 96, 256, dg.Config(block_n=32, block_m=64, block_k=64, programs=5), True, [0, 40]),
        (37, 80, 256, dg.Config(block_n=32, block_m=16, block_k=64, programs=7, tma=True), False, [3, 0, 20, 14]),
        (64, 64, 512, dg.Config(block_n=32, block_m=64, block_k=64, programs=4), False, None),  # runs of whole tiles
    ]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for i, (M, N, K, cfg, has_bias, sizes) in enumerate(cases):
            x = torch.randn(M, K, generator=gen).to(dtype)
            W = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype)
            bias = torch.randn(N, generator=gen).to(dtype) if has_bias else None
            lora = None
            if sizes is not None:
                R = 32
                offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
                n_rows = torch.tensor([M - 2], dtype=torch.int32) if i % 2 else None
                h = torch.randn(M, R, generator=gen)
                B = (torch.randn(len(sizes), N, R, generator=gen) / R ** 0.5).to(dtype)
                B[0] = 0
                lora = (h, B, offs, n_rows, ld.active_groups(offs, n_rows, skip_first=True))
            ws = dg.Workspace(M, N, "cpu")
            y = dg.decode_linear(x, W, bias, lora, ws, cfg)
            ref = reference(x, W, bias, lora)
            err = float((y.double() - ref).abs().max() / ref.abs().max())
            assert y.dtype == dtype and y.shape == (M, N), (y.dtype, y.shape)
            assert err < tol, (dtype, i, err)
            assert not ws.sums.any() and not ws.counters.any(), "the split-K workspace was left dirty"
            if cfg is not None and (cfg.split_k > 1 or cfg.programs):  # again through the same workspace: the same values
                assert torch.equal(dg.decode_linear(x, W, bias, lora, ws, cfg), y)
                # without a workspace every tile is one program's
                y1 = dg.decode_linear(x, W, bias, lora, None, cfg)
                assert float((y1.double() - ref).abs().max() / ref.abs().max()) < tol
    # shapes it refuses
    x, W = torch.randn(4, 64), torch.randn(8, 64)
    assert_refused(lambda: dg.decode_linear(x, W, torch.zeros(7)),
                   lambda: dg.decode_linear(x[:, :40], W[:, :40]),
                   lambda: dg.decode_linear(x, W, cfg=dg.Config(block_k=128)))
    print("OK")
    """
)


def test_decode_gemm_matches_float64():
    assert "OK" in run_interpreted(KERNEL_SCRIPT, timeout=900)


ENGINE_SCRIPT = textwrap.dedent(
    """
    import json
    from tests.triton_interp import patch_interpreter
    patch_interpreter()

    from ember.core.kernels import decode_gemm
    from ember.core.sampling import SamplerConfig
    from tests.unit.test_sampler import INTERPRETED_FIRST_TOKENS, _worker, decoded, static_decode_requests

    launches = []  # (LORA, output columns) of each launch
    real = decode_gemm._decode_gemm_kernel
    N_ARG = real.arg_names.index("N")
    class Counting:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((kwargs["LORA"], args[N_ARG]))
                return real[grid](*args, **kwargs)
            return launch
    decode_gemm._decode_gemm_kernel = Counting()

    config = SamplerConfig(max_seqs=16, page_size=4, kv_tokens=1024, static_decode=True, decode_gemm=True)
    worker = _worker(PATH, config)
    results = worker.sample(static_decode_requests(worker, INTERPRETED_FIRST_TOKENS))
    assert any(lora for lora, _ in launches), "no LoRA expand ran in the decode GEMM's epilogue"
    assert any(n == worker.model.lm_head.out_features for _, n in launches), "the LM head did not run in it"
    print(json.dumps(decoded(results)))
    """
)


def test_static_decode_through_the_decode_gemm_equals_eager(hf_models):
    """Static decode steps with ``decode_gemm`` (every dense product through the kernel, the LoRA
    expands in its epilogue; three adapters, one without MLP LoRA, and a base-model row in the same
    steps) give the eager decoder's tokens and logprobs (the PyTorch path, in this process)."""
    _, path = hf_models["qwen3"]
    out = run_interpreted(f"PATH = {str(path)!r}\n" + ENGINE_SCRIPT, timeout=900)
    assert_equals_eager(path, json.loads(out.strip().splitlines()[-1]), INTERPRETED_FIRST_TOKENS)


@pytest.mark.parametrize("tma,late", [(False, False), (True, False), (False, True)])
def test_decode_gemm_compiles_for_hopper(tma, late):
    """Compiled for sm_90 with the weight prefetch and programmatic dependent launch: the L2
    prefetch is issued before ``griddepcontrol.wait``, the products are wgmma, and the K loop is
    pipelined (cp.async through pointers, given the 16-divisible strides a real launch specialises
    on, or the bulk tensor copies of tensor descriptors). The next grid may launch right after the
    wait, or with ``LATE_LAUNCH`` behind a run-time test in the tile loop (the last tile)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ember.core.kernels.decode_gemm import _decode_gemm_kernel

    names = ["X", "W", "Y", "BIAS", "WS", "CNT", "H", "B", "OFFS", "ROWS", "ACTIVE", "N_ACTIVE", "XD", "WD",
             "M", "N", "K", "TILES_M", "PER", "stride_xm", "stride_wn", "stride_ym", "stride_hm", "stride_bg",
             "stride_bn", "R"]
    descs = ["tensordesc<bf16[64, 128]>", "tensordesc<bf16[128, 128]>"] if tma else ["*bf16", "*bf16"]
    types = ["*bf16", "*bf16", "*bf16", "*bf16", "*fp32", "*i32", "*fp32", "*bf16", "*i32", "*i32", "*i32", "*i32"]
    signature = dict(zip(names, types + descs + ["i32"] * 12))
    divisible = [i for i, n in enumerate(names) if n not in ("M", "R", "XD", "WD", "TILES_M", "PER")]
    constexprs = {"HAS_BIAS": False, "LORA": True, "HAS_ROWS": True, "BLOCK_N": 128, "BLOCK_M": 64,
                  "BLOCK_K": 128, "R_PAD": 32, "PREFETCH": 512, "PREC": "tf32", "TMA": tma, "PDL": True, "G_PAD": 4,
                  "LATE_LAUNCH": late}
    try:
        compiled = triton.compile(
            triton.compiler.ASTSource(fn=_decode_gemm_kernel, signature=signature, constexprs=constexprs,
                                      attrs={(i,): [["tt.divisibility", 16]] for i in divisible}),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4, "launch_pdl": True})
    except triton.compiler.errors.CompilationError:
        raise  # our kernel does not compile: a failure, not a missing tool chain
    except Exception as e:  # noqa: BLE001 - a Triton build without the CUDA backend
        pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {e}")
    ptx = compiled.asm["ptx"]
    prefetch, wait = ptx.find("cp.async.bulk.prefetch.L2.global"), ptx.find("griddepcontrol.wait")
    assert 0 <= prefetch < wait, "the weight prefetch must be issued before the dependency wait"
    launch = ptx.find("griddepcontrol.launch_dependents")
    assert ptx.count("griddepcontrol.launch_dependents") == 1 and wait < launch
    assert ("bra" in ptx[wait:launch]) == late, "the late launch is the tile loop's, the early one follows the wait"
    assert "wgmma.mma_async" in ptx
    if tma:
        assert ptx.count("cp.async.bulk.tensor") >= 2 and "cp.async.cg.shared.global" not in ptx
    else:
        assert ptx.count("cp.async.cg.shared.global") >= 8, "the K loop is not pipelined"
    assert compiled.metadata.shared >= 3 * (128 + 64) * 128 * 2, "fewer than 3 stages in shared memory"


def test_tuned_choices_are_read_and_looked_up(tmp_path, monkeypatch):
    """``load_tuned`` reads ``bench/decode_gemm.py``'s JSON; ``config`` takes the entry of the fewest
    rows at or above the call's (its row block cut to the rows), the largest past them, None where
    cuBLAS won, and the heuristic for a shape never measured."""
    import json

    from ember.core.kernels import decode_gemm as dg

    monkeypatch.setattr(dg, "TUNED", {})
    big = dg.Config(block_n=64, block_m=256, block_k=64, split_k=1, stages=5, warps=8, tma=True)
    results = {
        "o/64": {"M": 64, "N": 4096, "K": 4096, "config": dg.Config(split_k=2).__dict__, "use": True},
        "o/256": {"M": 256, "N": 4096, "K": 4096, "config": big.__dict__, "use": True},
        "down/64": {"M": 64, "N": 4096, "K": 12288, "config": dg.Config().__dict__, "use": False},
    }
    path = tmp_path / "decode_gemm.json"
    path.write_text(json.dumps({"hardware": "test", "results": results}))
    dg.load_tuned(path)
    assert dg.config(64, 4096, 4096) == dg.Config(split_k=2)
    assert dg.config(20, 4096, 4096) == dg.Config(split_k=2, block_m=32)
    assert dg.config(100, 4096, 4096) == dataclasses.replace(big, block_m=128)
    assert dg.config(512, 4096, 4096) == big
    assert dg.config(64, 4096, 12288) is None
    assert dg.config(64, 1024, 4096) == dg.heuristic(64, 1024, 4096)


def test_heuristic_launches_fit_the_kernel():
    """For decode-sized products of many widths, the heuristic's launch divides K into whole
    blocks per split, keeps its pipeline within the shared memory of a block, and spreads a large weight over nearly every SM."""
    import triton

    from ember.core.kernels import decode_gemm as dg

    for M in (1, 8, 37, 64, 200, 256):
        for N, K in [(6144, 4096), (4096, 12288), (24576, 4096), (151936, 4096), (1024, 1024), (96, 48), (7168, 2048)]:
            c = dg.heuristic(M, N, K, 132)
            assert K % (c.block_k * c.split_k) == 0, (M, N, K, c)
            assert (c.block_n + c.block_m) * c.block_k * 2 * c.stages <= dg.SMEM, (M, N, K, c)
            assert c.block_m >= min(M, 128) or c.block_m == 128, (M, N, K, c)
            programs, per = dg._layout(M, N, K, c)
            units = triton.cdiv(N, c.block_n) * triton.cdiv(M, c.block_m) * (K // c.block_k)
            assert (programs - 1) * per < units <= programs * per, (M, N, K, c)  # every unit, once
            if N * K >= 4096 * 4096:  # a large weight is spread over (nearly) every SM
                assert programs >= 0.9 * 132, (M, N, K, c, programs)
