"""HumanEval grading throughput under threads, and gradings lost to errors.

Grades answers to every HumanEval problem from `--threads` threads at once,
as the rollout driver's environment workers do: the canonical solution
(should pass) and, for the problems whose answer is a dict, the same values
returned as a `collections.Counter` (HumanEval's `check` accepts it). Prints
gradings per second, the verdicts, and how many gradings raised (a lost
grading: the driver would count an env_error and score 0).

    python benchmarks/grading.py --threads 4 --rounds 1

Run it against another checkout with `PYTHONPATH=<checkout>` to compare.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import time

from sao_jax.envs.humaneval import HumanEval, HumanEvalConfig
from sao_jax.envs.sandbox import SandboxLimits

# Problems whose canonical answer is a dict: the same values as a Counter.
COUNTER_PROBLEMS = {
  111: """
import collections
def histogram(test):
    c = collections.Counter(test.split())
    m = max(c.values(), default=0)
    return collections.Counter({k: v for k, v in c.items() if v == m})
"""
}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--threads", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=1)
  args = parser.parse_args()
  env = HumanEval(HumanEvalConfig(), SandboxLimits(cpu_seconds=5, wall_seconds=20.0))
  jobs = []
  for _ in range(args.rounds):
    for i, p in enumerate(env.problems):
      jobs.append((p, p["prompt"] + p["canonical_solution"], "passed"))
      if i in COUNTER_PROBLEMS:
        jobs.append((p, "```python\n" + COUNTER_PROBLEMS[i] + "```", "passed"))
  for p in env.problems:  # recorded once, before the clock starts
    env.recorded_calls(p)

  def grade(job):
    problem, answer, _ = job
    try:
      return env.grade(problem, answer)[0]
    except Exception as e:  # noqa: BLE001
      return f"raised {type(e).__name__}"

  start = time.time()
  with cf.ThreadPoolExecutor(args.threads) as pool:
    verdicts = list(pool.map(grade, jobs))
  seconds = time.time() - start
  wrong = collections.Counter(v for v, (_, _, want) in zip(verdicts, jobs) if v != want)
  print(
    f"{len(jobs)} gradings, {args.threads} threads: {seconds:.1f} s, "
    f"{len(jobs) / seconds:.2f} gradings/s; verdicts {dict(collections.Counter(verdicts))}; "
    f"not as expected {dict(wrong)}"
  )


if __name__ == "__main__":
  main()
