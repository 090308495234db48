"""Orbax checkpoints of the whole run: train state, version, data and rng.

A checkpoint at step s holds two items:

  * "state": the TrainState pytree (params and optimizer states of policy
    and critic, the policy version), restored straight into its shardings;
    with LoRA (config section `lora`) its policy and critic are the adapters
    and their moments only, and the meta's "lora_base" is a fingerprint of
    the frozen base (`lora.fingerprint`): `check_lora_base` refuses a resume
    on another base, or a full run's checkpoint in a LoRA run and back;
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

A save that fails for storage (the disk full, a quota, an I/O error: an
OSError, or tensorstore's "[os_error_code=28]" that orbax raises as a
ValueError) raises `CheckpointWriteError` from the `save`, `wait` or
`close` that meets it, once, naming the step and the newest complete
checkpoint. Older checkpoints are pruned (`max_to_keep`) only after a newer
one is complete, so a failed save never costs the last good one; the failed
save's partial files stay until that step is saved again (orbax replaces
an unfinished temporary directory). `restore_intact` resumes from the newest
checkpoint that restores, setting aside newer damaged ones (truncated,
files missing, unreadable) as `damaged-<step>` beside them, where orbax
no longer sees them as steps.

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

import errno
import logging
import os
import posixpath
import re
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp

from sao_jax.config import import_strings, sections
from sao_jax.data import files

# What orbax writes into a step directory when it finalises a save on a
# store without atomic renames (an object store), and the meta item's file.
COMMIT_FILE = "commit_success.txt"
# What a damaged checkpoint is renamed to: `damaged-<step>` (orbax's steps are digits).
DAMAGED_PREFIX = "damaged-"
# The OS errors of a full disk: no space left, the user's quota used up.
STORAGE_FULL = (errno.ENOSPC, errno.EDQUOT)


class CheckpointWriteError(OSError):
  """A checkpoint that storage refused (its `errno`: ENOSPC for a full
  disk); the message is one line naming the step and the newest complete
  checkpoint, which is intact."""

  def __init__(self, message: str, code: int, step: int | None):
    super().__init__(message)
    self.errno, self.step = code, step


def storage_errno(e: BaseException | None) -> int | None:
  """The OS error number behind `e` or its causes: an OSError's, or the
  "[os_error_code='28']" of tensorstore's errors, which orbax raises as
  ValueError; None for anything else."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno:
      return e.errno
    found = re.search(r"os_error_code='?(\d+)", str(e))
    if found:
      return int(found.group(1))
    e = e.__cause__ or e.__context__
  return None


class _QuietStorageFull(logging.Filter):
  """Drops the log records of a full disk from orbax's save threads (each
  logs the failure with a traceback) and from the asyncio tasks they leave
  unfinished: CheckpointWriteError reports it once, in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    if "orbax" not in record.pathname and record.name != "asyncio":
      return True
    error = record.exc_info[1] if record.exc_info else Exception(record.getMessage())
    return storage_errno(error) not in STORAGE_FULL and not any(
      os.strerror(code) in record.getMessage() for code in STORAGE_FULL
    )


for _logger in ("absl", "asyncio"):  # orbax logs through absl
  logging.getLogger(_logger).addFilter(_QuietStorageFull())


def _closed_loop(exc_type, exc_value) -> bool:
  return exc_type is RuntimeError and str(exc_value) == "Event loop is closed"


def _quiet_closed_loops() -> None:
  """After a failed save, drops the "Event loop is closed" errors of the
  writes it left running: they end after orbax closed their event loop, in
  callbacks whose error Python would print with a traceback (through
  sys.excepthook or, as "Exception ignored", sys.unraisablehook)."""
  if getattr(sys.excepthook, "quiet_closed_loops", False):
    return
  excepthook, unraisablehook = sys.excepthook, sys.unraisablehook

  def quiet_excepthook(exc_type, exc_value, tb):
    if not _closed_loop(exc_type, exc_value):
      excepthook(exc_type, exc_value, tb)

  def quiet_unraisablehook(unraisable):
    if not _closed_loop(unraisable.exc_type, unraisable.exc_value):
      unraisablehook(unraisable)

  quiet_excepthook.quiet_closed_loops = True
  sys.excepthook, sys.unraisablehook = quiet_excepthook, quiet_unraisablehook


class Checkpointer:
  def __init__(self, directory: str, max_to_keep: int = 3, name: str | None = None):
    """`name` (default: the directory's last component) keys this
    Checkpointer's multi-process barriers; see the module docstring."""
    self.directory = files.absolute(directory)
    self.name = name or posixpath.basename(self.directory.rstrip("/"))
    self._mngr = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=True,
        multiprocessing_options=ocp.options.MultiprocessingOptions(
          barrier_sync_key_prefix=f"sao_jax/{self.name}"
        ),
      ),
    )
    self._in_flight: int | None = None  # the step of the save orbax may still be writing
    self._failed: int | None = None  # a step whose failure has been raised

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def save(self, step: int, state, meta: dict[str, Any], force: bool = False) -> None:
    self.wait()  # a failure of the save in flight is that step's, raised first
    try:
      self._mngr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=force,
      )
    except Exception as e:  # noqa: BLE001
      self._raise_write_error(step, e)
    self._in_flight = step

  def restore(self, abstract_state, step: int | None = None):
    """(state, meta) of `step` (default latest) into the shardings of `abstract_state`."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    restored = self._mngr.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
      ),
    )
    return restored["state"], restored["meta"]

  def restore_intact(self, abstract_state, set_aside: bool = True):
    """(step, state, meta, skipped) of the newest checkpoint that restores;
    None if there is no checkpoint.

    `skipped`: [(step, why, where)] of the newer ones that did not
    (truncated, files missing, unreadable), each renamed to `where`,
    `damaged-<step>`, when `set_aside` (else `where` is None; on one
    process of several: the others `reload` after it), so that orbax
    neither counts it as the latest step nor refuses to save that step again. A checkpoint counts as damaged only when an older one
    restores into the same `abstract_state`: if none does (a config whose
    shapes differ), the newest one's error is raised and nothing is moved.
    """
    skipped, first_error = [], None
    for step in sorted(self._mngr.all_steps(), reverse=True):
      try:
        state, meta = self.restore(abstract_state, step)
      except Exception as e:  # noqa: BLE001  # whatever the damage raises
        first_error = first_error or e
        skipped.append((step, import_strings.one_line(e)))
        continue
      skipped = [(bad, why, self._set_aside(bad) if set_aside else None) for bad, why in skipped]
      self.reload()
      return step, state, meta, skipped
    if first_error is not None:
      raise first_error
    return None

  def reload(self) -> None:
    """Re-reads the steps on disk (after another process set one aside)."""
    self._mngr.reload()

  def _set_aside(self, step: int) -> str:
    """Renames step directory `step` to an unused `damaged-<step>[.n]`; the new path."""
    names = set(files.listdir(self.directory))
    name, n = f"{DAMAGED_PREFIX}{step}", 1
    while name in names:
      name, n = f"{DAMAGED_PREFIX}{step}.{n}", n + 1
    source, target = files.join(self.directory, str(step)), files.join(self.directory, name)
    if files.is_url(source):  # an object store has no rename: a copy, then the delete
      import fsspec

      fs, path = fsspec.core.url_to_fs(source)
      fs.mv(path, fsspec.core.url_to_fs(target)[1], recursive=True)
    else:
      os.rename(source, target)
    return target

  def wait(self) -> None:
    """Blocks until the save in flight is complete; CheckpointWriteError if it failed."""
    step, self._in_flight = self._in_flight, None
    try:
      self._mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      if step is None and self._failed is not None:
        return  # the failure raised already, which orbax raises again at every wait
      self._raise_write_error(step, e)

  def close(self) -> None:
    try:
      self.wait()
    finally:
      try:
        self._mngr.close()  # meets a failed save's error again
      except Exception:
        if self._failed is None:
          raise

  def _raise_write_error(self, step: int | None, e: Exception):
    """Raises `e` as CheckpointWriteError if storage refused the save of
    `step`, else as it is."""
    code = storage_errno(e)
    if code is None:
      raise e
    self._failed = step
    _quiet_closed_loops()
    complete = sorted(s for s in committed_checkpoints(self.directory) if s != step)
    newest = (
      f"checkpoint {complete[-1]} is the newest complete one"
      if complete
      else "no checkpoint is complete"
    )
    raise CheckpointWriteError(
      f"checkpoint {step} could not be written under {self.directory}: "
      f"{os.strerror(code)} (errno {code}); {newest}",
      code,
      step,
    ) from e


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) to restore `tree`'s structure into."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
  )


def check_lora_base(saved_meta: dict, step: int, ours: str | None, workdir: str) -> None:
  """Refuses, in one line, to restore checkpoint `step` (its meta `saved_meta`)
  into a run whose LoRA base fingerprint is `ours` (None: a full run) when
  the checkpoint was trained on another base or as the other kind of run."""
  theirs = saved_meta.get("lora_base")
  if theirs == ours:
    return
  where = f"checkpoint {step} in {workdir}"
  if theirs is None:
    why = "holds a full model's state, this run trains LoRA adapters (lora.enabled)"
  elif ours is None:
    why = "holds LoRA adapters only, this run trains the full model (lora.enabled = False)"
  else:
    why = (
      f"holds LoRA adapters trained on another base (fingerprint {theirs}, this run's "
      f"base {ours}: another model.hf_dir, sft.init_from_run checkpoint (pin one "
      "with DIR@N), seed or lora.base_dtype)"
    )
  raise sections.ConfigError(
    f"{where} {why}; resume with the config and base the run was started with, or use a new workdir"
  )


def restore_policy(directory: str, step: int, abstract_policy):
  """The policy params of checkpoint `step` under `directory`, alone: a partial
  restore of its state item into `abstract_policy`'s shapes and shardings
  (another run's policy, `sft.init_from_run`; its optimizer and critic are not
  read). Collective on several processes, like every restore."""
  restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), abstract_policy)
  got = ocp.PyTreeCheckpointer().restore(
    files.join(directory, str(step), "state"),
    args=ocp.args.PyTreeRestore(
      {"policy": abstract_policy}, restore_args={"policy": restore_args}, partial_restore=True
    ),
  )
  return got["policy"]


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
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: damaged JSON
      continue
  return out
