"""The paper's task on CPU over seeds: held-out pass@1 after SFT and after RL.

    python -m experiments.math_cpu                       # seeds 0, 1, 2, resumable
    python -m experiments.math_cpu --seeds 5 --first_seed 3
    python -m experiments.math_cpu --aggregate_only      # the table from results.json files

Each seed is one whole run of configs/math_tool_cpu.py (SFT -> value
pretraining -> async SAO -> evaluation) by `launch/train.py`, `nice`d, in
<workdir>/seed_<s>. A run whose summary.json exists is not run again; an
unfinished one resumes from its checkpoint (the trainer does that). Each
finished seed writes <results>/seed_<s>/results.json: the commit it ran
on, its wall time (the seconds of the launch that finished it, and of all
its launches), pass@1 after SFT and after RL with their standard errors,
and each evaluation's valid-tool-call rate and verifier verdicts.
<results>/results.json aggregates every seed found there: each seed's
pass@1 change (RL minus SFT, paired within the seed), their mean, the
Student-t interval and the exact sign-flip p (experiments/stats.py).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

from experiments import stats
from experiments.runner import check_commits, git_commit
from sao_jax.data import files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/math_tool_cpu.py"
RESULTS = os.path.join(ROOT, "experiments", "results", "math_cpu")
WORKDIR = os.path.join(ROOT, "workdirs", "experiments", "math_cpu")
# What each evaluation's record keeps besides pass@1.
EVAL_FIELDS = (
  "pass@1",
  "pass@1_stderr",
  "valid_tool_calls",
  "tool_calls_per_sample",
  "mean_turns",
  "truncated",
)


def _evaluation(summary: dict, name: str) -> dict:
  r = summary["evals"].get(name, {})
  out = {k: r[k] for k in EVAL_FIELDS if k in r}
  out["verdicts"] = {k[len("verdict_") :]: v for k, v in r.items() if k.startswith("verdict_")}
  out["tool_call_errors"] = {
    k[len("tool_call_error_") :]: v for k, v in r.items() if k.startswith("tool_call_error_")
  }
  return out


def run_seed(
  seed: int, workdir: str, results: str, overrides: list[str], config: str = CONFIG
) -> dict:
  """One whole run of seed `seed` (resumed or skipped when there is one); its record."""
  rdir = os.path.join(workdir, f"seed_{seed}")
  out = os.path.join(results, f"seed_{seed}", "results.json")
  summary_path = os.path.join(rdir, "summary.json")
  if os.path.exists(out) and os.path.exists(summary_path):
    with open(out, encoding="utf-8") as f:
      return json.load(f)
  # The commit the run starts on: a seed that spans a later commit on this
  # checkout is still the code that trained it.
  wall, launches, commit = 0.0, [], git_commit(ROOT)
  if not os.path.exists(summary_path):
    os.makedirs(rdir, exist_ok=True)
    cmd = [
      "nice",
      "-n",
      "10",
      sys.executable,
      os.path.join(ROOT, "launch", "train.py"),
      f"--config={os.path.join(ROOT, config)}",
      f"--workdir={rdir}",
      f"--config.seed={seed}",
    ] + [f"--config.{o}" for o in overrides]
    start = time.time()
    with open(os.path.join(rdir, "train.log"), "a", encoding="utf-8") as log:
      subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.time() - start
    launches.append(wall)
  with open(summary_path, encoding="utf-8") as f:
    summary = json.load(f)
  sft, final = _evaluation(summary, "sft"), _evaluation(summary, "final")
  rec = {
    "seed": seed,
    "config": config,
    "overrides": overrides,
    "commit": commit,
    "wall_s": wall or None,
    "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "load_average": os.getloadavg(),
    "sft": sft,
    "final": final,
    "change": final["pass@1"] - sft["pass@1"],
    "rl_steps": summary["rl_steps"],
    "sft_stopped_at": summary.get("sft_stopped_at"),
    "generated_tokens": summary["generated_tokens"],
  }
  os.makedirs(os.path.dirname(out), exist_ok=True)
  files.write_json(out, rec, indent=2)
  return rec


def aggregate(results: str, allow_mixed_commits: bool = False) -> dict:
  """Every seed's record under `results`, and the paired statistics of the change.

  Seeds that ran on different commits are refused (ValueError, naming them)
  unless `allow_mixed_commits`.
  """
  recs = []
  for path in sorted(glob.glob(os.path.join(results, "seed_*", "results.json"))):
    with open(path, encoding="utf-8") as f:
      recs.append(json.load(f))
  recs.sort(key=lambda r: r["seed"])
  if not recs:
    return {"seeds": []}
  commits = check_commits({"math_cpu": {r["seed"]: r for r in recs}}, allow_mixed_commits)
  change = [r["change"] for r in recs]
  sft = [r["sft"]["pass@1"] for r in recs]
  final = [r["final"]["pass@1"] for r in recs]
  agg = {
    "seeds": [
      {
        "seed": r["seed"],
        "sft": r["sft"]["pass@1"],
        "final": r["final"]["pass@1"],
        "change": r["change"],
        "wall_s": r["wall_s"],
        "commit": r["commit"],
      }
      for r in recs
    ],
    "mean_sft": sum(sft) / len(sft),
    "mean_final": sum(final) / len(final),
    "mean_change": sum(change) / len(change),
    "sft_t_interval": stats.t_interval(sft),
    "change_t_interval": stats.t_interval(change),
    "change_sign_flip_p": stats.sign_flip_p(change),
    "min_sign_flip_p": stats.min_sign_flip_p(len(change)),
    "commits": commits["math_cpu"],
    "mixed_commits_allowed": allow_mixed_commits,
  }
  files.write_json(os.path.join(results, "results.json"), agg, indent=2)
  return agg


def markdown(agg: dict) -> str:
  lines = [
    "| seed | SFT pass@1 | after RL | change | wall (s) | commit |",
    "|---|---|---|---|---|---|",
  ]
  for s in agg["seeds"]:
    wall = "-" if s["wall_s"] is None else f"{s['wall_s']:.0f}"
    lines.append(
      f"| {s['seed']} | {s['sft']:.3f} | {s['final']:.3f} | {s['change']:+.3f} | "
      f"{wall} | {(s['commit'] or '-')[:7]} |"
    )
  if len(agg["seeds"]) > 1:
    lo, hi = agg["change_t_interval"]
    lines.append(
      f"| mean | {agg['mean_sft']:.3f} | {agg['mean_final']:.3f} | "
      f"{agg['mean_change']:+.3f} (95% t [{lo:+.3f}, {hi:+.3f}], sign-flip p = "
      f"{agg['change_sign_flip_p']:.3f}) | | |"
    )
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--first_seed", type=int, default=0)
  parser.add_argument(
    "--config",
    default=CONFIG,
    help="the config file (relative to the repository), with :arg if any",
  )
  parser.add_argument("--workdir", default=WORKDIR)
  parser.add_argument("--results", default=RESULTS)
  parser.add_argument(
    "--set", action="append", default=[], help="a config override for every seed, e.g. rl.steps=10"
  )
  parser.add_argument("--aggregate_only", action="store_true")
  parser.add_argument(
    "--allow_mixed_commits",
    action="store_true",
    help="aggregate seeds that ran on different commits",
  )
  args = parser.parse_args(argv)
  if not args.aggregate_only:
    for seed in range(args.first_seed, args.first_seed + args.seeds):
      rec = run_seed(seed, args.workdir, args.results, args.set, args.config)
      print(
        f"[math_cpu] seed {seed}: pass@1 {rec['sft']['pass@1']:.3f} -> "
        f"{rec['final']['pass@1']:.3f} ({rec['change']:+.3f})",
        flush=True,
      )
  agg = aggregate(args.results, args.allow_mixed_commits)
  print(markdown(agg))
  return agg


if __name__ == "__main__":
  main()
