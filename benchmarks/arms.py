"""Runs several training arms end to end and tabulates held-out pass@1.

    python benchmarks/arms.py --arms sao_tiny,sao_sync,grpo --out benchmarks/RESULTS.md

Each arm is `launch/train.py --config=configs/<arm>.py` in its own workdir,
run one after the other on this machine with the same seed (so the same SFT
warm start), and the table reads each run's summary.json: SFT pass@1, final
pass@1 (same 400 held-out tasks, temperature 1.0) and wall time. One run per
arm: differences of a few points are within sampling noise (the standard
error of one pass@1 on 400 tasks is about 2.5 points).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--arms", default="sao_tiny,sao_sync,grpo")
  parser.add_argument("--workdir", default=os.path.join(ROOT, "workdirs", "arms"))
  parser.add_argument("--out", default=None)
  parser.add_argument("overrides", nargs="*", help="extra --config.* flags for every arm")
  args = parser.parse_args()
  lines = [
    "| arm | SFT pass@1 | final pass@1 | change | RL steps | wall (s) |",
    "|---|---|---|---|---|---|",
  ]
  for arm in args.arms.split(","):
    workdir = os.path.join(args.workdir, arm)
    start = time.time()
    subprocess.run(
      [
        sys.executable,
        os.path.join(ROOT, "launch", "train.py"),
        f"--config={os.path.join(ROOT, 'configs', arm + '.py')}",
        f"--workdir={workdir}",
        *args.overrides,
      ],
      check=True,
      cwd=ROOT,
    )
    wall = time.time() - start
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
      s = json.load(f)
    lines.append(
      f"| {arm} | {s['sft_pass@1']:.3f} | {s['final_pass@1']:.3f} | "
      f"{s['final_pass@1'] - s['sft_pass@1']:+.3f} | {s['rl_steps']} | {wall:.0f} |"
    )
    print(lines[-1], flush=True)
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
