"""Activation checkpointing of a sharded worker on gloo (2 CPU processes): the recompute enters
each layer's collectives again on every rank and gives the pass without checkpointing."""


from tests.parallel import checkpointing_cases
from tests.parallel.launch import run


def test_qwen3_moe_ep2(qwen3_moe_dir):
    """Expert parallelism: the MoE layers' count exchange and all-to-alls run again in backward."""
    run(2, checkpointing_cases.checkpointed_step_matches, qwen3_moe_dir, 2)


def test_qwen3_moe_tp2(qwen3_moe_dir):
    """Tensor + sequence parallelism: the token mixers' gathers and reduce-scatters run again, over
    the pass's token split, and the routing record's gathers (ShardedRouting) do not."""
    run(2, checkpointing_cases.checkpointed_step_matches, qwen3_moe_dir, 1, 2)
