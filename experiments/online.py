"""Online learning: after each shift of the preferred style, who recovers faster?

    python -m experiments.online                      # 3 seeds x 4 arms, 240 steps
    python -m experiments.online --smoke

The paper's simulation: reward preferences move between writing styles;
SAO's critic re-adapts after each shift faster than a running-mean
baseline. Here configs/sao_online.py (online_style, a shift every 320
training episodes = 20 steps of 16; evaluation and value pretraining do
not move the schedule) under SAO, the running-mean baseline, async GRPO +
DIS (G=4: the same episodes per step) and SAO with PPO's clipped surrogate
in place of DIS (`sao_ppo`, added after the headline's DIS collapses).
`analysis` gives, per arm and shift, the RL steps until the smoothed
training reward is back to 80% of its level before the shift (None: not
within the segment).
"""

import sys

import numpy as np

from experiments import runner

NO_CRITIC = {"rl.critic_updates": 0, "value_pretrain.steps": 0}


def steps_to_recover(finding, runs, fraction: float = 0.8, window: int = 5, min_level: float = 0.2):
  """Per arm: how the training reward fares after each shift of the preferred style.

  The curve is the share of training episodes with the full reward
  (`rollout/success_frac`; the mean reward for runs that did not log it),
  so that a partial credit (`env.kwargs.quality_credit`) for the old style
  does not count as recovering. A shift counts (is "assessable") when that
  share over the `window` steps before it is at least `min_level`: the
  policy had learned the style that just went out of favour. (A run
  already at 0 would otherwise "recover" to 80% of 0 at once.) For those
  shifts: the RL steps until the 3-step running mean regains `fraction` of
  that level (None: not within the segment). Also the mean of the curve
  over every step after the first shift, which says whether an arm keeps up
  at all. The schedule (switch_every, batch size) is each run's own, from
  its config.json; the finding's config when a record has none.
  """
  out = {}
  for arm, by_seed in runs.items():
    arm_config = runner.load_config(
      finding.arm(arm).config, {**finding.overrides, **finding.arm(arm).overrides}
    )
    per_seed, after_first = {}, {}
    for seed, rec in by_seed.items():
      config = rec.get("config") or arm_config.to_dict()
      # RL steps per preferred style.
      period = config["env"]["kwargs"]["switch_every"] / config["rl"]["batch_size"]
      curves = rec["curves"]
      steps = np.asarray(curves.get("step", []))
      reward = np.asarray(curves.get("rollout/success_frac", curves.get("rollout/reward_mean", [])))
      late = reward[steps > period]
      after_first[seed] = float(late.mean()) if late.size else None
      shifts = [int(round(k * period)) for k in range(1, int(steps.max(initial=0) // period) + 1)]
      rec_steps = []
      for s in shifts:
        before = reward[(steps > s - window) & (steps <= s)]
        after_idx = np.where((steps > s) & (steps <= s + period))[0]
        if before.size == 0 or after_idx.size == 0 or before.mean() < min_level:
          continue
        target = fraction * before.mean()
        y = np.convolve(reward[after_idx], np.ones(3) / 3, mode="same")
        hit = np.where(y >= target)[0]
        rec_steps.append(int(steps[after_idx[hit[0]]] - s) if hit.size else None)
      per_seed[seed] = rec_steps
    done = [x for v in per_seed.values() for x in v if x is not None]
    late_means = [v for v in after_first.values() if v is not None]
    out[arm] = {
      "per_seed": per_seed,
      "shifts_assessable": sum(len(v) for v in per_seed.values()),
      "shifts_not_recovered": sum(x is None for v in per_seed.values() for x in v),
      "mean_steps_to_recover": float(np.mean(done)) if done else None,
      "reward_after_first_shift": after_first,
      "mean_reward_after_first_shift": float(np.mean(late_means)) if late_means else None,
    }
  return {"steps_to_recover_80pct": out}


FINDING = runner.Finding(
  name="online",
  claim=(
    "With shifting reward preferences SAO recovers after each shift faster than a "
    "running-mean baseline (paper's online-learning simulation)."
  ),
  arms=(
    runner.Arm("sao", "sao_online", label="SAO"),
    # Added after the headline's DIS collapses (experiments/README.md): SAO
    # with PPO's clipped surrogate in place of DIS, nothing else changed.
    runner.Arm(
      "sao_ppo", "sao_online", {"rl.policy_loss": "ppo_clip"}, label="SAO with PPO clip (no DIS)"
    ),
    runner.Arm(
      "running_mean",
      "sao_online",
      {"rl.advantage": "running_mean", **NO_CRITIC},
      label="running-mean baseline",
    ),
    runner.Arm(
      "grpo_dis",
      "sao_online",
      {"rl.advantage": "group", "rollout.samples_per_prompt": 4, **NO_CRITIC},
      label="async GRPO + DIS (G=4)",
    ),
  ),
  reference="sao",
  seeds=3,
  budget_steps=240,
  curves=("rollout/success_frac", "rollout/reward_mean", "critic/explained_variance"),
  analyze=steps_to_recover,
)

if __name__ == "__main__":
  runner.main(FINDING, sys.argv[1:])
