"""Parallelism applied from outside the models (torchtitan's way).

The model files are single-process code. This package shards a built model in place and supplies
the collectives its sharded layers call:

* :mod:`ember.dist.mesh`: the layout (world, expert-parallel size) and its process groups;
* :mod:`ember.dist.comm`: every collective Ember uses, in one place (autograd-aware where a
  backward must move gradients back);
* :mod:`ember.dist.expert_parallel`: experts sharded by contiguous blocks, token rows dispatched to
  their experts' ranks (all-to-all for training and prefill, all-gather + reduce-scatter for decode);
* :mod:`ember.dist.adapters`: the adapter bank's gradients reduced over exactly the ranks that
  share a factor (sums, never means), the global gradient norm, full checkpoints gathered.
"""
