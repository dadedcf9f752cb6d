"""The static decoder's one-launch SwiGLU LoRA kernel (``ember.core.kernels.swiglu_decode``) equals
the three kernels it replaces (gate/up expand, ``silu(g) * u``, down shrink), and a SwiGLU block
decoded through ``StaticRoute.swiglu`` equals the block run as its three modules (run on the CPU
through Triton's interpreter)."""

import json
import textwrap

import pytest

from tests.triton_interp import run_interpreted
from tests.unit.test_sampler import INTERPRETED_FIRST_TOKENS, assert_equals_eager

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import types
    import torch
    from torch import nn
    from tests.triton_interp import patch_interpreter, rel_err as rel, seeded_randn
    patch_interpreter()

    from ember.core.kernels import lora_decode as ld
    from ember.core.kernels.swiglu_decode import swiglu_lora
    from ember.core.layers.activations import silu_mul
    from ember.core.layers.lora import LoraLinear
    from ember.core.layers.mlp import SwiGLU
    from ember.core.sampling.packed_linears import PackedLinears
    from ember.core.sampling.static_route import StaticRoute

    randn = seeded_randn(0)

    def stacks(G, I, H, R, RD, dtype):
        # as LoraStacks builds them: gate/up side by side (B block-diagonal), slot 0 zeros
        B = torch.zeros(G, 2 * I, 2 * R)
        B[:, :I, :R], B[:, I:, R:] = randn(G, I, R, scale=R ** -0.5), randn(G, I, R, scale=R ** -0.5)
        A_d = randn(G, RD, I, scale=I ** -0.5)
        B[0], A_d[0] = 0, 0
        return B.to(dtype), A_d.to(dtype)

    def unfused(gu, h_gu, B, A_d, offs, n_rows, active):
        y = gu.clone()
        if B is not None:
            ld.lora_expand_add(y, h_gu, B, offs, n_rows, True, active=active)
        I = y.shape[1] // 2
        act = silu_mul(y[:, :I], y[:, I:])
        h_d = None
        if A_d is not None:
            h_d = ld.lora_shrink(act, A_d, offs, n_rows, True, active=active)
        return act, h_d

    # (rows per group, intermediate width, stack ranks): groups sizes include empty ones, rows not a
    # multiple of the row block, a width not a multiple of the column block; padding rows after n_rows;
    # many groups in one row block (the kernel finds a block's groups from the whole list at once)
    cases = [([3, 20, 0, 14], 200, 16, 16, None), ([0, 70, 5], 136, 32, 16, 60), ([9], 128, 16, 32, None),
             ([1, 5, 3, 0, 7, 4, 2, 6], 128, 16, 16, 25)]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for sizes, I, R, RD, n_real in cases:
            N = sum(sizes)
            offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
            n_rows = torch.tensor([n_real], dtype=torch.int32) if n_real is not None else None
            active = ld.active_groups(offs, n_rows, skip_first=True)
            B, A_d = stacks(len(sizes), I, 64, R, RD, dtype)
            gu = randn(N, 2 * I).to(dtype)
            h_gu = randn(N, 2 * R)
            # the default launch, and 16-row blocks of 64-column programs (more of a block's rows in
            # several groups, whose partials are summed before the one atomic add)
            for parts, config in (("both", None), ("gate_up", None), ("down", None), ("both", (16, 64))):
                Bp = B if parts != "down" else None
                Ap = A_d if parts != "gate_up" else None
                want_act, want_h = unfused(gu, h_gu, Bp, Ap, offs, n_rows, active)
                h_d = torch.zeros(N, RD)
                act = swiglu_lora(gu, offs, active, n_rows, (h_gu, Bp) if Bp is not None else None,
                                  (Ap, h_d) if Ap is not None else None, config=config)
                assert act.dtype == dtype and act.shape == (N, I)
                err = rel(act, want_act)
                assert err <= tol, (dtype, sizes, parts, "act", err)
                if Ap is not None:
                    err = rel(h_d, want_h)
                    assert err <= tol, (dtype, sizes, parts, "h_down", err)
                print(dtype, sizes, parts, "ok")
            # h_gu windowed (the shrink carried out by the gate/up product): the i-th active group's
            # rows read window i; the other windows hold garbage at their rows
            want_act, _ = unfused(gu, h_gu, B, None, offs, n_rows, active)
            win = randn(N, active.bound, 2 * R, scale=100.0)
            ids, count = active.ids.tolist(), int(active.count)
            for i, grp in enumerate(ids[:count]):
                s, e = (int(offs[grp - 1]) if grp else 0), int(offs[grp])
                win[s:e, i] = h_gu[s:e]
            act = swiglu_lora(gu, offs, active, n_rows, (win, B), None)
            err = rel(act, want_act)
            assert err <= tol, (dtype, sizes, "windowed", err)

    # a SwiGLU block through the static route: one kernel, and the down projection finds its shrink
    H, I, R, N = 64, 96, 16, 13
    mlp = SwiGLU(H, I)
    with torch.no_grad():
        for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            m.weight.copy_(randn(*m.weight.shape, scale=m.in_features ** -0.5))
    mlp.gate_proj.lora_name, mlp.up_proj.lora_name, mlp.down_proj.lora_name = "gate", "up", "down"
    packed = PackedLinears(types.SimpleNamespace(modules=lambda: [mlp]))
    B_gu, A_d = stacks(3, I, H, R, R, torch.float32)
    A_gu = randn(3, 2 * R, H, scale=H ** -0.5)
    B_d = randn(3, H, R, scale=R ** -0.5)
    A_gu[0], B_d[0] = 0, 0
    st = types.SimpleNamespace(
        stacks={"gate": (A_gu[:, :R], B_gu[:, :I, :R]), "up": (A_gu[:, R:], B_gu[:, I:, R:]), "down": (A_d, B_d)},
        fused={"gate": (A_gu, B_gu), "down": (A_d, B_d)},
        member={"gate": ("gate", 0), "up": ("gate", 1), "down": ("down", 0)},
        splits={"gate": (I, I), "down": (H,)},
        rank=R,
    )
    offs = torch.tensor([2, 9, N], dtype=torch.int32)
    x = randn(N, H)
    route = StaticRoute(st, offs, torch.tensor([11], dtype=torch.int32), packed)
    calls = []
    real = ld.lora_shrink
    ld.lora_shrink = lambda *a, **k: calls.append(a[1].shape) or real(*a, **k)
    with torch.no_grad():
        fused_out = mlp(x, route)
        assert calls == [A_gu.shape], calls  # the gate/up shrink only: the kernel did the down one
        route = StaticRoute(st, offs, torch.tensor([11], dtype=torch.int32), packed)
        modules = mlp.down_proj(silu_mul(mlp.gate_proj(x, route), mlp.up_proj(x, route)), route)
    ld.lora_shrink = real
    err = rel(fused_out[:11], modules[:11])
    assert err <= 1e-5, err
    # against the formula in fp64 (rows 0-1 are the base model's, 2-8 slot 1's, 9-10 slot 2's)
    xd = x.double()
    gu = xd @ torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).double().T
    slot = torch.tensor([0] * 2 + [1] * 7 + [2] * 4)
    for s in (1, 2):
        rows = slot == s
        gu[rows] += xd[rows] @ A_gu[s].double().T @ B_gu[s].double().T
    act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    out = act @ mlp.down_proj.weight.double().T
    for s in (1, 2):
        rows = slot == s
        out[rows] += act[rows] @ A_d[s].double().T @ B_d[s].double().T
    err = rel(fused_out[:11], out[:11])
    assert err <= 1e-5, err
    # no adapter in the batch: the block runs its modules
    assert StaticRoute(st, offs, None, packed, lora=False).swiglu(mlp, x) is None
    print("OK")
    """
)


def test_swiglu_lora_kernel_matches_the_three_kernels():
    assert "OK" in run_interpreted(SCRIPT, timeout=900)


ENGINE_SCRIPT = textwrap.dedent(
    """
    import json
    from tests.triton_interp import LaunchGrids, patch_interpreter
    patch_interpreter()

    from ember.core.kernels import lora_decode, qkv_decode, swiglu_decode
    from ember.core.sampling import SamplerConfig
    from tests.unit.test_sampler import INTERPRETED_FIRST_TOKENS, _worker, decoded, static_decode_requests

    swiglu = LaunchGrids(swiglu_decode, "_swiglu_lora")
    shrink = LaunchGrids(lora_decode, "_lora_shrink_kernel")
    expand = LaunchGrids(lora_decode, "_lora_expand_kernel")
    qkv = LaunchGrids(qkv_decode, "_qkv_rope_write")

    worker = _worker(PATH, SamplerConfig(max_seqs=16, page_size=4, kv_tokens=1024, static_decode=True))
    results = worker.sample(static_decode_requests(worker, INTERPRETED_FIRST_TOKENS))
    assert swiglu.grids, "the static decoder never ran the SwiGLU kernel"
    # the q/k/v kernel (the default) adds q/k/v's LoRA delta: a layer's expands are o's and down's alone
    # a step's expands: each layer's o and down, and the LM head's
    layers = worker.model.config.num_layers
    steps = len(qkv.grids) // layers
    assert steps and len(qkv.grids) == steps * layers, (len(qkv.grids), layers)
    assert len(expand.grids) == steps * (2 * layers + 1), (len(expand.grids), steps, layers)
    # the shrinks' programs per split follow the adapters with rows in the step, not the bank's
    # slots: one for the last steps (only one adapter's request still decoding), more while all
    # three decode side by side
    slots = worker.sampler.static.stacks.groups - 1
    per_split = sorted({grid[0] for grid in shrink.grids})
    assert slots > 3 and per_split[0] == 1 and 2 <= per_split[-1] <= 4, (slots, per_split)
    print(json.dumps(decoded(results)))
    """
)


def test_static_decode_through_the_kernels_equals_eager(hf_models):
    """The whole static decode step on the Triton path (under the interpreter: the LoRA shrink and
    expand, the SwiGLU kernel, the q/k/v kernel with its KV write, the fused norms) gives the eager decoder's tokens and
    logprobs (the PyTorch path, in this process), with three adapters (one without MLP LoRA) and a
    base-model row in the same steps."""
    _, path = hf_models["qwen3"]
    out = run_interpreted(f"PATH = {str(path)!r}\n" + ENGINE_SCRIPT, timeout=900)
    assert_equals_eager(path, json.loads(out.strip().splitlines()[-1]), INTERPRETED_FIRST_TOKENS)
