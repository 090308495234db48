"""LoRA RL against full RL on math_tool_cpu, from one SFT start per seed.

    python -m experiments.lora_rl --seeds 3 --jobs 2      # resumable
    python -m experiments.lora_rl --aggregate_only        # tables only

The question. With `lora.enabled` the actor and the critic train rank-16
adapters over a frozen base (sao_jax/models/lora.py) instead of every
weight. Does SAO still lift held-out pass@1 on `make train-math`'s task, and
what does it save and cost on this machine?

The design. Each seed's SFT runs once, with the whole model trained
(`configs/math_tool_cpu.py`'s SFT to a target NLL). The `full` arm resumes a
copy of that checkpoint, as every finding does; the `lora` arm starts a fresh
run whose frozen base is that SFT policy (`sft.init_from_run`, sft.steps =
0) and trains adapters in value pretraining and RL: the setting LoRA is used
in, adapters over a trained model. Both arms get the same budget of
generated tokens and the config's learning rates and schedule; LoRA's
section defaults (rank 16, alpha 32, attention and MLP/expert targets; the
critic adapts its MLP/experts and trains its value head whole). The lora arm
evaluates its start again (the same weights: the gap to the shared SFT
evaluation is the evaluation's own noise) and that evaluation is in its wall
time.

`by_arm` reports per arm: the shared SFT pass@1, final pass@1 and the
change, RL steps, wall seconds, the train state's bytes (trained params and
Adam moments) and the peak host memory of the launch, and lora minus full
in final pass@1, paired by seed (t-interval, sign-flip p).
"""

import sys

import numpy as np

from experiments import runner, stats

REFERENCE = "full"
CONFIG = "math_tool_cpu"
ARMS = (
  runner.Arm(REFERENCE, CONFIG, label="full fine-tuning (every weight)"),
  runner.Arm("lora", CONFIG, {"lora.enabled": True}, label="LoRA r16", start="policy"),
)


def _mean(xs) -> float:
  got = [x for x in xs if x is not None]
  return float(np.mean(got)) if got else float("nan")


def by_arm(finding, runs):
  """Per arm: pass@1 from the shared start, wall time, state and host memory."""
  rows, record = [], {}
  shared_sft = {s: r["sft_pass@1"] for s, r in runs.get(REFERENCE, {}).items()}
  for arm in finding.arms:
    by_seed = runs.get(arm.name, {})
    if not by_seed:
      continue
    seeds = sorted(by_seed)
    state = [by_seed[s].get("state_bytes") for s in seeds]
    rss = [by_seed[s].get("peak_rss_bytes") for s in seeds]
    start = [shared_sft.get(s) for s in seeds]
    final = [by_seed[s]["final_pass@1"] for s in seeds]
    change = [f - s0 for f, s0 in zip(final, start) if s0 is not None]
    vs = None if arm.name == REFERENCE else runner.paired_difference(by_seed, runs[REFERENCE])
    e = record[arm.name] = {
      "seeds": seeds,
      "own_sft_eval": [by_seed[s]["sft_pass@1"] for s in seeds],
      "final": final,
      "change_from_shared_sft": change,
      "change_stats": stats.paired_stats(change) if len(change) > 1 else None,
      "wall_s": [by_seed[s]["wall_s"] for s in seeds],
      "rl_steps": [by_seed[s]["rl_steps"] for s in seeds],
      "state_bytes": state,
      "peak_rss_bytes": rss,
      "vs_full": vs,
    }
    rows.append(
      f"| {arm.title} | {len(seeds)} | {_mean(start):.3f} | {_mean(final):.3f} | "
      f"{_mean(change):+.3f} ({', '.join(f'{c:+.3f}' for c in change)}) | "
      f"{_mean(e['rl_steps']):.0f} | {_mean(e['wall_s']):.0f} | {_mean(state) / 2**20:.2f} | "
      f"{_mean(rss) / 2**30:.2f} | {'reference' if vs is None else stats.fmt_paired(vs)} |"
    )
  head = (
    "| arm | seeds | shared SFT pass@1 | final pass@1 | change (per seed) | RL steps | "
    "wall s | train state MiB | peak host GiB | final minus full (paired) |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
  )
  record["markdown"] = head + "\n" + "\n".join(rows)
  return record


FINDING = runner.Finding(
  name="lora_rl",
  claim=(
    "SAO with LoRA adapters over the SFT policy lifts held-out pass@1 like SAO "
    "training every weight, from the same start and token budget."
  ),
  arms=ARMS,
  reference=REFERENCE,
  seeds=3,
  budget_steps=150,
  analyze=by_arm,
)

if __name__ == "__main__":
  runner.main(FINDING, sys.argv[1:])
