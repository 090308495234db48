"""How much probability an exported subset head puts outside the subset.

    python benchmarks/export_subset_head.py --workdir=/tmp/subset_run [--sft_steps=80]

Trains configs/math_tool_cpu.py's SFT for `--sft_steps` steps into `--workdir`
(skipped when the workdir already holds that checkpoint), then, at every
position of 24 of its transcripts (12 training demonstrations, 12 held-out
ones), computes from the policy's subset logits what an export over the
whole vocabulary would give each id outside the subset under several
choices of their lm_head row, all derivable from the covered logits:

    zero row               logit 0
    mean of covered rows   the mean covered logit (what hf_export writes)
    min covered logit      a lower bound no single linear row reaches
    -c x mean direction    a row pointed against the mean direction of the
                           final hidden states (from the first half of the
                           positions; hidden states solved from the logits)

and prints, per choice, the outside ids' total probability at temperature 1
(mean, median, max over positions) and how often one would win the argmax.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import math_tool_cpu
from sao_jax.data.prompts import EVAL_OFFSET
from sao_jax.envs.demonstrations import (
  demonstration_trajectory,
)
from sao_jax.models.transformer import Transformer
from sao_jax.train import trainer

LENGTH = 512


def _config(sft_steps: int):
  c = math_tool_cpu.get_config()
  c.sft.steps, c.sft.stop_at_nll = sft_steps, 0.0
  c.eval.num_tasks, c.checkpoint.every = 2, 40
  return c


def _against_mean(run, z: np.ndarray) -> np.ndarray:
  """h . u at every position, u the unit mean direction of the first half's unit
  hidden states (h solved from z = h W: the head has more columns than d)."""
  w = np.asarray(run.state.policy["lm_head"], np.float64)  # [d, S]
  h = np.linalg.lstsq(w.T, z.T, rcond=None)[0].T  # [positions, d]
  half = h[: len(h) // 2] / np.linalg.norm(h[: len(h) // 2], axis=1, keepdims=True)
  u = half.mean(0) / np.linalg.norm(half.mean(0))
  return h @ u


def _logits(run) -> np.ndarray:
  """Subset logits [positions, S] of the policy over 24 transcripts."""
  cfg, params = run.model_cfg, run.state.policy
  apply = jax.jit(
    lambda t: Transformer(cfg).apply(
      {"params": params}, t, jnp.arange(LENGTH)[None], jnp.ones_like(t)
    )[0]
  )
  out = []
  for i in list(range(12)) + [EVAL_OFFSET + j for j in range(12)]:
    task = run.env.task(i)
    seq = [int(t) for t in demonstration_trajectory(run.env, task, run.tok, run.format).tokens][
      :LENGTH
    ]
    padded = np.zeros((1, LENGTH), np.int32)
    padded[0, : len(seq)] = seq
    out.append(np.asarray(apply(jnp.asarray(padded)))[0, : len(seq)].astype(np.float64))
  return np.concatenate(out)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--sft_steps", type=int, default=80)
  args = parser.parse_args()
  config = _config(args.sft_steps)
  done = os.path.isdir(os.path.join(args.workdir, "checkpoints"))
  if not done:
    trainer.train(config, args.workdir, until="value_pretrain")
  run = trainer.load_run(config, args.workdir)
  z = _logits(run)
  projection = _against_mean(run, z)
  outside = run.model_cfg.vocab_size - run.model_cfg.head_size
  run.close()
  lse = np.logaddexp.reduce(z, axis=1)
  print(
    f"{z.shape[0]} positions, {z.shape[1]} covered ids, {outside} outside; "
    f"covered logits: max - mean {np.mean(z.max(1) - z.mean(1)):.2f}, "
    f"max - min {np.mean(z.max(1) - z.min(1)):.2f} (means over positions); "
    f"projections on the mean direction < 0 at {np.mean(projection < 0):.3f}"
  )
  for name, row in (
    ("zero row", np.zeros(len(z))),
    ("mean of covered rows", z.mean(1)),
    ("min covered logit", z.min(1)),
    ("-10 x mean direction", -10 * projection),
    ("-100 x mean direction", -100 * projection),
  ):
    mass = np.exp(np.log(outside) + row - np.logaddexp(lse, np.log(outside) + row))
    print(
      f"{name:22s} outside mass mean {mass.mean():.3f} median {np.median(mass):.3f} "
      f"max {mass.max():.3f}; argmax outside {np.mean(row > z.max(1)):.3f}"
    )


if __name__ == "__main__":
  main()
