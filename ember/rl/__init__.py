"""``ember.rl``: RL and SFT recipes over the Tinker client API.

Only the public ``tinker`` SDK is used (no ``ember.core`` / ``engine`` / ``server`` / ``store``), so
the recipes run against ``ember serve`` or any Tinker-compatible service.

* formulas: :mod:`ember.rl.advantages` (GRPO, Dr. GRPO, RLOO, REINFORCE++), :mod:`ember.rl.losses`
  (PPO clip-higher / dual clip, CISPO, GSPO, REINFORCE, IS, aggregation modes, KL k1/k2/k3, TIS /
  IcePop / sequence masking), :mod:`ember.rl.shaping` (DAPO overlong penalty);
* :mod:`ember.rl.objective`: those losses through Tinker's built-in losses or ``forward_backward_custom``;
* :mod:`ember.rl.envs`: arithmetic (single- and multi-turn) and math answers (``math-verify``);
* :mod:`ember.rl.rollouts`: group sampling, multi-turn episodes in token ids, evaluation;
* :mod:`ember.rl.trainer` / :mod:`ember.rl.sft`: the ``ember rl`` / ``ember sft`` loops.
"""

from ember.rl.advantages import group_advantages, has_signal
from ember.rl.config import RLConfig, SFTConfig, load_config
from ember.rl.shaping import overlong_penalty, shaped_reward

__all__ = ["RLConfig", "SFTConfig", "group_advantages", "has_signal", "load_config", "overlong_penalty",
           "shaped_reward"]
