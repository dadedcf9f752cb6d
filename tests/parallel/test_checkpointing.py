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


def test_ranks_agree_on_the_layers_to_checkpoint(qwen3_moe_dir):
    """``auto`` decides per rank from its own free memory; the ranks then take the most layers any
    of them needs (the recompute's collectives must meet on every rank)."""
    run(2, checkpointing_cases.ranks_agree_on_the_layers, qwen3_moe_dir)
