"""Which implementation of the gated delta rule a GDN layer takes (fla's kernels only on CUDA)."""

import pytest
import torch

from ember.core.layers import gated_deltanet as gd


def test_the_cpu_takes_the_pytorch_rule_and_refuses_fla_clearly():
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    assert gd.gdn_backend(x) == "torch"
    assert gd.gdn_backend(x, "torch") == "torch"
    with pytest.raises(RuntimeError, match="needs a CUDA device and fla-core"):
        gd.gdn_backend(x, "fla")
    with pytest.raises(ValueError, match="GDN backend must be one of"):
        gd.gdn_backend(x, "triton")


def test_a_layer_with_the_torch_backend_requested_equals_the_default_on_the_cpu():
    torch.manual_seed(0)
    shape = gd.GDNShape(2, 4, 8, 8, 4, 1e-6, "silu")
    layer = gd.GatedDeltaNet(32, shape, 0, fused_projections=True).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    from ember.core.models.base import ForwardContext

    x = torch.randn(23, 32, dtype=torch.float64)
    ctx = dict(positions=torch.zeros(23, dtype=torch.long), attend=None, seq_lens=[10, 13])
    default = layer(x, ForwardContext(**ctx))
    layer.backend = "torch"
    assert torch.equal(layer(x, ForwardContext(**ctx)), default)
    layer.backend = "fla"
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        layer(x, ForwardContext(**ctx))
