"""Contiguous copies as 8-byte words (ember.core.layers.copies): bit for bit x.contiguous(), the
gradient passed through, and the plain copy where the layout is not whole words."""

import torch

from ember.core.layers import copies


def test_word_copies_equal_contiguous_bit_for_bit_and_pass_the_gradient():
    torch.manual_seed(0)
    wide = torch.randn(7, 3, 24).bfloat16()
    for cut in (wide[..., :16], wide[..., 8:24], wide[:, 1:, 4:12], wide.transpose(0, 1)[..., :8]):
        assert copies._in_words(cut)
        got = copies.contiguous(cut)
        assert got.is_contiguous() and got.dtype == cut.dtype and torch.equal(got.view(torch.int16), cut.contiguous().view(torch.int16))
    x = wide.clone().requires_grad_()
    y = copies.contiguous(x[..., 8:16])
    y.backward(torch.arange(y.numel(), dtype=torch.bfloat16).view(y.shape))
    ref = torch.zeros_like(wide)
    ref[..., 8:16] = torch.arange(y.numel(), dtype=torch.bfloat16).view(y.shape)
    assert torch.equal(x.grad, ref)


def test_layouts_that_are_not_whole_words_take_the_plain_copy():
    wide = torch.randn(5, 12).bfloat16()
    for cut in (wide[:, 1:9], wide[:, :6], wide[:, ::2], torch.randn(4, 6)[:, :4].double()):
        assert not copies._in_words(cut)
        assert torch.equal(copies.contiguous(cut), cut.contiguous())
    x = torch.randn(3, 4)
    assert copies.contiguous(x) is x
