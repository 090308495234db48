"""SAO on python_tool with the tiny MoE model: the CPU default.

    python launch/train.py --config=configs/sao_tiny.py --workdir=workdirs/sao_tiny
    python launch/train.py --config=configs/sao_tiny.py --config.rl.policy_loss=dis ...   # the paper's loss

SFT warm start -> value pretraining -> async SAO -> held-out pass@1, on 2 CPU
cores. Results of a run: benchmarks/RESULTS.md#learning-on-cpu.

SAO's single rollout, critic (skip-observation GAE, K=2, frozen attention,
value pretraining) and asynchrony as the paper specifies, with one change:
the policy loss is PPO's clipped surrogate against the rollout log-prob
(`ppo_clip`, window 0.2 / 0.28, the project's choice) instead of the
paper's DIS mask (`dis`, configs/sao_dis.py): at this scale SAO with DIS
collapsed in runs where SAO with PPO clip did not, and fell behind it
under forced lag (experiments/README.md, "DIS under lag"). The paper's
loss is one flag away: --config.rl.policy_loss=dis.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.rl.policy_loss = "ppo_clip"
  return c
