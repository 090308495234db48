"""Headline: SAO vs GRPO (async, async + DIS, sync G=4 / G=8) from one SFT start.

    python -m experiments.headline                       # 5 seeds x 7 arms (--jobs 3: seeds side by side)
    python -m experiments.headline --arms sao,grpo_dis,grpo_sync --seeds 3 --budget_steps 80
    python -m experiments.headline --set env.name=code_fix --results experiments/results/headline_code_fix

The paper (Qwen3-30B-A3B): SAO 97.3 / 74.8 on AIME25 / BeyondAIME vs GRPO
84.2 / 54.8 and SFT 80.4 / 53.3. Here: the tiny MoE on python_tool, every
arm from the same SFT checkpoint per seed and the same budget of generated
tokens (SAO's value-pretraining rollouts included, see runner.py), held-out
pass@1 on 400 tasks. The full grid is 7 arms x 5 seeds x 600 steps, too
long for one sitting on a 2-core box (run times: experiments/README.md;
sync GRPO the fastest, SAO the slowest), so it is run in pieces (--arms,
--first_seed, --reference); finished runs are skipped.

Policy lag: with rollout.slots = rl.batch_size (the default) the mean lag is
a few versions; `--set rollout.slots=48 --set rl.sync_every=2` makes it larger
for every arm.
"""

import sys

import numpy as np

from experiments import runner


def reward_by_quarter(finding, runs):
  """Per arm: the mean training reward in each quarter of the RL steps.

  Whether a run was long enough (the criterion: >= 600 steps, or until the
  curve flattens): the last quarter's mean minus the third's, per seed,
  and its mean over seeds. Near zero: flat at the end; clearly positive:
  still rising when the budget ran out.
  """
  del finding
  out = {}
  for arm, by_seed in runs.items():
    quarters, late_rise = {}, {}
    for seed, rec in by_seed.items():
      y = np.asarray(rec["curves"].get("rollout/reward_mean", []), float)
      if len(y) < 4:
        continue
      q = [float(part.mean()) for part in np.array_split(y, 4)]
      quarters[seed], late_rise[seed] = q, q[3] - q[2]
    if quarters:
      out[arm] = {
        "reward_by_quarter": quarters,
        "last_minus_third_quarter": late_rise,
        "mean_last_minus_third": float(np.mean(list(late_rise.values()))),
      }
  return {"training_reward_by_quarter": out}


ARMS = (
  runner.Arm("sao", "sao_dis", label="SAO"),
  # SAO's critic updates make its train step slower than GRPO's, so with the
  # default 64-trajectory queue its rollouts run further ahead than GRPO's
  # (their lags: experiments/README.md). One batch of read-ahead bounds it.
  runner.Arm("sao_q16", "sao_dis", {"rollout.queue_size": 16}, label="SAO, queue of one batch"),
  # SAO with PPO's clipped surrogate in place of DIS: everything else SAO's.
  # Separates DIS from the rest of SAO where SAO runs collapse.
  runner.Arm(
    "sao_ppo", "sao_dis", {"rl.policy_loss": "ppo_clip"}, label="SAO with PPO clip (no DIS)"
  ),
  runner.Arm("grpo", "grpo", label="async GRPO (PPO clip)"),
  runner.Arm("grpo_dis", "grpo_dis", label="async GRPO + DIS"),
  runner.Arm("grpo_sync", "grpo_sync", label="sync GRPO G=4"),
  runner.Arm("grpo_sync_g8", "grpo_sync", {"rollout.samples_per_prompt": 8}, label="sync GRPO G=8"),
  # GRPO without its per-group std rescaling (R - mean_G, reward units like
  # SAO's advantages): separates "group baseline" from "group rescaling".
  runner.Arm(
    "grpo_dis_nostd",
    "grpo_dis",
    {"rl.group_std_normalize": False},
    label="async GRPO + DIS, no std",
  ),
)

FINDING = runner.Finding(
  name="headline",
  claim=(
    "SAO (single rollout, value baseline, DIS, async) beats GRPO from the same SFT "
    "start at the same budget (paper: 97.3 vs 84.2 on AIME25, SFT 80.4)."
  ),
  arms=ARMS,
  reference="sao",
  seeds=5,
  budget_steps=600,
  curves=("rollout/reward_mean", "policy_lag/mean", "policy/masked_low_frac"),
  analyze=reward_by_quarter,
)

if __name__ == "__main__":
  runner.main(FINDING, sys.argv[1:])
