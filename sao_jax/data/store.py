"""A trajectory store: ArrayRecord shards of serialised Trajectory records.

Rollout writes (`TrajectoryWriter`), the trainer reads through grain
(`read_trajectories` uses `grain.sources.ArrayRecordDataSource`), so the same
format carries trajectories between separate rollout and trainer processes
on a pod. A record is an `.npz` of the arrays plus a JSON header of the
scalars: no pickle, readable from any language with numpy's format.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os

import grain
import numpy as np
from array_record.python import array_record_module

from sao_jax.data.trajectory import Trajectory

_ARRAYS = ("tokens", "action_mask", "rollout_logprobs", "policy_version", "rewards",
           "turn_starts")


def serialize(t: Trajectory) -> bytes:
  buf = io.BytesIO()
  header = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name not in _ARRAYS}
  np.savez(buf, header=np.frombuffer(json.dumps(header).encode(), np.uint8),
           **{k: getattr(t, k) for k in _ARRAYS})
  return buf.getvalue()


def deserialize(data: bytes) -> Trajectory:
  with np.load(io.BytesIO(data), allow_pickle=False) as z:
    header = json.loads(z["header"].tobytes().decode())
    return Trajectory(**{k: z[k] for k in _ARRAYS}, **header)


class TrajectoryWriter:
  """Appends trajectories to one ArrayRecord shard."""

  def __init__(self, path: str):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    self.path = path
    self._writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
    self.count = 0

  def write(self, t: Trajectory) -> None:
    self._writer.write(serialize(t))
    self.count += 1

  def close(self) -> None:
    self._writer.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def read_trajectories(paths: list[str], shuffle_seed: int | None = None):
  """A grain MapDataset of Trajectory records over the given shards."""
  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))
  if shuffle_seed is not None:
    ds = ds.shuffle(seed=shuffle_seed)
  return ds.map(deserialize)
