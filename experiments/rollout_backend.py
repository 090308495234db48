"""The CPU default trained with either rollout backend: held-out pass@1 and wall time.

    python -m experiments.rollout_backend                  # 1 seed x 2 arms, 150 steps
    python -m experiments.rollout_backend --seeds 3
    python -m experiments.rollout_backend --aggregate_only # tables only

The question. `rollout.backend = "vllm"` (sao_jax/rollout/vllm_backend.py)
serves the rollout from a vLLM server instead of the project's own engine,
with the same driver, chat format and trajectory records. Does `make
train`'s run (configs/sao_tiny.py) learn the same with it, and what does
it cost in wall time on a CPU where vLLM-CPU is the slower engine?

Both arms start from the same SFT checkpoint per seed and get the same
budget of generated tokens; they differ in `rollout.backend` alone. The
model's heads are 32 wide instead of sao_tiny's 16, in both arms: vLLM-CPU's
attention runs no narrower head (`vllm_backend.CPU_HEAD_DIMS`). The vllm
arm needs vLLM's own virtual environment (`make vllm-env`).

`by_backend` reports per arm: SFT and final pass@1, the gain, RL steps,
generated tokens, the run's wall time and its generated tokens per second
of wall time, and vllm minus jax paired by seed.
"""

import sys

from experiments import runner, stats

REFERENCE = "jax"
ARMS = (
  runner.Arm(
    REFERENCE, "sao_tiny", {"rollout.backend": "jax"}, label="the project's engine (default)"
  ),
  runner.Arm("vllm", "sao_tiny", {"rollout.backend": "vllm"}, label="vLLM-CPU server"),
)


def _mean(runs: list, key: str) -> float:
  return sum(r[key] or 0.0 for r in runs) / len(runs)


def by_backend(finding, runs):
  """Per arm: pass@1, gain, wall time and throughput; vllm minus jax, paired."""
  rows, record = [], {}
  for arm in finding.arms:
    by_seed = runs.get(arm.name, {})
    if not by_seed:
      continue
    rs = list(by_seed.values())
    tok_s = [
      r["generated_tokens"] / r["wall_s"]
      for r in rs
      if r.get("generated_tokens") and r.get("wall_s")
    ]
    vs = (
      None if arm.name == REFERENCE else runner.paired_difference(by_seed, runs.get(REFERENCE, {}))
    )
    record[arm.name] = {
      "seeds": sorted(by_seed),
      "sft": _mean(rs, "sft_pass@1"),
      "final": _mean(rs, "final_pass@1"),
      "gain": _mean(rs, "gain"),
      "wall_s": _mean(rs, "wall_s"),
      "rl_steps": _mean(rs, "rl_steps"),
      "generated_tokens": _mean(rs, "generated_tokens"),
      "tokens_per_wall_s": sum(tok_s) / len(tok_s) if tok_s else None,
      "vs_jax": vs,
    }
    e = record[arm.name]
    rate = "-" if e["tokens_per_wall_s"] is None else f"{e['tokens_per_wall_s']:.0f}"
    rows.append(
      f"| {arm.title} | {len(rs)} | {e['sft']:.3f} | {e['final']:.3f} | {e['gain']:+.3f} | "
      f"{e['rl_steps']:.0f} | {e['generated_tokens']:.0f} | {e['wall_s']:.0f} | {rate} | "
      f"{'reference' if vs is None else stats.fmt_paired(vs)} |"
    )
  head = (
    "| arm | seeds | SFT pass@1 | final pass@1 | gain | RL steps | generated tokens | "
    "wall s (value pretraining + RL + evals) | generated tokens / wall s | "
    "final minus jax (paired) |\n|---|---|---|---|---|---|---|---|---|---|"
  )
  record["markdown"] = head + "\n" + "\n".join(rows)
  return record


FINDING = runner.Finding(
  name="rollout_backend",
  claim=(
    "The trainer learns the same whichever engine serves its rollout: the project's "
    "own or a vLLM server fed token ids."
  ),
  arms=ARMS,
  reference=REFERENCE,
  seeds=1,
  budget_steps=150,
  overrides={"model.overrides": {"head_dim": 32}},
  analyze=by_backend,
)

if __name__ == "__main__":
  runner.main(FINDING, sys.argv[1:])
