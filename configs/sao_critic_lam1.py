"""Ablation: the critic regresses Monte Carlo returns (critic lambda 1.0), the actor keeps lambda 0.95.

    python launch/train.py --config=configs/sao_critic_lam1.py --workdir=workdirs/sao_critic_lam1

With one lambda for both, the critic's targets are its own lambda-returns
(self-bootstrapped); with rl.critic_lam = 1.0 they are the observed returns.
Everything else as configs/sao_dis.py (same SFT start, same budget), so the
held-out pass@1 of the runs compare directly.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.rl.critic_lam = 1.0
  return c
