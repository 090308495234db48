"""Prompt streams as grain datasets: index -> task index, deterministic, checkpointable.

Training draws task indices from a seeded shuffle of [0, num_train); the
held-out evaluation set is a disjoint range starting at EVAL_OFFSET, so no
evaluation task is ever trained on. The iterator's state is plain data and
goes into the checkpoint.
"""

from __future__ import annotations

import grain

EVAL_OFFSET = 10_000_000


def train_prompts(num_train: int, seed: int):
  """An infinite, shuffled, checkpointable iterator of training task indices."""
  ds = grain.MapDataset.range(num_train).shuffle(seed=seed).repeat()
  return iter(ds)


def eval_indices(num_eval: int) -> list[int]:
  return list(range(EVAL_OFFSET, EVAL_OFFSET + num_eval))
