"""Qwen3.8-Flash-Next's n-gram (PLE) table in host memory, split by expert parallelism.

The table (51.2 B parameters in the released model, ~95 GiB in bf16) lives in host memory on every
rank, never on the GPU (:mod:`ember.core.layers.ngram_memory`). Under ``--ep E`` the ``E`` ranks of
an expert group each hold a contiguous block of ``rows / E`` of its rows, read from the checkpoint
by block (``param_blocks``, before loading). A lookup (:class:`ShardedRows`, each
:class:`~ember.core.layers.ngram_memory.NGramEmbedding`'s ``lookup``) sends every row id to the rank
that holds its row and gets the rows back: two all-to-alls over the expert group on CPU tensors,
which travel over gloo (the engine's ``"cpu:gloo,cuda:nccl"`` world; on CPU runs the world is
gloo), so the lookup never touches a GPU. The table is frozen, so nothing travels back in backward.

Every rank enters the exchange of every PLE layer, in the same order, also with no ids (like the
experts' dispatch). The ranks of a TP group hold the same tokens and each fetches the same rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ember.core.layers.ngram_memory import NGramEmbedding, host_rows
from ember.dist import comm
from ember.dist.mesh import Parallel


class ShardedRows:
    """The ``lookup`` of an n-gram table whose rows are split in equal contiguous blocks over the
    expert group: this rank holds rows ``[ep_rank · n, (ep_rank + 1) · n)``."""

    def __init__(self, group, ep: int, ep_rank: int):
        self.group, self.ep, self.ep_rank = group, ep, ep_rank

    def __call__(self, table: torch.Tensor, ids: torch.Tensor, pin: bool) -> torch.Tensor:
        n = table.shape[0]  # rows per rank
        owner = torch.div(ids, n, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)  # ids grouped by the rank holding their row
        send = torch.bincount(owner, minlength=self.ep)
        recv = comm.exchange_counts(send[:, None], self.group)[:, 0]
        send_counts, recv_counts = send.tolist(), recv.tolist()
        asked = comm.exchange_rows(ids[order], recv_counts, send_counts, self.group)
        rows = host_rows(table, asked - self.ep_rank * n)
        back = comm.exchange_rows(rows, send_counts, recv_counts, self.group)
        out = torch.empty(back.shape, dtype=back.dtype, pin_memory=pin)
        return out.index_copy_(0, order, back)


def shard_tables(model: nn.Module, parallel: Parallel) -> int:
    """Narrow every n-gram table of ``model`` to this rank's block of rows, in place (on the meta
    device, before loading: a rank reads only its rows), and set the layers' ``lookup``; returns the
    number of tables. Refuses a table whose rows ``--ep`` does not divide."""
    ep, ep_rank = parallel.layout.ep, parallel.layout.ep_rank
    tables = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, NGramEmbedding)]
    for name, mod in tables:
        rows = mod.ngram_embedding.weight.shape[0]
        if rows % ep:
            raise ValueError(f"--ep {ep} must divide the rows of every n-gram table ({name}: {rows} rows)")
    if not tables:
        return 0
    backend = str(dist.get_backend(parallel.ep_group))
    if "gloo" not in backend and backend != "fake":
        raise ValueError(f"the n-gram table's lookup sends CPU tensors: the process group needs gloo, not {backend!r}")
    lookup = ShardedRows(parallel.ep_group, ep, ep_rank)
    blocks = model.__dict__.setdefault("param_blocks", {})  # read by load_model: what to read of each tensor
    for name, mod in tables:
        emb = mod.ngram_embedding
        n = emb.weight.shape[0] // ep
        emb.weight = nn.Parameter(emb.weight.data[ep_rank * n : (ep_rank + 1) * n].clone(), requires_grad=False)
        emb.num_embeddings = n
        blocks[f"{name}.ngram_embedding.weight"] = (0, ep_rank * n, n)
        mod.lookup = lookup
    return len(tables)
