"""Async GRPO with DIS instead of PPO clip (group advantages, G=4).

    python launch/train.py --config=configs/grpo_dis.py --workdir=workdirs/grpo_dis

configs/grpo.py with one change, so the two arms differ only in that.
"""

from configs import grpo


def get_config(arg=None):
  c = grpo.get_config(arg)
  c.rl.policy_loss = "dis"
  return c
