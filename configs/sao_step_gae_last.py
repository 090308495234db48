"""Ablation: step-level GAE, a step's value is the value at its last token.

    python launch/train.py --config=configs/sao_step_gae_last.py --workdir=workdirs/sao_step_gae_last

Everything else as configs/sao_dis.py (same SFT start, same budget), so the
held-out pass@1 of the runs compare directly.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.rl.advantage = "step_gae_last"
  return c
