"""Weights at network speed: the trainer's shards straight into each rollout's devices.

The fleet's direct weight path (`fleet.weights_path = "direct"`, the
default where `jax.experimental.transfer` works). No file holds the bytes:

  * `WeightServer` (trainer side, one per trainer process) offers, at each
    publish, the process's share of the serving params' distinct shards
    (cast to the engines' dtype) through JAX's transfer server, and writes
    a manifest `<root>/transfer/v<version>.p<process>.json` (atomic rename)
    saying where it listens and which pieces (leaf, index range) it holds.
  * `NetFollower` (rollout side) pulls the newest version whose manifests
    from every trainer process are present, piece by piece, onto the
    rollout devices that need them (`route`), after registering a request
    under `<root>/transfer/requests/`. A version is used whole or not at
    all: a pull that fails or outlives `fleet.pull_timeout_s` is discarded
    and counted by reason, and the held version stays.
  * `Follower` joins this to the checkpoint path (`fleet.WeightFollower`):
    every `fleet.checkpoint_every`-th version (and the first and last) is
    also an orbax checkpoint, the bootstrap and the fallback. A version's
    identity is (version, the trainer run's nonce) on both paths; manifests
    and checkpoints carry the run id and the params fingerprint
    (sao_jax/data/identity.py).

With `fleet.delta_versions` (sao_jax/transport/weight_delta.py) a rollout
holding exactly the version before pulls only its delta, checked by a
checksum per piece; a mismatch pulls the version whole.

`plan` (which bytes move) is a pure function of the trainer's and the
engine's layouts, shared by the rollout and launch/compile.py's "transfer"
entry; each distinct shard crosses the network once per rollout host.

Safety: the transfer server has no authentication; bind it to the
internal interface (`fleet.transfer_host`). Every server here is started
with `fleet.transfer_sockets` >= 1 bulk transport addresses (one without
them aborts its process on a remote pull).

How a pull proceeds, what fails and why, and the cost of delta versions:
docs/design/weight_sync.md; figures:
benchmarks/RESULTS.md#fleet-and-weight-sync.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import itertools
import json
import math
import os
import re
import socket
import threading
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.data import files, identity
from sao_jax.transport import weight_delta

TRANSFER = "transfer"
REQUESTS = "requests"
_MANIFEST = re.compile(r"^v(\d{10})\.p(\d{4})\.json$")
_REQUEST = re.compile(r"^([A-Za-z0-9_]+)-(\d{1,20})\.json$")
# Bounds on a manifest read back: it comes from another process.
_MANIFEST_MAX_BYTES = 64 << 20
# How far a manifest's publish time may lie ahead of a rollout's clock (the
# hosts' clocks differ a little); one further ahead is ignored (newest_offer).
CLOCK_SKEW_S = 60.0
# Snapshots a trainer process keeps serving: the newest and the one before
# (a rollout may have asked for it just before the newest appeared).
KEEP_SNAPSHOTS = 2


def transfer_dir(root: str) -> str:
  return files.join(root, TRANSFER)


def requests_dir(root: str) -> str:
  return files.join(transfer_dir(root), REQUESTS)


def manifest_name(version: int, process: int) -> str:
  return f"v{version:010d}.p{process:04d}.json"


def unavailable() -> str | None:
  """Why the direct path cannot run in this process (None: it can)."""
  try:
    from jax.experimental import transfer
  except Exception as e:  # noqa: BLE001
    return f"jax.experimental.transfer does not import: {e!r}"[:300]
  if not hasattr(transfer, "start_transfer_server"):
    return "jax.experimental.transfer has no start_transfer_server"
  return None


def host_address(host: str) -> str:
  """The address to bind and advertise: `host`, or this host name's address."""
  return host or socket.gethostbyname(socket.gethostname())


def start_server(host: str, sockets: int):
  """A transfer server on `host` (an IP address) with `sockets` bulk
  sockets; never with none (a remote pull would abort this process)."""
  from jax.experimental import transfer

  if sockets < 1:
    raise ValueError(f"a transfer server needs >= 1 bulk socket, not {sockets}")
  host = host_address(host)
  return transfer.start_transfer_server(
    jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"] * sockets
  )


# --- the plan: which source shard feeds which destination buffer ----------------------


Index = tuple[tuple[int, int], ...]  # [start, stop) per dimension


@dataclasses.dataclass(frozen=True)
class Piece:
  """One distinct shard of one leaf of the trainer's layout, as served."""

  leaf: int
  index: Index
  process: int  # the trainer process that serves it
  device: int  # the id of the trainer device whose copy is served
  nbytes: int

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(b - a for a, b in self.index)


def _index(slices, shape) -> Index:
  return tuple(
    (s.start or 0, n if s.stop is None else s.stop)
    for s, n in zip(tuple(slices) + (slice(None),) * (len(shape) - len(slices)), shape)
  )


def _volume(index: Index) -> int:
  return math.prod(b - a for a, b in index)


def _overlap(a: Index, b: Index) -> Index | None:
  out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
  return out if all(lo < hi for lo, hi in out) or not out else None


def source_pieces(leaves: Iterable[tuple[tuple[int, ...], Any, Any]]) -> list[Piece]:
  """The distinct shards of (shape, dtype, sharding) leaves, each once.

  A shard held by several devices (replicas) is served by one of them: on
  the holding process that serves the fewest bytes so far, its lowest
  device id. Depends only on the global layout, so every trainer process
  computes the same answer.
  """
  served: collections.Counter = collections.Counter()
  out = []
  for leaf, (shape, dtype, sharding) in enumerate(leaves):
    itemsize = jnp.dtype(dtype).itemsize
    holders: dict[Index, list] = {}
    for device, slices in sharding.devices_indices_map(tuple(shape)).items():
      holders.setdefault(_index(slices, shape), []).append(device)
    for index in sorted(holders):
      devices = holders[index]
      process = min({d.process_index for d in devices}, key=lambda p: (served[p], p))
      device = min(d.id for d in devices if d.process_index == process)
      nbytes = _volume(index) * itemsize
      served[process] += nbytes
      out.append(Piece(leaf, index, process, device, nbytes))
  return out


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where each piece lands in one rollout engine, and the bytes it moves.

  `routes[i]` is the destination device id piece `i` is pulled onto (one
  whose shard contains it, or at least overlaps it); `fills[device]` lists,
  for each destination shard, the pieces that make it up: (piece, the
  overlap's index in global coordinates).
  """

  pieces: tuple[Piece, ...]
  routes: tuple[int, ...]
  fills: dict  # (leaf, device id) -> [(piece number, overlap Index)]
  dest_index: dict  # (leaf, device id) -> the destination shard's Index

  def bytes_per_rollout_host(self, process_of: Callable[[int], int]) -> dict[int, int]:
    """Bytes pulled over the network per rollout host (process)."""
    out: collections.Counter = collections.Counter()
    for piece, dev in zip(self.pieces, self.routes):
      out[process_of(dev)] += piece.nbytes
    return dict(out)

  def bytes_per_trainer_host(self) -> dict[int, int]:
    """Bytes each trainer process serves to this engine."""
    out: collections.Counter = collections.Counter()
    for piece in self.pieces:
      out[piece.process] += piece.nbytes
    return dict(out)

  @property
  def local_copy_bytes(self) -> int:
    """Bytes copied between the engine's own devices after the pull (the
    pieces that also feed shards on devices other than the one they landed on,
    and partial overlaps)."""
    total = 0
    for (_, dev), fills in self.fills.items():
      for n, overlap in fills:
        if self.routes[n] != dev or overlap != self.pieces[n].index:
          total += _volume(overlap) * (
            self.pieces[n].nbytes // max(_volume(self.pieces[n].index), 1)
          )
    return total


def plan(pieces: list[Piece], dest: Iterable[tuple[tuple[int, ...], Any]]) -> Plan:
  """Routes `pieces` (source_pieces) into the destination layout: per leaf
  (shape, the engine's sharding). Pure: no device is touched.

  Each piece is pulled once, onto a destination device whose shard contains
  it (the one with the fewest bytes routed so far), else onto one it
  overlaps; a shard that needs pieces that landed elsewhere gets them by a
  local copy (ICI on a TPU host).
  """
  dest_index: dict = {}
  for leaf, (shape, sharding) in enumerate(dest):
    for device, slices in sharding.devices_indices_map(tuple(shape)).items():
      dest_index[(leaf, device.id)] = _index(slices, shape)
  by_leaf: dict[int, list] = collections.defaultdict(list)
  for (leaf, dev), index in dest_index.items():
    by_leaf[leaf].append((dev, index))
  routed: collections.Counter = collections.Counter()
  routes, fills = [], collections.defaultdict(list)
  for n, piece in enumerate(pieces):
    if piece.leaf not in by_leaf:
      raise ValueError(f"piece of leaf {piece.leaf}: the destination has no such leaf")
    overlapping = [
      (dev, index, _overlap(piece.index, index)) for dev, index in sorted(by_leaf[piece.leaf])
    ]
    overlapping = [x for x in overlapping if x[2] is not None]
    if not overlapping:
      raise ValueError(f"piece {piece.index} of leaf {piece.leaf} lies outside the array")
    containing = [x for x in overlapping if x[2] == piece.index]
    dev = min(containing or overlapping, key=lambda x: (routed[x[0]], x[0]))[0]
    routed[dev] += piece.nbytes
    routes.append(dev)
    for d, _, overlap in overlapping:
      fills[(piece.leaf, d)].append((n, overlap))
  return Plan(tuple(pieces), tuple(routes), dict(fills), dest_index)


def check_cover(pieces: list[Piece], shapes: list[tuple[int, ...]]) -> str | None:
  """Why `pieces` do not tile each leaf exactly once (None: they do).

  Linear in the pieces for a cover that is right (a manifest has thousands):
  inside the shape, volumes adding up to the shape's, and signed corners
  that cancel to the shape's own (`_corner_sums`) mean every element is
  covered exactly once. Only a cover that fails the last test is swept for
  the overlapping pair to name (`_first_overlap`).
  """
  per_leaf = collections.defaultdict(list)
  for p in pieces:
    if not 0 <= p.leaf < len(shapes):
      return f"piece of leaf {p.leaf}: there are {len(shapes)} leaves"
    per_leaf[p.leaf].append(p.index)
  for leaf, shape in enumerate(shapes):
    indices = per_leaf.get(leaf, [])
    if (
      any(
        len(ix) != len(shape) or any(not 0 <= a < b <= n for (a, b), n in zip(ix, shape))
        for ix in indices
      )
      and shape
    ):
      return f"leaf {leaf}: a piece outside its shape {shape}"
    if sum(_volume(ix) for ix in indices) != math.prod(shape) or (not shape and len(indices) != 1):
      return f"leaf {leaf}: pieces do not add up to its shape {shape}"
    if shape and _corner_sums(indices) != _corner_sums([tuple((0, n) for n in shape)]):
      a, b = _first_overlap(indices)
      return f"leaf {leaf}: pieces {a} and {b} overlap"
  return None


def _corner_sums(indices: list[Index]) -> dict:
  """Each box's corners, signed (-1)^(how many are its stops), summed over
  the boxes; zero sums left out.

  The sum of the boxes' indicator functions has these as its d-dimensional
  finite differences (each box's indicator is a product of steps up at its
  starts and down at its stops), and prefix sums undo differences: boxes
  whose corner sums are a shape's own sum to 1 on every element of the
  shape and 0 elsewhere, an exact tiling.
  """
  sums: collections.Counter = collections.Counter()
  for ix in indices:
    for corner in itertools.product(*(((a, 1), (b, -1)) for a, b in ix)):
      sums[tuple(c for c, _ in corner)] += math.prod(s for _, s in corner)
  return {c: s for c, s in sums.items() if s}


def _first_overlap(indices: list[Index]) -> tuple[Index, Index]:
  """The overlapping pair a scan of all pairs in order names first: the
  lowest-numbered box that overlaps another, and the lowest-numbered box it
  overlaps (a lowest one can only overlap later ones). Swept along the
  dimension with the most distinct starts: each box is compared only with
  the boxes whose ranges there are open at its start."""
  lo = np.array([[a for a, _ in ix] for ix in indices], np.int64)  # [n, rank]
  hi = np.array([[b for _, b in ix] for ix in indices], np.int64)  # [n, rank]
  dim = max(range(lo.shape[1]), key=lambda d: len(np.unique(lo[:, d])))
  involved = np.zeros(len(indices), bool)
  active = np.zeros(0, np.int64)  # boxes open along `dim` at the sweep's position
  for i in np.argsort(lo[:, dim], kind="stable"):
    active = active[hi[active, dim] > lo[i, dim]]
    hits = active[np.all((lo[active] < hi[i]) & (lo[i] < hi[active]), axis=1)]
    if hits.size:
      involved[hits] = involved[i] = True
    active = np.append(active, i)
  first = int(np.argmax(involved))
  partners = np.nonzero(np.all((lo < hi[first]) & (lo[first] < hi), axis=1))[0]
  return indices[first], indices[int(partners[partners != first].min())]


def report(src_leaves, dest_leaves, rollout_hosts: int = 1) -> dict:
  """launch/compile.py's "transfer" entry: the plan from the trainer's layout
  (shape, serving dtype, sharding per leaf) into one rollout engine's
  (shape, sharding per leaf), for `rollout_hosts` engines."""
  src_leaves = list(src_leaves)
  pieces = source_pieces(src_leaves)
  p = plan(pieces, dest_leaves)
  per_trainer = p.bytes_per_trainer_host()
  version = sum(piece.nbytes for piece in pieces)
  routed = collections.Counter(p.routes)
  # The double buffers: the trainer's served snapshot, and the rollout's
  # standby version while the held one keeps generating (per device, the
  # busiest device).
  snapshot, standby = collections.Counter(), collections.Counter()
  for shape, dtype, sharding in src_leaves:
    for device, slices in sharding.devices_indices_map(tuple(shape)).items():
      snapshot[device.id] += _volume(_index(slices, shape)) * jnp.dtype(dtype).itemsize
  itemsizes = [jnp.dtype(dtype).itemsize for _, dtype, _ in src_leaves]
  for (leaf, dev), index in p.dest_index.items():
    standby[dev] += _volume(index) * itemsizes[leaf]
  return {
    "pieces": len(pieces),
    "version_bytes": version,
    # One engine pulls the whole version once, spread over its devices.
    "bytes_per_rollout_engine": version,
    "max_bytes_per_rollout_device": max(p.bytes_per_rollout_host(lambda d: d).values(), default=0),
    "local_copy_bytes_per_engine": p.local_copy_bytes,
    "trainer_hosts": len(per_trainer),
    # Egress of the busiest trainer host when every engine pulls a version.
    "max_bytes_per_trainer_host": max(per_trainer.values(), default=0) * rollout_hosts,
    "min_bytes_per_trainer_host": min(per_trainer.values(), default=0) * rollout_hosts,
    "rollout_hosts": rollout_hosts,
    "destination_devices": len(routed),
    "snapshot_bytes_per_trainer_device": max(snapshot.values(), default=0),
    "standby_bytes_per_rollout_device": max(standby.values(), default=0),
  }


# --- trainer side ------------------------------------------------------------------


def _as_is(params):
  return params


@functools.partial(jax.jit, static_argnums=0)
def _snapshot(cast, params):
  """`cast(params)` in fresh buffers with the same shardings, in one pass
  over the bytes (a donated buffer cannot be served, and the train step
  donates the live params; casting and copying apart would read them twice)."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), cast(params))


def _piece_dict(p: Piece) -> dict:
  return {
    "leaf": p.leaf,
    "index": [list(ab) for ab in p.index],
    "device": p.device,
    "nbytes": p.nbytes,
  }


@dataclasses.dataclass(frozen=True)
class _Served:
  """One version as this process serves it: its pieces' arrays, and with
  `delta_from` (the version before, this run) the arrays of its delta: per
  piece (indices, values), or the whole piece where that was no smaller."""

  pieces: tuple[Piece, ...]
  arrays: list
  delta_from: int | None = None
  delta_arrays: list | None = None


def _delta_manifest(served: _Served, deltas: list, sums: list[int], block: int) -> dict:
  """The manifest's part for a delta version: what the puller's specs need
  (each piece's delta size, 0: sent whole) and each new piece's checksum."""
  return {
    "delta": {"from": served.delta_from, "block": block},
    "piece_deltas": [
      {"size": 0 if d is None else d.size, "changed": -1 if d is None else d.changed, "checksum": c}
      for d, c in zip(deltas, sums)
    ],
  }


class WeightServer:
  """One trainer process's side: its pieces of each version, served to pullers.

  `nonce` names the trainer run (the same on all its processes, another
  after a restart); a version's identity is (version, nonce). Starts a
  request thread polling `<root>/transfer/requests/` every `poll_seconds`
  (`thread=False`: the caller calls `serve_requests` itself).
  """

  def __init__(
    self,
    root: str,
    nonce: str,
    *,
    host: str = "",
    sockets: int = 4,
    poll_seconds: float = 0.5,
    pull_timeout_s: float = 300.0,
    log: Callable[[str], None] = print,
    thread: bool = True,
    delta_block: int | None = weight_delta.BLOCK,
  ):
    self.dir = transfer_dir(root)
    self._requests = requests_dir(root)
    files.makedirs(self._requests)
    self.process, self.num_processes = jax.process_index(), jax.process_count()
    # This process's manifests from a previous life: its server is gone.
    for name in _listdir(self.dir):
      m = _MANIFEST.match(name)
      if m and int(m.group(2)) == self.process:
        files.remove(files.join(self.dir, name))
    self.nonce = str(nonce)
    self._server = start_server(host, sockets)
    self.address = self._server.address()
    self.poll_seconds, self.pull_timeout_s = poll_seconds, pull_timeout_s
    self._log = log
    self._lock = threading.Lock()
    self._snapshots: collections.OrderedDict = collections.OrderedDict()  # version -> _Served
    self._seen: set[str] = set()
    self.served = 0  # pulls registered
    self.served_deltas = 0  # of which deltas
    # Each version's delta from the one before (weight_delta.py), in blocks
    # of this many elements; None: whole versions only.
    self.delta_block = delta_block
    # The newest version's delta: seconds, bytes (and the whole pieces'),
    # changed blocks of the pieces sent as deltas and all their blocks.
    self.last_delta: dict = {}
    self.refused: collections.Counter = collections.Counter()  # requests by reason
    self.last_publish_s = 0.0
    self.snapshot = None
    self.fingerprint: str | None = None  # the newest version's (identity.fingerprint)
    self._stop = threading.Event()
    self._thread = None
    if thread:
      self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
      self._thread.start()

  def publish(
    self,
    params,
    version: int,
    cast: Callable = _as_is,
    run_id: str | None = None,
    meta: dict | None = None,
  ) -> None:
    """Serves `cast(params)` (the engines' dtype, any sharding) as `version`.

    `cast` (traceable, hashable: the same function object each version, or
    the snapshot recompiles) runs inside the snapshot's program. `run_id`:
    the manifest names the trainer run and the served params' fingerprint
    (sao_jax/data/identity.py; kept in `fingerprint`), which the rollouts
    stamp on what this version samples. `meta` (JSON-able) goes into the
    manifest as it is; a puller hands it back with the version
    (`Follower.poll`'s meta).
    """
    t0 = time.time()
    snap = _snapshot(cast, params)
    self.fingerprint = None if run_id is None else identity.fingerprint(snap)
    leaves = jax.tree.leaves(snap)
    pieces = source_pieces((x.shape, x.dtype, x.sharding) for x in leaves)
    mine = [p for p in pieces if p.process == self.process]
    arrays = []
    for p in mine:
      shard = next(s for s in leaves[p.leaf].addressable_shards if s.device.id == p.device)
      arrays.append(shard.data)
    jax.block_until_ready(arrays)
    self.snapshot = snap  # the newest version's tree (FleetSource checkpoints it)
    served, extra = self._with_delta(_Served(tuple(mine), arrays))
    manifest = {
      "version": int(version),
      "nonce": self.nonce,
      "process": self.process,
      "num_processes": self.num_processes,
      "address": self.address,
      "published": time.time(),
      "leaves": [{"shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name} for x in leaves],
      "pieces": [_piece_dict(p) for p in mine],
      "meta": dict(meta or {}),
      **extra,
    }
    if run_id is not None:
      manifest.update(identity.VersionIdentity(run_id, self.fingerprint).meta())
    with self._lock:
      self._snapshots[int(version)] = served
      self._snapshots.move_to_end(int(version))
      dropped = []
      while len(self._snapshots) > KEEP_SNAPSHOTS:
        dropped.append(self._snapshots.popitem(last=False)[0])
    files.write_json(files.join(self.dir, manifest_name(version, self.process)), manifest)
    for v in dropped:
      files.remove(files.join(self.dir, manifest_name(v, self.process)))
    self.last_publish_s = time.time() - t0

  def _with_delta(self, served: _Served) -> tuple[_Served, dict]:
    """`served` with its delta from the newest version held (same pieces),
    and the manifest's delta fields; as it is without `delta_block` or a
    version before."""
    with self._lock:
      prev = next(reversed(self._snapshots.items()), None)
    self.last_delta = {}
    if (
      not self.delta_block
      or prev is None
      or prev[1].pieces != served.pieces
      or any(a.dtype != b.dtype for a, b in zip(prev[1].arrays, served.arrays))
    ):
      return served, {}
    t0 = time.time()
    deltas = weight_delta.encode_pieces(prev[1].arrays, served.arrays, self.delta_block)
    sums = weight_delta.checksums(served.arrays)
    delta_arrays = []
    for d, full in zip(deltas, served.arrays):
      delta_arrays += [full] if d is None else [d.indices, d.values]
    jax.block_until_ready(delta_arrays)
    served = dataclasses.replace(served, delta_from=prev[0], delta_arrays=delta_arrays)
    self.last_delta = dict(
      seconds=time.time() - t0,
      bytes=sum(x.nbytes for x in delta_arrays),
      full_bytes=sum(p.nbytes for p in served.pieces),
      changed=sum(d.changed for d in deltas if d is not None),
      blocks=sum(
        -(-math.prod(p.shape) // self.delta_block)
        for p, d in zip(served.pieces, deltas)
        if d is not None
      ),
      whole_pieces=sum(d is None for d in deltas),
    )
    return served, _delta_manifest(served, deltas, sums, self.delta_block)

  def _serve(self) -> None:
    while not self._stop.wait(self.poll_seconds):
      try:
        self.serve_requests()
      except Exception as e:  # noqa: BLE001
        self._log(f"[fleet] weight server: {e!r}"[:300])

  def serve_requests(self) -> int:
    """Registers each new request for a version held (the thread's body;
    callable directly). Returns how many it registered."""
    try:
      names = set(files.listdir(self._requests))
    except FileNotFoundError:
      return 0
    self._seen &= names  # forget requests their rollouts removed
    registered = 0
    for name in sorted(names - self._seen):
      m = _REQUEST.match(name)
      if not m:
        continue  # a temporary of files.write_json, or not ours
      self._seen.add(name)
      uuid = int(m.group(2))
      try:
        req = json.loads(files.read_bytes(files.join(self._requests, name), 4096))
        version, nonce = int(req["version"]), str(req["nonce"])
        delta_from = None if req.get("delta_from") is None else int(req["delta_from"])
      except (OSError, ValueError, KeyError, TypeError):
        self.refused["bad_request"] += 1
        continue
      with self._lock:
        served = self._snapshots.get(version) if nonce == self.nonce else None
      if served is None or uuid >= 1 << 64:
        self.refused["not_held"] += 1
        continue
      arrays = served.arrays
      if delta_from is not None:
        if delta_from != served.delta_from:
          self.refused["delta_not_held"] += 1
          continue
        arrays = served.delta_arrays
        self.served_deltas += 1
      deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.pull_timeout_s)
      self._server.await_pull(uuid, arrays, timeout=deadline)
      self.served += 1
      registered += 1
    return registered

  def withdraw(self) -> None:
    """Removes this process's manifests: rollouts take the checkpoint path."""
    with self._lock:
      versions = list(self._snapshots)
    for v in versions:
      files.remove(files.join(self.dir, manifest_name(v, self.process)))

  def close(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    self.withdraw()


def _listdir(path: str) -> list[str]:
  try:
    return files.listdir(path)
  except FileNotFoundError:
    return []


# --- rollout side ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Offer:
  """A version served by every trainer process: their manifests."""

  version: int
  nonce: str
  manifests: tuple[dict, ...]  # by process

  @property
  def identity(self) -> tuple[int, str]:
    return self.version, self.nonce


def _read_manifest(path: str) -> dict | None:
  try:
    raw = files.read_bytes(path, _MANIFEST_MAX_BYTES + 1)
    m = json.loads(raw)
    if len(raw) > _MANIFEST_MAX_BYTES or not isinstance(m, dict):
      return None
    int(m["version"]), int(m["process"]), int(m["num_processes"])
    str(m["nonce"]), str(m["address"]), list(m["pieces"]), list(m["leaves"])
    if not math.isfinite(float(m.get("published", 0))):
      return None
    return m
  except (OSError, ValueError, KeyError, TypeError, RecursionError):
    return None


def newest_offer(
  root: str, now: float | None = None, on_future: Callable[[str, float], None] | None = None
) -> Offer | None:
  """The newest version with a manifest from each of its trainer's processes.

  Newest by publish time; a manifest published after `now` (default: this
  host's clock) + CLOCK_SKEW_S is left out (a clock gone wrong, or a file
  no live trainer wrote: it would outrank every real version for as long as
  it stayed), and `on_future(name, seconds ahead)` is told.
  """
  d = transfer_dir(root)
  try:
    names = files.listdir(d)
  except FileNotFoundError:
    return None
  latest = (time.time() if now is None else now) + CLOCK_SKEW_S
  groups: dict = collections.defaultdict(dict)
  for name in names:
    if not _MANIFEST.match(name):
      continue
    m = _read_manifest(files.join(d, name))
    if m is None:
      continue
    if float(m.get("published", 0)) > latest:
      if on_future is not None:
        on_future(name, float(m["published"]) - latest + CLOCK_SKEW_S)
      continue
    groups[(int(m["version"]), str(m["nonce"]), int(m["num_processes"]))][int(m["process"])] = m
  complete = [
    (max(float(m.get("published", 0)) for m in ms.values()), key, ms)
    for key, ms in groups.items()
    if sorted(ms) == list(range(key[2]))
  ]
  if not complete:
    return None
  _, (version, nonce, n), ms = max(complete, key=lambda x: (x[0], x[1][0]))
  return Offer(version, nonce, tuple(ms[p] for p in range(n)))


def _pieces_of(offer: Offer) -> list[list[Piece]]:
  """Per trainer process, its pieces in the order it registered them."""
  out = []
  for m in offer.manifests:
    out.append(
      [
        Piece(
          int(p["leaf"]),
          tuple((int(a), int(b)) for a, b in p["index"]),
          int(m["process"]),
          int(p["device"]),
          int(p["nbytes"]),
        )
        for p in m["pieces"]
      ]
    )
  return out


class PullError(Exception):
  """A version that cannot be pulled; `reason` is the counter's key.
  `retry`: the same version may be pulled again (whole)."""

  def __init__(self, reason: str, message: str, retry: bool = False):
    super().__init__(message)
    self.reason, self.retry = reason, retry


@dataclasses.dataclass(frozen=True)
class _Held:
  """The version a rollout holds, in the piece layout: what a delta applies to."""

  identity: tuple[int, str]
  pieces: dict  # (leaf, Index) -> the piece's array, on the device it was pulled onto


@dataclasses.dataclass(frozen=True)
class _DeltaPull:
  """A delta pull's recipe: per piece (flat, in the plan's order) the held
  array and its delta's size (0: the piece comes whole), and the checksum
  each assembled piece must have."""

  base: int  # the version it applies to
  block: int
  held: list
  sizes: list[int]
  checksums: list[int]


@dataclasses.dataclass
class _Pull:
  offer: Offer
  plan: Plan
  arrays: list  # per trainer process, its pieces' arrays being filled
  requests: list[str]
  started: float
  delta: _DeltaPull | None = None


class NetFollower:
  """A rollout's direct path: pulls offered versions into `abstract_params`'
  layout (ShapeDtypeStructs with shardings on this process's devices)."""

  def __init__(
    self,
    root: str,
    rollout_id: str,
    abstract_params,
    *,
    host: str = "",
    sockets: int = 4,
    pull_timeout_s: float = 300.0,
    delta: bool = True,
  ):
    self.root, self.rollout_id = root, rollout_id
    self._requests = requests_dir(root)
    files.makedirs(self._requests)
    for name in _listdir(self._requests):  # a killed predecessor's requests
      if name.startswith(f"{rollout_id}-"):
        files.remove(files.join(self._requests, name))
    self.retarget(abstract_params)
    self._server = start_server(host, sockets)
    self._connections: dict[str, Any] = {}
    self.pull_timeout_s = pull_timeout_s
    self._pull: _Pull | None = None
    # Pull versions offered as deltas from the one held as deltas (keeping
    # the held version's pieces: one more copy of a version on the devices).
    self.delta = delta
    self._held: _Held | None = None
    self.pulled_bytes = 0
    self.pulls_by_kind: collections.Counter = collections.Counter()  # "full" / "delta"
    self.bytes_by_kind: collections.Counter = collections.Counter()
    self.pull_seconds = 0.0
    # The last complete pull: until every piece was ready (as seen by the
    # polls), applying a delta (and checking it), the assembly into the
    # engine's layout.
    self.last_transfer_s = self.last_apply_s = self.last_assemble_s = 0.0

  def retarget(self, abstract_params) -> None:
    leaves, self._treedef = jax.tree.flatten(abstract_params)
    self._abstract = leaves
    self._held = None  # pieces of another layout

  @property
  def pulling(self) -> Offer | None:
    return self._pull.offer if self._pull else None

  def start(self, offer: Offer) -> None:
    """Asks every trainer process for `offer` and posts the pulls (returns at
    once; `advance` finishes): its delta when it is one from the version
    held (`delta`), else the whole version. Raises PullError."""
    assert self._pull is None, "one pull at a time"
    shapes = [tuple(a.shape) for a in self._abstract]
    for m in offer.manifests:
      theirs = [(tuple(x["shape"]), x["dtype"]) for x in m["leaves"]]
      ours = [(tuple(a.shape), jnp.dtype(a.dtype).name) for a in self._abstract]
      if theirs != ours:
        raise PullError(
          "layout_mismatch",
          f"version {offer.version}: the trainer's leaves (shapes, dtypes) are not this engine's",
        )
    per_process = _pieces_of(offer)
    flat = [p for ps in per_process for p in ps]
    why = check_cover(flat, shapes)
    if why:
      raise PullError("bad_manifest", f"version {offer.version}: {why}")
    p = plan(flat, [(tuple(a.shape), a.sharding) for a in self._abstract])
    delta = self._delta_for(offer, p)
    devices = {d.id: d for a in self._abstract for d in a.sharding.device_set}
    uuid = int.from_bytes(os.urandom(8), "little") >> 1
    name = f"{self.rollout_id}-{uuid}.json"
    request = {"version": offer.version, "nonce": offer.nonce}
    if delta is not None:
      request["delta_from"] = delta.base
    files.write_json(files.join(self._requests, name), request)
    arrays, n = [], 0
    try:
      for m, pieces in zip(offer.manifests, per_process):
        specs = []
        for piece in pieces:
          specs += self._specs(piece, devices[p.routes[n]], delta, n)
          n += 1
        if not specs:
          arrays.append([])
          continue
        _probe(m["address"])
        conn = self._connection(m["address"])
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.pull_timeout_s)
        arrays.append(conn.pull(uuid, specs, timeout=deadline))
    except PullError:
      files.remove(files.join(self._requests, name))
      raise
    except Exception as e:  # noqa: BLE001
      files.remove(files.join(self._requests, name))
      raise PullError("pull_failed", f"version {offer.version}: {e!r}"[:300]) from None
    self._pull = _Pull(offer, p, arrays, [name], time.time(), delta)

  def _specs(self, piece: Piece, device, delta: _DeltaPull | None, n: int) -> list:
    """What piece `n` arrives as on `device`: whole, or its delta's
    (indices, values)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    dtype = self._abstract[piece.leaf].dtype
    size = 0 if delta is None else delta.sizes[n]
    if not size:
      return [jax.ShapeDtypeStruct(piece.shape, dtype, sharding=sharding)]
    return [
      jax.ShapeDtypeStruct((size,), weight_delta.INDEX_DTYPE, sharding=sharding),
      jax.ShapeDtypeStruct((size, delta.block), weight_delta.word_dtype(dtype), sharding=sharding),
    ]

  def _delta_for(self, offer: Offer, p: Plan) -> _DeltaPull | None:
    """How to pull `offer` as a delta: when every trainer process offers it
    as one from the version held (this trainer run's), and every piece of
    the held version is where the plan routes its delta. None: whole."""
    held = self._held
    if not self.delta or held is None:
      return None
    try:
      infos = [m["delta"] for m in offer.manifests]
      bases = {int(d["from"]) for d in infos}
      blocks = {int(d["block"]) for d in infos}
      entries = [m["piece_deltas"] for m in offer.manifests]
      if any(len(e) != len(m["pieces"]) for e, m in zip(entries, offer.manifests)):
        return None
      sizes = [int(x["size"]) for e in entries for x in e]
      sums = [int(x["checksum"]) for e in entries for x in e]
    except (KeyError, TypeError, ValueError):
      return None  # no delta offered (or not one this rollout reads)
    if len(bases) != 1 or len(blocks) != 1 or min(blocks) < 1 or min(sizes, default=0) < 0:
      return None
    base = bases.pop()
    if held.identity != (base, offer.nonce):
      return None  # too far behind, or another trainer run's
    arrays = [held.pieces.get((piece.leaf, piece.index)) for piece in p.pieces]
    if any(
      a is None or a.is_deleted() or {d.id for d in a.devices()} != {dev}
      for a, dev in zip(arrays, p.routes)
    ):
      return None
    return _DeltaPull(base, blocks.pop(), arrays, sizes, sums)

  def _connection(self, address: str):
    if address not in self._connections:
      self._connections[address] = self._server.connect(address)
    return self._connections[address]

  def advance(self, now: float | None = None):
    """The pulled params (a pytree in the engine's layout) once every piece
    arrived; None while pieces are in flight. Raises PullError (the pull is
    discarded) on a failed or timed-out pull."""
    pull = self._pull
    if pull is None:
      return None
    flat = [a for arrays in pull.arrays for a in arrays]
    ready = [a.is_ready() for a in flat]
    try:
      # Ready pieces return at once, raising a failed piece's error: a dead
      # trainer process fails the pull while others' pieces are in flight.
      jax.block_until_ready([a for a, r in zip(flat, ready) if r])
      if not all(ready):
        if (now or time.time()) - pull.started > self.pull_timeout_s:
          self._discard()
          raise PullError(
            "timeout",
            f"version {pull.offer.version}: not complete after {self.pull_timeout_s:.0f} s",
          )
        return None
      t0 = time.time()
      self.last_transfer_s = t0 - pull.started
      pieces = self._applied(pull, flat)
      self.last_apply_s = time.time() - t0
      params = self._assemble(pull.plan, pieces)
      self.last_assemble_s = time.time() - t0 - self.last_apply_s
    except PullError:
      raise
    except Exception as e:  # noqa: BLE001
      self._discard()
      self._connections.clear()  # a connection that failed is not reused
      raise PullError("pull_failed", f"version {pull.offer.version}: {e!r}"[:300]) from None
    nbytes = sum(a.nbytes for a in flat)
    self.pulled_bytes += nbytes
    kind = "full" if pull.delta is None else "delta"
    self.pulls_by_kind[kind] += 1
    self.bytes_by_kind[kind] += nbytes
    self.pull_seconds += time.time() - pull.started
    self._held = (
      _Held(
        pull.offer.identity,
        {(piece.leaf, piece.index): a for piece, a in zip(pull.plan.pieces, pieces)},
      )
      if self.delta
      else None
    )
    self._discard()
    return params

  def _applied(self, pull: _Pull, flat: list) -> list:
    """The pieces of the version pulled: as they came, or (a delta) the held
    ones with their deltas applied, each checked against its checksum. A
    mismatch drops the held version (the retry is whole): PullError."""
    d = pull.delta
    if d is None:
      return flat
    out, arrived = [], iter(flat)
    for held, size in zip(d.held, d.sizes):
      out.append(
        weight_delta.apply(held, next(arrived), next(arrived), block=d.block)
        if size
        else next(arrived)
      )
    bad = sum(a != b for a, b in zip(weight_delta.checksums(out), d.checksums))
    if bad:
      self._held = None
      self._discard()
      raise PullError(
        "delta_checksum",
        f"version {pull.offer.version}: {bad} of {len(out)} "
        f"pieces differ from their checksums after the delta from version "
        f"{d.base}; the version is pulled whole next",
        retry=True,
      )
    return out

  def _discard(self) -> None:
    pull, self._pull = self._pull, None
    if pull is None:
      return
    for name in pull.requests:
      files.remove(files.join(self._requests, name))

  def abandon(self) -> None:
    """Drops a pull in flight (its buffers fill, or fail, unseen)."""
    self._discard()

  def _assemble(self, p: Plan, flat: list):
    """The engine's arrays from the pulled pieces: a piece that is a whole
    destination shard on its device is used as it is; other shards are put
    together from copies of the overlaps."""
    devices = {d.id: d for a in self._abstract for d in a.sharding.device_set}
    out = []
    for leaf, a in enumerate(self._abstract):
      shards = []
      for device in a.sharding.addressable_devices:
        index = p.dest_index[(leaf, device.id)]
        fills = p.fills[(leaf, device.id)]
        if (
          len(fills) == 1
          and p.pieces[fills[0][0]].index == index
          and p.routes[fills[0][0]] == device.id
        ):
          shards.append(flat[fills[0][0]])
          continue
        parts, where = [], []
        for n, overlap in fills:
          src = p.pieces[n].index
          take = tuple((lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(overlap, src))
          part = flat[n]
          if p.routes[n] != device.id:  # only the overlap crosses to this device
            part = jax.device_put(part[tuple(slice(*ab) for ab in take)], devices[device.id])
            take = tuple((0, hi - lo) for lo, hi in overlap)
          parts.append(part)
          where.append(
            (take, tuple((lo - d0, hi - d0) for (lo, hi), (d0, _) in zip(overlap, index)))
          )
        buf = _fill(parts, tuple(b - a0 for a0, b in index), jnp.dtype(a.dtype), tuple(where))
        shards.append(buf)
      out.append(jax.make_array_from_single_device_arrays(tuple(a.shape), a.sharding, shards))
    return jax.tree.unflatten(self._treedef, out)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _fill(parts, shape, dtype, where):
  """A destination shard of `shape` from `parts` (on its device): part i's
  range where[i][0] goes to where[i][1]; one program per layout, one copy.
  Moved as unsigned words: XLA on CPU fills bf16 through float32 and
  quietens NaN payloads on the way."""
  words = dtype if dtype == jnp.bool_ else weight_delta.word_dtype(dtype)
  buf = jnp.zeros(shape, words)
  for part, (take, put) in zip(parts, where):
    part = jax.lax.bitcast_convert_type(part, words)
    buf = buf.at[tuple(slice(*ab) for ab in put)].set(part[tuple(slice(*ab) for ab in take)])
  return jax.lax.bitcast_convert_type(buf, dtype)


def _probe(address: str) -> None:
  """Fails fast on a trainer process that is gone: a pull to a closed port
  would wait forever (the library's timeout fires only at that server's
  next event), a refused connection is immediate."""
  host, _, port = address.rpartition(":")
  try:
    socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
  except (OSError, ValueError) as e:
    raise PullError("unreachable", f"trainer process at {address}: {e}") from None


class Follower:
  """A rollout's weights on the direct path, the checkpoint path behind it.

  `poll()` is `fleet.WeightFollower.poll`'s contract, never blocking on a
  pull: (params, version, meta) when a whole new version is ready, else
  None. Counts pulls, failures and fallbacks by reason (`failures`,
  `fallbacks`) and logs each failure once; a manifest from the future
  (`newest_offer`) is counted in `ignored_manifests["from_future"]` and
  logged once. `clock` is the wall clock manifests are judged by.
  """

  def __init__(
    self,
    checkpoints,
    net: NetFollower | None,
    log: Callable[[str], None] = print,
    clock: Callable[[], float] = time.time,
  ):
    self._ckpt, self._net, self._log, self._clock = checkpoints, net, log, clock
    self.version: int | None = None
    self.identity: tuple | None = None  # (version, trainer nonce) held
    self._tried: set = set()  # offers pulled or failed: not pulled again
    self.pulls = 0
    self.failures: collections.Counter = collections.Counter()
    self.fallbacks: collections.Counter = collections.Counter()
    self.ignored_manifests: collections.Counter = collections.Counter()
    self._future: set[str] = set()  # manifests from the future, counted once each
    self.last_path: str | None = None

  @property
  def pulling(self) -> Offer | None:
    """The version being pulled (generation goes on meanwhile), or None."""
    return self._net.pulling if self._net is not None else None

  def retarget(self, abstract_params) -> None:
    self._ckpt.retarget(abstract_params)
    if self._net is not None:
      self._net.retarget(self._ckpt.abstract)  # unplaced leaves on a device, as there

  def poll(self, final: bool = False):
    """`final`: the trainer is done (its last version is on disk); a pull in
    flight is dropped and only the checkpoint path is read."""
    net = self._net
    offer = None
    if net is not None and not final:
      pulling = net.pulling
      if pulling is not None:
        try:
          params = net.advance()
        except PullError as e:
          self._failed(e)
          if e.retry:
            self._tried.discard(pulling.identity)
        else:
          return None if params is None else self._take(params, pulling, "direct")
      offer = newest_offer(net.root, self._clock(), self._from_future)
      if (
        offer is not None and offer.identity != self.identity and offer.identity not in self._tried
      ):
        self._tried.add(offer.identity)
        try:
          net.start(offer)
        except PullError as e:
          self._failed(e)
        else:
          return None
    elif net is not None and net.pulling is not None:
      net.abandon()
    return self._from_checkpoint(offer, final)

  def pull_counts(self) -> dict:
    """Direct pulls and their bytes, whole ("full") and as deltas ("delta")."""
    if self._net is None:
      return {}
    return dict(
      pulls_by_kind=dict(self._net.pulls_by_kind), pulled_bytes=dict(self._net.bytes_by_kind)
    )

  def _from_future(self, name: str, ahead_s: float) -> None:
    if name in self._future:
      return
    self._future.add(name)
    self.ignored_manifests["from_future"] += 1
    self._log(
      f"[fleet] ignored the weight manifest {name}: published {ahead_s:.0f} s "
      f"after this host's now (more than {CLOCK_SKEW_S:.0f} s of clock skew); "
      "the newest valid version is pulled"
    )

  def _failed(self, e: PullError) -> None:
    self.failures[e.reason] += 1
    self.fallbacks[e.reason] += 1
    then = "it is pulled again whole" if e.retry else "checkpoints are the fallback"
    self._log(
      f"[fleet] direct pull failed ({e.reason}): {e}; the held version {self.version} stays, {then}"
    )

  def _take(self, params, offer: Offer, path: str):
    self.pulls += 1
    self.version, self.identity, self.last_path = offer.version, offer.identity, path
    first = offer.manifests[0]
    meta = {k: first[k] for k in ("run_id", "fingerprint") if k in first}
    extra = first.get("meta") if isinstance(first.get("meta"), dict) else {}
    return params, offer.version, {**extra, **meta, "nonce": offer.nonce, "path": path}

  def _from_checkpoint(self, offer: Offer | None, final: bool):
    newest = self._ckpt.newest()
    if newest is None:
      return None
    version, meta = newest
    identity = (version, str(meta.get("nonce", meta.get("published"))))
    if identity == self.identity:
      return None
    # With versions offered directly, a checkpoint is a fallback only when it
    # moves forward; so it is when it comes from the trainer run whose version
    # is held (its servers gone: a checkpoint it wrote earlier is no news).
    # Otherwise (a trainer on the checkpoint path, or a restarted one) it is
    # followed as fleet.WeightFollower follows, back included.
    behind = self.version is not None and version <= self.version
    if behind and (
      (offer is not None and not final)
      or (self.identity is not None and identity[1] == self.identity[1])
    ):
      return None
    got = self._ckpt.restore_version(version)
    if got is None:
      return None
    params, meta = got
    self.version, self.identity, self.last_path = version, identity, "checkpoint"
    return params, version, meta

  def close(self) -> None:
    if self._net is not None:
      self._net.abandon()
    self._ckpt.close()
