"""The rollout fleet's transport: trajectories and weights over shared storage.

In `rl.mode = "fleet"` rollout runs in its own processes (launch/rollout.py
around `fleet_worker.run_rollout_worker`, which uses the pieces here), so
generation never waits for training. Nothing travels over a hand-written
RPC layer: trajectories move as ArrayRecord shards of the trajectory store,
weights as versioned orbax checkpoints (on the default direct path,
`fleet.weights_path = "direct"`, the bytes of most versions go over the
network instead and these checkpoints are its bootstrap and fallback:
sao_jax/data/weight_transfer.py), both under one shared directory
(`fleet.root`, default `<workdir>/fleet`):

    <root>/weights/<version>/         orbax: the policy params after <version>
                                      actor updates, and a JSON meta (version,
                                      publish time)
    <root>/trajectories/<rollout_id>-<seq>.array_record
                                      one closed shard of one rollout process
    <root>/trajectories/<rollout_id>-<seq>.array_record.stats.json
                                      its driver's counters (malformed tool
                                      calls, environment events) since the
                                      previous shard, if any
    <root>/consumed.json              the trainer's cursor: per rollout, the
                                      highest shard it has fully read
    <root>/DONE                       the trainer finished RL: rollouts exit

Visibility is by rename only, so a reader never sees half of anything:

  * a shard is written under `<name>.tmp-<pid>` and renamed when it holds
    `fleet.shard_trajectories` trajectories or is `fleet.shard_seconds` old
    (`ShardWriter`, on `store.TrajectoryWriter`). A SIGKILLed rollout loses
    its open shard only; a restarted one removes its own dead temporaries
    and continues its sequence numbers after the last renamed shard.
  * orbax saves a version under a temporary directory and renames it when
    complete; `committed_checkpoints` lists only complete versions. The
    trainer keeps the newest `fleet.keep_versions`; a rollout whose restore
    loses the race with pruning keeps its params and takes the newest
    version at its next poll.

Trainer side, `ShardFeed` hands out trajectories in completion order: each
rollout's shards in sequence order, and across rollouts the shard renamed
first. Shards are read through grain's ArrayRecordDataSource and every record
is deserialised with the store's hostile-input checks and validated by the
in-process queue's validation, `ingestion.check` (staleness included);
bad shards and records are counted by reason, never trained on, never a
crash. Counts that are no trajectory's (the driver's `tool_call_errors` and
`env_events`, `SHARD_COUNTERS`) travel beside the shard: its writer records
what they grew by while the shard was open in a `.stats.json` written before
the shard's rename, and the feed adds them when it finishes the shard; a
stats file that is not what a writer writes is logged and ignored.

What was consumed is a cursor that goes into the trainer's checkpoint: per
rollout, the highest fully consumed sequence number, and (at most one)
partially consumed shard with the index of its next record. A restarted
trainer resumes exactly at the cursor of its checkpoint: trajectories trained
after that checkpoint are trained again (their updates were lost with the
process), none is skipped, none is trained twice into the same state.

Rollout side, `WeightFollower` polls for the newest complete version and
restores it into the engine's abstract params. "Newest" may be older than
what it holds: a trainer killed after publishing versions v+1.. resumes from
its checkpoint at v, removes those versions (a future it discarded) and
republishes; the rollouts follow it back.

The feed's watermarks (`consumed.json`, rewritten atomically whenever a
shard is finished) also give backpressure without a channel back: a rollout
holding `fleet.max_unread_shards` closed shards the trainer has not read
stops emitting (its driver blocks, like the in-process queue's `put`) until
the trainer reads on. It cannot deadlock: the trainer only waits when it has
read every closed shard, and then no rollout has any unread. (Progress is
not taken from the weight versions: a trainer short of a batch publishes
nothing, and would wait on rollouts that wait on it.)

Polling is deliberate: shared filesystems and object stores (GCS) have no
portable change notification, and the poll interval (`fleet.poll_seconds`)
is small beside a train step. The root is a POSIX directory every host
mounts (local disk, NFS / Filestore, a gcsfuse mount) or an object-store URL
(gs://bucket/run/fleet), through sao_jax/data/files.py: there a shard is written
locally and uploaded on close (an object appears whole or not at all, so
its name is its own marker, and no temporary is ever seen under the root),
a version is complete when orbax has written its commit file, and the
trainer downloads a shard before reading it.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
from typing import Any, Callable

import grain
import jax

from sao_jax.data import files
from sao_jax.data.checkpoint import Checkpointer, committed_checkpoints
from sao_jax.data import ingestion, store
from sao_jax.data.trajectory import ENV_FAULTS, Trajectory

WEIGHTS = "weights"
TRAJECTORIES = "trajectories"
CONSUMED = "consumed.json"
DONE = "DONE"
SHARD_SUFFIX = ".array_record"
_SHARD_NAME = re.compile(r"^([A-Za-z0-9_]+)-(\d{8})" + re.escape(SHARD_SUFFIX) + r"$")
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9_]+$")
# The driver's counters (DriverStats fields) a shard carries in its stats file.
SHARD_COUNTERS = ("tool_call_errors", "env_events")
STATS_SUFFIX = ".stats.json"
# Bounds on a stats file read back: it comes from another process, like the shard.
_STATS_MAX_BYTES = 1 << 16
_STATS_MAX_NAMES = 256
# Seconds without a new shard between the feed's "still waiting" lines.
REPORT_WAIT_S = 60.0


def root_of(config, workdir: str) -> str:
  """The fleet's shared directory: `fleet.root`, or `<workdir>/fleet`."""
  return files.absolute(config.fleet.root or files.join(workdir, "fleet"))


def weights_dir(root: str) -> str:
  return files.join(root, WEIGHTS)


def trajectories_dir(root: str) -> str:
  return files.join(root, TRAJECTORIES)


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
    self._ckpt.save(version, params, dict(meta or {}, version=int(version),
                                          published=time.time()), force=True)
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
      lambda a: a if getattr(a, "sharding", None) is not None
      else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)


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
    held, else None (`final`, the trainer is done, changes nothing here). Differs: newer, older after a trainer restart, or the
    same number published again by a restarted trainer (whose version v is
    not the discarded run's v), told apart by the publish time."""
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
    except Exception:  # pylint: disable=broad-except
      # Pruned (or removed as a discarded future) while we read it: the
      # next poll takes whatever is newest then.
      self.failed_restores += 1
      return None

  def close(self) -> None:
    if self._ckpt is not None:
      self._ckpt.close()


# --- trajectories: rollouts -> trainer -----------------------------------------------


class ShardWriter:
  """A rollout's side: rotating atomic shards `<rollout_id>-<seq>.array_record`.

  `write` is called from the driver thread, `rotate_if_older` and `close`
  from the process's main loop; a lock orders them. A shard is opened with
  its first trajectory (no empty shards) and closed by count or age.

  `counters()`, if given, returns the driver's `SHARD_COUNTERS` (name ->
  Counter, cumulative, possibly growing in another thread); each shard's
  stats file holds what they grew by since the previous shard closed.
  """

  def __init__(self, root: str, rollout_id: str, max_trajectories: int, max_seconds: float,
               counters: Callable[[], dict] | None = None):
    if not ROLLOUT_ID.match(rollout_id):
      raise ValueError(f"rollout_id {rollout_id!r}: use letters, digits and _ only")
    self.dir = trajectories_dir(root)
    files.makedirs(self.dir)
    self.rollout_id = rollout_id
    self.max_trajectories, self.max_seconds = max_trajectories, max_seconds
    own = []
    try:
      names = set(files.listdir(self.dir))
    except FileNotFoundError:
      names = set()
    for name in names:
      parsed = parse_shard_name(name)
      if parsed and parsed[0] == rollout_id:
        own.append(parsed[1])
      elif name.startswith(f"{rollout_id}-") and (
          files.TMP_MARK in name or (name.endswith(STATS_SUFFIX)
                                     and name[:-len(STATS_SUFFIX)] not in names)):
        # The open shard (or the stats written just before its rename) of a
        # killed predecessor: never renamed, never read.
        files.remove(files.join(self.dir, name))
    self.last_closed = max(own, default=-1)  # seq of the newest renamed shard
    self.first_seq = self.last_closed + 1  # this process's first shard
    self.trajectories = 0
    self._writer: store.TrajectoryWriter | None = None
    self._path = ""
    self._opened = 0.0
    self._lock = threading.Lock()
    self._counters = counters
    self._counted: dict[str, dict] = {}  # the counters when the last shard closed

  def write(self, t: Trajectory) -> None:
    with self._lock:
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
    """Renames the open shard (if any): everything written is visible."""
    with self._lock:
      if self._writer is not None:
        self._close_locked()

  def _close_locked(self):
    writer, self._writer = self._writer, None
    self._write_stats()  # before the rename: visible no later than the shard
    writer.close()  # fsync, then the rename that makes it visible
    self.last_closed += 1

  def _write_stats(self):
    if self._counters is None:
      return
    # dict(): one copy under the GIL of a Counter the driver thread updates.
    now = {k: dict(v) for k, v in self._counters().items() if k in SHARD_COUNTERS}
    grown = {}
    for name, counts in now.items():
      before = self._counted.get(name, {})
      delta = {k: v - before.get(k, 0) for k, v in counts.items() if v > before.get(k, 0)}
      if delta:
        grown[name] = delta
    self._counted = now
    if grown:
      files.write_json(self._path + STATS_SUFFIX, grown)


class ShardFeed:
  """The trainer's side: validated trajectories from closed shards, in
  completion order, with a checkpointable cursor (module docstring).

  `current_version` is the trainer's policy version (for `version_from_future`
  and `max_staleness`, as in the in-process queue). `state` is what `state()`
  returned into a checkpoint. Only the shard being handed out is held in
  memory; the shards on disk are the queue.

  `share(name, compute)` is how the processes of a multi-host trainer agree
  on the next shard (`distributed.share_from_primary`: process 0 lists the
  directory, the others take its answer), so every host trains on the same
  batches; everything after the choice (reading, validation, the cursor) is
  deterministic. Default: this process decides alone.
  """

  def __init__(self, root: str, vocab_size: int, max_length: int,
               current_version: Callable[[], int], max_staleness: int | None = None,
               state: dict | None = None, poll_seconds: float = 0.5,
               log: Callable[[str], None] = print,
               share: Callable[[str, Callable[[], Any]], Any] | None = None,
               routing_shape: tuple[int, int, int] | None = None):
    self.dir = trajectories_dir(root)
    self._routing_shape = routing_shape
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
    # Per rollout: the highest sequence number fully consumed.
    self.consumed: dict[str, int] = {k: int(v) for k, v in state.get("consumed", {}).items()}
    # The shard being handed out and the index of its next record.
    current = state.get("current")
    self._current: tuple[str, int] | None = (
        (current["shard"], int(current["offset"])) if current else None)
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
    return {"consumed": dict(self.consumed), "current": current}

  # --- reading ---------------------------------------------------------------

  def _pending(self) -> list[tuple[float, str]]:
    """(mtime, name) of closed shards not yet consumed, the next one first:
    each rollout's lowest unconsumed sequence number, the oldest of those
    first (completion order)."""
    lowest: dict[str, tuple[int, str]] = {}
    rest = []
    current = self._current[0] if self._current else None
    for name, mtime in files.scan(self.dir):
      parsed = parse_shard_name(name)
      if parsed is None or name == current:
        continue
      rid, seq = parsed
      if seq <= self.consumed.get(rid, -1):
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
    except Exception:  # pylint: disable=broad-except  # truncated or not an ArrayRecord file
      self._rejected["corrupt_shard"] += 1
      self._sizes[name] = 0
      return None

  def _load(self, name: str, offset: int) -> None:
    """Reads records [offset, end) of shard `name` into the buffer, validated."""
    source = self._open(name)
    n = self._sizes[name]
    for i in range(offset, n):
      try:
        data = source[i]
      except Exception:  # pylint: disable=broad-except  # a chunk failing its checksum
        self._rejected["corrupt_record"] += 1
        continue
      try:
        t = store.deserialize(data, self._max_length, max(
            store.DEFAULT_ROUTING_CHOICES,
            self._routing_shape[0] * self._routing_shape[1] if self._routing_shape else 0))
      except store.CorruptRecordError as e:
        self._rejected[e.reason] += 1
        continue
      except Exception:  # pylint: disable=broad-except
        self._rejected["deserialize_error"] += 1
        continue
      canon, reason, error = ingestion.check(t, self._vocab_size, self._max_length,
                                             self._current_version(), self._max_staleness,
                                             self._routing_shape)
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
        if not (isinstance(counts, dict) and len(counts) <= _STATS_MAX_NAMES and all(
            0 < len(k) <= 64 and type(v) is int and v > 0 for k, v in counts.items())):
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
    self.consumed[rid] = max(seq, self.consumed.get(rid, -1))
    self._current = None
    self._sizes.pop(name, None)
    self._copies.drop(files.join(self.dir, name))
    self.shards_consumed += 1
    files.write_json(self._consumed_path, self.consumed)
    self._log(f"[fleet] consumed {name}: {self._in_shard[0]} trajectories, "
              f"{self._in_shard[1]} rejected")

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
          self._log(f"[fleet] no new shard for {waited:.0f} s: are rollout processes "
                    f"(launch/rollout.py) writing to {self.dir}?")
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
