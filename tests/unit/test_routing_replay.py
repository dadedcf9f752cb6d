"""MoE routing can be recorded and replayed (rollout routing replay, R3)."""

import torch

from ember.core.batch import pack
from ember.core.layers.attention import PackedAttention
from ember.core.loading import load_model
from ember.core.logprobs import token_logprobs
from ember.core.models.base import ForwardContext, RoutingRecord
from tests.tiny_models import random_sequences


def _logprobs(model, batch, routing):
    attn = PackedAttention(batch.doc_lengths, torch.device("cpu"))
    ctx = ForwardContext(batch.positions, lambda i, q, k, v, s, sc: attn(q, k, v, s, sc),
                         seq_lens=batch.doc_lengths, routing=routing)
    with torch.no_grad():
        h = model.hidden_states(batch.input_ids, ctx)
        return token_logprobs(h, model.unembed_weight, torch.roll(batch.input_ids, -1))


def test_record_and_replay(hf_models):
    _, path = hf_models["qwen3_moe"]
    model = load_model(path, "cpu", torch.float32)
    batch = pack(random_sequences(320, [12, 20], seed=3), [0, 0], "cpu")
    rec = RoutingRecord(record={})
    base = _logprobs(model, batch, rec)
    assert sorted(rec.record) == [0, 1] and rec.record[0].shape == (32, 2)
    same = _logprobs(model, batch, RoutingRecord(replay=rec.record))
    torch.testing.assert_close(same, base, atol=0, rtol=0)
    # replaying other experts changes the output: the replayed choice is really used
    other = {k: (v + 1) % 8 for k, v in rec.record.items()}
    changed = _logprobs(model, batch, RoutingRecord(replay=other))
    assert (changed - base).abs().max() > 1e-3
