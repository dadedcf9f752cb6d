"""Runs tinker-cookbook's DPO trainer (``preference.train_dpo.main``, unmodified) on a local
comparisons JSONL file: ``python -m tests.cookbook.dpo_driver MODEL COMPARISONS LOG_DIR STEPS``.

The cookbook's DPO CLI only offers Hugging Face datasets, so this builds the same ``Config`` the CLI
builds, with the cookbook's own ``ComparisonBuilderFromJsonl`` for the local file. The DPO loss runs
client-side through ``forward_backward_custom``; the reference is ``save_weights_and_get_sampling_client``
+ ``compute_logprobs``.
"""

import sys

from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

model, comparisons, log_dir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name="role_colon", max_length=256,
                                        batch_size=4)
train_dpo.main(train_dpo.Config(
    log_path=log_dir, model_name=model, recipe_name="recipe_preference_dpo", renderer_name="role_colon",
    dataset_builder=DPODatasetBuilderFromComparisons(common_config=common,
                                                     comparison_builder=ComparisonBuilderFromJsonl(train_path=comparisons)),
    evaluator_builders=[], learning_rate=2e-3, lr_schedule="constant", dpo_beta=0.5, lora_rank=8, max_steps=steps,
    save_every=0, eval_every=0,
))
