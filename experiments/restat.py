"""Every paired comparison of the committed results, under experiments/stats.py.

    python -m experiments.restat            # writes experiments/results/STATS.md
    python -m experiments.restat --update   # also adds the t-interval and the
                                            # sign-flip p to each results.json's
                                            # paired differences (values unchanged)

For each finding in experiments/results/<finding>/results.json: every pair
of arms that share seeds, A minus B in final pass@1 seed by seed, with the
percentile bootstrap the earlier tables quoted, the Student-t interval, the
exact sign-flip p, the seeds where A is ahead, and the collapses of each arm
(final pass@1 < stats.COLLAPSE_FRACTION x SFT, the one rule). README.md and
experiments/README.md word their claims by this table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

from experiments import dis_stability, runner, stats


def load_runs(path: str) -> tuple[dict, dict]:
  """(results.json, {arm: {seed: record}}) of one finding."""
  with open(path, encoding="utf-8") as f:
    result = json.load(f)
  runs = {
    arm: {int(s): rec for s, rec in by_seed.items()}
    for arm, by_seed in result.get("runs", {}).items()
  }
  return result, runs


def pairs(result: dict, runs: dict) -> list[dict]:
  """Every pair of arms (in the results' arm order) with common seeds."""
  arms = [a for a in result["arms"] if a in runs]
  out = []
  for i, a in enumerate(arms):
    for b in arms[i + 1 :]:
      if vs := runner.paired_difference(runs[a], runs[b]):
        out.append(dict(vs, a=a, b=b))
  return out


def collapses(runs: dict) -> dict:
  """{arm: (collapsed runs, judged runs)} under the one collapse rule."""
  out = {}
  for arm, by_seed in runs.items():
    flags = [c for rec in by_seed.values() if (c := stats.collapsed(rec)) is not None]
    out[arm] = (sum(flags), len(flags))
  return out


def _intervals(vs: dict) -> tuple[str, str]:
  """The bootstrap and t cells of a `paired_stats` record ("n/a" under 2 seeds)."""
  if vs["n"] < 2:
    return "n/a", "n/a"
  return tuple(f"[{lo:+.3f}, {hi:+.3f}]" for lo, hi in (vs["ci95"], vs["t_ci95"]))


def markdown(name: str, result: dict, runs: dict) -> str:
  coll = collapses(runs)
  lines = [f"## {name}", "", "| arm | seeds | collapses |", "|---|---|---|"]
  for arm in result["arms"]:
    if arm in runs:
      k, n = coll[arm]
      lines.append(f"| {arm} | {len(runs[arm])} | {k} of {n} |")
  lines += [
    "",
    "| A - B | n | mean | bootstrap 95% | t 95% | sign-flip p | A ahead |",
    "|---|---|---|---|---|---|---|",
  ]
  for vs in pairs(result, runs):
    b, t = _intervals(vs)
    lines.append(
      f"| {vs['a']} - {vs['b']} | {vs['n']} | {vs['mean_diff']:+.3f} | {b} | {t} "
      f"| {vs['sign_flip_p']:.3g} | {vs['wins']} of {vs['n']} |"
    )
  return "\n".join(lines)


def markdown_within_seed(name: str, result: dict) -> str:
  """A one-arm finding (math_cpu): final minus SFT pass@1 within each seed."""
  seeds = result["seeds"]
  vs = stats.paired_stats([r["final"] - r["sft"] for r in seeds])
  coll = sum(
    bool(stats.collapsed({"final_pass@1": r["final"], "sft_pass@1": r["sft"]})) for r in seeds
  )
  b, t = _intervals(vs)
  return "\n".join(
    [
      f"## {name}",
      "",
      "One arm; the comparison is final minus SFT pass@1 within each seed.",
      "",
      "| seeds | collapses | final - SFT | bootstrap 95% | t 95% | sign-flip p | RL ahead |",
      "|---|---|---|---|---|---|---|",
      f"| {vs['n']} | {coll} of {vs['n']} | {vs['mean_diff']:+.3f} | {b} | {t} | "
      f"{vs['sign_flip_p']:.3g} | {vs['wins']} of {vs['n']} |",
    ]
  )


def _with_stats(vs: dict | None) -> dict | None:
  """A stored paired difference with this module's statistics added (values unchanged)."""
  if not vs or "per_seed" not in vs:
    return vs
  new = stats.paired_stats(vs["per_seed"])
  # The stored bootstrap stays as it was written, its verdict under its own name.
  new.pop("ci95")
  new["bootstrap_excludes_zero"] = bool(vs["ci95"][0] > 0 or vs["ci95"][1] < 0)
  return {**vs, **new}


def update(path: str) -> None:
  """Adds the t-interval and sign-flip p beside every stored paired difference
  of results.json, and rewrites results.md's tables from it."""
  with open(path, encoding="utf-8") as f:
    result = json.load(f)
  for rec in result["arms"].values():
    if "vs_reference" in rec:
      rec["vs_reference"] = _with_stats(rec["vs_reference"])
  analysis = result.get("analysis", {})
  for rec in analysis.get("by_arm", {}).values():
    rec["vs_reference"] = _with_stats(rec.get("vs_reference"))
  for key, vs in analysis.get("lr_sweep", {}).items():
    if isinstance(vs, dict) and "per_seed" in vs:
      analysis["lr_sweep"][key] = _with_stats(vs)
  if result["finding"] == dis_stability.FINDING.name and "by_arm" in analysis:
    # Its collapse table, re-rendered with the new columns.
    ref = dis_stability.FINDING.arm(analysis["reference"]).title
    analysis["markdown"] = dis_stability.markdown(analysis["by_arm"], analysis["reference"], ref)
  runner._write_json(path, result)
  runner.write_results_md(os.path.join(os.path.dirname(path), "results.md"), result)


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--results", default=runner.RESULTS)
  parser.add_argument("--update", action="store_true")
  args = parser.parse_args(argv)
  parts = [
    "# Paired comparisons of the committed results",
    "",
    "Generated by `python -m experiments.restat` from experiments/results/*/results.json."
    " A - B: final pass@1 of arm A minus arm B over their common seeds. Bootstrap: the "
    "percentile interval the earlier tables quoted (too narrow at 3-8 seeds). t: the "
    "Student-t interval. Sign-flip p: exact, two-sided; with n seeds it cannot go below "
    "2 / 2^n (0.25 at 3, 0.125 at 4, 0.0625 at 5, 0.0078 at 8). Collapse: final pass@1 "
    f"< {stats.COLLAPSE_FRACTION:g} x the seed's SFT pass@1.",
    "",
  ]
  for path in sorted(glob.glob(os.path.join(args.results, "*", "results.json"))):
    name = os.path.basename(os.path.dirname(path))
    result, runs = load_runs(path)
    if "arms" not in result:  # a one-arm finding of its own shape (math_cpu)
      parts += [markdown_within_seed(name, result), ""]
      continue
    parts += [markdown(name, result, runs), ""]
    if args.update:
      update(path)
  text = "\n".join(parts)
  with open(os.path.join(args.results, "STATS.md"), "w", encoding="utf-8") as f:
    f.write(text)
  return text


if __name__ == "__main__":
  main()
