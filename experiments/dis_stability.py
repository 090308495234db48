"""DIS under lag: does DIS collapse because of policy lag, and what fixes it?

    python -m experiments.dis_stability                     # 8 seeds x 14 arms, ~150 steps
    python -m experiments.dis_stability --arms sao_sync,dis_q64,ppo_q64 --seeds 8
    python -m experiments.dis_stability --smoke --arms sao_sync,dis_stale
    python -m experiments.dis_stability --aggregate_only    # tables and plots only

The earlier grids (experiments/README.md) saw async SAO with DIS (eps_low
0.2, eps_high 0.28: the project's window) collapse, pass@1 to ~0 within a
few dozen RL steps, where async SAO with PPO clip did not; but those runs
mixed tasks, SFT starts and lags, with too few seeds an arm to tell a
collapse rate from 0 in any single arm. Here every
arm runs on the same 8 SFT starts (one per seed, shared by all arms) at the
same budget of generated tokens, ~150 RL steps of 16 trajectories (the
budget of the headline's measured grids, where the collapses were seen;
`--budget_steps` to change it), at the shared actor lr of 3e-4.

The arms, most informative first (the runner runs a seed's arms in this
order, so a grid stopped early still holds the comparisons that matter):

  sao_sync        SAO in the synchronous loop (configs/sao_sync.py): every
                  batch is sampled by the policy it trains, one actor update
                  per batch, so the ratio is 1 and DIS, PPO clip and the
                  plain policy gradient give the same update. The control:
                  if it collapses too, "single-rollout PG at lr 3e-4 is
                  marginal and PPO's corrective term rescues it" explains
                  the collapses, not "DIS destabilises under lag".
  dis_q64         async SAO, DIS (0.2, 0.28) (the project's window: the
                  paper gives no epsilon values), the default
                  queue of 64 trajectories (generation and the actor step
                  keep pace, so the queue seldom fills and the lag stays
                  low).
  ppo_q64         the same with PPO's clipped surrogate (same eps).
  dis_wide_q64    DIS with SkyRL's fully-async window (0.5, 4.0).
  dis_narrow_q64  DIS with a narrow window (0.1, 0.1): if masking the
                  out-of-window tokens is what destabilises, more of it
                  should collapse more often.
  grpo_sync       sync GRPO G=4 (configs/grpo_sync.py): the reference for
                  final pass@1 (the runner's paired differences are to it).
  dis_kl_q64      DIS + a k3 penalty with a token mean on KL(rollout ||
                  current) (`dis_rollout_kl` with
                  rollout_kl_estimator k3, rollout_kl_reduction token: not
                  SkyRL's k2 / per-sequence mean, the loss's default),
                  beta 0.1.
  cispo_q64       CISPO with a two-sided clip (`cispo_two_sided`; not
                  MiniMax-M1's CISPO, which clips from above only): every
                  token's gradient kept, its stop-gradient weight clipped
                  to the same (0.2, 0.28) window as dis_q64, so the two
                  differ only in dropping vs bounding the out-of-window
                  tokens.
  *_stale         the six async arms again under forced lag: 48 decode
                  slots (3 batches in flight) and weights pushed to the
                  engine every 4 actor updates (experiments/stability.py's
                  STALE), several versions of lag. A queue of 16 against
                  64 would give little contrast, as queue 64's lag is
                  already low; the stale arms give the high-lag side.

Collapse, applied mechanically to every run (`stats.collapsed`, the rule of
every finding): the run's final
held-out pass@1 is below 25% of its seed's SFT pass@1 (COLLAPSE_FRACTION).
The line lies in the gap of final / SFT pass@1, which is bimodal over the
committed results (experiments/results/; the distribution:
experiments/README.md). Relative rather than absolute because SFT starts
differ between seeds and tasks. A seed whose SFT pass@1 is 0 cannot
collapse.

`analysis` (also rendered as a markdown table into results.md):

  * per arm: runs, collapses and their rate with an exact (Clopper-Pearson)
    95% binomial interval; the collapsed seeds and every run's final / SFT
    ratio (to re-apply another line); mean final pass@1 and its paired
    difference to sync GRPO with its t-interval and exact sign-flip p
    over seeds, the bootstrap CI beside them (`runner.paired_difference`);
    the mean policy lag;
  * per arm, the lag diagnostics the RL step logs (`dis/` metrics of
    sao_jax/train/train_step.py's `lag_diagnostics`, and `policy/approx_kl`),
    as the mean and the largest value over a run's logged steps, averaged
    over seeds: the share of action tokens in each lag bucket, the ratio's
    1% and 99% quantiles and the approx KL per bucket, the share outside
    the window and the corrective tokens' share of tokens and of |r A|.
    outside_frac and the corrective shares are measured against each arm's
    own window (wider for dis_wide, narrower for dis_narrow); the ratio
    quantiles and approx KL are window-free and compare across arms;
  * `contrasts`: collapse counts of pairs of arms with Fisher's exact
    two-sided p-value (dis vs ppo clip, async vs sync, the windows, queue
    16 vs 64).

Curves (mean over seeds, over generated tokens): training reward, policy
lag, approx KL, the share outside the window, the corrective mass and the
episode length (collapsed runs ran to the length cap).

Cost: the full grid is 112 runs + 8 SFT starts, many hours on a 2-core box
(run times: experiments/README.md): run it in pieces (--arms,
--first_seed/--seeds); finished runs are skipped and carried over.
"""

import sys

import numpy as np

from experiments import runner, stability, stats

COLLAPSE_FRACTION = stats.COLLAPSE_FRACTION
REFERENCE = "grpo_sync"

# (name stem, overrides, label) of the async SAO arms, run at each queue.
ASYNC_ARMS = (
  ("dis", {"rl.policy_loss": "dis", "rl.eps_low": 0.2, "rl.eps_high": 0.28}, "DIS (0.2, 0.28)"),
  (
    "ppo",
    {"rl.policy_loss": "ppo_clip", "rl.eps_low": 0.2, "rl.eps_high": 0.28},
    "PPO clip (0.2, 0.28)",
  ),
  ("dis_wide", {"rl.policy_loss": "dis", "rl.eps_low": 0.5, "rl.eps_high": 4.0}, "DIS (0.5, 4.0)"),
  (
    "dis_narrow",
    {"rl.policy_loss": "dis", "rl.eps_low": 0.1, "rl.eps_high": 0.1},
    "DIS (0.1, 0.1)",
  ),
  # The k3 / token-mean penalty and the two-sided CISPO clip these arms ran
  # (before `dis_rollout_kl` defaulted to SkyRL's k2 / sequence mean and
  # `cispo` became MiniMax-M1's upper clip), named so their runs reproduce.
  (
    "dis_kl",
    {
      "rl.policy_loss": "dis_rollout_kl",
      "rl.eps_low": 0.2,
      "rl.eps_high": 0.28,
      "rl.rollout_kl_coef": 0.1,
      "rl.rollout_kl_estimator": "k3",
      "rl.rollout_kl_reduction": "token",
    },
    "DIS + rollout KL 0.1 (k3, token mean)",
  ),
  (
    "cispo",
    {"rl.policy_loss": "cispo_two_sided", "rl.eps_low": 0.2, "rl.eps_high": 0.28},
    "CISPO, two-sided clip (0.2, 0.28)",
  ),
)


# The two lag settings each async arm runs at: (suffix, overrides, label).
LAGS = {
  "q64": ({"rollout.queue_size": 64}, "queue 64"),
  "stale": ({"rollout.queue_size": 64, **stability.STALE}, "forced lag (48 slots, sync every 4)"),
}


def _async_arm(stem: str, lag: str) -> runner.Arm:
  overrides, label = next((o, l) for s, o, l in ASYNC_ARMS if s == stem)
  lag_overrides, lag_label = LAGS[lag]
  return runner.Arm(
    f"{stem}_{lag}",
    "sao_dis",
    {**overrides, **lag_overrides},
    label=f"async SAO, {label}, {lag_label}",
  )


ARMS = (
  runner.Arm("sao_sync", "sao_sync", label="sync SAO (on-policy: DIS = PPO clip = PG)"),
  *(_async_arm(s, "q64") for s in ("dis", "ppo")),
  *(_async_arm(s, "stale") for s in ("dis", "ppo", "dis_wide")),
  runner.Arm(REFERENCE, "grpo_sync", label="sync GRPO G=4"),
  *(_async_arm(s, "q64") for s in ("dis_wide", "dis_narrow", "dis_kl", "cispo")),
  *(_async_arm(s, "stale") for s in ("dis_narrow", "dis_kl", "cispo")),
)

# Pairs of arms whose collapse counts are compared (Fisher's exact test).
CONTRASTS = (
  ("dis_q64", "ppo_q64"),
  ("dis_q64", "sao_sync"),
  ("ppo_q64", "sao_sync"),
  ("dis_q64", "dis_wide_q64"),
  ("dis_q64", "dis_narrow_q64"),
  ("dis_q64", "dis_kl_q64"),
  ("dis_q64", "cispo_q64"),
  ("dis_q64", "dis_stale"),
  ("dis_stale", "ppo_stale"),
  ("dis_stale", "dis_wide_stale"),
  ("dis_stale", "dis_kl_stale"),
  ("dis_stale", "cispo_stale"),
  ("dis_stale", "sao_sync"),
)

# Logged per step, summarised per arm (besides the per-bucket ones below).
DIAGNOSTICS = (
  "policy/approx_kl",
  "dis/outside_frac",
  "dis/corrective_token_frac",
  "dis/corrective_mass_frac",
)
# Per lag bucket (`dis/<key>_<bucket>`).
BUCKET_DIAGNOSTICS = ("ratio_q01", "ratio_q99", "approx_kl")


clopper_pearson = stats.clopper_pearson  # (experiments/stats.py)


collapsed = stats.collapsed  # the one collapse rule (experiments/stats.py)


def _finite(values) -> list[float]:
  out = []
  for v in values:
    if isinstance(v, (int, float)) and np.isfinite(v):
      out.append(float(v))
  return out


def _summary(per_run: list[list[float]]) -> dict | None:
  """Mean and largest value of each run's logged values, then their means over runs."""
  per_run = [v for v in per_run if v]
  if not per_run:
    return None
  return {
    "mean": float(np.mean([np.mean(v) for v in per_run])),
    "max": float(np.mean([np.max(v) for v in per_run])),
  }


def _bucket_names() -> list[str]:
  from sao_jax.train import train_step

  return [train_step.lag_bucket_name(lo, hi) for lo, hi in train_step.LAG_BUCKETS]


def lag_diagnostics(by_seed: dict) -> dict:
  """An arm's logged lag diagnostics, summarised over steps, then seeds (see the docstring)."""
  curves = [rec.get("curves", {}) for rec in by_seed.values()]
  out = {}
  for key in DIAGNOSTICS:
    if (s := _summary([_finite(c.get(key, [])) for c in curves])) is not None:
      out[key] = s
  buckets = _bucket_names()
  shares = {b: [] for b in buckets}
  for c in curves:
    counts = [c.get(f"dis/tokens_{b}") for b in buckets]
    if any(x is None for x in counts) or len({len(x) for x in counts}) != 1:
      continue
    total = np.sum(np.asarray(counts, np.float64), axis=0)
    for b, x in zip(buckets, counts):
      shares[b].append(_finite(np.asarray(x, np.float64)[total > 0] / total[total > 0]))
  for b in buckets:
    entry = {}
    if (s := _summary(shares[b])) is not None:
      entry["token_share"] = s["mean"]
    for key in BUCKET_DIAGNOSTICS:
      # An empty bucket's quantiles are logged as null: absent from the curve.
      if (s := _summary([_finite(c.get(f"dis/{key}_{b}", [])) for c in curves])) is not None:
        entry[key] = s
    if entry:
      out.setdefault("by_lag", {})[b] = entry
  return out


def markdown(by_arm: dict, reference: str, reference_label: str) -> str:
  """The collapse-rate table of `collapse_rates`' per-arm records."""
  lines = [
    f"Collapse: final pass@1 < {COLLAPSE_FRACTION:g} x the seed's SFT pass@1. "
    "95% CI: exact (Clopper-Pearson) for the rate; Student t over paired seeds (the "
    f"percentile bootstrap beside it), with the exact sign-flip p, for the difference "
    f"to {reference_label}.",
    "",
    "| arm | runs | collapses | rate | 95% CI | final pass@1 (mean ± sd) | "
    f"minus {reference_label} [95% t-interval; bootstrap] p (seeds) | policy lag, mean |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for rec in by_arm.values():
    lo, hi = rec["ci95"]
    f = rec["final_pass@1"]
    diff = "reference" if rec["arm"] == reference else stats.fmt_paired(rec["vs_reference"])
    lag = "-" if rec["lag_mean"] is None else f"{rec['lag_mean']:.2f}"
    rate = "-" if rec["rate"] is None else f"{rec['rate']:.0%}"
    lines.append(
      f"| {rec['label']} | {rec['runs']} | {rec['collapses']} | "
      f"{rate} | [{lo:.2f}, {hi:.2f}] | {f['mean']:.3f} ± {f['std']:.3f} | "
      f"{diff} | {lag} |"
    )
  return "\n".join(lines)


def collapse_rates(finding, runs):
  """Per arm: collapses with an exact CI, pass@1 against sync GRPO, lag and its diagnostics."""
  reference = runs.get(finding.reference, {})
  by_arm = {}
  for arm in finding.arms:
    by_seed = runs.get(arm.name, {})
    if not by_seed:
      continue
    seeds = sorted(by_seed)
    flags = {s: c for s in seeds if (c := collapsed(by_seed[s])) is not None}
    k, n = sum(flags.values()), len(flags)
    finals = np.array([by_seed[s]["final_pass@1"] for s in seeds], np.float64)
    lags = _finite(by_seed[s].get("lag_mean") for s in seeds)
    by_arm[arm.name] = {
      "arm": arm.name,
      "label": arm.title,
      "runs": n,
      "collapses": k,
      "rate": k / n if n else None,
      "ci95": list(clopper_pearson(k, n)),
      "collapsed_seeds": [s for s in seeds if flags.get(s)],
      "final_over_sft": {
        s: (
          by_seed[s]["final_pass@1"] / by_seed[s]["sft_pass@1"]
          if by_seed[s].get("sft_pass@1")
          else None
        )
        for s in seeds
      },
      "final_pass@1": {
        "mean": float(finals.mean()),
        "std": float(finals.std(ddof=1)) if len(seeds) > 1 else 0.0,
      },
      "vs_reference": (
        None if arm.name == finding.reference else runner.paired_difference(by_seed, reference)
      ),
      "lag_mean": float(np.mean(lags)) if lags else None,
      "lag_diagnostics": lag_diagnostics(by_seed),
    }
  contrasts = {}
  for a, b in CONTRASTS:
    if a in by_arm and b in by_arm:
      ka, na, kb, nb = (
        by_arm[a]["collapses"],
        by_arm[a]["runs"],
        by_arm[b]["collapses"],
        by_arm[b]["runs"],
      )
      p = stats.fisher_exact_p(ka, na, kb, nb)
      contrasts[f"{a}_vs_{b}"] = {"collapses": [ka, kb], "runs": [na, nb], "fisher_p": float(p)}
  return {
    "collapse_criterion": f"final_pass@1 < {COLLAPSE_FRACTION:g} x sft_pass@1",
    "reference": finding.reference,
    "by_arm": by_arm,
    "contrasts": contrasts,
    "markdown": markdown(by_arm, finding.reference, finding.arm(finding.reference).title),
  }


FINDING = runner.Finding(
  name="dis_stability",
  claim=(
    "DIS (the project's window 0.2 / 0.28) collapses async SAO under policy lag where PPO "
    "clip does not; sync SAO (on-policy, DIS = PPO = PG) is the control, wider / "
    "narrower windows, a rollout-KL penalty and two-sided CISPO the candidate fixes."
  ),
  arms=ARMS,
  reference=REFERENCE,
  seeds=8,
  budget_steps=150,
  curves=(
    "rollout/reward_mean",
    "policy_lag/mean",
    "policy/approx_kl",
    "dis/outside_frac",
    "dis/corrective_mass_frac",
    "rollout/length_mean",
  ),
  analyze=collapse_rates,
)

if __name__ == "__main__":
  runner.main(FINDING, sys.argv[1:])
