"""DIS vs PPO clip under forced lag at a lower actor lr.

    python -m experiments.lr_by_lag                      # 8 seeds x 2 arms, ~150 steps
    python -m experiments.lr_by_lag --seeds 4            # a first piece (resumable)
    python -m experiments.lr_by_lag --smoke              # CI-sized
    python -m experiments.lr_by_lag --aggregate_only     # tables only

The question. Under forced lag (48 decode slots, a sync every 4 steps) at
actor lr 3e-4, async SAO with PPO clip ended ahead of async SAO with DIS
(0.2, 0.28) (experiments/README.md, "DIS under lag";
experiments/results/dis_stability). Is that DIS's deficit in
general, or one of a policy that moves far per version? If it tracks the
movement, a lower lr (a smaller step per version) should shrink it: here
the same two arms at actor lr 1e-4, the same 8 SFT configs and seeds
(`runner.sft_key`; the SFT runs were rebuilt on later code, so their pass@1
is close to, not equal to, the 3e-4 grid's) and token budget, with the
policy's movement per step logged (`policy/approx_kl`, the mean k3 KL
between the trainer's policy before the update and the rollout's over the
batch's action tokens, and the fraction of tokens outside the DIS window,
`dis/outside_frac`).

The 3e-4 arms are not rerun: their per-seed results are read from
experiments/results/dis_stability/results.json (ran on the commits that
file records) and shown beside these, labelled as such; the within-lr
comparisons are paired by seed, the across-lr one is not a paired test:
`by_lr` compares the two lrs' per-seed gaps as unpaired groups (Welch's
t-interval and an exact permutation p, `stats.unpaired_stats`).
"""

import json
import os
import sys

import numpy as np

from experiments import dis_stability, runner, stats

LR, LR_NAME = 1e-4, "1e-4"
EARLIER = os.path.join(runner.RESULTS, "dis_stability", "results.json")
REFERENCE = "dis_stale_lr1e4"
MOVEMENT = ("policy/approx_kl", "dis/outside_frac")


def _arm(stem: str) -> runner.Arm:
  base = dis_stability._async_arm(stem, "stale")
  return runner.Arm(
    f"{base.name}_lr1e4",
    base.config,
    {**base.overrides, "rl.actor_lr": LR},
    label=f"{base.label}, actor lr {LR_NAME}",
  )


ARMS = (_arm("dis"), _arm("ppo"))


def _movement(by_seed: dict) -> dict:
  """Mean over seeds of each run's mean of the MOVEMENT curves."""
  out = {}
  for key in MOVEMENT:
    means = [
      float(np.mean(r["curves"][key])) for r in by_seed.values() if r.get("curves", {}).get(key)
    ]
    if means:
      out[key] = float(np.mean(means))
  return out


def _earlier_3e4() -> dict:
  """The dis_stale / ppo_stale arms of dis_stability (actor lr 3e-4), per seed."""
  if not os.path.exists(EARLIER):
    return {}
  with open(EARLIER, encoding="utf-8") as f:
    earlier = json.load(f)
  out = {}
  for arm in ("dis_stale", "ppo_stale"):
    runs = earlier.get("runs", {}).get(arm, {})
    out[arm] = {int(s): r for s, r in runs.items()}
  return out


def _row(label: str, dis: dict, ppo: dict) -> tuple[str, dict | None]:
  vs = runner.paired_difference(ppo, dis)
  collapses = lambda runs: sum(bool(stats.collapsed(r)) for r in runs.values())
  move = {name: _movement(runs) for name, runs in (("dis", dis), ("ppo", ppo))}
  kl = lambda m: f"{m['policy/approx_kl']:.2e}" if "policy/approx_kl" in m else "-"
  out = lambda m: f"{m['dis/outside_frac']:.3f}" if "dis/outside_frac" in m else "-"
  final = lambda runs: f"{np.mean([r['final_pass@1'] for r in runs.values()]):.3f}" if runs else "-"
  line = (
    f"| {label} | {len(dis)} / {len(ppo)} | {final(dis)} | {final(ppo)} | "
    f"{stats.fmt_paired(vs)} | {collapses(dis)} / {collapses(ppo)} | "
    f"{kl(move['dis'])} / {kl(move['ppo'])} | {out(move['dis'])} / {out(move['ppo'])} |"
  )
  return line, {
    "ppo_minus_dis": vs,
    "movement": move,
    "collapses": [collapses(dis), collapses(ppo)],
  }


def by_lr(finding, runs):
  """PPO clip minus DIS per lr, with each arm's mean movement per step."""
  del finding
  earlier = _earlier_3e4()
  rows, record = [], {}
  if earlier.get("dis_stale") and earlier.get("ppo_stale"):
    line, rec = _row(
      "3e-4 (dis_stability, earlier commits)", earlier["dis_stale"], earlier["ppo_stale"]
    )
    rows.append(line)
    record["3e-4"] = rec
  dis, ppo = runs.get("dis_stale_lr1e4", {}), runs.get("ppo_stale_lr1e4", {})
  if dis and ppo:
    line, rec = _row(f"{LR_NAME} (this finding)", dis, ppo)
    rows.append(line)
    record[LR_NAME] = rec
  gaps = [record.get(lr, {}).get("ppo_minus_dis") for lr in ("3e-4", LR_NAME)]
  across = ""
  if all(g and g.get("per_seed") for g in gaps):
    record["gap_3e4_minus_1e4"] = u = stats.unpaired_stats(gaps[0]["per_seed"], gaps[1]["per_seed"])
    lo, hi = u["welch_ci95"]
    across = (
      f"\n\nThe gap at 3e-4 minus the gap at {LR_NAME} (separate grids, not paired): "
      f"{u['diff']:+.3f} [Welch t: {lo:+.3f}, {hi:+.3f}], exact permutation "
      f"p={u['permutation_p']:.2g} (n={u['n_a']} / {u['n_b']})"
    )
  head = (
    "| actor lr | seeds DIS / PPO | final DIS | final PPO | PPO - DIS (paired) | "
    "collapses DIS / PPO | approx KL a step DIS / PPO | outside window DIS / PPO |\n"
    "|---|---|---|---|---|---|---|---|"
  )
  record["markdown"] = head + "\n" + "\n".join(rows) + across
  return record


FINDING = runner.Finding(
  name="lr_by_lag",
  claim=(
    "Under forced policy lag, DIS's deficit against PPO clip tracks how far the policy "
    "moves per version: at a lower actor lr it shrinks."
  ),
  arms=ARMS,
  reference=REFERENCE,
  seeds=8,
  budget_steps=150,
  curves=("rollout/reward_mean", "policy_lag/mean", "policy/approx_kl", "dis/outside_frac"),
  analyze=by_lr,
)

if __name__ == "__main__":
  runner.main(FINDING, sys.argv[1:])
