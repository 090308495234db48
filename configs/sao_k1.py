"""Ablation: one critic update per actor update (without faster value updates).

    python launch/train.py --config=configs/sao_k1.py --workdir=workdirs/sao_k1

Everything else as configs/sao_dis.py (same SFT start, same budget), so the
held-out pass@1 of the runs compare directly.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.rl.critic_updates = 1
  return c
