"""Classic synchronous GRPO: G=4 samples per prompt, PPO clip, batch barrier.

    python launch/train.py --config=configs/grpo_sync.py --workdir=workdirs/grpo_sync

Everything else as configs/sao_tiny.py (same SFT start, same budget), so the
held-out pass@1 of the runs compare directly.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import common  # pylint: disable=g-import-not-at-top


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.rollout.samples_per_prompt = 4
  c.rl.advantage = 'group'
  c.rl.policy_loss = 'ppo_clip'
  c.rl.critic_updates = 0
  c.value_pretrain.steps = 0
  c.rl.mode = 'sync'
  return c
