"""The workdir's files: POSIX paths and object-store URLs behind one interface.

Every file the project writes under a workdir or a fleet root goes through
here, so a workdir may be a POSIX path (local disk, NFS / Filestore, a
gcsfuse mount) or an object-store URL such as `gs://bucket/run`. POSIX is
the fast path: plain `os` calls, as before. A URL goes through fsspec (for
gs://, gcsfs: the `gcs` extra); orbax and tensorstore speak gs:// natively
(sao_jax/data/checkpoint.py hands them the URL).

Publication is atomic either way, so a reader (another process, a
restarted run, a rollout host) sees the old file or the new one, never a
partial write:

  * POSIX: the bytes go to a temporary name in the same directory (the
    writer's pid in it, so two writers of one path do not trample each
    other), are fsynced where it matters, and a rename publishes them;
  * an object store: an object becomes visible only when its upload
    completes (GCS's simple, multipart and resumable uploads alike), so the
    object is its own marker. What cannot be written in place (an
    ArrayRecord shard, a growing metrics file) is written to a local file
    and uploaded whole (`staging_path` / `publish`, `Appender`); a writer
    killed before it uploads leaves that local file in the temp directory.

Object stores have no directories (`makedirs` is a no-op there) and no
atomic rename of a tree, which is why orbax marks a finished checkpoint on
them with a commit file (`renames_atomically`).

One client serves every gs:// access of a process: etils.epath (orbax's
path layer) would pick TensorFlow's GCS client whenever TensorFlow is
importable; `EPATH_USE_TF=false` (unless the user set it) keeps it on
fsspec / gcsfs, the client the rest of this module uses. gcsfs caches
listings for ever by default, which is wrong where other processes write:
a rollout's orbax, having listed the weights once, would never see a new
version; the listings cache is off for gs:// (fsspec's config, unless set).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import shutil
import tempfile
import time
import uuid
import weakref

os.environ.setdefault("EPATH_USE_TF", "false")


def _configure_fsspec() -> None:
  try:
    import fsspec.config
  except ImportError:
    return  # no object stores in this process
  for protocol in ("gs", "gcs"):
    fsspec.config.conf.setdefault(protocol, {}).setdefault("use_listings_cache", False)


_configure_fsspec()


class StorageError(OSError):
  """A workdir that cannot be reached or written; the message is one line."""


def is_url(path: str) -> bool:
  """An object-store URL (`scheme://...`), not a POSIX path."""
  return "://" in os.fspath(path)


def renames_atomically(path: str) -> bool:
  """Whether a directory renamed into place is published atomically at `path`
  (POSIX filesystems; not object stores, which have no directories)."""
  return not is_url(path)


def join(path: str, *parts: str) -> str:
  return posixpath.join(path, *parts) if is_url(path) else os.path.join(path, *parts)


def absolute(path: str) -> str:
  """`path` made absolute (a URL is already)."""
  return path if is_url(path) else os.path.abspath(path)


def _fs(path: str):
  """(fsspec filesystem, the path in its terms) for a URL; StorageError if
  this process has no client for its scheme."""
  scheme = path.split("://", 1)[0]
  try:
    import fsspec

    return fsspec.core.url_to_fs(path)
  except (ImportError, ValueError) as e:  # the client is not installed / an unknown scheme
    hint = " (pip install -e '.[gcs]')" if scheme in ("gs", "gcs") else ""
    raise StorageError(
      f"no client for {scheme}:// URLs{hint}: {' '.join(str(e).split())[:200]}"
    ) from None


def makedirs(path: str) -> None:
  """Creates the directory `path` (and its parents); a no-op on object stores."""
  if not is_url(path):
    os.makedirs(path, exist_ok=True)


def exists(path: str) -> bool:
  if not is_url(path):
    return os.path.exists(path)
  fs, p = _fs(path)
  return fs.exists(p)


def _name(p: str) -> str:
  return posixpath.basename(p.rstrip("/"))


def listdir(path: str) -> list[str]:
  """The names in the directory `path`; FileNotFoundError if there is none
  (on an object store: no object under the prefix)."""
  if not is_url(path):
    return os.listdir(path)
  fs, p = _fs(path)
  fs.invalidate_cache(p)  # another process writes here: never a cached listing
  return [_name(x) for x in fs.ls(p, detail=False)]


def _mtime(info: dict) -> float:
  for key in ("mtime", "updated", "LastModified", "last_modified", "created"):
    value = info.get(key)
    if value is None:
      continue
    if isinstance(value, (int, float)):
      return float(value)
    if hasattr(value, "timestamp"):
      return value.timestamp()
    import datetime

    return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
  return 0.0


def scan(path: str) -> list[tuple[str, float]]:
  """(name, modification time) of each file in the directory `path` (none if
  it does not exist), in one listing."""
  if not is_url(path):
    out = []
    try:
      with os.scandir(path) as entries:
        for e in entries:
          try:
            out.append((e.name, e.stat().st_mtime))
          except FileNotFoundError:
            continue
    except FileNotFoundError:
      pass
    return out
  fs, p = _fs(path)
  fs.invalidate_cache(p)
  try:
    infos = fs.ls(p, detail=True)
  except FileNotFoundError:
    return []
  return [(_name(i["name"]), _mtime(i)) for i in infos if i.get("type") != "directory"]


def mtime(path: str) -> float:
  if not is_url(path):
    return os.path.getmtime(path)
  fs, p = _fs(path)
  return _mtime(fs.info(p))


def remove(path: str) -> None:
  """Removes the file `path`; nothing if it is not there."""
  try:
    if not is_url(path):
      os.remove(path)
    else:
      fs, p = _fs(path)
      fs.rm_file(p)
  except FileNotFoundError:
    pass


def rmtree(path: str) -> None:
  """Removes the directory `path` and everything under it, if there."""
  if not is_url(path):
    shutil.rmtree(path, ignore_errors=True)
    return
  fs, p = _fs(path)
  try:
    fs.rm(p, recursive=True)
  except FileNotFoundError:
    pass


def read_bytes(path: str, limit: int | None = None) -> bytes:
  """The file's bytes (at most `limit`); FileNotFoundError if missing."""
  if not is_url(path):
    with open(path, "rb") as f:
      return f.read() if limit is None else f.read(limit)
  fs, p = _fs(path)
  with fs.open(p, "rb") as f:
    return f.read() if limit is None else f.read(limit)


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


def read_json(path: str):
  return json.loads(read_bytes(path))


def write_bytes(path: str, data: bytes) -> None:
  """`data` at `path`, atomically; creates the parent directory."""
  if is_url(path):
    fs, p = _fs(path)
    fs.pipe_file(p, data)
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
  """`text` at `path`, atomically; creates the parent directory."""
  write_bytes(path, text.encode("utf-8"))


def write_json(path: str, value, **dump_kwargs) -> None:
  """`value` as JSON at `path`, atomically (`dump_kwargs` go to `json.dumps`)."""
  write_text(path, json.dumps(value, **dump_kwargs))


# --- files written locally, then published ------------------------------------------

TMP_MARK = ".tmp-"


def staging_path(path: str) -> str:
  """Where to write a file that `publish(staging, path)` will make visible at
  `path`: `<path>.tmp-<pid>` beside it on POSIX (its parent created), a
  fresh local temporary file for an object store."""
  if not is_url(path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return f"{path}{TMP_MARK}{os.getpid()}"
  fd, tmp = tempfile.mkstemp(prefix="sao_jax-", suffix="-" + posixpath.basename(path))
  os.close(fd)
  return tmp


def publish(staging: str, path: str) -> None:
  """Makes the finished local file `staging` visible at `path` in one step:
  an fsync and a rename on POSIX, an upload (and the local file removed)
  for an object store. On failure `staging` is left for the caller."""
  if not is_url(path):
    fd = os.open(staging, os.O_RDONLY)
    try:
      os.fsync(fd)  # the data is on disk before the name points at it
    finally:
      os.close(fd)
    os.replace(staging, path)
    return
  fs, p = _fs(path)
  fs.put_file(staging, p)
  os.remove(staging)


class LocalCopies:
  """Local paths of files to read with libraries that take only local files
  (ArrayRecord): a POSIX path is itself; an object is downloaded once into a
  private temporary directory, kept until `drop` or `close`."""

  def __init__(self):
    self._dir: str | None = None
    self._held: dict[str, str] = {}

  def get(self, path: str) -> str:
    """A local path with the bytes of `path`; FileNotFoundError if missing."""
    if not is_url(path):
      return path
    if path not in self._held:
      if self._dir is None:
        self._dir = tempfile.mkdtemp(prefix="sao_jax-copies-")
        # Removed at exit (or when collected) even if `close` is never called.
        weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
      local = os.path.join(self._dir, f"{len(self._held)}-{posixpath.basename(path)}")
      fs, p = _fs(path)
      fs.get_file(p, local)
      self._held[path] = local
    return self._held[path]

  def drop(self, path: str) -> None:
    local = self._held.pop(path, None)
    if local is not None:
      try:
        os.remove(local)
      except FileNotFoundError:
        pass

  def close(self) -> None:
    for path in list(self._held):
      self.drop(path)
    if self._dir is not None:
      shutil.rmtree(self._dir, ignore_errors=True)
      self._dir = None


class Appender:
  """A text file that grows by lines (metrics.jsonl).

  POSIX: appended and flushed at each `write`. An object store: a local copy
  (the existing object's bytes first, so a resumed run continues it),
  uploaded whole at the first `write`, then at most every `sync_seconds`,
  and at `close`: a killed writer loses at most the last `sync_seconds` of
  lines (a resumed run records its steps after the checkpoint again anyway).
  """

  def __init__(self, path: str, sync_seconds: float = 5.0):
    self.path = path
    self.sync_seconds = sync_seconds
    self._synced = float("-inf")
    self._dirty = False
    if not is_url(path):
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
      self._local, self._object = path, False
    else:
      self._local, self._object = staging_path(path), True
      try:
        data = read_bytes(path)
      except FileNotFoundError:
        data = b""
      with open(self._local, "wb") as f:
        f.write(data)
    self._f = open(self._local, "a", encoding="utf-8")

  def write(self, text: str) -> None:
    self._f.write(text)
    self._f.flush()
    if self._object:
      self._dirty = True
      if time.monotonic() - self._synced >= self.sync_seconds:
        self.sync()

  def sync(self) -> None:
    """Uploads what was written (object stores; a no-op on POSIX)."""
    if self._object and self._dirty:
      fs, p = _fs(self.path)
      fs.put_file(self._local, p)
      self._synced, self._dirty = time.monotonic(), False

  def close(self) -> None:
    self._f.close()
    if self._object:
      self.sync()
      os.remove(self._local)


# --- the workdir check ---------------------------------------------------------------


def check_writable(path: str) -> float | None:
  """Creates the directory `path` and proves it writable with a probe file
  (written, flushed to disk, removed); returns its free GiB (None for an
  object store, which has no such limit). StorageError (one line) if not."""
  probe = join(path, f".write_probe_{uuid.uuid4().hex}")
  if not is_url(path):
    try:
      os.makedirs(path, exist_ok=True)
      with open(probe, "wb") as f:
        f.write(b"\0" * 4096)
        f.flush()
        os.fsync(f.fileno())
      os.remove(probe)
    except OSError as e:
      raise StorageError(f"not writable: {e.strerror or e}") from None
    return shutil.disk_usage(path).free / 2**30
  try:
    fs, p = _fs(probe)
  except StorageError as e:
    raise StorageError(f"not writable: {e}") from None
  # The client logs each failed retry with its traceback; the error below
  # says it in one line.
  client_log = logging.getLogger(type(fs).__module__.split(".")[0])
  level = client_log.level
  client_log.setLevel(logging.CRITICAL)
  t0 = time.time()
  try:
    fs.pipe_file(p, b"\0" * 4096)
    fs.rm_file(p)
  except Exception as e:  # noqa: BLE001  # each client raises its own
    raise StorageError(_object_store_error(path, e, time.time() - t0)) from None
  finally:
    client_log.setLevel(level)
  return None


def _object_store_error(path: str, e: Exception, seconds: float) -> str:
  text = " ".join(str(e).split())[:300] or type(e).__name__
  code = getattr(e, "code", None)
  bucket = path.split("://", 1)[1].split("/", 1)[0]
  if isinstance(e, FileNotFoundError) or code == 404:
    return f"not writable: the bucket {bucket!r} does not exist ({text})"
  if code in (401, 403) or isinstance(e, PermissionError):
    return (
      f"not writable: no credentials with write access to {bucket!r} ({text}); "
      "on a TPU VM the host's service account needs roles/storage.objectUser, "
      "elsewhere run `gcloud auth application-default login`"
    )
  return f"unreachable after {seconds:.0f} s: {type(e).__name__}: {text}"
