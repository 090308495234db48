"""Run identity: which trainer run and which params produced a trajectory.

A policy version is a per-run counter (the params after that many actor
updates), so a version number alone does not say whose params sampled a
token: another run's rollouts, an endpoint serving some other checkpoint,
or the future a killed trainer discarded all write "version 7". Each
trajectory therefore carries

    run_id        the trainer run that published the params it used: a
                  random id made once per run and kept in the workdir
                  (`<workdir>/run_id`, so a resumed run keeps it)
    fingerprints  {version: fingerprint} for each version its action
                  tokens used, the fingerprint the trainer computed over
                  those params when it published them

and a fleet trainer (`Published.check`, through `ingestion.check`) refuses,
counted by reason (`REJECT_REASONS`), a trajectory of another run, one
whose fingerprint for a version is not the one it published under that
number, and one that carries no identity at all (records written before
identities existed, an endpoint that served params of its own: in-process
sources and offline reads check nothing).

The identity travels with the weights: the trainer puts `run_id` and
`fingerprint` in a version's checkpoint meta and in its direct-path
manifests; a rollout notes them when it swaps the version in
(`Ledger.note`) and stamps them on what that version sampled.

The fingerprint (`fingerprint`) is a digest of a fixed sample of every
leaf: SAMPLES elements at positions drawn from the leaf's shape alone, read
as raw bits (so -0.0 and NaN payloads count, and no arithmetic can change
them), hashed on the host with each leaf's path, shape and dtype. The
sample is gathered inside one jitted program from the params where they
lie: on a sharded leaf each device reads the sampled elements it holds and
an all-reduce of SAMPLES integers per leaf assembles them (the operand is
never gathered; tests/data/test_identity.py checks the compiled program).
Its output and its all-reduce grow with the number of leaves, not their
size; what it costs at Qwen3.5-35B-A3B's size (benchmarks/identity.py):
benchmarks/RESULTS.md#fleet-and-weight-sync. The positions depend only on
shapes, so any layout of the same values (the trainer's sharding, an
engine's, host numpy) gives the same fingerprint.
It names params, it does not authenticate them: two param sets that agree
on every sampled element share a fingerprint.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
import secrets
import threading
import zlib
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.data import files

RUN_ID_FILE = "run_id"
# Elements sampled per leaf (all of a smaller leaf).
SAMPLES = 64
# A fingerprint: this many hex digits (64 bits).
FINGERPRINT_HEX = 16
# Versions a trainer remembers the fingerprints of (and a rollout the
# identities of): a trajectory using an older one is refused as unpublished.
KEEP_VERSIONS = 1024
RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
FINGERPRINT = re.compile(r"^[0-9a-f]{%d}$" % FINGERPRINT_HEX)

# Why a fleet trainer refuses a trajectory's identity (`Published.check`).
REJECT_REASONS = (
  "missing_run_id",  # no identity: an old record, an endpoint serving its own params
  "other_run",  # another trainer run's rollouts
  "missing_fingerprint",  # a version used without a fingerprint for it
  "other_params",  # a version's fingerprint is not the one published under that number
  "unpublished_version",  # a version this trainer has no fingerprint of
)


def new_run_id() -> str:
  return secrets.token_hex(8)


def run_id(workdir: str, share: Callable | None = None) -> str:
  """The run's id: `<workdir>/run_id`, made on the first call.

  `share(name, compute)` runs `compute` on one process and gives every
  process its answer (`distributed.share_from_primary`); default: here.
  """
  path = files.join(workdir, RUN_ID_FILE)

  def read_or_make() -> str:
    try:
      saved = files.read_text(path).strip()
    except FileNotFoundError:
      saved = ""
    if RUN_ID.match(saved):
      return saved
    made = new_run_id()
    files.write_text(path, made + "\n")
    return made

  return (share or (lambda name, compute: compute()))("run_id", read_or_make)


# --- the fingerprint ----------------------------------------------------------------


def _positions(shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
  """Per dimension, the coordinates of the sampled elements of a leaf of
  `shape`: all of them up to SAMPLES, else the first, the last and
  SAMPLES - 2 drawn from a generator seeded by the shape."""
  size = int(np.prod(shape, dtype=np.int64))
  if not shape:
    return ()
  if size <= SAMPLES:
    flat = np.arange(size)
  else:
    rng = np.random.default_rng(zlib.crc32(repr(tuple(shape)).encode()))
    flat = np.concatenate([[0, size - 1], rng.integers(0, size, SAMPLES - 2)])
  return tuple(c.astype(np.int32) for c in np.unravel_index(flat, shape))


def _bits(x):
  """`x` as unsigned integers of its width (bool as uint8)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8)
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{jnp.dtype(x.dtype).itemsize * 8}"))
  return x


def _sampler(shapes: tuple[tuple[int, ...], ...], out_sharding):
  """A jitted program: each leaf's sampled elements, as bits, replicated."""
  positions = [_positions(s) for s in shapes]

  def sample(leaves):
    out = []
    for x, coords in zip(leaves, positions):
      x = _bits(x)
      out.append(x.reshape(-1) if not x.ndim else x[tuple(jnp.asarray(c) for c in coords)])
    return out

  return jax.jit(sample, out_shardings=out_sharding)


_SAMPLERS: collections.OrderedDict = collections.OrderedDict()


def _replicated(leaves):
  """A replicated output sharding on the leaves' mesh (None: jit's default)."""
  for x in leaves:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  return None


def fingerprint(params) -> str:
  """A digest of `params` (any pytree of arrays), FINGERPRINT_HEX hex digits.

  Deterministic in the values, shapes, dtypes and tree paths; independent
  of the layout (module docstring). Costs one small jitted program per
  call (compiled once per tree shape).
  """
  with_paths, _ = jax.tree_util.tree_flatten_with_path(params)
  leaves = [jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x for _, x in with_paths]
  shapes = tuple(tuple(x.shape) for x in leaves)
  out_sharding = _replicated(leaves)
  key = (shapes, tuple(str(x.dtype) for x in leaves), out_sharding)
  if key not in _SAMPLERS:
    _SAMPLERS[key] = _sampler(shapes, out_sharding)
    while len(_SAMPLERS) > 8:
      _SAMPLERS.popitem(last=False)
  samples = _SAMPLERS[key](leaves)
  h = hashlib.blake2b(digest_size=FINGERPRINT_HEX // 2)
  for (path, _), x, s in zip(with_paths, leaves, samples):
    h.update(f"{jax.tree_util.keystr(path)}|{x.shape}|{jnp.dtype(x.dtype).name}|".encode())
    h.update(np.asarray(s.addressable_data(0)).tobytes())
  return h.hexdigest()


# --- what travels with the weights ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VersionIdentity:
  """Whose params a policy version is: the publishing run and their fingerprint."""

  run_id: str
  fingerprint: str

  def meta(self) -> dict:
    """The fields a version's checkpoint meta and manifests carry."""
    return {"run_id": self.run_id, "fingerprint": self.fingerprint}


def of_meta(meta: Mapping | None) -> VersionIdentity | None:
  """The identity a version's meta carries; None if it carries none (or a
  malformed one: its tokens then get no identity, and are refused)."""
  if not isinstance(meta, Mapping):
    return None
  rid, fp = meta.get("run_id"), meta.get("fingerprint")
  if isinstance(rid, str) and isinstance(fp, str) and RUN_ID.match(rid) and FINGERPRINT.match(fp):
    return VersionIdentity(rid, fp)
  return None


class Ledger:
  """The rollout side: the identity of each version this engine held.

  `note(version, meta)` when a version is swapped in; `get(version)` when
  a token of it is sampled. A version number noted again with another
  identity (a restarted trainer republishing it) replaces the old entry;
  an episode that sampled under both (`Tokens`) drops that version's
  fingerprint rather than guess.
  """

  def __init__(self):
    self._table: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()  # an endpoint notes and stamps in different threads

  def note(self, version: int, meta: Mapping | None) -> None:
    ident = of_meta(meta)
    with self._lock:
      self._table.pop(int(version), None)
      if ident is not None:
        self._table[int(version)] = ident
        while len(self._table) > KEEP_VERSIONS:
          self._table.popitem(last=False)

  def get(self, version: int) -> VersionIdentity | None:
    with self._lock:
      return self._table.get(int(version))

  def stamp(self, t):
    """`t` with the identity of the versions it used, as known now."""
    tokens = Tokens()
    for v in np.unique(t.policy_version[t.action_mask]):
      tokens.add(int(v), self.get(int(v)))
    return dataclasses.replace(t, **tokens.fields())


class Tokens:
  """One episode's identities, gathered as its tokens are sampled."""

  def __init__(self):
    self._seen: dict[int, VersionIdentity | None] = {}
    self._ambiguous: set[int] = set()

  def add(self, version: int, ident: VersionIdentity | None) -> None:
    if version not in self._seen:
      self._seen[version] = ident
    elif self._seen[version] != ident:
      self._ambiguous.add(version)

  def fields(self) -> dict:
    """`run_id` (the newest known version's run) and `fingerprints`."""
    known = {v: i for v, i in self._seen.items() if i is not None and v not in self._ambiguous}
    return {
      "run_id": known[max(known)].run_id if known else "",
      "fingerprints": {v: i.fingerprint for v, i in sorted(known.items())},
    }


# --- the trainer side -----------------------------------------------------------------


class Published:
  """A trainer's run id and the fingerprint it published under each version.

  `state()` goes into the trainer's checkpoint (with the feed's cursor) and
  `restore` takes it back, without the versions past the checkpoint (a
  future the restarted trainer discarded and publishes anew).
  """

  def __init__(self, run_id_: str, fingerprints: Mapping[int, str] | None = None):
    if not RUN_ID.match(run_id_):
      raise ValueError(f"run id {run_id_[:80]!r}: 1 to 64 of A-Z a-z 0-9 _ . -")
    self.run_id = run_id_
    self._fingerprints: collections.OrderedDict = collections.OrderedDict(
      sorted((int(v), str(fp)) for v, fp in (fingerprints or {}).items())
    )

  @classmethod
  def restore(cls, run_id_: str, state: Mapping | None, version: int) -> Published:
    """From a `state()` (None: a fresh run), keeping versions up to `version`."""
    saved = (
      (state or {}).get("fingerprints", {})
      if (state or {}).get("run_id") in (None, run_id_)
      else {}
    )
    return cls(run_id_, {int(v): fp for v, fp in saved.items() if int(v) <= version})

  def note(self, version: int, fp: str) -> None:
    """`fp` was published as `version` (replacing a discarded future's)."""
    self._fingerprints.pop(int(version), None)
    self._fingerprints[int(version)] = fp
    while len(self._fingerprints) > KEEP_VERSIONS:
      self._fingerprints.popitem(last=False)

  def identity(self, version: int) -> VersionIdentity:
    return VersionIdentity(self.run_id, self._fingerprints[int(version)])

  def state(self) -> dict:
    return {
      "run_id": self.run_id,
      "fingerprints": {str(v): fp for v, fp in self._fingerprints.items()},
    }

  def check(self, t) -> str | None:
    """None if canonical trajectory `t` is this run's, with this run's params
    at every version its action tokens used; else a REJECT_REASONS entry."""
    if not t.run_id:
      return "missing_run_id"
    if t.run_id != self.run_id:
      return "other_run"
    for v in np.unique(t.policy_version[t.action_mask]):
      theirs, ours = t.fingerprints.get(int(v)), self._fingerprints.get(int(v))
      if theirs is None:
        return "missing_fingerprint"
      if ours is None:
        return "unpublished_version"
      if theirs != ours:
        return "other_params"
    return None
