"""Orbax checkpoints of the whole run: train state, version, data and rng.

A checkpoint at step s holds two items:

  * "state": the TrainState pytree (params and optimizer states of policy
    and critic, the policy version), restored straight into its shardings;
  * "meta": JSON: the run stage, the prompt iterator's state, the running-
    mean baseline, counters and the host rng seed sequence.

Saving is asynchronous (orbax writes in the background) and atomic: a run
killed mid-save leaves the previous checkpoint as the latest complete one.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, directory: str, max_to_keep: int = 3):
    self.directory = os.path.abspath(directory)
    self._mngr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                                             create=True))

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def save(self, step: int, state, meta: dict[str, Any], force: bool = False) -> None:
    self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                  meta=ocp.args.JsonSave(meta)), force=force)

  def restore(self, abstract_state, step: int | None = None):
    """(state, meta) of `step` (default latest) into the shardings of `abstract_state`."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    restored = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return restored["state"], restored["meta"]

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) to restore `tree`'s structure into."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
      tree)
