"""System: wall-clock to a target pass@1 and trainer idle time, async single rollout vs sync grouped.

    python -m experiments.system                      # 3 seeds x 4 arms, 300 steps
    python -m experiments.system --smoke

Same engine, same budget of generated tokens, held-out evaluation every 50
steps (its time is inside the wall clock of every arm alike). On one CPU
box rollout and training share the same cores, so asynchrony pays only
where time is spent waiting: sandboxed tool calls and stragglers of the
long-tailed python_tool length mix (DESIGN.md section 7); read the
wall-clock figures as that, not as a TPU-pod speed-up. `analysis` reports,
per arm, the wall seconds at which held-out pass@1 first reached
`TARGET` (None: never) and the mean trainer idle fraction.
"""

import sys

import numpy as np

from experiments import runner

TARGET = 0.6


def time_to_target(finding, runs):
  del finding
  out = {}
  for arm, by_seed in runs.items():
    reach, idle = {}, {}
    for seed, rec in by_seed.items():
      hits = [e["time"] for e in rec["evals"] if e.get("eval/pass@1", 0) >= TARGET]
      reach[seed] = min(hits) if hits else None
      curve = rec["curves"].get("trainer/idle_fraction", [])
      idle[seed] = float(curve[-1]) if curve else None
    got = [v for v in reach.values() if v is not None]
    out[arm] = {"seconds_to_target": reach, "mean_seconds_to_target":
                float(np.mean(got)) if got else None, "final_idle_fraction": idle}
  return {"target_pass@1": TARGET, "by_arm": out}


FINDING = runner.Finding(
    name="system",
    claim=("Asynchronous single-rollout training reaches a given pass@1 sooner in wall-clock "
           "time than synchronous grouped rollouts, with less trainer idle time."),
    arms=(
        runner.Arm("sao", "sao_tiny", label="async SAO"),
        runner.Arm("sao_sync", "sao_sync", label="sync SAO"),
        runner.Arm("grpo_dis", "grpo_dis", label="async GRPO + DIS (G=4)"),
        runner.Arm("grpo_sync", "grpo_sync", label="sync GRPO (G=4)"),
    ),
    reference="sao", seeds=3, budget_steps=300, overrides={"rl.eval_every": 50},
    curves=("rollout/reward_mean", "trainer/idle_fraction", "rollout/generated_tokens_per_s"),
    analyze=time_to_target)

if __name__ == "__main__":
  runner.main(FINDING, sys.argv[1:])
