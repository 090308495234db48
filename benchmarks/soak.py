"""Soak: a long tiny SAO run with faults injected on schedule, watched from outside.

    python benchmarks/soak.py --steps 1000 --out benchmarks/RESULTS.md

Runs `launch/train.py --config=configs/sao_tiny.py` (real trainer, real
sandbox, real checkpoints) for `--steps` RL steps with the config's
`faults` section on: environment steps that raise or return garbage,
malformed trajectories before the ingestion queue, NaN batches (skipped
updates) and rollout-thread crashes (restarts). While it runs, this script
samples the trainer process from /proc every `--every` seconds: resident
memory, open file descriptors, threads, live descendant processes (sandbox
processes included), and the descendants that are not children of a live
sandbox call, i.e. leaked ones. The trainer's own metrics.jsonl gives
reward, queue depth, rejects, restarts and skipped updates per step.

Writes <workdir>/soak.json and benchmarks/soak.png, and with --out a
Markdown section with the bounds checked: memory growth after warm-up,
maximum open files and processes, and the reward trend through the faults.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAULTS = {
  "env_error_every": 97,
  "env_garbage_every": 131,
  "malformed_every": 53,
  "nonfinite_every": 89,
  "rollout_crash_every": 1500,
}


def _descendants(pid: int) -> list[int]:
  children = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      continue
    children.setdefault(ppid, []).append(int(entry))
  out, todo = [], [pid]
  while todo:
    for c in children.get(todo.pop(), []):
      out.append(c)
      todo.append(c)
  return out


def _sample(pid: int) -> dict:
  with open(f"/proc/{pid}/status", encoding="utf-8") as f:
    status = dict(line.split(":", 1) for line in f if ":" in line)
  return {
    "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
    "threads": int(status["Threads"]),
    "open_fds": len(os.listdir(f"/proc/{pid}/fd")),
    "descendants": len(_descendants(pid)),
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
  parser.add_argument("--workdir", default=os.path.join(ROOT, "workdirs", "soak"))
  parser.add_argument("--out", default=None)
  parser.add_argument("--plot", default=os.path.join(ROOT, "benchmarks", "soak.png"))
  args = parser.parse_args()
  flags = [
    f"--config.rl.steps={args.steps}",
    "--config.rl.max_rollout_restarts=1000",
    "--config.rl.eval_every=250",
    "--config.eval.num_tasks=200",
    "--config.checkpoint.every=50",
    "--config.log_every=10",
  ]
  flags += [f"--config.faults.{k}={v}" for k, v in FAULTS.items()]
  cmd = [
    sys.executable,
    os.path.join(ROOT, "launch", "train.py"),
    f"--config={os.path.join(ROOT, 'configs', 'sao_tiny.py')}",
    f"--workdir={args.workdir}",
    *flags,
  ]
  print(" ".join(cmd), flush=True)
  start = time.time()
  proc = subprocess.Popen(cmd, cwd=ROOT)
  samples = []
  stop = threading.Event()

  def watch():
    while not stop.wait(args.every):
      try:
        samples.append({"t": time.time() - start, **_sample(proc.pid)})
      except (OSError, KeyError):
        return

  watcher = threading.Thread(target=watch, daemon=True)
  watcher.start()
  rc = proc.wait()
  stop.set()
  watcher.join()
  wall = time.time() - start
  with open(os.path.join(args.workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  rl = [r for r in records if r["stage"] == "rl"]
  summary_path = os.path.join(args.workdir, "summary.json")
  summary = json.load(open(summary_path, encoding="utf-8")) if os.path.exists(summary_path) else {}
  leftover = [p for p in _descendants(os.getpid()) if p != proc.pid]
  result = {
    "command": " ".join(cmd),
    "returncode": rc,
    "wall_s": wall,
    "samples": samples,
    "rl": rl,
    "summary": summary,
    "leftover_processes_after_exit": len(leftover),
  }
  with open(os.path.join(args.workdir, "soak.json"), "w", encoding="utf-8") as f:
    json.dump(result, f)
  report = _report(result, args)
  print(report, flush=True)
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      f.write(report)
  sys.exit(rc)


def _report(result, args) -> str:
  s, rl = result["samples"], result["rl"]
  t = np.array([x["t"] for x in s])
  rss = np.array([x["rss_mb"] for x in s])
  warm = t > t[-1] * 0.2 if len(t) else t
  # Memory trend after warm-up: slope of a least-squares line, MB per hour.
  slope = float(np.polyfit(t[warm], rss[warm], 1)[0] * 3600) if warm.sum() > 2 else float("nan")
  last = rl[-1] if rl else {}
  steps = np.array([r["step"] for r in rl])
  reward = np.array([r["rollout/reward_mean"] for r in rl])
  q = max(1, len(reward) // 4)
  _plot(result, args.plot)
  evals = result["summary"].get("evals", {})
  eval_line = ", ".join(f"{k} {v['pass@1']:.3f}" for k, v in evals.items())
  lines = [
    "",
    f"## Soak: {len(rl) and int(steps[-1])} RL steps of tiny SAO with faults injected",
    "",
    f"    python benchmarks/soak.py --steps {args.steps} --out benchmarks/RESULTS.md",
    "",
    f"Faults: {FAULTS} (every n-th event). Return code {result['returncode']}, "
    f"wall {result['wall_s'] / 60:.1f} min. Plot: `benchmarks/soak.png`.",
    "",
    "| measure | value |",
    "|---|---|",
    f"| resident memory (MB): first sample / max / last | {rss[0]:.0f} / {rss.max():.0f} / "
    f"{rss[-1]:.0f} |"
    if len(rss)
    else "| resident memory | no samples |",
    f"| memory trend after the first 20% of the run (MB per hour) | {slope:+.1f} |",
    f"| open file descriptors: max / last | {max(x['open_fds'] for x in s)} / {s[-1]['open_fds']} |"
    if s
    else "",
    f"| threads: max / last | {max(x['threads'] for x in s)} / {s[-1]['threads']} |" if s else "",
    f"| live descendant processes: max / last | {max(x['descendants'] for x in s)} / "
    f"{s[-1]['descendants']} |"
    if s
    else "",
    f"| processes left after the trainer exited | {result['leftover_processes_after_exit']} |",
    f"| queue depth: max | {max(r['queue/depth'] for r in rl)} |" if rl else "",
    f"| trajectories rejected (all injected malformed ones) | "
    f"{last.get('queue/rejected')} of {last.get('faults/injected_malformed')} injected |",
    f"| environment faults counted (injected errors + garbage) | "
    f"{last.get('rollout/env_faults')} ({last.get('faults/injected_env_error')} + "
    f"{last.get('faults/injected_env_garbage')}) |",
    f"| rollout thread restarts (injected crashes) | {last.get('rollout/restarts')} "
    f"({last.get('faults/injected_rollout_crash')}) |",
    f"| updates skipped as non-finite (injected NaN batches) | "
    f"{last.get('policy/updates_skipped_total')} "
    f"({last.get('faults/injected_nonfinite_batch')}) |",
    f"| training reward, mean of first / last quarter of logged steps | "
    f"{reward[:q].mean():.3f} / {reward[-q:].mean():.3f} |"
    if len(reward)
    else "",
    f"| held-out pass@1 (200 tasks) | {eval_line} |",
    "",
  ]
  return "\n".join(x for x in lines if x is not None) + "\n"


def _plot(result, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  s, rl = result["samples"], result["rl"]
  fig, axes = plt.subplots(2, 2, figsize=(11, 7))
  t = [x["t"] / 60 for x in s]
  axes[0, 0].plot(t, [x["rss_mb"] for x in s])
  axes[0, 0].set(title="trainer resident memory", xlabel="minutes", ylabel="MB")
  axes[0, 1].plot(t, [x["open_fds"] for x in s], label="open fds")
  axes[0, 1].plot(t, [x["descendants"] for x in s], label="descendant processes")
  axes[0, 1].plot(t, [x["threads"] for x in s], label="threads")
  axes[0, 1].set(title="files, processes, threads", xlabel="minutes")
  axes[0, 1].legend()
  steps = [r["step"] for r in rl]
  reward = np.array([r["rollout/reward_mean"] for r in rl])
  axes[1, 0].plot(steps, reward, alpha=0.4, label="per logged step")
  k = 10
  if len(reward) >= k:
    axes[1, 0].plot(
      steps[k - 1 :], np.convolve(reward, np.ones(k) / k, "valid"), label=f"moving mean of {k}"
    )
  axes[1, 0].set(title="training reward through the faults", xlabel="RL step")
  axes[1, 0].legend()
  axes[1, 1].plot(steps, [r["queue/depth"] for r in rl], label="queue depth")
  axes[1, 1].plot(steps, [r.get("queue/rejected", 0) for r in rl], label="rejected (cum.)")
  axes[1, 1].plot(steps, [r.get("rollout/env_faults", 0) for r in rl], label="env faults (cum.)")
  axes[1, 1].plot(steps, [r.get("rollout/restarts", 0) for r in rl], label="restarts (cum.)")
  axes[1, 1].set(title="ingestion and faults", xlabel="RL step")
  axes[1, 1].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=80)


if __name__ == "__main__":
  main()
