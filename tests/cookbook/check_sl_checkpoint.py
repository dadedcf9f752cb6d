"""Replays a chat-SL checkpoint with the SDK: ``python -m tests.cookbook.check_sl_checkpoint MODEL
DATASET STATE_PATH J``. Loads the state with its optimizer, computes the mean NLL of batch J (the
recipe's own dataset builder and epoch-0 order), takes the recipe's step on batch J (constant lr
1e-3, the recipe's Adam defaults), then the NLL of batch J+1. Prints them as JSON."""

import asyncio
import json
import sys

import tinker
from tinker_cookbook.supervised.common import compute_mean_nll
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

model, dataset, state_path, j = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name="role_colon", max_length=16384,
                                        batch_size=8)
built = FromConversationFileBuilder(common_config=common, file_path=dataset)()
train = (asyncio.run(built) if asyncio.iscoroutine(built) else built)[0]
train.set_epoch(seed=0)
batches = [train.get_batch(i) for i in range(j + 2)]


def nll(client, data) -> float:
    out = client.forward(data, "cross_entropy").result()
    return compute_mean_nll([o["logprobs"] for o in out.loss_fn_outputs], [d.loss_fn_inputs["weights"] for d in data])


service = tinker.ServiceClient()
tc = service.create_training_client_from_state_with_optimizer(state_path).result()
before = nll(tc, batches[j])
tc.forward_backward(batches[j], "cross_entropy").result()
tc.optim_step(tinker.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8)).result()
after = nll(tc, batches[j + 1])
service.close("success").result()
print(json.dumps({"nll_j": before, "nll_j1": after}))
