"""A small decoding harness for model tests: a dict-backed ``SequenceState`` and a KV-cache ``attend``,
both keyed by sequence, so a test can run sequences through several passes (prefill, chunks, one token
at a time) and compare with one packed training pass."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.core.models.base import ForwardContext


class DictState:
    """Per-sequence recurrent state. ``get`` stacks the pass's sequences (zeros for one that has none
    yet, rows zero-padded along the first axis to the longest); ``put`` splits the rows back."""

    def __init__(self):
        self.values: dict[tuple[int, int, str], torch.Tensor] = {}
        self.active: list[int] = []

    def get(self, layer: int, name: str) -> torch.Tensor | None:
        rows = [self.values.get((sid, layer, name)) for sid in self.active]
        known = [r for r in rows if r is not None]
        if not known:
            return None
        longest = max(r.shape[0] for r in known)
        out = []
        for r in rows:
            r = torch.zeros_like(known[0]) if r is None else r
            if r.shape[0] < longest:
                r = torch.cat([r, r.new_zeros(longest - r.shape[0], *r.shape[1:])])
            out.append(r)
        return torch.stack(out)

    def put(self, layer: int, name: str, value: torch.Tensor) -> None:
        for sid, row in zip(self.active, value):
            self.values[(sid, layer, name)] = row


class CachedAttend:
    """Causal attention over each sequence's cached keys and values (eager), honouring a QSA
    ``selection`` when given."""

    accepts_selection = True

    def __init__(self):
        self.cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.active: list[int] = []
        self.seq_lens: list[int] = []
        self.positions = torch.zeros(0, dtype=torch.long)

    def __call__(self, layer, q, k, v, spec, scale, selection=None):
        outs, start = [], 0
        for sid, n in zip(self.active, self.seq_lens):
            rows = slice(start, start + n)
            past = self.cache.get((sid, layer))
            keys = k[rows] if past is None else torch.cat([past[0], k[rows]])
            values = v[rows] if past is None else torch.cat([past[1], v[rows]])
            self.cache[(sid, layer)] = (keys, values)
            pos = self.positions[rows]
            mask = torch.arange(keys.shape[0])[None] <= pos[:, None]
            if selection is not None:
                mask = mask & selection.token_mask(rows, keys.shape[0])
            rep = q.shape[1] // k.shape[1]
            kh = keys.transpose(0, 1).repeat_interleave(rep, 0)
            vh = values.transpose(0, 1).repeat_interleave(rep, 0)
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), kh, vh, attn_mask=mask, scale=scale)
            outs.append(o.transpose(0, 1))
            start += n
        return torch.cat(outs)


def incremental_logprobs(model, seqs: list[list[int]], schedule: list[list[int]]) -> list[torch.Tensor]:
    """Run ``seqs`` through ``model`` in passes: ``schedule[p][i]`` tokens of sequence ``i`` in pass
    ``p`` (0 = not in this pass); returns, per sequence, the logprob of every token after the first."""
    state, attend = DictState(), CachedAttend()
    done = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    for counts in schedule:
        ids, pos, lens, active = [], [], [], []
        for i, n in enumerate(counts):
            if n:
                ids += seqs[i][done[i] : done[i] + n]
                pos += range(done[i], done[i] + n)
                lens.append(n)
                active.append(i)
        state.active = attend.active = active
        attend.seq_lens = lens
        attend.positions = torch.tensor(pos)
        ctx = ForwardContext(positions=attend.positions, attend=attend, seq_lens=lens, state=state)
        with torch.no_grad():
            hidden = model.hidden_states(torch.tensor(ids), ctx)
            out = (hidden @ model.unembed_weight.t()).double()
        start = 0
        for i, n in zip(active, lens):
            logits[i].append(out[start : start + n])
            start += n
            done[i] += n
    assert done == [len(s) for s in seqs], (done, [len(s) for s in seqs])
    result = []
    for s, parts in zip(seqs, logits):
        lp = torch.log_softmax(torch.cat(parts)[:-1], -1)
        result.append(lp.gather(1, torch.tensor(s[1:])[:, None])[:, 0])
    return result
