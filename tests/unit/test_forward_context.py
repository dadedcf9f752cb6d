"""ForwardContext.memo: what a pass derives from its batch is made once, and a context made from
another by dataclasses.replace (checkpointing, sequence parallelism) does not inherit it."""

import dataclasses

import torch

from ember.core.models.base import ForwardContext


def test_memo_makes_each_key_once_and_replace_starts_empty():
    made = []

    def make(tag):
        made.append(tag)
        return torch.tensor([len(made)])

    ctx = ForwardContext(positions=torch.arange(4), attend=None, seq_lens=[4])
    first = ctx.memo(("positions", "cpu"), lambda: make("a"))
    assert ctx.memo(("positions", "cpu"), lambda: make("b")) is first
    assert ctx.memo(("cu_seqlens", "cpu"), lambda: make("c")).item() == 2
    assert made == ["a", "c"]
    other = dataclasses.replace(ctx, seq_lens=[2, 2])
    assert other.memo(("positions", "cpu"), lambda: make("d")).item() == 3
    assert made == ["a", "c", "d"]
