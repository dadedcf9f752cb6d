"""Shrink windows (``SamplerConfig.shrink_windows``): a static decode step of few adapters multiplies
their LoRA shrink factors, copied into spare rows after the packed base weights, in the base
products. The tokens and logprobs are the eager decoder's, also after an adapter changes and when
the step's adapters move to other windows (run under Triton's interpreter; the eager reference in
this process)."""

import json
import textwrap

import numpy as np
import pytest

from ember.core.sampling import SamplerConfig
from tests.lora_helpers import randomise
from tests.triton_interp import run_interpreted
from tests.unit.test_sampler import INTERPRETED_FIRST_TOKENS, _worker, decoded, static_decode_requests

pytest.importorskip("triton")

MAX_RANK = 8  # window rows of rank 16 (RANK_MULTIPLE): the tiny model's q/k/v take two windows


def phases(worker):
    """The decodes both processes run: the mixed requests of three adapters (steps of three use the
    shrink kernels, steps of one or two the windows); the second adapter's requests alone (window
    0); then, after that adapter changes, the second and third adapters' (window 0 holds the
    second's old factors: copied again); then the third alone (it moves to window 0)."""
    reqs = static_decode_requests(worker, INTERPRETED_FIRST_TOKENS)
    slots = sorted({r.slot for r in reqs} - {0})
    yield reqs
    yield [r for r in reqs if r.slot == slots[1]]
    randomise(worker.adapter(slots[1]), seed=999, scale=0.05)
    yield [r for r in reqs if r.slot in slots[1:]]
    yield [r for r in reqs if r.slot == slots[2]]


SCRIPT = textwrap.dedent(
    """
    import json
    from tests.triton_interp import patch_interpreter
    patch_interpreter()

    from ember.core.kernels import lora_decode
    from ember.core.sampling import SamplerConfig, packed_linears
    from tests.unit.test_sampler import _worker, decoded
    from tests.unit.test_shrink_windows import MAX_RANK, phases

    packed_linears.WINDOW_SHARE = 1  # the tiny model's groups are too small for windows under the cap
    # the three kernels after the q/k/v product (the q/k/v kernel is test_swiglu_decode_kernel's):
    # the windowed q/k/v expand and the static decoder's path without the q/k/v kernel
    worker = _worker(PATH, SamplerConfig(max_seqs=16, page_size=4, kv_tokens=1024, static_decode=True,
                                         qkv_kernel=False), max_rank=MAX_RANK)
    packed = worker.sampler.static.packed
    assert packed.positions == 2 and len(packed.windows) == 6, (packed.positions, list(packed.windows))

    products, shrinks = [], []
    window_product, shrink = packed.window_product, lora_decode.lora_shrink
    packed.window_product = lambda key, x, cols: products.append(cols) or window_product(key, x, cols)
    lora_decode.lora_shrink = lambda *a, **k: shrinks.append(a[1].data_ptr()) or shrink(*a, **k)
    out = []
    for reqs in phases(worker):
        products.clear(), shrinks.clear()
        out.append(decoded(worker.sample(reqs)))
        # the LM head's shrink (the third adapter adapts it) has no window
        fused = worker.sampler.static.stacks.fused
        heads = {A.data_ptr() for name, (A, _) in fused.items() if name.endswith("lm_head")}
        assert heads, list(fused)
        others = sum(p not in heads for p in shrinks)
        print("window columns", sorted(set(products)), "shrink launches", others)
        out.append([len(products), others])
    print(json.dumps(out))
    """
)


def test_shrink_windows_equal_eager(hf_models):
    _, path = hf_models["qwen3"]
    got = json.loads(run_interpreted(f"PATH = {str(path)!r}\n" + SCRIPT, timeout=900).strip().splitlines()[-1])
    eager = _worker(path, SamplerConfig(max_seqs=16, page_size=4, kv_tokens=1024), max_rank=MAX_RANK)
    assert eager.sampler.static is None
    for i, reqs in enumerate(phases(eager)):
        want, (products, shrinks) = decoded(eager.sample(reqs)), got[2 * i + 1]
        assert len(got[2 * i]) == len(want)
        for g, w in zip(got[2 * i], want, strict=True):
            assert [t for t, _ in g] == [t for t, _ in w], i
            for (_, g_lp), (_, w_lp) in zip(g, w, strict=True):
                np.testing.assert_allclose(g_lp, w_lp, atol=1e-5, rtol=0)
        # the windows carried shrinks in every phase; the first one's steps of three adapters used
        # the shrink kernels, the later ones (two adapters at most) none
        assert products > 0, i
        assert (shrinks > 0) == (i == 0), (i, shrinks)


def test_windows_fit_under_the_cap_and_a_second_decoder_shares_them():
    """How many windows a model gets (a power of two, at most WINDOW_POSITIONS, each group's windows
    at most 1 / WINDOW_SHARE of its rows), the memory they take, weights unchanged, and a second packing of the same model (another decoder, with or without
    windows) reusing the first's tensors."""
    import torch
    from torch import nn

    from ember.core.layers.lora import LoraLinear
    from ember.core.sampling import packed_linears

    torch.manual_seed(0)
    attn, mlp = nn.Module(), nn.Module()
    H = 256
    for mod, names in ((attn, {"q_proj": 256, "k_proj": 128, "v_proj": 128, "o_proj": H}),
                       (mlp, {"gate_proj": 512, "up_proj": 512})):
        for name, out in names.items():
            lin = LoraLinear(H, out, False, "attn")
            lin.weight.data.normal_()
            lin.lora_name = name
            setattr(mod, name, lin)
    model = nn.Module()
    model.attn, model.mlp = attn, mlp
    # o's weight: the first rows of a larger tensor (as a loader may give): rows after it are not
    # spare, the packing must copy it rather than take them for windows
    big = torch.randn(H + 64, H)
    attn.o_proj.weight.data = big[:H]
    tail = big[H:].clone()
    before = {m.lora_name: m.weight.detach().clone() for m in model.modules() if isinstance(m, LoraLinear)}
    # q/k/v: 512 rows // (4 · 3 · 16) = 2 windows; o: 256 // 64 = 4; gate/up: 1024 // 128 = 8
    packed = packed_linears.PackedLinears(model, 16, before)
    assert packed.positions == 2 and set(packed.windows) == {"q_proj", "o_proj", "gate_proj"}
    spare = {k: W.shape[0] - packed.weights[k][0].shape[0] for k, (W, _) in packed.windows.items()}
    assert spare == {"q_proj": 96, "o_proj": 32, "gate_proj": 64}, spare  # 2 windows of members · 16 rows
    for m in model.modules():
        if isinstance(m, LoraLinear):
            assert m.weight.equal(before[m.lora_name]) and packed.rows(m.lora_name, m.weight) is not None
    assert packed.windows["o_proj"][0].data_ptr() != big.data_ptr() and big[H:].equal(tail)
    # a module the bank does not adapt gets no window (and a single one is not packed)
    assert set(packed_linears.PackedLinears(model, 16, set(before) - {"o_proj"}).windows) == {"q_proj", "gate_proj"}
    # the product: the base output, then the step's windows
    W, _ = packed.windows["o_proj"]
    W[H:].normal_()
    x = torch.randn(3, H)
    y = packed.window_product("o_proj", x, 16)
    assert y.shape == (3, H + 16)
    torch.testing.assert_close(y, x @ W[: H + 16].T)
    # a second decoder shares the tensors, with windows or without
    for rank in (16, 0):
        again = packed_linears.PackedLinears(model, rank, before)
        for key, (Wk, _) in again.weights.items():
            assert Wk.data_ptr() == packed.weights[key][0].data_ptr(), (rank, key)
    # no windows where the cap leaves none (a rank too large for these groups)
    assert packed_linears.PackedLinears(model, 64, before).positions == 0
