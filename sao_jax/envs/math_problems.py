"""math_problems: the shipped math set of `math_tool`, generated, with tool-using solutions.

No package ships GSM8K, MATH or AIME, and nothing may be downloaded at run
time, so the repository ships a small procedurally generated set in the
shape of the paper's agentic-reasoning tasks: a question in words or
symbols whose integer answer takes a few operations, and for every row a
demonstration that solves it the way the policy should, by calling the
`python` tool and answering in `\\boxed{}`:

    user       A shop sells pens at 7 dollars each. Maya buys 12 pens and
               pays with 100 dollars. How much change does she get?
    assistant  (reasoning: I will compute it with Python.)
               <tool_call>{"name": "python", "arguments": {"code":
               "print(100 - 7 * 12)"}}</tool_call>
    tool       16
    assistant  (reasoning: The tool printed 16.)
               The answer is \\boxed{16}.

About one row in nine takes two tool calls (35% of the distance, sharing
and area problems: an intermediate
quantity, then the answer from the tool's output). The tool outputs in the
demonstrations are what the sandbox prints for that code (the code is this
module's own, run here in-process). Rows are verl's format
(`sao_jax.data.datasets`); the answer is `reward_model.ground_truth`.

Regenerate the shipped files (deterministic for a seed):

    python -m sao_jax.envs.math_problems --out_dir=sao_jax/envs/task_data/math_tool

The set is for training and measuring sao-jax itself on CPU; a real run
points `env.kwargs.path` at its own dataset.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
from typing import Callable

import numpy as np

DATA_SOURCE = "sao_jax/math_problems"
SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "task_data", "math_tool")
SHIPPED_TRAIN = os.path.join(SHIPPED_DIR, "train.jsonl.gz")
SHIPPED_HELDOUT = os.path.join(SHIPPED_DIR, "heldout.jsonl.gz")

# A problem: (question, [code of each tool call], answer). A code string may
# use "{prev}" for the previous call's printed output.
Problem = tuple[str, list[str], int]


def _expression(rng) -> Problem:
  a, b, c, d = (int(x) for x in rng.integers(2, 99, 4))
  op1, op2, op3 = (str(x) for x in rng.choice(["+", "-", "*"], 3))
  expr = f"{a} {op1} {b} {op2} {c} {op3} {d}"
  return f"Compute {expr}.", [f"print({expr})"], int(eval(expr))  # noqa: S307


def _change(rng) -> Problem:
  price, count = int(rng.integers(2, 20)), int(rng.integers(2, 15))
  paid = int(np.ceil((price * count + 1) / 50) * 50)
  q = (
    f"A shop sells pens at {price} dollars each. Maya buys {count} pens and pays with "
    f"{paid} dollars. How much change does she get?"
  )
  return q, [f"print({paid} - {price} * {count})"], paid - price * count


def _distance(rng) -> Problem:
  speed, hours, extra = (
    int(rng.integers(20, 120)),
    int(rng.integers(2, 9)),
    int(rng.integers(5, 90)),
  )
  q = (
    f"A train travels at {speed} km per hour for {hours} hours, then {extra} km more. "
    "How many km does it travel in total?"
  )
  if rng.random() < 0.35:
    return q, [f"print({speed} * {hours})", f"print({{prev}} + {extra})"], speed * hours + extra
  return q, [f"print({speed} * {hours} + {extra})"], speed * hours + extra


def _sharing(rng) -> Problem:
  children, each, gives = (
    int(rng.integers(2, 12)),
    int(rng.integers(5, 30)),
    int(rng.integers(1, 5)),
  )
  apples = children * each
  q = (
    f"{apples} apples are shared equally among {children} children, and each child gives "
    f"{gives} apples to the teacher. How many apples does each child keep?"
  )
  if rng.random() < 0.35:
    return q, [f"print({apples} // {children})", f"print({{prev}} - {gives})"], each - gives
  return q, [f"print({apples} // {children} - {gives})"], each - gives


def _area(rng) -> Problem:
  length, width = int(rng.integers(5, 60)), int(rng.integers(5, 60))
  side = int(rng.integers(1, min(length, width)))
  q = (
    f"A garden is {length} m long and {width} m wide. A square pond of side {side} m is "
    "dug in it. What area in square metres is left?"
  )
  if rng.random() < 0.35:
    return (
      q,
      [f"print({length} * {width})", f"print({{prev}} - {side} * {side})"],
      (length * width - side * side),
    )
  return q, [f"print({length} * {width} - {side} * {side})"], length * width - side * side


def _savings(rng) -> Problem:
  weekly, weeks = int(rng.integers(5, 60)), int(rng.integers(2, 20))
  spent = int(rng.integers(1, weekly * weeks))
  q = (
    f"Leo saves {weekly} dollars a week for {weeks} weeks, then spends {spent} dollars. "
    "How many dollars does he have left?"
  )
  return q, [f"print({weekly} * {weeks} - {spent})"], weekly * weeks - spent


def _range_sum(rng) -> Problem:
  lo = int(rng.integers(1, 50))
  hi = lo + int(rng.integers(5, 200))
  q = f"What is the sum of the integers from {lo} to {hi}, inclusive?"
  return q, [f"print(sum(range({lo}, {hi} + 1)))"], sum(range(lo, hi + 1))


def _remainder(rng) -> Problem:
  a, b = int(rng.integers(100, 100_000)), int(rng.integers(3, 97))
  return (f"What is the remainder when {a} is divided by {b}?", [f"print({a} % {b})"], a % b)


def _power(rng) -> Problem:
  base, exp, sub = int(rng.integers(2, 13)), int(rng.integers(2, 7)), int(rng.integers(1, 500))
  q = f"What is {base} to the power {exp}, minus {sub}?"
  return q, [f"print({base} ** {exp} - {sub})"], base**exp - sub


FAMILIES: dict[str, Callable] = {
  "expression": _expression,
  "change": _change,
  "distance": _distance,
  "sharing": _sharing,
  "area": _area,
  "savings": _savings,
  "range_sum": _range_sum,
  "remainder": _remainder,
  "power": _power,
}


def _run(code: str) -> str:
  """What print() writes for this module's own code (the sandbox's stdout)."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(code, {})  # noqa: S102
  return out.getvalue()


def solution(question: str, codes: list[str], answer: int) -> list[dict]:
  """The demonstration: tool calls whose outputs chain, then the boxed answer."""
  del question
  messages, prev = [], None
  for k, code in enumerate(codes):
    code = code.replace("{prev}", str(prev).strip()) if prev is not None else code
    plan = (
      "I will compute it with Python."
      if k == 0
      else f"The tool printed {str(prev).strip()}. Next step."
    )
    messages.append(
      {
        "role": "assistant",
        "content": "",
        "reasoning_content": plan,
        "tool_calls": [{"name": "python", "arguments": {"code": code}}],
      }
    )
    prev = _run(code)
    messages.append({"role": "tool", "content": prev})
  if int(str(prev).strip()) != answer:
    raise AssertionError(f"generator bug: {codes} printed {prev!r}, expected {answer}")
  messages.append(
    {
      "role": "assistant",
      "content": f"The answer is \\boxed{{{answer}}}.",
      "reasoning_content": f"The tool printed {answer}.",
    }
  )
  return messages


def rows(n: int, seed: int, exclude: frozenset = frozenset()) -> list[dict]:
  """`n` verl-style rows with `n` different questions, none in `exclude`,
  deterministic for `seed`.

  Each row draws a family uniformly, then a problem of it; a question
  already drawn (or excluded) is drawn again, family and all, so the file
  passes the datasets' own hygiene check (no repeated prompt). A family
  with few distinct questions ("change": 234) ends up with fewer rows.
  """
  rng = np.random.default_rng(seed)
  names = sorted(FAMILIES)
  out, seen = [], set(exclude)
  for i in range(n):
    while True:
      family = names[int(rng.integers(len(names)))]
      question, codes, answer = FAMILIES[family](rng)
      if question not in seen:
        break
    seen.add(question)
    out.append(
      {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question}],
        "reward_model": {"ground_truth": str(answer)},
        "extra_info": {"family": family, "index": i},
        "completion": solution(question, codes, answer),
      }
    )
  return out


def write(path: str, data: list[dict]) -> None:
  # mtime=0: the same rows give the same bytes, so regenerating changes nothing.
  with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
    for row in data:
      f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out_dir", default=SHIPPED_DIR)
  parser.add_argument("--train", type=int, default=4000)
  parser.add_argument("--heldout", type=int, default=400)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  # Disjoint seeds; no question repeats within or across the files.
  train = rows(args.train, args.seed)
  heldout = rows(
    args.heldout, args.seed + 1, exclude=frozenset(r["prompt"][0]["content"] for r in train)
  )
  write(os.path.join(args.out_dir, "train.jsonl.gz"), train)
  write(os.path.join(args.out_dir, "heldout.jsonl.gz"), heldout)
  print(f"wrote {len(train)} training and {len(heldout)} held-out rows to {args.out_dir}")


if __name__ == "__main__":
  main()
