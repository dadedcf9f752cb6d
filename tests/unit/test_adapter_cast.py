"""An adapter's factors cast for a pass and cut into pieces (``ember.core.adapters.cast_split``):
the same pieces as ``flat.to(dtype).split(sizes)``, and the same fp32 gradient as autograd's split
and cast give, with pieces a pass does not use, empty pieces, and gradients accumulated over two
backward passes."""

import torch

from ember.core.adapters import cast_split


def test_cast_split_gives_autograds_pieces_and_gradient():
    torch.manual_seed(0)
    sizes = [6, 0, 12, 5, 9, 3]
    for dtype in (torch.bfloat16, torch.float16):
        mine = torch.randn(sum(sizes), requires_grad=True)
        theirs = mine.detach().clone().requires_grad_()
        weights = [torch.randn(n).to(dtype) for n in sizes]
        for unused in (3, 5):  # two passes, each leaving another piece out: the gradients add up
            a = cast_split(mine, dtype, sizes)
            b = torch.split(theirs.to(dtype), sizes)
            assert all(x.dtype == dtype and torch.equal(x, y) for x, y in zip(a, b))

            def loss(pieces, unused=unused, weights=weights):
                return sum((p.view(-1, 1) * w.view(-1, 1) * 3).sum()
                           for i, (p, w) in enumerate(zip(pieces, weights)) if i != unused)

            loss(a).backward()
            loss(b).backward()
            assert mine.grad.dtype == torch.float32
            assert torch.equal(mine.grad, theirs.grad), dtype


def test_cast_split_without_gradients_or_cast_is_a_plain_split():
    flat = torch.randn(10, requires_grad=True)
    same = cast_split(flat, torch.float32, [4, 6])  # no cast: autograd's own split of flat
    assert same[0]._base is flat
    with torch.no_grad():
        pieces = cast_split(flat, torch.bfloat16, [4, 6])
    assert not pieces[0].requires_grad and pieces[1].dtype == torch.bfloat16
