"""Stages 2-3: session and model (ids, get_info, offline tokenizer), then supervised numerics on
both models: step-0 logprobs equal the transformers base model's, loss:sum = -sum(w * lp) in float64,
1-D/2-D (dense and CSR) targets, list/numpy inputs, ragged lengths; the loss falls with training."""

import itertools

import numpy as np
import tinker
import torch
from tinker import types

from tests.conformance.scenarios.common import (
    MOE,
    QWEN3,
    arr,
    check_metric_keys,
    model_dir,
    reference_logprobs,
    tokens_of,
)

sc = tinker.ServiceClient(user_metadata={"purpose": "conformance"}, display_name="stage2")
rng = np.random.default_rng(0)

for base in (QWEN3, MOE):
    tc = sc.create_lora_training_client(base_model=base, rank=8, seed=0,
                                        user_metadata={"renderer_name": "role_colon"}).result()
    session = sc.holder.get_session_id()
    assert tc.model_id.startswith(f"{session}:train:"), tc.model_id
    info = tc.get_info()
    assert info.model_data.model_name == base and info.model_data.tokenizer_id == model_dir(base)
    assert info.lora_rank == 8 and info.is_lora
    tok = tc.get_tokenizer()  # loads offline from the model's folder
    ids = tok.encode("User: hello there")
    assert tok.decode(ids) == "User: hello there"

    # Mixed inputs: lists, numpy, ragged lengths, 2-D targets dense and (auto) sparse CSR.
    seqs = [rng.integers(0, 512, n + 1) for n in (7, 12, 5)]
    data = [
        types.Datum(model_input=types.ModelInput.from_ints(seqs[0][:-1].tolist()),
                    loss_fn_inputs={"target_tokens": seqs[0][1:].tolist(), "weights": [1.0] * 7}),
        types.Datum(model_input=types.ModelInput.from_ints(seqs[1][:-1].tolist()),
                    loss_fn_inputs={"target_tokens": seqs[1][1:].astype(np.int64),
                                    "weights": rng.uniform(0, 2, 12).astype(np.float32)}),
        types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": np.array(ids[1:]), "weights": np.ones(len(ids) - 1, np.float32)}),
    ]
    t2d = torch.zeros(5, 8, dtype=torch.long)
    t2d[:, 0] = torch.as_tensor(seqs[2][1:])
    t2d[:, 3] = 7
    w2d = torch.zeros(5, 8)
    w2d[:, 0], w2d[:, 3] = 1.0, 0.25
    dense_k = torch.as_tensor(rng.integers(0, 512, (5, 2)))
    data.append(types.Datum(model_input=types.ModelInput.from_ints(seqs[2][:-1].tolist()),
                            loss_fn_inputs={"target_tokens": t2d, "weights": w2d}))
    data.append(types.Datum(model_input=types.ModelInput.from_ints(seqs[2][:-1].tolist()),
                            loss_fn_inputs={"target_tokens": dense_k, "weights": torch.ones(5, 2)}))
    assert data[3].loss_fn_inputs["target_tokens"].sparse_crow_indices is not None  # sent as CSR

    out = tc.forward(data, "cross_entropy").result()
    check_metric_keys(out.metrics)
    expected_loss = 0.0
    for d, o in zip(data, out.loss_fn_outputs):
        targets, weights = arr(d.loss_fn_inputs["target_tokens"]), arr(d.loss_fn_inputs["weights"])
        lp = arr(o["logprobs"])
        ref = reference_logprobs(base, tokens_of(d), targets)
        assert lp.shape == targets.shape, (lp.shape, targets.shape)
        np.testing.assert_allclose(lp, ref, atol=2e-4, rtol=0)
        expected_loss += -(weights.astype(np.float64) * lp.astype(np.float64)).sum()
    assert abs(out.metrics["loss:sum"] - expected_loss) <= 1e-4 * max(1.0, abs(expected_loss)), (out.metrics, expected_loss)

    # Training: forward_backward + optim_step submitted back to back; the loss falls.
    batch = data[:3]
    losses = []
    for _ in range(6):
        f = tc.forward_backward(batch, "cross_entropy")
        o = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        r = f.result()
        check_metric_keys(r.metrics)
        losses.append(r.metrics["loss:sum"])
        assert o.result().metrics["grad_norm"] > 0
    assert losses[-1] < 0.7 * losses[0] and all(b < a for a, b in itertools.pairwise(losses)), losses
    print(base, "losses", [round(x, 2) for x in losses])
sc.close("success").result()
print("stages 2-3 ok")
