"""A trajectory store: ArrayRecord shards of serialised Trajectory records.

Rollout writes (`TrajectoryWriter`), the trainer reads the valid records back
(`read_valid_trajectories`), so the same format carries trajectories between
separate rollout and trainer processes on a pod. A record is an `.npz` (a zip
of `.npy` members) of the arrays plus a JSON header of the scalars: no
pickle, readable from any language with numpy's format.

A shard may have been written by another machine, cut short by a crash, or
tampered with, so reading trusts nothing:

* `deserialize` refuses a hostile record with `CorruptRecordError(reason)`
  before it costs more than a bounded amount of memory: the sizes every zip
  member declares are checked against a cap derived from `max_length` before
  anything is decompressed (a small `savez_compressed` of zeros can declare
  gigabytes), each member is then read at most to its declared size (a member
  that lies about its size fails its CRC instead of inflating), and `.npy`
  headers are parsed here, not by `np.load`, so a header declaring a huge
  shape is refused before numpy preallocates it. Object dtypes (pickles),
  missing or extra members and bad header JSON are refused too.
* `read_valid_trajectories` counts, per reason, every shard it cannot open
  and every record it cannot read, deserialize or validate, and returns only
  the canonical copies of valid ones; it raises only if none is left.
* `TrajectoryWriter` writes `<path>.tmp-<pid>` and renames it to `<path>` on
  close, so a killed writer never leaves a half shard under the final name.
  On an object store (a gs:// path) it writes a local temporary file and
  uploads it on close: the object appears whole or not at all
  (sao_jax/data/files.py). Readers download such a shard before reading it.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import math
import os
import zipfile
import zlib

import grain
import numpy as np
from array_record.python import array_record_module

from sao_jax.data import files
from sao_jax.data.trajectory import ARRAY_FIELDS, OPTIONAL_ARRAY_FIELDS, Trajectory, checked

_ARRAYS = ARRAY_FIELDS
_OPTIONAL = OPTIONAL_ARRAY_FIELDS
_SCALARS = tuple(
  f.name for f in dataclasses.fields(Trajectory) if f.name not in _ARRAYS + _OPTIONAL
)
_MEMBERS = frozenset(f"{k}.npy" for k in ("header",) + _ARRAYS)
# The optional members a record may add to _MEMBERS.
_OPTIONAL_MEMBERS = frozenset(f"{k}.npy" for k in _OPTIONAL)

# The default cap when a caller does not say how long a trajectory may be.
DEFAULT_MAX_LENGTH = 1 << 16
# Bounds on one record, derived from max_length: an array member is an .npy
# header (numpy writes 128 bytes; anything under 4 KiB is accepted) plus at
# most 8 bytes per token (int64/float64, the widest dtype a writer could
# sensibly use); the JSON header holds the scalars and the identity's
# {version: fingerprint}, at most one version per token.
_NPY_HEADER_CAP = 4096
_HEADER_JSON_CAP = 4096
_FINGERPRINT_ENTRY_CAP = 40  # '"-2147483648": "<16 hex digits>", '
_ZIP_OVERHEAD = 4096  # local and central headers of 8 members, zip64 extras
# A routing record (routing replay) is [T, M, k] int16, 2 bytes a choice: a
# reader allows this many choices a token unless told more (Qwen3-30B-A3B
# has M x k = 48 x 8 = 384).
DEFAULT_ROUTING_CHOICES = 384

# The labels read_valid_trajectories counts besides deserialize's and
# validate's reasons.
SHARD_REASONS = (
  "missing_shard",
  "corrupt_shard",
  "corrupt_record",
  "deserialize_error",
  "validation_error",
)
# Every CorruptRecordError.reason.
RECORD_REASONS = (
  "not_bytes",
  "record_too_large",
  "not_npz",
  "bad_members",
  "member_too_large",
  "encrypted_member",
  "bad_compression",
  "corrupt_zip",
  "bad_npy",
  "pickled_object",
  "bad_array_dtype",
  "size_mismatch",
  "bad_header",
)


class CorruptRecordError(ValueError):
  """A record that is not a well-formed serialised Trajectory.

  `reason` is a short snake_case label (one of RECORD_REASONS) to count; the
  message adds the detail.
  """

  def __init__(self, reason: str, detail: str = ""):
    super().__init__(f"{reason}: {detail}" if detail else reason)
    self.reason = reason


class NoValidTrajectoriesError(RuntimeError):
  """read_valid_trajectories found no valid trajectory in any shard."""


def _builtin(x):
  """A numpy scalar as the Python scalar JSON can hold (np.int64 ids...); a
  dict's keys as the decimal strings JSON's object keys are."""
  if isinstance(x, dict):
    return {str(_builtin(k)): _builtin(v) for k, v in x.items()}
  return x.item() if isinstance(x, np.generic) else x


def serialize(t: Trajectory) -> bytes:
  """The .npz bytes of `t`. Raises ValueError for an object array (the store
  never pickles) and TypeError for a header value JSON cannot hold."""
  buf = io.BytesIO()
  header = {k: _builtin(getattr(t, k)) for k in _SCALARS}
  arrays = {k: np.asarray(getattr(t, k)) for k in _ARRAYS}
  arrays.update(
    {k: np.asarray(getattr(t, k)) for k in _OPTIONAL if getattr(t, k, None) is not None}
  )
  for k, a in arrays.items():
    if a.dtype.hasobject:
      raise ValueError(f"Trajectory.{k} has dtype {a.dtype}: the store never pickles.")
  np.savez(buf, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)
  return buf.getvalue()


def _caps(max_length: int, routing_choices: int) -> tuple[int, int, int, int]:
  """(per array member, header member, routing member, whole record)
  uncompressed byte caps."""
  member = _NPY_HEADER_CAP + 8 * int(max_length)
  header = _NPY_HEADER_CAP + _HEADER_JSON_CAP + _FINGERPRINT_ENTRY_CAP * int(max_length)
  routing = _NPY_HEADER_CAP + 2 * int(routing_choices) * int(max_length)
  return member, header, routing, member * len(_ARRAYS) + header + routing


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
  """The member's bytes, never more than its (already capped) declared size.

  An explicit size matters: `read()` without one lets zipfile ask the
  decompressor for up to 2 GiB at a time before trimming to the declared
  size; `read(n)` bounds every step by n.
  """
  try:
    with zf.open(info) as f:
      raw = f.read(info.file_size)
  except (
    zipfile.BadZipFile,
    zlib.error,
    EOFError,
    OSError,
    ValueError,
    RuntimeError,
    NotImplementedError,
  ) as e:
    raise CorruptRecordError("corrupt_zip", f"{info.filename}: {e}") from None
  if len(raw) != info.file_size:
    raise CorruptRecordError("corrupt_zip", f"{info.filename} shorter than declared")
  return raw


def _parse_npy(raw: bytes, name: str) -> np.ndarray:
  """An .npy member as an array, refusing what np.load would trust.

  The declared shape must match the bytes present before any array is
  made (np.load preallocates from the header), and the dtype must be a
  plain bool/int/uint/float: no objects, no structured or subarray dtypes.
  """
  f = io.BytesIO(raw)
  fmt = np.lib.format
  try:
    version = fmt.read_magic(f)
    if version == (1, 0):
      shape, fortran, dtype = fmt.read_array_header_1_0(f, max_header_size=_NPY_HEADER_CAP)
    elif version == (2, 0):
      shape, fortran, dtype = fmt.read_array_header_2_0(f, max_header_size=_NPY_HEADER_CAP)
    else:
      raise CorruptRecordError("bad_npy", f"{name}: .npy version {version}")
  except CorruptRecordError:
    raise
  except Exception as e:  # noqa: BLE001
    # numpy raises ValueError for most, but the header is a Python literal
    # parsed by numpy: anything it raises means a bad header.
    raise CorruptRecordError("bad_npy", f"{name}: {e}") from None
  if dtype.hasobject:
    raise CorruptRecordError("pickled_object", f"{name}: dtype {dtype}")
  if dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None:
    raise CorruptRecordError("bad_array_dtype", f"{name}: dtype {dtype}")
  if any(not isinstance(d, int) or d < 0 for d in shape):
    raise CorruptRecordError("bad_npy", f"{name}: shape {shape}")
  count = math.prod(shape)
  offset = f.tell()
  if count * dtype.itemsize != len(raw) - offset:
    raise CorruptRecordError(
      "size_mismatch",
      f"{name}: shape {shape} of {dtype} needs {count * dtype.itemsize} "
      f"bytes, the member has {len(raw) - offset}",
    )
  if count == 0:
    return np.zeros(shape, dtype)
  flat = np.frombuffer(raw, dtype, count=count, offset=offset)
  if dtype.kind == "b" and flat.view(np.uint8).max() > 1:
    # numpy would keep the raw byte: a "bool" that is neither True nor False.
    raise CorruptRecordError("bad_npy", f"{name}: bool bytes other than 0 and 1")
  return flat.reshape(shape, order="F" if fortran else "C").copy()


def _parse_header(a: np.ndarray) -> dict:
  if a.dtype != np.uint8 or a.ndim != 1:
    raise CorruptRecordError("bad_header", f"header array of {a.dtype}, rank {a.ndim}")
  try:
    header = json.loads(a.tobytes().decode("utf-8"))
  except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, deep nesting, huge ints
    raise CorruptRecordError("bad_header", str(e)) from None
  if not isinstance(header, dict):
    raise CorruptRecordError("bad_header", f"a JSON {type(header).__name__}, not an object")
  unknown = set(header) - set(_SCALARS)
  if unknown or "prompt_id" not in header:
    raise CorruptRecordError(
      "bad_header", f"unknown keys {sorted(unknown)}" if unknown else "no prompt_id"
    )
  return header


def deserialize(
  data: bytes, max_length: int = DEFAULT_MAX_LENGTH, routing_choices: int = DEFAULT_ROUTING_CHOICES
) -> Trajectory:
  """The Trajectory in `data`, or CorruptRecordError(reason).

  Structural checks only: the values are as stored (any numeric dtype);
  `trajectory.checked` canonicalizes and validates them. `max_length` (the
  longest trajectory the reader accepts) bounds what the record may declare
  before a byte of it is decompressed; see the module docstring.
  `routing_choices` (M x k) bounds a routing record's member the same way.
  """
  if not isinstance(data, (bytes, bytearray, memoryview)):
    raise CorruptRecordError("not_bytes", type(data).__name__)
  member_cap, header_cap, routing_cap, total_cap = _caps(max_length, routing_choices)
  if len(data) > total_cap + _ZIP_OVERHEAD:
    raise CorruptRecordError(
      "record_too_large",
      f"{len(data)} bytes, cap {total_cap + _ZIP_OVERHEAD} for max_length {max_length}",
    )
  try:
    zf = zipfile.ZipFile(io.BytesIO(data))
  except Exception as e:  # noqa: BLE001
    # BadZipFile mostly; a crafted central directory can make zipfile raise
    # other things (struct.error, ValueError, ...).
    raise CorruptRecordError("not_npz", str(e)) from None
  with zf:
    infos = zf.infolist()
    names = [i.filename for i in infos]
    if (
      len(names) != len(set(names))
      or not _MEMBERS <= set(names)
      or not set(names) <= _MEMBERS | _OPTIONAL_MEMBERS
    ):
      raise CorruptRecordError("bad_members", f"{sorted(names)[:10]}")
    # Every cap before anything is decompressed.
    total = 0
    for info in infos:
      cap = {"header.npy": header_cap, "routing.npy": routing_cap}.get(info.filename, member_cap)
      if info.file_size > cap:
        raise CorruptRecordError(
          "member_too_large",
          f"{info.filename} declares {info.file_size} bytes "
          f"uncompressed, cap {cap} for max_length {max_length}",
        )
      if info.flag_bits & 0x1:
        raise CorruptRecordError("encrypted_member", info.filename)
      if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise CorruptRecordError("bad_compression", f"{info.filename}: method {info.compress_type}")
      total += info.file_size
    if total > total_cap:
      raise CorruptRecordError(
        "record_too_large", f"members declare {total} bytes uncompressed, cap {total_cap}"
      )
    arrays = {
      info.filename[: -len(".npy")]: _parse_npy(_read_member(zf, info), info.filename)
      for info in infos
    }
  header = _parse_header(arrays.pop("header"))
  return Trajectory(**arrays, **header)


class TrajectoryWriter:
  """Appends trajectories to one ArrayRecord shard, atomically.

  Records go to `<path>.tmp-<pid>`; `close` renames that to `path` (after an
  fsync), so `path` either does not exist or is a complete shard: a writer
  killed before close leaves only its temporary file (never read: readers
  take explicit shard paths), and leaving the `with` block by an exception
  discards the temporary file, because a run that failed mid-collection
  collects again on resume. A `path` written before is replaced whole.
  For an object store the temporary file is local and `close` uploads it
  (`files.staging_path` / `files.publish`).
  """

  def __init__(self, path: str):
    self.path = path
    self.tmp_path = files.staging_path(path)
    self._writer = array_record_module.ArrayRecordWriter(self.tmp_path, "group_size:1")
    if not self._writer.ok():
      raise OSError(f"Cannot write the trajectory shard {self.tmp_path}.")
    self.count = 0
    self._closed = False

  def write(self, t: Trajectory) -> None:
    if self._closed:
      raise ValueError(f"TrajectoryWriter for {self.path} is closed.")
    self._writer.write(serialize(t))
    self.count += 1

  def close(self, path: str | None = None) -> None:
    """Finishes the shard and moves it to `path` (default: the one it was
    opened for; another name beside it, if given). Idempotent."""
    if self._closed:
      return
    self._closed = True
    self.path = path or self.path
    try:
      self._writer.close()
      files.publish(self.tmp_path, self.path)
    except BaseException:
      _remove(self.tmp_path)
      raise

  def abort(self) -> None:
    """Drops what was written; `path` is left as it was. Idempotent."""
    if self._closed:
      return
    self._closed = True
    try:
      self._writer.close()
    except Exception:  # noqa: BLE001
      pass  # the file is going anyway
    _remove(self.tmp_path)

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *exc):
    if exc_type is None:
      self.close()
    else:
      self.abort()


def _remove(path: str) -> None:
  try:
    os.remove(path)
  except FileNotFoundError:
    pass


def _read_shard(path: str, counts: collections.Counter) -> list[bytes]:
  """The records of one shard; a shard or record that cannot be read is
  counted ("missing_shard", "corrupt_shard", "corrupt_record") and skipped.

  A truncated shard (its footer gone) cannot be opened at all, so it counts
  as one corrupt shard; in a shard that opens, a record whose chunk fails
  its hash is counted alone and the others are kept.
  """
  copies = files.LocalCopies()
  try:
    local = copies.get(path)
  except (FileNotFoundError, IsADirectoryError):
    local = None
  try:
    if local is None or not os.path.isfile(local):
      counts["missing_shard"] += 1
      return []
    return _read_local_shard(local, counts)
  finally:
    copies.close()


def _read_local_shard(path: str, counts: collections.Counter) -> list[bytes]:
  try:
    reader = array_record_module.ArrayRecordReader(path)
  except Exception:  # noqa: BLE001
    counts["corrupt_shard"] += 1
    return []
  try:
    if not reader.ok():  # the constructor reports a bad file here, not by raising
      counts["corrupt_shard"] += 1
      return []
    try:
      return list(reader.read_all())
    except Exception:  # noqa: BLE001
      pass  # some record is bad: read them one at a time to keep the others
    records = []
    for i in range(reader.num_records()):
      try:
        records.append(reader.read([i])[0])
      except Exception:  # noqa: BLE001
        counts["corrupt_record"] += 1
    return records
  finally:
    try:
      reader.close()
    except Exception:  # noqa: BLE001
      pass  # closing a reader that failed to open raises; nothing to release


def read_valid_trajectories(
  paths: list[str] | str,
  vocab_size: int,
  max_length: int,
  shuffle_seed: int | None = None,
) -> tuple[list[Trajectory], collections.Counter]:
  """The valid trajectories in `paths` (canonical copies), and what was dropped.

  Never raises for bad data in a shard: a missing or unreadable shard, a
  record that cannot be read or deserialised, and a trajectory that fails
  validation are each counted under a reason (SHARD_REASONS, RECORD_REASONS,
  trajectory.REJECT_REASONS) and skipped, so the other shards still serve.
  Only if nothing valid is left does it raise NoValidTrajectoriesError, whose
  message names the shards and the counts: training on nothing is not an
  option the caller can recover from silently.

  Returns:
    (trajectories in shard order, or shuffled by `shuffle_seed`; Counter of
    dropped shards and records per reason).
  """
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]  # one shard, not a list of one-character paths
  paths = [os.fspath(p) for p in paths]
  counts: collections.Counter = collections.Counter()
  out: list[Trajectory] = []
  for path in paths:
    for data in _read_shard(path, counts):
      try:
        t = deserialize(data, max_length)
      except CorruptRecordError as e:
        counts[e.reason] += 1
        continue
      except Exception:  # noqa: BLE001
        counts["deserialize_error"] += 1  # a bug or a case not foreseen: still counted
        continue
      try:
        canon, reason = checked(t, vocab_size, max_length)
      except Exception:  # noqa: BLE001
        canon, reason = None, "validation_error"
      if reason is not None:
        counts[reason] += 1
      else:
        out.append(canon)
  if not out:
    raise NoValidTrajectoriesError(
      f"No valid trajectory in {len(paths)} shard(s) {paths[:5]}; dropped: {dict(counts)}."
    )
  if shuffle_seed is not None:
    order = np.random.default_rng(shuffle_seed).permutation(len(out))
    out = [out[i] for i in order]
  return out, counts


def read_trajectories(
  paths: list[str],
  shuffle_seed: int | None = None,
  vocab_size: int | None = None,
  max_length: int = DEFAULT_MAX_LENGTH,
):
  """A lazy grain MapDataset of Trajectory records over the given shards.

  For pipelines that want grain; a bad record raises CorruptRecordError
  (with a reason) when it is reached, and an unreadable shard makes grain
  raise when the dataset is built. Records come back canonicalized, and
  validated too when `vocab_size` is given. The trainer uses
  `read_valid_trajectories`, which skips and counts instead. Local paths
  only (grain opens the files itself).
  """
  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))
  if shuffle_seed is not None:
    ds = ds.shuffle(seed=shuffle_seed)

  def load(data: bytes) -> Trajectory:
    t = deserialize(data, max_length)
    canon, reason = checked(t, vocab_size if vocab_size is not None else 2**31 - 1, max_length)
    if reason is not None:
      raise CorruptRecordError(reason, "invalid trajectory")
    return canon

  return ds.map(load)
