"""Value-model ablations: K critic updates, frozen attention, value pretraining, critic lambda, running mean.

    python -m experiments.value_ablations             # 3 seeds x 7 arms, 400 steps
    python -m experiments.value_ablations --smoke

The paper (AIME25 / BeyondAIME): SAO 97.3 / 74.8; without faster value
updates (K=1) 95.0 / 69.8; without frozen critic attention 90.6 / 74.5;
running-mean baseline instead of a critic 79.8 / 55.3. Value pretraining
(the cold-start fix) and the critic's own lambda (rl.critic_lam = 1:
Monte Carlo targets) are this project's questions. Each arm is one
configs/ file (one change from configs/sao_dis.py) at the same budget of
generated tokens: the arms without value pretraining spend those tokens on
RL steps instead.
"""

import sys

from experiments import runner

FINDING = runner.Finding(
  name="value_ablations",
  claim=(
    "A strong value model matters: K=2 critic updates, frozen critic attention and "
    "value pretraining each help; a running-mean baseline is far worse (paper: 97.3 "
    "vs 95.0 (K=1), 90.6 (trained attention), 79.8 (running mean) on AIME25)."
  ),
  arms=(
    runner.Arm("sao", "sao_dis", label="SAO (K=2, frozen attn)"),
    runner.Arm("k1", "sao_k1", label="K=1"),
    runner.Arm("k4", "sao_dis", {"rl.critic_updates": 4}, label="K=4"),
    runner.Arm("no_freeze", "sao_no_freeze", label="critic attention trained"),
    runner.Arm("no_value_pretrain", "sao_no_value_pretrain", label="no value pretraining"),
    runner.Arm("critic_lam1", "sao_critic_lam1", label="critic lambda 1"),
    runner.Arm("running_mean", "running_mean", label="running-mean baseline"),
  ),
  reference="sao",
  seeds=3,
  budget_steps=400,
  curves=("rollout/reward_mean", "critic/explained_variance", "critic/value_loss"),
)

if __name__ == "__main__":
  runner.main(FINDING, sys.argv[1:])
