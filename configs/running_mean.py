"""Single rollout, no critic: A = R - mean of the last W rewards, DIS loss.

    python launch/train.py --config=configs/running_mean.py --workdir=workdirs/running_mean

Everything else as configs/sao_dis.py (same SFT start, same budget), so the
held-out pass@1 of the runs compare directly.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.rl.advantage = "running_mean"
  c.rl.critic_updates = 0
  c.value_pretrain.steps = 0
  return c
