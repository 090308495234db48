"""The rollout fleet's transport: trajectories and weights over shared storage.

In `rl.mode = "fleet"` rollout runs in its own processes (launch/rollout.py
around `fleet_worker.run_rollout_worker`), so generation never waits for
training. Trajectories move as ArrayRecord shards of the trajectory store and
weights as versioned orbax checkpoints (the bootstrap and fallback of the
direct path, weight_transfer.py), all under one root (`fleet.root`, default
`<workdir>/fleet`; a POSIX directory every host mounts or an object-store URL,
through sao_jax/data/files.py):

    <root>/weights/<version>/         orbax: the policy params after <version>
                                      actor updates, and a JSON meta (version,
                                      publish time, the trainer's run id and
                                      the params' fingerprint: identity.py)
    <root>/trajectories/<rollout_id>-<seq>.array_record
                                      one closed shard of one rollout process
    <root>/trajectories/<rollout_id>-<seq>.array_record.stats.json
                                      its driver's counters (malformed tool
                                      calls, environment events) since the
                                      previous shard, if any
    <root>/rollouts/<rollout_id>.lock (POSIX) or .lease (object store)
                                      held by the one process writing the id
    <root>/consumed.json              the trainer's watermarks: per rollout,
                                      the shard up to which it read them all
    <root>/DONE                       the trainer finished RL: rollouts exit

Contract:

* Visibility is by rename (or, on an object store, by whole-object upload)
  only: a reader never sees half a shard or half a version
  (`ShardWriter`, `committed_checkpoints`).
* One process writes a rollout id: it holds the id's `RolloutLock` (POSIX)
  or `RolloutLease` (object store); a second one is refused with
  `RolloutIdInUse` before it touches the first one's files.
* `ShardFeed` hands out trajectories in completion order, each validated
  (`ingestion.check`: staleness, run id and params fingerprints); bad
  shards and records are counted by reason, never trained on, never a
  crash. Its cursor goes into the trainer's checkpoint, and a restarted
  trainer resumes exactly there: none skipped, none trained twice into the
  same state.
* `WeightPublisher` publishes versions and keeps the newest
  `fleet.keep_versions`; `WeightFollower` follows the newest complete one,
  back as well as forward when a resumed trainer republishes.
* Backpressure without a channel back: a rollout holding
  `fleet.max_unread_shards` closed shards the trainer has not read
  (`consumed.json`) stops emitting until it reads on; it cannot deadlock.

How restarts, pruning races, the cursor, backpressure and object stores
work, and why the transport polls: docs/design/fleet.md.
"""

from __future__ import annotations

import collections
import fcntl
import json
import math
import os
import re
import socket
import threading
import time
import uuid
import weakref
from typing import Any, Callable

import grain
import jax

from sao_jax.data import files, ingestion, store
from sao_jax.data.checkpoint import Checkpointer, committed_checkpoints
from sao_jax.data.identity import Published
from sao_jax.data.trajectory import ENV_FAULTS, Trajectory

WEIGHTS = "weights"
TRAJECTORIES = "trajectories"
ROLLOUTS = "rollouts"
CONSUMED = "consumed.json"
DONE = "DONE"
SHARD_SUFFIX = ".array_record"
_SHARD_NAME = re.compile(r"^([A-Za-z0-9_]+)-(\d{8})" + re.escape(SHARD_SUFFIX) + r"$")
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9_]+$")
# The driver's counters (DriverStats fields) a shard carries in its stats file.
SHARD_COUNTERS = ("tool_call_errors", "env_events")
STATS_SUFFIX = ".stats.json"
# A rollout id's lock file (a POSIX root) or lease object (an object store),
# under <root>/rollouts/.
LOCK_SUFFIX = ".lock"
LEASE_SUFFIX = ".lease"
# A lease's holder renews it every LEASE_S / 3; a process that sees no
# renewal for LEASE_S takes the holder to be dead.
LEASE_S = 60.0
# Bounds on a stats file read back: it comes from another process, like the shard.
_STATS_MAX_BYTES = 1 << 16
_STATS_MAX_NAMES = 256
# Shards of one rollout the feed reads beyond a gap in its sequence before it
# gives the gap up (a shard that never comes; ShardFeed).
MAX_AHEAD = 1024
# Seconds without a new shard between the feed's "still waiting" lines.
REPORT_WAIT_S = 60.0


def root_of(config, workdir: str) -> str:
  """The fleet's shared directory: `fleet.root`, or `<workdir>/fleet`."""
  return files.absolute(config.fleet.root or files.join(workdir, "fleet"))


def weights_dir(root: str) -> str:
  return files.join(root, WEIGHTS)


def trajectories_dir(root: str) -> str:
  return files.join(root, TRAJECTORIES)


def rollouts_dir(root: str) -> str:
  """Where the rollout ids' locks and leases are."""
  return files.join(root, ROLLOUTS)


def shard_name(rollout_id: str, seq: int) -> str:
  return f"{rollout_id}-{seq:08d}{SHARD_SUFFIX}"


def parse_shard_name(name: str) -> tuple[str, int] | None:
  """(rollout_id, seq) of a closed shard's file name; None for anything else
  (temporaries `<name>.tmp-<pid>` included)."""
  match = _SHARD_NAME.match(name)
  return (match.group(1), int(match.group(2))) if match else None


def mark_done(root: str, version: int) -> None:
  """Tells the rollouts that RL is over."""
  files.write_json(files.join(root, DONE), {"version": int(version), "time": time.time()})


def read_consumed(root: str) -> dict[str, int]:
  """The trainer's watermarks: rollout id -> highest shard seq fully read."""
  try:
    return {str(k): int(v) for k, v in files.read_json(files.join(root, CONSUMED)).items()}
  except (FileNotFoundError, ValueError, AttributeError, TypeError):
    return {}


def is_done(root: str) -> bool:
  return files.exists(files.join(root, DONE))


def clear_done(root: str) -> None:
  files.remove(files.join(root, DONE))


def unread_shards(consumed: dict, rollout_id: str, last_written: int) -> int:
  """Shards rollout `rollout_id` closed (up to seq `last_written`) that the
  trainer had not fully consumed by its watermarks `consumed`."""
  return last_written - int(consumed.get(rollout_id, -1))


# --- weights: trainer -> rollouts ----------------------------------------------------


class WeightPublisher:
  """The trainer's side: versioned orbax checkpoints of the policy params.

  Saving is orbax's asynchronous save (the device-to-host copy happens in
  `publish`, the write in the background), so training goes on while a
  version is written; a publish waits only for the previous one.
  """

  def __init__(self, root: str, keep: int, version: int):
    self.dir = weights_dir(root)
    files.makedirs(self.dir)
    # Versions beyond the trainer's are a future it discarded (it was killed
    # after publishing them and resumed from an older checkpoint); orbax's
    # temporaries are saves that never finished. Neither may be followed.
    try:
      names = files.listdir(self.dir)
    except FileNotFoundError:
      names = []
    for name in names:
      if not name.isdigit() or int(name) > version:
        files.rmtree(files.join(self.dir, name))
    self._ckpt = Checkpointer(self.dir, keep, name="weights")
    self.last_publish_s = 0.0

  def publish(self, params, version: int, meta: dict | None = None) -> None:
    """Starts writing `params` as `version` (a no-op if it is on disk)."""
    if version in committed_checkpoints(self.dir):
      return  # the same params: a version is the state after that many updates
    t0 = time.time()
    self._ckpt.save(
      version, params, dict(meta or {}, version=int(version), published=time.time()), force=True
    )
    self.last_publish_s = time.time() - t0

  def close(self) -> None:
    """Waits for the save in flight: the last version is complete on return."""
    self._ckpt.close()


def _with_device(abstract):
  """ShapeDtypeStructs placed on this process's first device where unplaced
  (a follower starts from the initialiser's eval_shape, which carries no
  sharding, until `retarget` gives it the engine's layout)."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(
    lambda a: (
      a
      if getattr(a, "sharding", None) is not None
      else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device)
    ),
    abstract,
  )


class WeightFollower:
  """A rollout's side: the newest complete version, restored into its params."""

  def __init__(self, root: str, abstract_params):
    self.dir = weights_dir(root)
    files.makedirs(self.dir)
    self._abstract = _with_device(abstract_params)
    self._ckpt: Checkpointer | None = None
    self.version: int | None = None
    self._published = None  # when the held version was published: its identity
    self.failed_restores = 0

  def retarget(self, abstract_params) -> None:
    """Restores later versions into this layout (a sharded engine's)."""
    self._abstract = _with_device(abstract_params)

  @property
  def abstract(self):
    """The layout versions are restored into (ShapeDtypeStructs with shardings)."""
    return self._abstract

  def newest(self) -> tuple[int, dict] | None:
    """(version, meta) of the newest complete version, or None."""
    versions = committed_checkpoints(self.dir)
    if not versions:
      return None
    v = max(versions)
    return v, versions[v]

  def poll(self, final: bool = False):
    """(params, version, meta) when the newest version differs from the one
    held, else None (`final`, the trainer is done, changes nothing here).
    Differs: newer, older after a trainer restart, or the same number
    published again by a restarted trainer (whose version v is not the
    discarded run's v), told apart by the publish time."""
    newest = self.newest()
    if newest is None:
      return None
    del final
    version, meta = newest
    if (version, meta.get("published")) == (self.version, self._published):
      return None
    got = self.restore_version(version)
    if got is None:
      return None
    params, meta = got
    self.version, self._published = version, meta.get("published")
    return params, version, meta

  def restore_version(self, version: int):
    """(params, meta) of a committed `version`, or None (counted in
    `failed_restores`) if it went while being read."""
    if self._ckpt is None:
      # Read-only use of a manager: it never saves here, so it never prunes.
      self._ckpt = Checkpointer(self.dir, max_to_keep=1 << 30, name="weights")
    try:
      return self._ckpt.restore(self._abstract, version)
    except Exception:  # noqa: BLE001
      # Pruned (or removed as a discarded future) while we read it: the
      # next poll takes whatever is newest then.
      self.failed_restores += 1
      return None

  def close(self) -> None:
    if self._ckpt is not None:
      self._ckpt.close()


# --- one writer per rollout id -------------------------------------------------------


class RolloutIdInUse(RuntimeError):
  """Another live process writes shards under this rollout id; the message
  is one line."""


def _whoami() -> dict:
  """This process as a lock names its holder."""
  try:
    pidns = os.readlink("/proc/self/ns/pid")  # pids mean something within one namespace
  except OSError:
    pidns = ""
  return {"host": socket.gethostname(), "pid": os.getpid(), "pidns": pidns, "since": time.time()}


def _parse_holder(raw: bytes | None) -> dict:
  try:
    holder = json.loads(raw or b"{}")
  except (ValueError, RecursionError):
    return {}
  return holder if isinstance(holder, dict) else {}


def _in_use(rollout_id: str, holder: dict, path: str) -> str:
  since = holder.get("since")
  when = (
    time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since))
    if isinstance(since, (int, float)) and math.isfinite(since)
    else ""
  )
  return (
    f"rollout id {rollout_id!r} is in use: pid {holder.get('pid', '?')} on "
    f"{holder.get('host', '?')} holds {path}{when}; start this process with "
    "another --rollout_id, or stop that one first"
  )


def _dead_here(holder: dict) -> bool:
  """Whether the holder ran on this host, in this pid namespace, and its
  process is gone (on another host only time can tell)."""
  me = _whoami()
  pid = holder.get("pid")
  if (holder.get("host"), holder.get("pidns")) != (me["host"], me["pidns"]) or not (
    type(pid) is int and pid > 0
  ):
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except OSError:
    return False  # alive, another user's
  return False


class RolloutLock:
  """A rollout id's lock on a POSIX root: flock on `<dir>/<id>.lock`.

  Held while the process lives: the kernel drops it when the process ends,
  however it ends, so a crashed writer never blocks its restart. On NFS
  (v4, Filestore) the lock is the server's, across hosts, and a dead host's
  goes when its NFS lease expires (about 90 s). A gcsfuse mount locks only
  between the processes of one host: give such a fleet its gs:// URL as
  `fleet.root` (RolloutLease) instead. A filesystem without locks is
  noted (`note`), not refused. The file stays: removing a lock file races
  with a process that has just opened it.
  """

  def __init__(self, directory: str, rollout_id: str):
    self.path = os.path.join(directory, rollout_id + LOCK_SUFFIX)
    self.note: str | None = None
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _parse_holder(os.pread(fd, 4096, 0))
      os.close(fd)
      raise RolloutIdInUse(_in_use(rollout_id, holder, self.path)) from None
    except OSError as e:  # ENOLCK, EOPNOTSUPP: a filesystem without locks
      self.note = (
        f"{self.path} cannot be locked ({e.strerror or e}): nothing stops a "
        "second process with this rollout id"
      )
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_whoami()).encode(), 0)
    # Closing the descriptor drops the lock: at release, or when this object goes.
    self._close = weakref.finalize(self, os.close, fd)

  def check(self) -> None:
    """Raises RolloutIdInUse if the lock was lost; a flock never is."""

  def release(self) -> None:
    self._close()


class _Objects:
  """What RolloutLease does to its object: files.py's client, and fsspec's
  create-only write (GCS: ifGenerationMatch=0)."""

  def read(self, path: str) -> bytes | None:
    try:
      return files.read_bytes(path, 1 << 16)
    except FileNotFoundError:
      return None

  def create(self, path: str, data: bytes) -> bool:
    import fsspec  # object stores only

    fs, p = fsspec.core.url_to_fs(path)
    try:
      fs.pipe_file(p, data, mode="create")
    except FileExistsError:
      return False
    return True

  def write(self, path: str, data: bytes) -> None:
    files.write_bytes(path, data)

  def delete(self, path: str) -> None:
    files.remove(path)


class RolloutLease:
  """A rollout id's lease on an object store (gs://), which has no locks.

  The object `<dir>/<id>.lease` names its holder (a random token, host,
  pid) and a beat the holder advances every `ttl_s` / 3 (`renew`: a daemon
  thread, or the caller with `thread=False`). It is taken by creating it
  only if absent. A process that finds one watches it: a beat within
  `ttl_s` is a live holder (RolloutIdInUse); no beat for `ttl_s`, or a
  holder on this host whose pid is gone (at once), is a dead one's, and the
  lease is taken over. A holder that finds another token in its lease (it
  stalled past `ttl_s` and was taken over), or cannot renew it for 2/3 of
  `ttl_s`, has lost it: `check` raises from then on.

  The limit: taking over is a delete and a create, not one conditional
  overwrite (the client exposes a generation match only for creating), so
  two processes taking over one dead id in the same instant can both
  start; the one whose lease was replaced finds out at its next renewal.
  `clock` and `sleep` (monotonic seconds) time the waits, `store` reads and
  writes the object; tests pass fakes.
  """

  def __init__(
    self,
    directory: str,
    rollout_id: str,
    *,
    ttl_s: float = LEASE_S,
    store=None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = print,
    thread: bool = True,
  ):
    self.path = files.join(directory, rollout_id + LEASE_SUFFIX)
    self.rollout_id, self.ttl_s = rollout_id, ttl_s
    self._store = store or _Objects()
    self._clock, self._sleep, self._log = clock, sleep, log
    self.token = uuid.uuid4().hex
    self.note: str | None = None
    self.lost: str | None = None
    self._holder = dict(_whoami(), token=self.token, beat=0)
    self._acquire()
    self._renewed = clock()
    self._stop = threading.Event()
    self._thread = None
    if thread:
      # The thread holds the lease weakly: a lease dropped unreleased stops
      # being renewed (and goes stale) instead of living on in its thread.
      self._thread = threading.Thread(
        target=_renew_while_held,
        name="rollout-lease",
        args=(weakref.ref(self), self._stop, ttl_s / 3),
        daemon=True,
      )
      self._thread.start()

  def _record(self) -> bytes:
    return json.dumps(self._holder).encode()

  def _acquire(self) -> None:
    while True:
      raw = self._store.read(self.path)
      if raw is None:
        if self._store.create(self.path, self._record()):
          return
        continue  # another process created it in between: look at theirs
      holder = _parse_holder(raw)
      verdict = "dead" if _dead_here(holder) else self._watch(raw, holder)
      if verdict == "live":
        raise RolloutIdInUse(_in_use(self.rollout_id, holder, self.path))
      if verdict == "dead" and self._store.read(self.path) == raw:
        self._store.delete(self.path)

  def _watch(self, raw: bytes, holder: dict) -> str:
    """ "live" if the lease changes within ttl_s, "gone" if it goes, else "dead"."""
    self._log(
      f"[fleet] {self.path} is held by pid {holder.get('pid', '?')} on "
      f"{holder.get('host', '?')}: waiting up to {self.ttl_s:.0f} s for it to be renewed"
    )
    start = self._clock()
    while self._clock() - start < self.ttl_s:
      self._sleep(self.ttl_s / 12)
      now = self._store.read(self.path)
      if now is None:
        return "gone"
      if now != raw:
        return "live"
    return "dead"

  def renew(self) -> None:
    """Advances the beat, or finds the lease lost."""
    if self.lost is not None:
      return
    try:
      holder = _parse_holder(self._store.read(self.path))
      if holder.get("token") != self.token:
        self.lost = (
          f"rollout id {self.rollout_id!r}: the lease {self.path} was taken over "
          f"by pid {holder.get('pid', '?')} on {holder.get('host', '?')}; this "
          "process stopped writing"
        )
        return
      self._holder["beat"] += 1
      self._store.write(self.path, self._record())
      self._renewed = self._clock()
    except Exception as e:  # noqa: BLE001  # the store's errors: retried
      if self._clock() - self._renewed > self.ttl_s * 2 / 3:
        self.lost = (
          f"rollout id {self.rollout_id!r}: the lease {self.path} could not be "
          f"renewed for {self._clock() - self._renewed:.0f} s ({e!r:.200}); "
          "another process may hold it now"
        )

  def check(self) -> None:
    """Raises RolloutIdInUse if the lease was lost."""
    if self.lost is not None:
      raise RolloutIdInUse(self.lost)

  def release(self) -> None:
    """Stops renewing and removes the lease if it is still this process's."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self.lost is None:
      try:
        if _parse_holder(self._store.read(self.path)).get("token") == self.token:
          self._store.delete(self.path)
      except OSError:
        pass  # it goes stale: the next holder waits ttl_s
      self.lost = f"rollout id {self.rollout_id!r}: the lease {self.path} was released"


def _renew_while_held(ref: weakref.ref, stop: threading.Event, interval: float) -> None:
  while not stop.wait(interval):
    lease = ref()
    if lease is None or lease.lost is not None:
      return
    lease.renew()
    del lease


def lock_rollout(root: str, rollout_id: str, log: Callable[[str], None] = print):
  """The lock (POSIX root) or lease (object store) of `rollout_id` under
  `root`, held by this process; RolloutIdInUse if another process holds it."""
  d = rollouts_dir(root)
  files.makedirs(d)
  if files.is_url(d):
    return RolloutLease(d, rollout_id, log=log)
  return RolloutLock(d, rollout_id)


# --- trajectories: rollouts -> trainer -----------------------------------------------


class ShardWriter:
  """A rollout's side: rotating atomic shards `<rollout_id>-<seq>.array_record`.

  `write` is called from the driver thread, `rotate_if_older` and `close`
  from the process's main loop; a lock orders them. A shard is opened with
  its first trajectory (no empty shards) and closed by count or age.

  `counters()`, if given (or set as `counters` before the first write),
  returns the driver's `SHARD_COUNTERS` (name -> Counter, cumulative,
  possibly growing in another thread); each shard's stats file holds what
  they grew by since the previous shard closed.

  One process writes an id: the writer holds its lock (`lock_rollout`)
  from the start, before it clears a dead predecessor's temporaries, until
  `close`; a second writer of a live id gets RolloutIdInUse. Sequence
  numbers continue after the trainer's watermark for the id, at the first
  that no shard on disk has, and a name some other file took meanwhile is
  passed over (`names_taken`), never overwritten: a stray file with a high
  number neither moves this writer's sequence nor hides its shards.
  """

  def __init__(
    self,
    root: str,
    rollout_id: str,
    max_trajectories: int,
    max_seconds: float,
    counters: Callable[[], dict] | None = None,
    log: Callable[[str], None] = print,
  ):
    if not ROLLOUT_ID.match(rollout_id):
      raise ValueError(f"rollout_id {rollout_id!r}: use letters, digits and _ only")
    self.dir = trajectories_dir(root)
    self.lock = lock_rollout(root, rollout_id, log)
    files.makedirs(self.dir)  # the trainer and tools list it before the first shard
    self.rollout_id = rollout_id
    self.max_trajectories, self.max_seconds = max_trajectories, max_seconds
    own = set()
    try:
      names = set(files.listdir(self.dir))
    except FileNotFoundError:
      names = set()
    for name in names:
      parsed = parse_shard_name(name)
      if parsed and parsed[0] == rollout_id:
        own.add(parsed[1])
      elif name.startswith(f"{rollout_id}-") and (
        files.TMP_MARK in name
        or (name.endswith(STATS_SUFFIX) and name[: -len(STATS_SUFFIX)] not in names)
      ):
        # The open shard (or the stats written just before its rename) of a
        # killed predecessor: never renamed, never read.
        files.remove(files.join(self.dir, name))
    seq = read_consumed(root).get(rollout_id, -1) + 1
    while seq in own:
      seq += 1
    self.first_seq = seq  # this process's first shard
    self.last_closed = seq - 1  # seq of the newest renamed shard
    self.names_taken = 0  # sequence numbers passed over: another file had the name
    self.trajectories = 0
    self._closed = False
    self._writer: store.TrajectoryWriter | None = None
    self._path = ""
    self._opened = 0.0
    self._lock = threading.Lock()
    self.counters = counters
    self._counted: dict[str, dict] = {}  # the counters when the last shard closed

  def write(self, t: Trajectory) -> None:
    with self._lock:
      if self._closed:
        raise ValueError(f"the ShardWriter of {self.rollout_id!r} is closed")
      if self._writer is None:
        self._path = files.join(self.dir, shard_name(self.rollout_id, self.last_closed + 1))
        self._writer = store.TrajectoryWriter(self._path)
        self._opened = time.time()
      self._writer.write(t)
      self.trajectories += 1
      if self._writer.count >= self.max_trajectories:
        self._close_locked()

  def rotate_if_older(self, now: float | None = None) -> None:
    with self._lock:
      if self._writer is not None and (now or time.time()) - self._opened >= self.max_seconds:
        self._close_locked()

  def close(self) -> None:
    """Renames the open shard (if any): everything written is visible; then
    releases the id. Idempotent; RolloutIdInUse if the id's lease was lost
    (the open shard is dropped: another process writes the id)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      try:
        if self._writer is not None:
          self._close_locked()
      finally:
        self.lock.release()

  def _close_locked(self):
    writer, self._writer = self._writer, None
    try:
      self.lock.check()
    except RolloutIdInUse:
      writer.abort()
      raise
    seq = self.last_closed + 1
    while files.exists(files.join(self.dir, shard_name(self.rollout_id, seq))):
      seq += 1  # a file this writer did not write: its name is not ours to replace
      self.names_taken += 1
    self._path = files.join(self.dir, shard_name(self.rollout_id, seq))
    self._write_stats()  # before the rename: visible no later than the shard
    writer.close(self._path)  # fsync, then the rename that makes it visible
    self.last_closed = seq

  def _write_stats(self):
    if self.counters is None:
      return
    # dict(): one copy under the GIL of a Counter the driver thread updates.
    now = {k: dict(v) for k, v in self.counters().items() if k in SHARD_COUNTERS}
    grown = {}
    for name, counts in now.items():
      before = self._counted.get(name, {})
      delta = {k: v - before.get(k, 0) for k, v in counts.items() if v > before.get(k, 0)}
      if delta:
        grown[name] = delta
    self._counted = now
    if grown:
      files.write_json(self._path + STATS_SUFFIX, grown)


def _raise_watermark(low: int, ahead: set[int]) -> int:
  """The watermark `low` moved up through the consecutive numbers in
  `ahead`, which are taken out of it."""
  while low + 1 in ahead:
    ahead.remove(low + 1)
    low += 1
  return low


class ShardFeed:
  """The trainer's side: validated trajectories from closed shards, in
  completion order, with a checkpointable cursor (module docstring).

  `current_version` is the trainer's policy version (for `version_from_future`
  and `max_staleness`, as in the in-process queue); `identity` the trainer's
  run and published fingerprints (None: not checked), whose `state()` the
  feed's carries as "identity". `state` is what `state()` returned into a
  checkpoint. Only the shard being handed out is held in
  memory; the shards on disk are the queue.

  `share(name, compute)` is how the processes of a multi-host trainer agree
  on the next shard (`distributed.share_from_primary`: process 0 lists the
  directory, the others take its answer), so every host trains on the same
  batches; everything after the choice (reading, validation, the cursor) is
  deterministic. Default: this process decides alone.

  What was read is per rollout a watermark (every shard up to it) and the
  shards read beyond it (`ahead`), so the feed reads every shard that exists
  and was not read, whatever its number: a stray file with a high number is
  read (and its records validated) like any shard, without passing over the
  live writer's lower ones. Skipped, each counted once in `rejected` and
  logged: a file whose name is no shard's (`bad_shard_name`), a shard that
  appears below what was already read (`out_of_order_shard`), and a gap
  given up once MAX_AHEAD shards beyond it were read (`sequence_gap`).
  """

  def __init__(
    self,
    root: str,
    vocab_size: int,
    max_length: int,
    current_version: Callable[[], int],
    max_staleness: int | None = None,
    state: dict | None = None,
    poll_seconds: float = 0.5,
    log: Callable[[str], None] = print,
    share: Callable[[str, Callable[[], Any]], Any] | None = None,
    routing_shape: tuple[int, int, int] | None = None,
    identity: Published | None = None,
  ):
    self.dir = trajectories_dir(root)
    self._routing_shape = routing_shape
    self.identity = identity  # its state goes into `state()`, beside the cursor
    files.makedirs(self.dir)
    self._consumed_path = files.join(root, CONSUMED)
    self._copies = files.LocalCopies()  # shards of an object store, downloaded to read
    self._max_length = max_length
    self._vocab_size = vocab_size
    self._current_version, self._max_staleness = current_version, max_staleness
    self.poll_seconds = poll_seconds
    self._log = log
    self._share = share or (lambda name, compute: compute())
    state = state or {}
    # Per rollout: the watermark (every shard up to it consumed), and the
    # shards consumed beyond it.
    self.consumed: dict[str, int] = {k: int(v) for k, v in state.get("consumed", {}).items()}
    self._ahead: dict[str, set[int]] = {
      k: {int(s) for s in v} for k, v in state.get("ahead", {}).items() if v
    }
    self._seen: set[str] | None = None  # shard names listed or read; None before a listing
    self._skipped_names: set[str] = set()  # files that are no shard's, counted once each
    # The shard being handed out and the index of its next record.
    current = state.get("current")
    self._current: tuple[str, int] | None = (
      (current["shard"], int(current["offset"])) if current else None
    )
    self._buffer: collections.deque = collections.deque()  # (trajectory, record index)
    self._sizes: dict[str, int] = {}  # records per shard seen on disk (for depth)
    # Dropped shards and records by reason: the store's and validation's.
    self._rejected: collections.Counter = collections.Counter()
    self.last_error: str | None = None  # as TrajectoryQueue.last_error
    self._in_shard = (0, 0)  # (handed out, rejected) of the current shard
    # Counters since this feed was made (the trainer's metrics).
    self.shards_consumed = 0
    self.trajectories = 0
    self.generated_tokens = 0
    self.env_faults: collections.Counter = collections.Counter()
    # The driver's SHARD_COUNTERS, from the stats files of finished shards.
    self.tool_call_errors: collections.Counter = collections.Counter()
    self.env_events: collections.Counter = collections.Counter()
    self.last_shard_age_s = 0.0
    self.wait_s = 0.0
    files.write_json(self._consumed_path, self.consumed)  # a restarted trainer's, too

  # --- the cursor ------------------------------------------------------------

  def state(self) -> dict:
    """JSON for the checkpoint: the cursor after the last trajectory handed out."""
    current = None
    if self._current is not None:
      current = {"shard": self._current[0], "offset": self._current[1]}
    out = {"consumed": dict(self.consumed), "current": current}
    if self.identity is not None:
      out["identity"] = self.identity.state()
    if self._ahead:
      out["ahead"] = {k: sorted(v) for k, v in self._ahead.items()}
    return out

  def _is_consumed(self, rid: str, seq: int) -> bool:
    return seq <= self.consumed.get(rid, -1) or seq in self._ahead.get(rid, ())

  def _mark_consumed(self, rid: str, seq: int) -> None:
    """Adds shard `seq` of `rid` to the cursor; the watermark moves up only
    through shards read (or, past MAX_AHEAD shards read beyond it, a gap
    given up)."""
    low = self.consumed.get(rid, -1)
    ahead = self._ahead.setdefault(rid, set())
    ahead.add(seq)
    low = _raise_watermark(low, ahead)
    if len(ahead) > MAX_AHEAD:
      self._rejected["sequence_gap"] += 1
      self._log(
        f"[fleet] gave up {rid}'s shards {low + 1}..{min(ahead) - 1}: {MAX_AHEAD} "
        "later shards were read; one that appears now counts as out_of_order_shard"
      )
      low = _raise_watermark(min(ahead) - 1, ahead)
    self.consumed[rid] = low
    if not ahead:
      del self._ahead[rid]

  def _skip_name(self, name: str, reason: str, why: str) -> None:
    if name not in self._skipped_names:
      self._skipped_names.add(name)
      self._rejected[reason] += 1
      self._log(f"[fleet] skipped {name} ({reason}): {why}")

  def _known_file(self, name: str) -> bool:
    """A file a writer leaves beside its shards: a temporary or a stats file."""
    if files.TMP_MARK in name:
      return True
    return name.endswith(STATS_SUFFIX) and parse_shard_name(name[: -len(STATS_SUFFIX)]) is not None

  # --- reading ---------------------------------------------------------------

  def _pending(self) -> list[tuple[float, str]]:
    """(mtime, name) of closed shards not yet consumed, the next one first:
    each rollout's lowest unconsumed sequence number, the oldest of those
    first (completion order)."""
    lowest: dict[str, tuple[int, str]] = {}
    rest = []
    current = self._current[0] if self._current else None
    first_listing, self._seen = self._seen is None, self._seen or set()
    for name, mtime in files.scan(self.dir):
      parsed = parse_shard_name(name)
      if parsed is None:
        if not self._known_file(name):
          self._skip_name(
            name, "bad_shard_name", f"not <rollout id>-<8 digits>{SHARD_SUFFIX} nor a writer's file"
          )
        continue
      rid, seq = parsed
      new = name not in self._seen
      self._seen.add(name)
      if name == current:
        continue
      if self._is_consumed(rid, seq):
        if new and not first_listing:
          self._skip_name(
            name,
            "out_of_order_shard",
            f"appeared after {rid}'s shards up to {self.consumed.get(rid, -1)} were read",
          )
        continue
      rest.append((mtime, name))
      if rid not in lowest or seq < lowest[rid][0]:
        lowest[rid] = (seq, name)
    heads = {name for _, name in lowest.values()}
    return sorted(x for x in rest if x[1] in heads) + sorted(x for x in rest if x[1] not in heads)

  def _next_pending(self) -> str | None:
    pending = self._pending()
    return pending[0][1] if pending else None

  def _open(self, name: str) -> grain.sources.ArrayRecordDataSource | None:
    try:
      local = self._copies.get(files.join(self.dir, name))
      source = grain.sources.ArrayRecordDataSource([local])
      self._sizes[name] = len(source)
      return source
    except Exception:  # noqa: BLE001  # truncated or not an ArrayRecord file
      self._rejected["corrupt_shard"] += 1
      self._sizes[name] = 0
      return None

  def _load(self, name: str, offset: int) -> None:
    """Reads records [offset, end) of shard `name` into the buffer, validated."""
    rid, seq = parse_shard_name(name)
    if seq > self.consumed.get(rid, -1) + 1 and offset == 0:
      self._log(
        f"[fleet] reading {name} ahead of {rid}'s sequence (next "
        f"{shard_name(rid, self.consumed.get(rid, -1) + 1)}); the lower ones are "
        "still read when they appear"
      )
    if self._seen is not None:
      self._seen.add(name)  # chosen by process 0 (`share`) or a checkpoint
    source = self._open(name)
    n = self._sizes[name]
    for i in range(offset, n):
      try:
        data = source[i]
      except Exception:  # noqa: BLE001  # a chunk failing its checksum
        self._rejected["corrupt_record"] += 1
        continue
      try:
        t = store.deserialize(
          data,
          self._max_length,
          max(
            store.DEFAULT_ROUTING_CHOICES,
            self._routing_shape[0] * self._routing_shape[1] if self._routing_shape else 0,
          ),
        )
      except store.CorruptRecordError as e:
        self._rejected[e.reason] += 1
        continue
      except Exception:  # noqa: BLE001
        self._rejected["deserialize_error"] += 1
        continue
      canon, reason, error = ingestion.check(
        t,
        self._vocab_size,
        self._max_length,
        self._current_version(),
        self._max_staleness,
        self._routing_shape,
        self.identity,
      )
      if reason is not None:
        self._rejected[reason] += 1
        self.last_error = error or self.last_error
        continue
      self._buffer.append((canon, i))
    self._in_shard = (0, n - offset - len(self._buffer))
    self._current = (name, offset)
    try:
      self.last_shard_age_s = time.time() - files.mtime(files.join(self.dir, name))
    except OSError:
      pass

  def _read_stats(self, name: str) -> None:
    """Adds shard `name`'s stats file (if it has one) to the SHARD_COUNTERS."""
    path = files.join(self.dir, name + STATS_SUFFIX)
    try:
      raw = files.read_bytes(path, _STATS_MAX_BYTES + 1)
    except FileNotFoundError:
      return  # nothing grew while the shard was open
    except OSError as e:
      self._log(f"[fleet] ignored the counters of {name}: {e}")
      return
    try:
      if len(raw) > _STATS_MAX_BYTES:
        raise ValueError(f"more than {_STATS_MAX_BYTES} bytes")
      stats = json.loads(raw)
      if not isinstance(stats, dict) or set(stats) - set(SHARD_COUNTERS):
        raise ValueError(f"not an object of {SHARD_COUNTERS}")
      for counts in stats.values():
        if not (
          isinstance(counts, dict)
          and len(counts) <= _STATS_MAX_NAMES
          and all(0 < len(k) <= 64 and type(v) is int and v > 0 for k, v in counts.items())
        ):
          raise ValueError("counts must be {name: positive int}")
    except (ValueError, RecursionError) as e:  # json's errors included
      self._log(f"[fleet] ignored the counters of {name}: {str(e)[:200]}")
      return
    for counter, counts in stats.items():
      getattr(self, counter).update(counts)

  def _finish_shard(self) -> None:
    name = self._current[0]
    self._read_stats(name)
    rid, seq = parse_shard_name(name)
    self._mark_consumed(rid, seq)
    self._current = None
    self._sizes.pop(name, None)
    self._copies.drop(files.join(self.dir, name))
    self.shards_consumed += 1
    files.write_json(self._consumed_path, self.consumed)
    self._log(
      f"[fleet] consumed {name}: {self._in_shard[0]} trajectories, {self._in_shard[1]} rejected"
    )

  def _next_shard(self) -> bool:
    """Loads the next shard with records left; False if none is on disk."""
    if self._current is not None:  # resuming the partial shard of a checkpoint
      self._load(*self._current)
    else:
      name = self._share("fleet_next_shard", self._next_pending)
      if name is None:
        return False
      self._load(name, 0)
    if not self._buffer:  # nothing valid left in it
      self._finish_shard()
    return True

  def take(self, n: int, on_wait: Callable[[float], None] | None = None) -> list[Trajectory]:
    """The next `n` valid trajectories, waiting for shards as long as it takes
    (and saying so every `REPORT_WAIT_S`).

    `on_wait(seconds_waited)` is called at every empty poll (a place for the
    caller's liveness checks; it may raise to give up).
    """
    out = []
    started = None
    reported = 0
    while len(out) < n:
      if not self._buffer and not self._next_shard():
        started = started or time.time()
        waited = time.time() - started
        if waited >= (reported + 1) * REPORT_WAIT_S:
          reported = int(waited // REPORT_WAIT_S)
          self._log(
            f"[fleet] no new shard for {waited:.0f} s: are rollout processes "
            f"(launch/rollout.py) writing to {self.dir}?"
          )
        if on_wait is not None:
          on_wait(waited)
        time.sleep(self.poll_seconds)
        continue
      if not self._buffer:
        continue
      t, index = self._buffer.popleft()
      out.append(t)
      self._current = (self._current[0], index + 1)
      self._in_shard = (self._in_shard[0] + 1, self._in_shard[1])
      self.trajectories += 1
      self.generated_tokens += int(t.action_mask.sum())
      if t.finish_reason in ENV_FAULTS:
        self.env_faults[t.finish_reason] += 1
      if not self._buffer:
        self._finish_shard()
    if started is not None:
      self.wait_s += time.time() - started
    return out

  # --- what the trainer reports ------------------------------------------------

  def qsize(self) -> int:
    """Trajectories not yet handed out: the buffer plus records of closed
    shards on disk (counted once per shard, when first seen)."""
    total = len(self._buffer)
    for _, name in self._pending():
      if name not in self._sizes:
        self._open(name)
      total += self._sizes[name]
    return total

  @property
  def rejected(self) -> collections.Counter:
    """Dropped shards and records by reason: the store's and validation's."""
    return +self._rejected
