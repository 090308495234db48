"""Ablation: RL starts with an untrained value head (no cold-start fix).

    python launch/train.py --config=configs/sao_no_value_pretrain.py --workdir=workdirs/sao_no_value_pretrain

Everything else as configs/sao_dis.py (same SFT start, same budget), so the
held-out pass@1 of the runs compare directly.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.value_pretrain.steps = 0
  return c
