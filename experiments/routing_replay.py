"""Routing replay over seeds: ratio tails and stability with and without it.

    python -m experiments.routing_replay                    # 4 seeds x 2 arms, ~100 steps
    python -m experiments.routing_replay --first_seed 2 --seeds 2
    python -m experiments.routing_replay --smoke            # CI-sized
    python -m experiments.routing_replay --aggregate_only   # tables only
    python -m experiments.routing_replay --arms frozen,frozen_replay --seeds 2

The question. In bf16 compute the engine's sampling pass and the trainer's
forward pick different experts for some tokens (how many, and what a flip
does to a log-prob: benchmarks/RESULTS.md#models-and-the-train-step). Does
that show in training, as ratio tails at lag 0 (where the
ratio would be 1 but for the two programs' arithmetic) and in final
pass@1 or collapses, and does `rl.routing_replay` (the trainer uses the
engine's recorded choices) remove it?

Both arms: configs/sao_sync.py (SAO's critic and GAE in the synchronous
loop: every batch is sampled by the very params it trains, so every
token is at lag 0 and a ratio away from 1 is the engine and the trainer
disagreeing, nothing else) with PPO clip (0.2, 0.28) at actor lr 3e-4 (the
CPU default's loss), 32 experts / top-4 (`benchmarks/routing_config.py`'s
model) and bf16 compute over fp32 masters (the pod preset's precision),
the same SFT start per seed; they differ in `rl.routing_replay` alone.
(In the async loop at the default queue the lag-0 bucket is empty, so the
ratio there mixes policy movement with routing.)

`by_replay` reports per arm: final pass@1 and collapses (the one rule,
`stats.collapsed`), the paired replay-minus-plain difference (t-interval,
exact sign-flip p), and the lag diagnostics the RL step logs
(`dis_stability.lag_diagnostics`): all in the lag-0 bucket here, the
engine-against-trainer measure: the ratio's 1% / 99% quantiles, the mean
k3 KL and the share of tokens outside the clip window.
"""

import sys

from experiments import dis_stability, runner, stats

# rl.actor_frozen's rule for every MoE layer's gate (its SFT too: both fill one
# optimizer slot, so a frozen-router arm's SFT start is its own, not plain's).
ROUTER = r"/moe/router$"
MODEL = {
  "model.overrides": {"num_experts": 32, "experts_per_token": 4},
  "model.compute_dtype": "bfloat16",
  "rl.policy_loss": "ppo_clip",
}
REFERENCE = "plain"
ARMS = (
  runner.Arm(
    REFERENCE,
    "sao_sync",
    {**MODEL, "rl.routing_replay": False},
    label="bf16 E32 k4, trainer routes itself",
  ),
  runner.Arm(
    "replay", "sao_sync", {**MODEL, "rl.routing_replay": True}, label="bf16 E32 k4, routing replay"
  ),
  # The actor's router frozen: no version-to-version drift of
  # the gate, so what is left at lag 0 is the bf16 near-tie flips replay removes.
  runner.Arm(
    "frozen",
    "sao_sync",
    {**MODEL, "rl.routing_replay": False, "rl.actor_frozen": (ROUTER,)},
    label="bf16 E32 k4, frozen router",
  ),
  runner.Arm(
    "frozen_replay",
    "sao_sync",
    {**MODEL, "rl.routing_replay": True, "rl.actor_frozen": (ROUTER,)},
    label="bf16 E32 k4, frozen router and routing replay",
  ),
)
LAG0 = "lag0"


def _fmt(entry: dict | None, key: str, fmt: str) -> str:
  """ "mean / largest" of a `lag_diagnostics` summary (each over a run's logged steps,
  then averaged over seeds)."""
  s = (entry or {}).get(key)
  return "-" if s is None else f"{s['mean']:{fmt}} / {s['max']:{fmt}}"


def _mean(entry: dict | None, key: str, fmt: str) -> str:
  s = (entry or {}).get(key)
  return "-" if s is None else f"{s['mean']:{fmt}}"


def by_replay(finding, runs):
  """Per arm: final pass@1, collapses, lag-0 ratio tails; replay minus plain, paired."""
  rows, record = [], {}
  for arm in finding.arms:
    by_seed = runs.get(arm.name, {})
    if not by_seed:
      continue
    diag = dis_stability.lag_diagnostics(by_seed)
    lag0 = diag.get("by_lag", {}).get(LAG0)
    finals = [r["final_pass@1"] for r in by_seed.values()]
    collapses = sum(bool(stats.collapsed(r)) for r in by_seed.values())
    vs = (
      None if arm.name == REFERENCE else runner.paired_difference(by_seed, runs.get(REFERENCE, {}))
    )
    record[arm.name] = {
      "seeds": sorted(by_seed),
      "final_mean": sum(finals) / len(finals),
      "collapses": collapses,
      "diagnostics": diag,
      "vs_plain": vs,
    }
    rows.append(
      f"| {arm.title} | {len(by_seed)} | {record[arm.name]['final_mean']:.3f} | {collapses} | "
      f"{'reference' if vs is None else stats.fmt_paired(vs)} | "
      f"{_mean(lag0, 'ratio_q01', '.4f')} | {_fmt(lag0, 'ratio_q99', '.4f')} | "
      f"{_fmt(lag0, 'approx_kl', '.2e')} | {_fmt(diag, 'dis/outside_frac', '.4f')} |"
    )
  head = (
    "| arm | seeds | final pass@1 | collapses | minus plain (paired) | "
    "lag-0 ratio q01, mean | lag-0 ratio q99, mean / largest | "
    "lag-0 approx KL, mean / largest | outside the clip window, mean / largest |\n"
    "|---|---|---|---|---|---|---|---|---|"
  )
  record["markdown"] = head + "\n" + "\n".join(rows)
  return record


FINDING = runner.Finding(
  name="routing_replay",
  claim=(
    "In bf16 the engine's and the trainer's MoE routing differ; replaying the engine's "
    "expert choices in the trainer shrinks the lag-0 ratio tails this causes and keeps "
    "training at least as stable."
  ),
  arms=ARMS,
  reference=REFERENCE,
  seeds=4,
  budget_steps=100,
  curves=(
    "rollout/reward_mean",
    "policy_lag/mean",
    "dis/ratio_q99_lag0",
    "dis/ratio_q01_lag0",
    "dis/outside_frac",
  ),
  analyze=by_replay,
)

if __name__ == "__main__":
  runner.main(FINDING, sys.argv[1:])
