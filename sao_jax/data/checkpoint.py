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

import posixpath
from typing import Any

import jax
import orbax.checkpoint as ocp

from sao_jax.data import files

# What orbax writes into a step directory when it finalises a save on a
# store without atomic renames (an object store), and the meta item's file.
COMMIT_FILE = "commit_success.txt"


class Checkpointer:

  def __init__(self, directory: str, max_to_keep: int = 3, name: str | None = None):
    """`name` (default: the directory's last component) keys this
    Checkpointer's multi-process barriers; see the module docstring."""
    self.directory = files.absolute(directory)
    self.name = name or posixpath.basename(self.directory.rstrip("/"))
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

  On a POSIX filesystem orbax writes a step under a temporary name and
  renames it when the save is finalised, so a directory named by its step
  number, with its meta item, is complete. On an object store (gs://) it
  writes in place and marks the end with `COMMIT_FILE` in the step's
  directory, which is then required too. Reads only files: safe to call
  while another process is training.
  """
  out = {}
  try:
    names = files.listdir(directory)
  except FileNotFoundError:
    return out
  marked = not files.renames_atomically(directory)
  for name in names:
    if not name.isdigit():
      continue
    step_dir = files.join(directory, name)
    if marked and not files.exists(files.join(step_dir, COMMIT_FILE)):
      continue
    try:
      out[int(name)] = files.read_json(files.join(step_dir, "meta", "metadata"))
    except (FileNotFoundError, NotADirectoryError):
      continue
  return out
