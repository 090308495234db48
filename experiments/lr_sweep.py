"""Actor learning rate: is the comparison of SAO and GRPO an artefact of one shared lr?

    python -m experiments.lr_sweep                      # 3 seeds x 7 arms, 150 steps
    python -m experiments.lr_sweep --smoke

Every other finding runs every arm at `rl.actor_lr = 3e-4`, untuned. Adam
makes a constant rescaling of the loss irrelevant, so GRPO's std-normalised
advantages and SAO's raw ones are not a hidden step-size difference, but
the best step size can still differ between a critic baseline and a group
baseline, and SAO's DIS collapses (experiments/README.md) could be a step
size that is too large for it. This sweeps the actor lr over
{1e-4, 3e-4, 1e-3} for SAO (DIS, the paper's method) and for sync GRPO
G=4, from the same SFT start per seed and at the same budget of generated
tokens, and compares each at its own best lr.

The best lr is picked on the same held-out evaluation it is then compared
on, for both arms alike: an optimistic estimate of each, not an unbiased
one. With 3 lrs and 3 seeds it says which way the comparison moves when
each arm gets its own lr, not what either arm's tuned score is.
"""

import sys

import numpy as np

from experiments import runner, stats

# configs/common.py's rl.actor_lr, which every other finding runs at.
DEFAULT_LR = 3e-4
LRS = (1e-4, DEFAULT_LR, 1e-3)
# (family, configs/ file, label): the two arms whose lr is swept.
FAMILIES = (("sao", "sao_dis", "SAO"), ("grpo_sync", "grpo_sync", "sync GRPO G=4"))


def arm_name(family: str, lr: float) -> str:
  return family if lr == DEFAULT_LR else f"{family}_lr{lr:.0e}"


# Added after SAO (DIS) collapsed at lr 1e-3 in its first two seeds: the
# same lr with PPO's clipped surrogate, everything else SAO's. Paired with
# SAO at that lr, it says whether the collapse is DIS's or the step size's.
DIAGNOSTIC = runner.Arm(
  "sao_ppo_lr1e-03",
  "sao_dis",
  {"rl.policy_loss": "ppo_clip", "rl.actor_lr": 1e-3},
  label="SAO with PPO clip, lr 1e-03",
)
PAIRS = (("sao_ppo_lr1e-03", "sao_lr1e-03"),)


def best_lr_comparison(finding, runs):
  """Per family: mean final pass@1 at each lr and the best lr; then SAO at
  its best lr minus sync GRPO at its best, and each of PAIRS, paired by
  seed, with the t-interval and exact sign-flip p (`runner.paired_difference`)."""
  out, best = {}, {}
  for family, _, _ in FAMILIES:
    by_lr, means = {}, {}
    for lr in LRS:
      seeds = runs.get(arm_name(family, lr), {})
      if seeds:
        means[lr] = float(np.mean([r["final_pass@1"] for r in seeds.values()]))
        by_lr[f"{lr:g}"] = {
          "arm": arm_name(family, lr),
          "mean_final": means[lr],
          # The one collapse rule (experiments/stats.py).
          "collapsed": sum(bool(stats.collapsed(r)) for r in seeds.values()),
          "seeds": len(seeds),
        }
    if means:
      top = max(means, key=means.get)
      best[family] = arm_name(family, top)
      out[family] = {"by_lr": by_lr, "best_lr": top}
  a, b = (best.get(f) for f, _, _ in FAMILIES)
  if a and b and (vs := runner.paired_difference(runs[a], runs[b])):
    out["best_vs_best"] = dict(vs, arms=[a, b])
  for x, y in PAIRS:
    if vs := runner.paired_difference(runs.get(x, {}), runs.get(y, {})):
      out[f"{x}_vs_{y}"] = dict(vs, arms=[x, y])
  return {"lr_sweep": out}


FINDING = runner.Finding(
  name="lr_sweep",
  claim=(
    "SAO's advantage over GRPO (or its absence) is not an artefact of one shared, "
    "untuned actor learning rate."
  ),
  arms=tuple(
    runner.Arm(
      arm_name(family, lr),
      config,
      {} if lr == DEFAULT_LR else {"rl.actor_lr": lr},
      label=f"{label}, lr {lr:.0e}",
    )
    for family, config, label in FAMILIES
    for lr in LRS
  )
  + (DIAGNOSTIC,),
  reference="sao",
  seeds=3,
  budget_steps=150,
  curves=("rollout/reward_mean", "policy/approx_kl", "rollout/length_mean"),
  analyze=best_lr_comparison,
)

if __name__ == "__main__":
  runner.main(FINDING, sys.argv[1:])
