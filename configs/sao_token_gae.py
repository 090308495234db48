"""Ablation: naive token-level GAE (observation tokens stay in the recursion).

    python launch/train.py --config=configs/sao_token_gae.py --workdir=workdirs/sao_token_gae

Everything else as configs/sao_dis.py (same SFT start, same budget), so the
held-out pass@1 of the runs compare directly.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.rl.advantage = "token_gae"
  return c
