"""The shared experiment runner: arms x seeds from one SFT start, equal token budgets.

A finding (experiments/headline.py, stability.py, ...) is a list of arms,
each a config file of configs/ plus field overrides, compared over seeds.
`main(finding)` is its whole command line:

    python -m experiments.headline                  # the full grid, resumable
    python -m experiments.headline --smoke          # 1 seed, a few steps (CI)
    python -m experiments.headline --aggregate_only # tables and plots only

What makes the arms comparable:

  * One SFT start per seed. `launch/sft.py` runs once per seed (into
    <workdir>/sft/<key>/seed_<s>) and every arm of that seed starts from a
    copy of its checkpoint, so differences between arms of one seed are
    differences of RL, not of the warm start. The key covers every field
    that shapes the SFT or the checkpoint's layout (model, env, sft, data,
    eval, critic freezing); arms that differ there get their own start.
  * An equal budget of generated tokens. Every token the policy samples
    after SFT counts, in every stage that samples: value-pretraining
    rollouts (the critic's cold-start fix, SAO's cost that GRPO does not
    pay), RL rollouts, and rollouts generated but never trained on (in
    flight at a swap, left in the queue at the end). Evaluation does not
    count. The trainer stops RL at `rl.max_generated_tokens`; the budget is
    `budget_steps x rl.batch_size x` the SFT policy's mean sampled tokens per
    episode on the held-out tasks (measured in the shared SFT run), i.e.
    the tokens of `budget_steps` RL steps at the start. `rl.steps` (the lr
    schedule's horizon, and a ceiling) is `budget_steps` for every arm, so
    an arm that spends tokens on warm-up trains fewer RL steps.
  * Paired comparisons. Each arm is compared to the reference arm (SAO)
    seed by seed; the report gives the mean difference, its Student-t
    interval and the exact sign-flip p over seeds (experiments/stats.py;
    with n seeds no p can be below 2 / 2^n), the percentile bootstrap
    beside them only for comparison with earlier results.

Runs launch as subprocesses (`nice`d: the box is shared), the arms of a
seed one after the other and, with --jobs, seeds side by side, each in
<workdir>/<finding>/<arm>/seed_<s>; a run whose summary.json
exists is skipped, an unfinished one resumes from its checkpoint (the
trainer does that). Results (JSON and PNG) go to experiments/results/<finding>/.
Run directories do not outlive a checkout, but results.json keeps each run's
numbers and curves: a grid extended later (`--first_seed 3 --seeds 2`, then
`--aggregate_only --seeds 5`) carries the earlier runs of the same budget and
overrides over from it (`earlier_runs`) instead of rerunning them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from experiments import stats
from sao_jax.data import files
from sao_jax.train.configuration import parse_literal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
WORKDIRS = os.path.join(ROOT, "workdirs", "experiments")

# A few steps of everything (CI): the code paths of a full run, not its numbers.
SMOKE_OVERRIDES = {
  "sft.steps": 4,
  "sft.batch_size": 8,
  "sft.warmup": 1,
  "value_pretrain.steps": 2,
  "value_pretrain.num_trajectories": 8,
  "rl.batch_size": 8,
  "rl.warmup": 1,
  "rollout.slots": 8,
  "eval.num_tasks": 8,
  "eval.slots": 8,
  "log_every": 1,
  "checkpoint.every": 100,
  "tensorboard": False,
}
SMOKE_BUDGET_STEPS = 3

# Config sections whose fields shape the SFT start or the checkpoint layout:
# arms equal on these share one SFT run per seed.
_SFT_KEY_FIELDS = (
  "seed",
  "model",
  "env",
  "sft",
  "data",
  "eval",
  "sharding",
  "rl.freeze_critic_attention",
)
# Inside those sections but not shaping the SFT checkpoint or its
# evaluation's pass@1: a simulated tool wait only delays environment steps.
_NOT_SFT_SHAPING = ("env.tool_latency_s",)


@dataclasses.dataclass(frozen=True)
class Arm:
  """One way of training: configs/<config>.py with `overrides` (dotted fields)."""

  name: str
  config: str
  overrides: dict = dataclasses.field(default_factory=dict)
  label: str = ""  # for tables and plots; default: name
  # How the arm starts from the seed's SFT run: "copy", resuming a copy of its
  # checkpoint (its SFT evaluation included); "policy", a fresh run whose
  # policy is the SFT run's (`sft.init_from_run`, sft.steps = 0), for arms whose
  # state has another shape (LoRA's adapters): it evaluates that policy again.
  # The SFT run itself is then launched without this arm's overrides.
  start: str = "copy"

  def __post_init__(self):
    if self.start not in ("copy", "policy"):
      raise ValueError(f"Arm {self.name!r}: start = {self.start!r}, not 'copy' or 'policy'")

  @property
  def title(self) -> str:
    return self.label or self.name


@dataclasses.dataclass(frozen=True)
class Finding:
  """A claim of the paper and the arms x seeds that test it."""

  name: str
  claim: str  # the paper's claim, one sentence
  arms: tuple[Arm, ...]
  reference: str  # the arm every other is compared to, seed by seed
  seeds: int
  budget_steps: int
  overrides: dict = dataclasses.field(default_factory=dict)  # every arm
  # Logged RL metrics plotted over generated tokens (mean over seeds).
  curves: tuple[str, ...] = ("rollout/reward_mean", "policy_lag/mean")
  # Extra analysis of the collected runs: (finding, runs by arm) -> dict. Its
  # "markdown" entry (a str), if any, goes into results.md as markdown.
  analyze: Callable[["Finding", dict], dict] | None = None

  def arm(self, name: str) -> Arm:
    for a in self.arms:
      if a.name == name:
        return a
    raise KeyError(f"no arm {name!r} in {self.name}; arms: {[a.name for a in self.arms]}")


# ------------------------------------------------------------------ configs
def config_path(name: str) -> str:
  return os.path.join(ROOT, "configs", name if name.endswith(".py") else name + ".py")


def load_config(name: str, overrides: dict):
  """The config of configs/<name>.py with `overrides` (dotted fields) applied.

  The file's own imports (`from configs import common`) resolve through the
  repository root, on sys.path wherever `experiments` itself imports from."""
  import importlib.util

  from sao_jax.train import configuration

  spec = importlib.util.spec_from_file_location(f"_experiment_cfg_{name}", config_path(name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for field, value in overrides.items():
    configuration.set_field(config, field, value)
  return config


def flag(field: str, value: Any) -> str:
  """One `--config.<field>=<value>` flag as ml_collections parses it."""
  return f"--config.{field}={value if isinstance(value, str) else repr(value)}"


def _flat(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def sft_key(config) -> str:
  """A short hash of what shapes the SFT start of `config`.

  Only the fields of the key sections that differ from configs/common.py's
  defaults enter it, and only the `env.kwargs` that differ from the
  environment's own defaults, so a field added later with a default (to
  common.py, or to a config's env.kwargs so that `--set` can reach it) does
  not orphan the SFT starts of a grid that is still running. Fields that
  shape neither the checkpoint nor its pass@1 (`_NOT_SFT_SHAPING`) stay out.
  """
  from sao_jax.envs import registry

  default = _flat(load_config("common", {}).to_dict())
  default.update(
    {f"env.kwargs.{k}": v for k, v in registry.kwargs_defaults(config.env.name).items()}
  )
  ours = _flat(config.to_dict())
  parts = {
    k: v
    for k, v in ours.items()
    if any(k == f or k.startswith(f + ".") for f in _SFT_KEY_FIELDS)
    and k not in _NOT_SFT_SHAPING
    and (k not in default or default[k] != v)
  }
  blob = json.dumps(sorted(parts.items()), default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:10]


# ----------------------------------------------------------------- launching
@dataclasses.dataclass
class Launcher:
  """Runs one stage of one run: a niced subprocess, or in this process (tests)."""

  nice: int = 15
  in_process: bool = False
  env: dict = dataclasses.field(default_factory=dict)

  def __call__(self, script: str, config: str, overrides: dict, workdir: str) -> float:
    """Runs launch/<script> to completion; its wall seconds. Raises on failure."""
    os.makedirs(workdir, exist_ok=True)
    start = time.time()
    if self.in_process:
      from sao_jax.train import trainer

      until = "value_pretrain" if script == "sft.py" else "done"
      trainer.train(load_config(config, overrides), workdir, until=until)
      return time.time() - start
    cmd = [
      "nice",
      "-n",
      str(self.nice),
      sys.executable,
      os.path.join(ROOT, "launch", script),
      f"--config={config_path(config)}",
      f"--workdir={workdir}",
      *(flag(k, v) for k, v in overrides.items()),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(WORKDIRS, ".jax_cache"))
    with open(os.path.join(workdir, "log.txt"), "a", encoding="utf-8") as log:
      log.write(f"$ {' '.join(cmd)}\n")
      log.flush()
      rc = subprocess.run(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, check=False
      ).returncode
    if rc:
      raise RuntimeError(f"{script} failed (exit {rc}); see {workdir}/log.txt")
    return time.time() - start


def run_dir(workdir: str, finding: Finding, arm: Arm, seed: int) -> str:
  return os.path.join(workdir, finding.name, arm.name, f"seed_{seed}")


def _read_json(path: str):
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _write_json(path: str, obj) -> None:
  files.write_json(path, obj, indent=2, default=float)


def sft_start(launch: Launcher, workdir: str, arm: Arm, overrides: dict, seed: int) -> str:
  """The seed's shared SFT run for `arm` (run once, then reused): its directory."""
  key = sft_key(load_config(arm.config, overrides))
  sft_dir = os.path.join(workdir, "sft", key, f"seed_{seed}")
  marker = os.path.join(sft_dir, "sft_done.json")
  os.makedirs(os.path.dirname(sft_dir), exist_ok=True)
  with open(sft_dir + ".lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # another runner's SFT of this seed: wait for it
    if not os.path.exists(marker):
      print(f"[experiments] SFT start seed {seed} ({key}) -> {sft_dir}", flush=True)
      wall = launch("sft.py", arm.config, overrides, sft_dir)
      _write_json(marker, {"wall_s": wall, "key": key})
  return sft_dir


def run_arm(
  launch: Launcher,
  workdir: str,
  finding: Finding,
  arm: Arm,
  seed: int,
  budget_steps: int,
  base_overrides: dict,
) -> str:
  """One arm x seed to completion (skipped when finished): its directory."""
  rdir = run_dir(workdir, finding, arm, seed)
  if os.path.exists(os.path.join(rdir, "summary.json")):
    return rdir
  # Two runners on one grid (e.g. different --arms) never train one run twice.
  os.makedirs(os.path.dirname(rdir), exist_ok=True)
  with open(rdir + ".lock", "w", encoding="utf-8") as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      print(f"[experiments] {rdir} is being run by another runner; skipped", flush=True)
      return rdir
    return _run_arm_locked(launch, workdir, finding, arm, seed, budget_steps, base_overrides, rdir)


def _run_arm_locked(launch, workdir, finding, arm, seed, budget_steps, base_overrides, rdir):
  overrides = {**finding.overrides, **base_overrides, **arm.overrides, "seed": seed}
  if arm.start == "policy":
    shared = {**finding.overrides, **base_overrides, "seed": seed}
    sft_dir = sft_start(launch, workdir, arm, shared, seed)
    overrides.update({"sft.init_from_run": sft_dir, "sft.steps": 0})
  else:
    sft_dir = sft_start(launch, workdir, arm, overrides, seed)
  if arm.start == "copy" and not os.path.exists(os.path.join(rdir, "checkpoints")):
    # The arm starts from a copy of the seed's SFT checkpoint (stage
    # value_pretrain, step 0), its SFT evaluation included.
    shutil.rmtree(rdir, ignore_errors=True)
    shutil.copytree(sft_dir, rdir, ignore=shutil.ignore_patterns("log.txt", "sft_done.json"))
  sft_eval = _sft_eval(sft_dir)
  batch = int(overrides.get("rl.batch_size", load_config(arm.config, overrides).rl.batch_size))
  budget = int(round(budget_steps * batch * sft_eval["mean_generated"]))
  overrides.update({"rl.steps": budget_steps, "rl.max_generated_tokens": budget})
  print(
    f"[experiments] {finding.name}/{arm.name} seed {seed}: budget {budget} generated "
    f"tokens (~{budget_steps} steps of {batch}) -> {rdir}",
    flush=True,
  )
  commit = git_commit()
  wall = launch("train.py", arm.config, overrides, rdir)
  _write_json(
    os.path.join(rdir, "runner.json"),
    {
      "wall_s": wall,
      "budget_tokens": budget,
      "budget_steps": budget_steps,
      "overrides": overrides,
      "config": arm.config,
      "commit": commit,
    },
  )
  return rdir


def git_commit(root: str = ROOT) -> str | None:
  """The checkout's commit (`-dirty` when tracked files other than experiments' results
  differ from it: another finding writing its results.json mid-run changes no code);
  None outside git."""
  try:
    head = subprocess.run(
      ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
      [
        "git",
        "-C",
        root,
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        ":(exclude)experiments/results",
      ],
      capture_output=True,
      text=True,
      check=True,
    ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return head + ("-dirty" if dirty else "")


def _short(commit: str) -> str:
  """A commit as a message shows it: 12 hex digits, keeping any `-dirty` suffix."""
  return commit[:12] + ("-dirty" if commit.endswith("-dirty") else "")


def check_commits(runs: dict[str, dict[int, dict]], allow_mixed: bool = False) -> dict:
  """{arm: {seed: commit}} of `runs`; ValueError when one arm's seeds ran on different
  commits, unless `allow_mixed`. Records without a commit (written before runs
  recorded it) are "unrecorded" and never count as a second commit."""
  out, mixed = {}, []
  for arm, by_seed in runs.items():
    commits = {s: rec.get("commit") or "unrecorded" for s, rec in sorted(by_seed.items())}
    out[arm] = commits
    if len(set(commits.values()) - {"unrecorded"}) > 1:
      mixed.append(f"{arm}: " + ", ".join(f"seed {s} {_short(c)}" for s, c in commits.items()))
  if mixed and not allow_mixed:
    raise ValueError(
      "seeds of one arm ran on different commits (pass --allow_mixed_commits "
      "to aggregate them anyway): " + "; ".join(mixed)
    )
  return out


def _sft_eval(sft_dir: str) -> dict:
  """The SFT evaluation record written by the shared SFT run."""
  for rec in read_metrics(sft_dir):
    if rec["stage"] == "eval" and "eval/mean_generated" in rec:
      return {k[len("eval/") :]: v for k, v in rec.items() if k.startswith("eval/")}
  raise RuntimeError(f"no SFT evaluation in {sft_dir}/metrics.jsonl")


# ---------------------------------------------------------------- collecting
def read_metrics(rdir: str) -> list[dict]:
  path = os.path.join(rdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def collect(rdir: str) -> dict | None:
  """One finished run: final numbers and its logged RL curves; None if unfinished."""
  path = os.path.join(rdir, "summary.json")
  if not os.path.exists(path):
    return None
  summary = _read_json(path)
  runner = (
    _read_json(os.path.join(rdir, "runner.json"))
    if os.path.exists(os.path.join(rdir, "runner.json"))
    else {}
  )
  config_path = os.path.join(rdir, "config.json")
  config = _read_json(config_path) if os.path.exists(config_path) else None
  if "budget_tokens" not in runner and config is not None:
    # A run finished without its runner (stopped meanwhile): its config says.
    runner["budget_tokens"] = config["rl"].get("max_generated_tokens")
  # A resumed run appends to metrics.jsonl: keep the last record of each step.
  rl = {}
  evals = []
  for rec in read_metrics(rdir):
    if rec["stage"] == "rl":
      rl[rec["step"]] = rec
    elif rec["stage"] == "eval":
      evals.append(rec)
  curves = {}
  for step in sorted(rl):
    for k, v in rl[step].items():
      if isinstance(v, (int, float)):
        curves.setdefault(k, []).append(v)
  final = summary["evals"]["final"]
  sft = summary["evals"].get("sft", {})
  # Policy lag (versions between sampling and training) over the logged steps.
  lag = curves.get("policy_lag/mean")
  lag_max = curves.get("policy_lag/max")
  return {
    "sft_pass@1": summary["sft_pass@1"],
    "final_pass@1": summary["final_pass@1"],
    "gain": summary["final_pass@1"] - summary["sft_pass@1"],
    "final_stderr": final.get("pass@1_stderr"),
    "sft_stderr": sft.get("pass@1_stderr"),
    "rl_steps": summary["rl_steps"],
    "generated_tokens": summary.get("generated_tokens"),
    # What the launch that finished held (stages.done): None for older runs.
    "state_bytes": summary.get("state_bytes"),
    "peak_rss_bytes": summary.get("peak_rss_bytes"),
    "budget_tokens": runner.get("budget_tokens"),
    "wall_s": runner.get("wall_s"),
    "commit": runner.get("commit"),
    "lag_mean": float(np.mean(lag)) if lag else None,
    "lag_max": float(np.max(lag_max)) if lag_max else None,
    "evals": evals,
    "curves": curves,
    "config": config,  # the run's own config (analyses read its settings)
  }


def paired_difference(a: dict, b: dict) -> dict | None:
  """Final pass@1 of runs `a` minus runs `b` ({seed: record} each) over their
  common seeds: `stats.paired_stats` (t-interval, exact sign-flip p, the
  bootstrap CI beside them) plus the seeds; None when they share no seed."""
  seeds = sorted(set(a) & set(b))
  if not seeds:
    return None
  diffs = [a[s]["final_pass@1"] - b[s]["final_pass@1"] for s in seeds]
  return {"paired_seeds": seeds, "per_seed": diffs, **stats.paired_stats(diffs)}


def aggregate(finding: Finding, runs: dict[str, dict[int, dict]]) -> dict:
  """Per arm: mean / std over seeds; per arm vs the reference: paired difference + CI."""
  out = {
    "finding": finding.name,
    "claim": finding.claim,
    "reference": finding.reference,
    "arms": {},
  }
  ref = runs.get(finding.reference, {})
  for arm in finding.arms:
    by_seed = runs.get(arm.name, {})
    if not by_seed:
      continue
    seeds = sorted(by_seed)
    rec = {"label": arm.title, "config": arm.config, "overrides": arm.overrides, "seeds": seeds}
    for key in (
      "sft_pass@1",
      "final_pass@1",
      "gain",
      "rl_steps",
      "generated_tokens",
      "wall_s",
      "final_stderr",
      "lag_mean",
      "lag_max",
    ):
      vals = np.array(
        [by_seed[s][key] for s in seeds if by_seed[s].get(key) is not None], np.float64
      )
      if vals.size:
        rec[key] = {
          "mean": float(vals.mean()),
          "std": float(vals.std(ddof=1)) if vals.size > 1 else 0.0,
          "per_seed": vals.tolist(),
        }
    if arm.name != finding.reference and (vs := paired_difference(by_seed, ref)):
      rec["vs_reference"] = vs
    out["arms"][arm.name] = rec
  if finding.analyze is not None:
    out["analysis"] = finding.analyze(finding, runs)
  return out


# ------------------------------------------------------------------ plotting
def smooth(y: Sequence[float], k: int = 5) -> np.ndarray:
  """A running mean over up to `k` logged points (fewer on short curves)."""
  y = np.asarray(y, np.float64)
  k = max(1, min(k, y.size // 4))
  return np.convolve(y, np.ones(k) / k, mode="valid") if y.size else y


def earlier_runs(path: str, budget_steps: int, overrides: dict) -> dict:
  """{arm: {seed: record}} of an earlier results.json of the same grid, else {}.

  Run directories (workdirs/) do not outlive a checkout; results.json keeps
  every run's numbers and curves. A grid extended later (more seeds or
  arms, in a new checkout) carries those runs over rather than rerunning
  them, when the budget and the overrides are the same. Their records have
  no config (and, written before evaluations were kept, no evaluations).
  """
  if not os.path.exists(path):
    return {}
  old = _read_json(path)
  if (
    old.get("smoke")
    or old.get("budget_steps") != budget_steps
    or json.dumps(old.get("overrides"), sort_keys=True) != json.dumps(overrides, sort_keys=True)
  ):
    return {}
  return {
    arm: {int(s): dict(rec, config=None) for s, rec in by_seed.items()}
    for arm, by_seed in old.get("runs", {}).items()
  }


def plot(finding: Finding, runs: dict, result: dict, path: str) -> None:
  """Final pass@1 per arm (seeds as dots) and each curve over generated tokens."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  arms = [a for a in finding.arms if a.name in result["arms"]]
  n = 1 + len(finding.curves)
  fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6))
  axes = np.atleast_1d(axes)
  ax = axes[0]
  for i, arm in enumerate(arms):
    rec = result["arms"][arm.name]
    vals = rec["final_pass@1"]["per_seed"]
    ax.bar(i, np.mean(vals), color=f"C{i}", alpha=0.6)
    ax.scatter([i] * len(vals), vals, color="k", s=10, zorder=3)
  sft = [v for a in arms for v in result["arms"][a.name]["sft_pass@1"]["per_seed"]]
  ax.axhline(np.mean(sft), color="gray", ls="--", lw=1, label="SFT start")
  ax.set_xticks(range(len(arms)), [a.title for a in arms], rotation=30, ha="right", fontsize=8)
  ax.set_ylabel("held-out pass@1")
  ax.set_title("final pass@1 (dots: seeds)", fontsize=9)
  ax.legend(fontsize=7)
  for ax, metric in zip(axes[1:], finding.curves):
    if not any(
      metric in c and "rollout/generated_tokens_total" in c
      for c in (rec["curves"] for a in arms for rec in runs[a.name].values())
    ):
      # E.g. DIS's masked fractions in a grid of PPO-clip arms: say so, not a blank panel.
      ax.text(
        0.5,
        0.5,
        "not logged by these arms",
        ha="center",
        va="center",
        transform=ax.transAxes,
        fontsize=8,
        color="gray",
      )
    for i, arm in enumerate(arms):
      for j, s in enumerate(sorted(runs[arm.name])):
        c = runs[arm.name][s]["curves"]
        if metric not in c or "rollout/generated_tokens_total" not in c:
          continue
        y = smooth(c[metric])
        x = np.asarray(c["rollout/generated_tokens_total"])[-len(y) :] if len(y) else []
        ax.plot(x, y, color=f"C{i}", alpha=0.8, lw=1, label=arm.title if j == 0 else None)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1e3:g}k"))
    ax.set_xlabel("generated tokens (all stages)")
    ax.set_title(metric, fontsize=9)
    if metric.endswith("explained_variance"):
      # Near-zero return variance (a collapsed run) sends it to -1e5: clip the view.
      ax.set_ylim(-1.0, 1.0)
      ax.set_title(metric + " (view clipped to [-1, 1])", fontsize=9)
  axes[1 if n > 1 else 0].legend(fontsize=7)
  fig.suptitle(
    f"{finding.name}: {len(runs.get(finding.reference, {}))} seed(s), "
    f"budget ~{finding.budget_steps} steps",
    fontsize=10,
  )
  fig.tight_layout()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _lag(rec: dict) -> str:
  """Mean over seeds of each run's mean lag / the largest lag of any run."""
  if "lag_mean" not in rec:
    return "-"
  top = rec.get("lag_max")
  return f"{rec['lag_mean']['mean']:.2f} / " + (f"{max(top['per_seed']):.0f}" if top else "-")


def table(result: dict) -> str:
  """A markdown table of `aggregate`'s result."""
  lines = [
    "| arm | seeds | SFT pass@1 | final pass@1 (mean ± sd) | gain | vs ref: diff "
    "[95% t-interval; bootstrap] sign-flip p (paired seeds) | RL steps | generated tokens | "
    "policy lag: mean / max |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, rec in result["arms"].items():
    f = rec["final_pass@1"]
    vs = rec.get("vs_reference")
    vs_s = "reference" if name == result["reference"] else stats.fmt_paired(vs)
    lines.append(
      f"| {rec['label']} | {len(rec['seeds'])} | {rec['sft_pass@1']['mean']:.3f} | "
      f"{f['mean']:.3f} ± {f['std']:.3f} | {rec['gain']['mean']:+.3f} | {vs_s} | "
      f"{rec['rl_steps']['mean']:.0f} | {rec.get('generated_tokens', {}).get('mean', 0):.0f} | "
      f"{_lag(rec)} |"
    )
  return "\n".join(lines)


# ---------------------------------------------------------------------- main
def run_finding(
  finding: Finding,
  *,
  seeds: Sequence[int],
  arms: Sequence[str] | None = None,
  budget_steps: int | None = None,
  smoke: bool = False,
  workdir: str | None = None,
  results: str | None = None,
  launch: Launcher | None = None,
  aggregate_only: bool = False,
  extra_overrides: dict | None = None,
  jobs: int = 1,
  reference: str | None = None,
  allow_mixed_commits: bool = False,
) -> dict:
  """Runs (or resumes) the grid, then writes results.json, results.md and results.png.

  `reference` replaces the finding's reference arm (a grid run without it).
  Every run records its commit; seeds of one arm from different commits are
  refused (`check_commits`) unless `allow_mixed_commits`.
  """
  launch = launch or Launcher()
  if reference is not None:
    finding = dataclasses.replace(finding, reference=finding.arm(reference).name)
  base = dict(SMOKE_OVERRIDES if smoke else {}, **(extra_overrides or {}))
  budget_steps = budget_steps or (SMOKE_BUDGET_STEPS if smoke else finding.budget_steps)
  # The overrides of every arm (`--set`) are the finding's from here on, so
  # that an analysis reading a config field (online's switch_every) sees them.
  finding = dataclasses.replace(
    finding, budget_steps=budget_steps, overrides={**finding.overrides, **base}
  )
  workdir = workdir or os.path.join(WORKDIRS, "smoke" if smoke else "full")
  results = results or os.path.join(
    RESULTS if not smoke else os.path.join(workdir, "results"), finding.name
  )
  chosen = [finding.arm(a) for a in arms] if arms else list(finding.arms)
  # Seed-major: a grid stopped early still holds whole seeds of every arm.
  failed = []

  def run_seed(seed):
    for arm in chosen:
      try:
        run_arm(launch, workdir, finding, arm, seed, budget_steps, base)
      except RuntimeError as e:  # one broken run must not stop the grid
        if launch.in_process:
          raise
        print(f"[experiments] {arm.name} seed {seed} failed: {e}", flush=True)
        failed.append(f"{arm.name}/seed_{seed}")

  if not aggregate_only:
    if jobs > 1 and not launch.in_process:
      # Seeds side by side (each its own SFT start and arms, in order): more
      # of a shared box's idle cycles for a niced grid, same runs.
      with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run_seed, seeds))
    else:
      for seed in seeds:
        run_seed(seed)
  runs, carried = {}, []
  earlier = (
    earlier_runs(os.path.join(results, "results.json"), budget_steps, finding.overrides)
    if not smoke
    else {}
  )
  for arm in finding.arms:
    # The seeds asked for, and every other seed the earlier results.json
    # holds: a run of some seeds never drops the others from the file.
    for seed in sorted(set(seeds) | set(earlier.get(arm.name, {}))):
      rec = collect(run_dir(workdir, finding, arm, seed))
      if rec is None and seed in earlier.get(arm.name, {}):
        rec = earlier[arm.name][seed]
        carried.append(f"{arm.name}/seed_{seed}")
      if rec is not None:
        runs.setdefault(arm.name, {})[seed] = rec
  if carried:
    print(
      f"[experiments] carried over from the earlier results.json (no run directory "
      f"here): {', '.join(carried)}",
      flush=True,
    )
  commits = check_commits(runs, allow_mixed_commits)
  result = aggregate(finding, runs)
  result.update(
    {
      "commits": commits,
      "mixed_commits_allowed": allow_mixed_commits,
      "budget_steps": budget_steps,
      "smoke": smoke,
      "seeds_requested": list(seeds),
      "failed": failed,
      "carried_over": carried,
      "overrides": {**finding.overrides, **base},
      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
      "machine": _machine(),
    }
  )
  _write_json(
    os.path.join(results, "results.json"),
    dict(
      result,
      runs={
        a: {str(s): {k: v for k, v in r.items() if k != "config"} for s, r in by.items()}
        for a, by in runs.items()
      },
    ),
  )
  write_results_md(os.path.join(results, "results.md"), result)
  if runs:
    plot(finding, runs, result, os.path.join(results, "results.png"))
  print(table(result), flush=True)
  if isinstance(md := result.get("analysis", {}).get("markdown"), str):
    print(md, flush=True)
  return result


def write_results_md(path: str, result: dict) -> None:
  """results.md of `aggregate`'s result: the claim, `table`, the analysis."""
  with open(path, "w", encoding="utf-8") as f:
    f.write(f"# {result['finding']}\n\n{result['claim']}\n\n{table(result)}\n")
    if "analysis" in result:
      # An analysis's "markdown" (e.g. a table of its own) is written as is, the rest as JSON.
      analysis = dict(result["analysis"])
      if isinstance(md := analysis.pop("markdown", None), str):
        f.write(f"\n{md}\n")
      f.write("\n```\n" + json.dumps(analysis, indent=1, default=float) + "\n```\n")


def _machine() -> str:
  return f"{os.cpu_count()} CPU cores ({os.uname().machine}), shared; JAX on CPU"


def main(finding: Finding, argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=finding.claim)
  parser.add_argument("--smoke", action="store_true", help="1 seed, a few steps (CI)")
  parser.add_argument("--seeds", type=int, default=None, help=f"default {finding.seeds}")
  parser.add_argument("--first_seed", type=int, default=0)
  parser.add_argument(
    "--arms", default="", help="comma-separated subset of " + ",".join(a.name for a in finding.arms)
  )
  parser.add_argument(
    "--budget_steps",
    type=int,
    default=None,
    help=f"default {finding.budget_steps} (smoke {SMOKE_BUDGET_STEPS})",
  )
  parser.add_argument("--workdir", default=None)
  parser.add_argument("--results", default=None)
  parser.add_argument("--nice", type=int, default=15)
  parser.add_argument("--in_process", action="store_true")
  parser.add_argument("--jobs", type=int, default=1, help="seeds run side by side")
  parser.add_argument("--aggregate_only", action="store_true")
  parser.add_argument(
    "--reference",
    default=None,
    help=f"the arm the others are compared to (default {finding.reference})",
  )
  parser.add_argument(
    "--allow_mixed_commits",
    action="store_true",
    help="aggregate an arm whose seeds ran on different commits",
  )
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="FIELD=VALUE",
    help="an override of every arm, e.g. --set eval.samples_per_task=2",
  )
  args = parser.parse_args(argv)
  extra = {}
  for item in args.set:
    field, value = item.split("=", 1)
    extra[field] = parse_literal(value)
  n = args.seeds or (1 if args.smoke else finding.seeds)
  return run_finding(
    finding,
    seeds=range(args.first_seed, args.first_seed + n),
    arms=[a for a in args.arms.split(",") if a] or None,
    budget_steps=args.budget_steps,
    smoke=args.smoke,
    workdir=args.workdir,
    results=args.results,
    launch=Launcher(nice=args.nice, in_process=args.in_process),
    aggregate_only=args.aggregate_only,
    extra_overrides=extra,
    jobs=args.jobs,
    reference=args.reference,
    allow_mixed_commits=args.allow_mixed_commits,
  )
