"""Stage 4: chunking and ordering. API-only servers on the same database hand the SDK other flags
(2 or 3 datums per request, serial chunks, zstd bodies). The chunks of one forward_backward arrive
out of order (the SDK sends the first last) yet run in seq_id order and accumulate into ONE step:
outputs, loss and the weights after optim_step equal the unchunked call's."""

import numpy as np
import tinker
from tinker import types

from tests.conformance.scenarios.common import CONF, QWEN3, arr, random_datum

rng = np.random.default_rng(4)
data = [random_datum(rng, n, weights=rng.uniform(0.2, 1.5, n)) for n in (6, 9, 4, 11, 7)]
adam = types.AdamParams(learning_rate=1e-2)


def train_once(sc):
    tc = sc.create_lora_training_client(base_model=QWEN3, rank=8, seed=3).result()
    fb = tc.forward_backward(data, "cross_entropy")
    opt = tc.optim_step(adam)
    after = tc.forward(data, "cross_entropy")
    return tc, fb.result(), opt.result(), after.result()


ref_sc = tinker.ServiceClient()
_, ref, ref_opt, ref_after = train_once(ref_sc)
for flag, chunk in (("chunk2", 2), ("serial", 2), ("zstd", 3)):
    sc = tinker.ServiceClient(base_url=CONF["extra"][flag])
    tc, got, opt, after = train_once(sc)
    cfg = sc.holder._client_config
    assert cfg.fwdbwd_max_chunk_len == chunk, cfg
    assert cfg.parallel_fwdbwd_chunks == (flag != "serial") and cfg.proto_compress_fwdbwd == (flag == "zstd")
    assert len(got.loss_fn_outputs) == len(data)
    for a, b in zip(got.loss_fn_outputs, ref.loss_fn_outputs):
        np.testing.assert_allclose(arr(a["logprobs"]), arr(b["logprobs"]), atol=1e-5)
    assert abs(got.metrics["loss:sum"] - ref.metrics["loss:sum"]) < 1e-3, (got.metrics, ref.metrics)
    # One optimizer step over the gradients of every chunk: same norm, same weights afterwards.
    assert abs(opt.metrics["grad_norm"] - ref_opt.metrics["grad_norm"]) < 1e-3 * ref_opt.metrics["grad_norm"]
    for a, b in zip(after.loss_fn_outputs, ref_after.loss_fn_outputs):
        np.testing.assert_allclose(arr(a["logprobs"]), arr(b["logprobs"]), atol=1e-5)
    sc.close("success").result()
    print(flag, "ok")
ref_sc.close("success").result()
print("stage 4 ok")
