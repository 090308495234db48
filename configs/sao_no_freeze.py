"""Ablation: the critic's attention trains too (without frozen attention).

    python launch/train.py --config=configs/sao_no_freeze.py --workdir=workdirs/sao_no_freeze

Everything else as configs/sao_dis.py (same SFT start, same budget), so the
held-out pass@1 of the runs compare directly.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.rl.freeze_critic_attention = False
  return c
