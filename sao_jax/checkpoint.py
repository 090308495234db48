"""Orbax checkpoints of the whole run: train state, version, data and rng.

A checkpoint at step s holds two items:

  * "state": the TrainState pytree (params and optimizer states of policy
    and critic, the policy version), restored straight into its shardings;
  * "meta": JSON: the run stage, the prompt iterator's state, the running-
    mean baseline, counters and the host rng seed sequence.

Saving is asynchronous (orbax writes in the background) and atomic: a run
killed mid-save leaves the previous checkpoint as the latest complete one.
A new save first waits for the one in flight, so at any moment at most one
save is incomplete: a run that checkpoints every `e` steps and is killed
after step k resumes from a step >= k - 2e (the save of the last multiple
of e may not have started or may still be in flight; the one before it is
complete).
`committed_checkpoints` reads what is complete on disk, from any process.

On several processes each save ends in barriers over the coordination
service, keyed by the step number (or by nothing), not by the directory:
two Checkpointers saving at once in one job (a fleet trainer's run
checkpoints and its published weights) would meet at the same key and the
service fails the second waiter ("Barrier ... is already ongoing"). Each
Checkpointer therefore prefixes its barriers with its `name`, which must be
the same in every process and differ between Checkpointers that save in
the same job.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, directory: str, max_to_keep: int = 3, name: str | None = None):
    """`name` (default: the directory's last component) keys this
    Checkpointer's multi-process barriers; see the module docstring."""
    self.directory = os.path.abspath(directory)
    self.name = name or os.path.basename(self.directory)
    self._mngr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                barrier_sync_key_prefix=f"sao_jax/{self.name}")))

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


def committed_checkpoints(directory: str) -> dict[int, dict[str, Any]]:
  """{step: meta} of the checkpoints under `directory` that are complete.

  Orbax writes a step under a temporary name and renames it when the save
  is finalised, so a directory named by its step number, with its meta
  item, is complete. That holds on filesystems with atomic rename, which
  are the only ones this reads (it lists with `os`): on object stores
  orbax writes in place and marks the end with a commit file, which this
  does not check. Reads only files: safe to call while another process is
  training.
  """
  out = {}
  if not os.path.isdir(directory):
    return out
  for name in os.listdir(directory):
    meta_path = os.path.join(directory, name, "meta", "metadata")
    if name.isdigit() and os.path.exists(meta_path):
      with open(meta_path, encoding="utf-8") as f:
        out[int(name)] = json.load(f)
  return out
