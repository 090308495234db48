"""Vanilla async GRPO: G=4 samples per prompt, group-normalised advantage, PPO clip (the arm the paper reports collapsing).

    python launch/train.py --config=configs/grpo.py --workdir=workdirs/grpo

Everything else as configs/sao_dis.py (same SFT start, same budget), so the
held-out pass@1 of the runs compare directly.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.rollout.samples_per_prompt = 4
  c.rl.advantage = "group"
  c.rl.policy_loss = "ppo_clip"
  c.rl.critic_updates = 0
  c.value_pretrain.steps = 0
  return c
