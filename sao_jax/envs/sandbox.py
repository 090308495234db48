"""A sandbox for model-written code: a separate, limited, isolated process tree.

Model code is untrusted: it may loop, fork, daemonize, fill memory, open
sockets, read files, or signal any process it can reach.
`run_python(code, limits)` runs Python (`python -I -S`, an empty
environment, a fresh private temporary directory as its `/`) and
`run_shell(command, Workspace(directory))` runs `/bin/sh` over a workspace
(the repo_repair environment's bash tool); each returns a `SandboxResult`
with the (truncated) output once every process the call started is gone.
The process code is in sandbox_runner.py, the disk limits in
sandbox_disk.py.

Contract:

* Isolation is reported, never assumed: `isolation()` (and
  `shell_isolation()`, `disk_limits()`) name the measures that apply here
  ("netns", "ipcns", "chroot", "uid_pool", "pidns", "subreaper", "userns",
  "mounts", "tmpfs" / "disk_watchdog"), every `SandboxResult.isolation`
  repeats them, and `check_isolation` refuses (RuntimeError) where
  network, filesystem, user or process-cleanup isolation is missing unless
  explicitly allowed; `registry.make_env` calls it for the environments
  that run code.
* Nothing outlives a call: the model's processes are torn down with their
  PID namespace (or, where that is refused, killed by uid and confirmed
  gone in /proc), and the wall-clock limit kills the whole tree.
* `SandboxLimits` checks every field when made: no field has a "no limit"
  value, none exceeds what the machine has, and a limit the system refuses
  to set is an error (RuntimeError), never a call run without it.
* Concurrent calls run under different uids leased from `UidPool`
  (`DEFAULT_UIDS`, `set_uid_range`, or `SAO_SANDBOX_UIDS=first-last`); a
  uid whose processes were not confirmed gone is quarantined, never reused.
* A shell is never run unconfined: where mount namespaces are refused it is
  not run and the result says why (`mount_error`), unless
  `SandboxLimits(isolate=False)`. Its workspace and /tmp together hold at
  most `max_disk_bytes` and `max_disk_files`; a call that hit them is not
  `ok` (`SandboxResult.disk_limit`).
* Output is truncated to `limits.max_output_chars`; whatever happened
  (exception, limit hit, timeout) comes back as text for the observation.

How the three processes, the measures and the cleanup work, and why:
docs/design/sandbox.md.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import functools
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

# The supervisor, init and model process (docs/design/sandbox.md) are one
# script, sandbox_runner.py next to this file, run by `python -I -S -c` with a
# last line `exec(*main({...}))` added (see that file's docstring).
_RUNNER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_runner.py")
# A shell's disk limits, also run by the supervisor: appended to the runner's text.
_DISK_PATH = os.path.join(os.path.dirname(_RUNNER_PATH), "sandbox_disk.py")


@functools.lru_cache(maxsize=1)
def _runner() -> str:
  """The runner's text (read by path: this module also runs loaded from its file alone)."""
  texts = []
  for path in (_RUNNER_PATH, _DISK_PATH):
    with open(path, encoding="utf-8") as f:
      texts.append(f.read())
  return "\n".join(texts)


# Default uid range of the pool (inclusive); docs/design/sandbox.md says why this one.
DEFAULT_UIDS = (60160, 61183)
# How long the trainer waits beyond the wall-clock limit for the supervisor,
# which enforces that limit itself, before it kills it.
_GRACE_SECONDS = 10.0
_LOCK_DIRS = ("/run/sao_sandbox_uids", "/tmp/sao_sandbox_uids")
# Tests switch this off to exercise the cleanup without a PID namespace.
_PIDNS = True
# Tests switch this off to exercise a shell where mount namespaces are refused.
_MOUNTNS = True
# Tests switch this off to exercise the disk watchdog where no tmpfs is mounted.
_TMPFS = True
# How often the watchdog measures (sandbox_disk.WATCH_SECONDS), for the log.
_WATCH_MS = 10
# Where the supervisor mounts a shell's tmpfs (in the call's directory, a
# mount point of its own) before binding its repo/ and tmp/ into place.
_DISK_TOP = ".disk"


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """One call's limits; `validate` (run on construction) refuses what cannot hold."""

  cpu_seconds: int = 2
  wall_seconds: float = 5.0
  # Address space (RLIMIT_AS).
  memory_bytes: int = 512 * 2**20
  # The largest file it may write (RLIMIT_FSIZE; its output is a file too).
  max_file_bytes: int = 64 * 2**10
  max_open_files: int = 32
  max_processes: int = 16
  max_output_chars: int = 400
  # A shell's workspace and /tmp together: bytes allocated (a page per small
  # file) and entries, held while the call runs (module docstring).
  max_disk_bytes: int = 16 * 2**20
  max_disk_files: int = 2000
  # Namespaces, chroot and a uid of its own, where permitted.
  isolate: bool = True

  def __post_init__(self):
    self.validate()

  def validate(self) -> None:
    """Raises ValueError, one line naming the field, its value and the allowed
    range, for a limit the sandbox cannot hold: a wrong type, a value below
    the least that works (no field has a "no limit" value: -1, 0 and
    negatives are refused) or above what this machine has."""
    for name, low, high, why in _ranges():
      value = getattr(self, name)
      number = (int, float) if name == "wall_seconds" else int
      if (
        not isinstance(value, number) or isinstance(value, bool) or not low <= value <= high
      ):  # NaN too
        kind = "a number" if name == "wall_seconds" else "an integer"
        raise ValueError(
          f"sandbox limit {name} = {value!r}: must be {kind} in "
          f"[{low}, {high}] ({why}); no value means 'no limit'"
        )
    if not isinstance(self.isolate, bool):
      raise ValueError(f"sandbox limit isolate = {self.isolate!r}: must be True or False")


_DAY = 86400.0


@functools.lru_cache(maxsize=1)
def _ranges() -> tuple[tuple[str, float, float, str], ...]:
  """(field, least, most, why) of each numeric limit, the most from this machine.

  A call's rlimits are set after it dropped its privileges, so none can go
  above the trainer's hard limit; memory and a shell's tmpfs cannot go
  above the memory the trainer may use.
  """
  memory = _memory_bytes()
  page = os.sysconf("SC_PAGE_SIZE")
  try:
    st = os.statvfs(tempfile.gettempdir())
    disk = st.f_blocks * st.f_frsize
  except OSError:
    disk = 1 << 50
  return (
    (
      "cpu_seconds",
      1,
      min(int(_DAY), _hard("CPU", 1 << 62) - 1),
      "at most a day, under the trainer's hard RLIMIT_CPU",
    ),
    ("wall_seconds", 0.01, _DAY, "seconds, at most a day"),
    (
      "memory_bytes",
      32 << 20,
      min(memory, _hard("AS", memory)),
      "from 32 MiB, as the interpreter alone maps 15 MiB, to this host's memory",
    ),
    (
      "max_file_bytes",
      1,
      min(disk, _hard("FSIZE", disk)),
      "up to the size of the temporary directory's filesystem",
    ),
    (
      "max_open_files",
      8,
      _hard("NOFILE", 1 << 20),
      "from 8, the standard streams and a shell's loader, to the trainer's hard RLIMIT_NOFILE",
    ),
    (
      "max_processes",
      1,
      _hard("NPROC", _read_int("/proc/sys/kernel/threads-max", 1 << 22)),
      "1 forbids forking; up to the trainer's hard RLIMIT_NPROC",
    ),
    ("max_output_chars", 1, 1 << 30, "characters of a tool answer, at most 2**30"),
    ("max_disk_bytes", page, memory, "from a page to this host's memory, which a tmpfs takes"),
    ("max_disk_files", 1, 1 << 20, "entries, at most 2**20: each is kernel memory in a tmpfs"),
  )


def _hard(name: str, otherwise: int) -> int:
  """The trainer's hard RLIMIT_`name`, or `otherwise` where unlimited or unknown."""
  which = getattr(resource, "RLIMIT_" + name, None)
  if which is None:
    return otherwise
  hard = resource.getrlimit(which)[1]
  return otherwise if hard == resource.RLIM_INFINITY else hard


def _memory_bytes() -> int:
  """This host's physical memory, or the trainer's cgroup limit where lower."""
  total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    total = min(total, _read_int(path, total))
  return total


def _read_int(path: str, otherwise: int) -> int:
  try:
    with open(path, encoding="ascii") as f:
      return int(f.read().strip())
  except (OSError, ValueError):  # absent, or "max"
    return otherwise


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  stdout: str
  error: str  # last line of stderr (e.g. the exception), or a limit note
  returncode: int
  timed_out: bool
  seconds: float
  isolation: tuple[str, ...]
  # Why a shell's workspace could not be mounted ("": it was, or none was asked).
  mount_error: str = ""
  # A shell's call ended at max_disk_bytes / max_disk_files (module docstring).
  disk_limit: bool = False
  # Why its disk limits fell back from a tmpfs to the watchdog ("": they did not).
  tmpfs_error: str = ""

  @property
  def ok(self) -> bool:
    return self.returncode == 0 and not self.timed_out and not self.disk_limit

  def observation(self) -> str:
    """What the agent sees: output, then the error if the run failed."""
    if self.ok:
      return self.stdout
    error = self.error or f"error: exited with status {self.returncode} (nothing on stderr)"
    return (self.stdout + ("\n" if self.stdout else "") + error).strip("\n")


_SIGNAL_NOTES = {
  signal.SIGXCPU: "killed: cpu time limit",
  signal.SIGKILL: "killed",
  signal.SIGXFSZ: "killed: output size limit",
  signal.SIGSEGV: "killed: segmentation fault",
}


# --- the uid pool -----------------------------------------------------------------


class UidPool:
  """Thread-safe leases of uids `first..last` (inclusive), one per sandbox call.

  Within the process a lock and a queue of free uids (least recently used
  first, so that a uid is reused as late as possible); across processes an
  exclusive, non-blocking flock on `<lock dir>/<uid>`, held for the lease,
  so two trainers (or test workers) on one machine never share a uid. A uid
  goes back only after its supervisor confirmed that none of its processes
  is left; otherwise it is quarantined (kept locked, never reused).
  """

  def __init__(self, first: int, last: int, lock_dir: str | None = None):
    if not 0 < first <= last:
      raise ValueError(f"bad uid range {first}-{last}")
    taken, mapped = _passwd_uids(), _mapped_uids()
    self.first, self.last = first, last
    self._free = collections.deque(
      u for u in range(first, last + 1) if u not in taken and mapped(u)
    )
    if not self._free:
      raise ValueError(
        f"no uid in {first}-{last} is both free of users in /etc/passwd "
        "and mapped in this user namespace"
      )
    self._lock_dir = lock_dir or _lock_dir()
    self._held: dict[int, int] = {}
    self.quarantined: set[int] = set()
    self._cond = threading.Condition()

  def lease(self, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    with self._cond:
      while True:
        for _ in range(len(self._free)):
          uid = self._free.popleft()
          fd = self._try_lock(uid)
          if fd is not None:
            self._held[uid] = fd
            return uid
          self._free.append(uid)  # another process has it
        left = deadline - time.monotonic()
        if left <= 0:
          raise RuntimeError(
            f"sandbox: no free uid in {self.first}-{self.last} after {timeout:g}s "
            f"({len(self._held)} leased here, {len(self.quarantined)} quarantined)"
          )
        self._cond.wait(min(left, 0.05))  # other processes' locks don't notify

  def release(self, uid: int) -> None:
    with self._cond:
      os.close(self._held.pop(uid))
      self._free.append(uid)
      self._cond.notify()

  def quarantine(self, uid: int) -> None:
    with self._cond:
      self.quarantined.add(uid)  # its lock stays held: no process reuses it
    _log(f"WARNING: uid {uid} may still have processes; it is quarantined, not reused")

  def _try_lock(self, uid: int) -> int | None:
    fd = os.open(
      os.path.join(self._lock_dir, str(uid)),
      os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
      0o600,
    )
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      os.close(fd)
      return None
    return fd


def _passwd_uids() -> set[int]:
  uids = set()
  try:
    with open("/etc/passwd", encoding="utf-8", errors="replace") as f:
      for line in f:
        parts = line.split(":")
        if len(parts) > 2 and parts[2].isdigit():
          uids.add(int(parts[2]))
  except OSError:
    pass
  return uids


def _mapped_uids():
  """Whether a uid exists in this user namespace (a container may map few)."""
  ranges = []
  try:
    with open("/proc/self/uid_map", encoding="ascii") as f:
      for line in f:
        inside, _, count = map(int, line.split())
        ranges.append((inside, inside + count))
  except (OSError, ValueError):
    return lambda uid: True
  return lambda uid: any(a <= uid < b for a, b in ranges)


def _lock_dir() -> str:
  """A root-owned directory, writable by root only, for the uid locks."""
  for path in _LOCK_DIRS:
    try:
      os.makedirs(path, mode=0o700, exist_ok=True)
      st = os.lstat(path)
    except OSError:
      continue
    if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022:
      return path
  raise RuntimeError(f"sandbox: no safe directory for uid locks among {_LOCK_DIRS}")


_pool: UidPool | None = None
_pool_lock = threading.Lock()


def set_uid_range(first: int, last: int) -> None:
  """Leases uids `first..last` (inclusive) from now on (root only)."""
  global _pool  # noqa: PLW0603  # the process's one pool, under _pool_lock
  with _pool_lock:
    _pool = UidPool(first, last)


def _uid_pool() -> UidPool:
  global _pool  # noqa: PLW0603  # the process's one pool, under _pool_lock
  with _pool_lock:
    if _pool is None:
      env = os.environ.get("SAO_SANDBOX_UIDS")
      first, last = DEFAULT_UIDS
      if env:
        first, _, last = env.partition("-")
        first, last = int(first), int(last or first)
      _pool = UidPool(first, last)
    return _pool


# --- running code -----------------------------------------------------------------


def run_python(
  code: str, limits: SandboxLimits = SandboxLimits(), preload: tuple[str, ...] = ()
) -> SandboxResult:
  """Runs `code` in the sandbox and returns its (truncated) result.

  `preload` names standard modules to import before the chroot, which
  leaves only already-imported modules importable (a benchmark's prompts
  import `typing`, its solutions `hashlib`, ...). Returns only after every
  process the code started is gone.
  """
  return _run(code, limits, tuple(preload), None, None)


# Where a shell finds its programs: these host directories appear read-only at
# the same paths in the chroot (a symlink, as /bin -> usr/bin is on merged-/usr
# systems, is recreated as the same symlink), with the interpreter's prefix.
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/usr")
# Device files a shell expects, bound where the kernel allows (else absent).
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
SHELL_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclasses.dataclass(frozen=True)
class Workspace:
  """A shell's filesystem in the sandbox (`run_shell`).

  The chroot gets the system directories (`SYSTEM_DIRS`, and
  `sys.base_prefix` when it lies elsewhere) bind-mounted read-only, /dev/null,
  /dev/zero and /dev/urandom, an empty writable /tmp, and `directory` (a host
  directory) bind-mounted read-write at `path`, the shell's working directory.
  The mounts are made in a mount namespace of the sandbox's own, with
  private propagation, so the trainer never sees them, and they vanish with
  the sandbox. As root the directory is handed to the call's uid first
  (`lchown`, never following links). Where mount namespaces are refused the
  command is not run: the result's isolation lacks "mounts" and "chroot" and
  `SandboxResult.mount_error` says why (`check_isolation(shell=True)` refuses
  such a machine unless allowed). With `SandboxLimits(isolate=False)` the
  shell runs in `directory` itself, unisolated.
  """

  directory: str
  path: str = "/repo"
  # Host directories hidden under an empty one where the system directories
  # would show them (say, task data or the trainer's package installed under
  # /usr): the shell cannot read what lies there.
  hide: tuple[str, ...] = ()


def run_shell(
  command: str,
  workspace: Workspace,
  limits: SandboxLimits = SandboxLimits(),
  env: dict | None = None,
) -> SandboxResult:
  """Runs `command` with /bin/sh in the sandbox, `workspace` its working directory.

  The same isolation, limits and cleanup as `run_python`, plus the
  workspace's mounts. `env` adds to the shell's environment (PATH, HOME=/tmp,
  LANG=C.UTF-8, PYTHONDONTWRITEBYTECODE=1). Returns once every process the
  command started is gone.
  """
  shell_env = {
    "PATH": SHELL_PATH,
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    **(env or {}),
  }
  # The command travels as a script file, like run_python's code (an argument's
  # size is limited).
  return _run(command, limits, (), workspace, ("/bin/sh",), shell_env)


def _system_binds(workdir: str, hide: tuple[str, ...] = ()) -> list:
  """Prepares `workdir` as a shell's root: mount points, symlinks, /tmp; the binds."""
  binds, dirs = [], list(SYSTEM_DIRS)
  prefix = os.path.realpath(sys.base_prefix)
  if not any(prefix == d or prefix.startswith(d + "/") for d in dirs):
    dirs.append(prefix)
  for d in dirs:
    target = workdir + d
    if os.path.islink(d):
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.symlink(os.readlink(d), target)
    elif os.path.isdir(d):
      os.makedirs(target, mode=0o755, exist_ok=True)
      binds.append((d, target, False, True))
  os.makedirs(os.path.join(workdir, "dev"), mode=0o755)
  for d in _DEVICES:
    if os.path.exists(d):
      open(workdir + d, "w").close()
      binds.append((d, workdir + d, True, False))
  os.makedirs(os.path.join(workdir, "tmp"))
  os.chmod(os.path.join(workdir, "tmp"), 0o1777)
  bound = [source for source, _, _, required in binds if required]
  empty = os.path.join(workdir, ".hidden")
  for path in sorted({os.path.realpath(h) for h in hide}):
    if os.path.isdir(path) and any(path == b or path.startswith(b + "/") for b in bound):
      os.makedirs(empty, mode=0o755, exist_ok=True)
      binds.append((empty, workdir + path, False, True))  # mounted after what it covers
  return binds


def _hand_to(directory: str, uid: int) -> None:
  """Every file under `directory` (links themselves, never followed) to `uid`."""
  os.lchown(directory, uid, uid)
  for root, dirs, files in os.walk(directory, followlinks=False):
    for name in dirs + files:
      try:
        os.lchown(os.path.join(root, name), uid, uid)
      except OSError:
        pass


def _unmount_points(workdir: str, binds: list) -> bool:
  """Removes the (unmounted) mount points; False if one is still in use."""
  ok = True
  for _, target, _, _ in binds:
    if not os.path.lexists(target):  # a hidden path's mount point lay in a bound directory
      continue
    try:
      (os.rmdir if os.path.isdir(target) and not os.path.islink(target) else os.unlink)(target)
    except OSError:
      ok = False
  return ok


@dataclasses.dataclass
class _Progress:
  """How far a call got, which its cleanup needs to know.

  The mount points made ready (removed at the end), whether the supervisor
  started, and whether it reported that no process of the uid is left (else
  the uid is quarantined).
  """

  binds: list = dataclasses.field(default_factory=list)
  started: bool = False
  clean: bool = False


def _run(
  code: str,
  limits: SandboxLimits,
  preload: tuple,
  workspace: Workspace | None,
  argv: tuple | None = None,
  env: dict | None = None,
) -> SandboxResult:
  """One call: its directory and uid, the runner, the result; then the cleanup."""
  start = time.monotonic()
  linux = sys.platform.startswith("linux")
  isolate = bool(limits.isolate and linux)
  pool = _uid_pool() if isolate and os.geteuid() == 0 else None
  workdir = tempfile.mkdtemp(prefix="sao_sandbox_")
  uid = None
  progress = _Progress()
  try:
    uid = pool.lease() if pool else None
    cwd, host_cwd = _prepare(workdir, code, workspace, isolate, uid, progress)
    lim = dataclasses.asdict(limits)
    lim.update(
      isolate=isolate,
      uid=uid,
      report_fd=None,
      pidns=_PIDNS,
      preload=tuple(preload),
      mountns=_MOUNTNS,
      binds=progress.binds,
      cwd=cwd,
      host_cwd=host_cwd,
      argv=list(argv or ()),
      env=env or {},
      disk=_disk(workdir, cwd, host_cwd, limits, isolate) if workspace else None,
    )
    report, returncode, timed_out = _launch(workdir, lim, limits, workspace is None, progress)
    return _result(report, returncode, timed_out, workdir, limits, workspace, start, progress)
  finally:
    if uid is not None:
      if progress.clean or not progress.started:
        pool.release(uid)
      else:
        pool.quarantine(uid)
    if _unmount_points(workdir, progress.binds):
      shutil.rmtree(workdir, ignore_errors=True)
    else:  # never delete through a mount that is somehow still there
      _log(f"WARNING: {workdir} still has a mount; left in place")


def _prepare(
  workdir: str,
  code: str,
  workspace: Workspace | None,
  isolate: bool,
  uid: int | None,
  progress: _Progress,
) -> tuple[str, str]:
  """Writes the code into `workdir` and, for a shell, prepares its mounts.

  Returns the shell's working directory in the chroot and on the host ("" for
  Python); the mounts go into `progress.binds` as they are made ready.
  """
  os.chmod(workdir, 0o755)
  with open(os.path.join(workdir, "code.py"), "w", encoding="utf-8") as f:
    f.write(code)
  cwd = host_cwd = ""
  if workspace is not None:
    host_cwd = os.path.realpath(workspace.directory)
    if isolate:
      progress.binds = _system_binds(workdir, tuple(workspace.hide))
      cwd = "/" + workspace.path.strip("/")
      os.makedirs(workdir + cwd, mode=0o755)
      progress.binds.append((host_cwd, workdir + cwd, True, True))
      os.mkdir(os.path.join(workdir, _DISK_TOP), 0o700)
      if uid is not None:
        _hand_to(host_cwd, uid)
  return cwd, host_cwd


def _disk(workdir: str, cwd: str, host_cwd: str, limits: SandboxLimits, isolate: bool) -> dict:
  """A shell's disk limits for the runner (sandbox_disk.py): where the
  workspace lies on the host and in the chroot, /tmp, the limits, and whether
  to mount a tmpfs (else the watchdog watches the host's directories)."""
  return {
    "host": host_cwd,
    "target": workdir + cwd if isolate else host_cwd,
    "tmp": os.path.join(workdir, "tmp") if isolate else "",
    "top": os.path.join(workdir, _DISK_TOP),
    "bytes": limits.max_disk_bytes,
    "files": limits.max_disk_files,
    "tmpfs": isolate and _TMPFS,
  }


def _launch(
  workdir: str, lim: dict, limits: SandboxLimits, stderr_apart: bool, progress: _Progress
) -> tuple[bytes, int, bool]:
  """Runs the runner with `lim` and waits for it; (its report, exit status, timed out).

  Output goes to out.txt in `workdir`, stderr to err.txt (`stderr_apart`) or to
  the output. Should the supervisor hang past the grace period, it and every
  process of the uid are killed here.
  """
  rfd, wfd = os.pipe()
  lim["report_fd"] = wfd
  runner = _runner() + f"\nexec(*main({lim!r}))\n"
  timed_out = False
  try:
    with (
      open(os.path.join(workdir, "out.txt"), "wb") as out,
      open(os.path.join(workdir, "err.txt"), "wb") as err,
    ):
      proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", runner],
        cwd=workdir,
        env={},
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=err if stderr_apart else out,
        start_new_session=True,
        close_fds=True,
        pass_fds=(wfd,),
      )
    progress.started = True
    os.close(wfd)
    wfd = -1
    try:  # and time for a shell's tmpfs copies (in and out, 100 MB/s at least)
      _wait(proc, limits.wall_seconds + _GRACE_SECONDS + 2 * limits.max_disk_bytes / 1e8)
    except subprocess.TimeoutExpired:  # the supervisor itself is stuck
      timed_out = True
      try:
        os.killpg(proc.pid, signal.SIGKILL)  # not reaped yet: still its group
      except OSError:
        pass
      proc.wait()
      if lim["uid"] is not None:
        _kill_uid(lim["uid"])
    report = b""
    while True:
      chunk = os.read(rfd, 4096)
      if not chunk:
        break
      report += chunk
  finally:
    os.close(rfd)
    if wfd >= 0:
      os.close(wfd)
  return report, proc.returncode, timed_out


def _result(
  report: bytes,
  returncode: int,
  timed_out: bool,
  workdir: str,
  limits: SandboxLimits,
  workspace: Workspace | None,
  start: float,
  progress: _Progress,
) -> SandboxResult:
  """The result from the supervisor's report and the output files in `workdir`."""
  fields = dict(line.partition(" ")[::2] for line in report.decode().splitlines())
  rc = int(fields.get("rc", returncode or -signal.SIGKILL))
  timed_out = timed_out or fields.get("timed_out") == "1"
  progress.clean = fields.get("clean") == "1"
  isolation = tuple(x for x in fields.get("applied", "").split(",") if x)
  mount_error = fields.get("mount_error", "") if progress.binds else ""
  if fields.get("rlimit_error"):  # the sandbox failed, not the code
    raise RuntimeError(f"sandbox: {fields['rlimit_error']}; the code was not run")
  if fields.get("disk_error"):
    raise RuntimeError(f"sandbox: {fields['disk_error']}")
  disk_mode = fields.get("disk_mode", "")
  if disk_mode:
    isolation += ("tmpfs",) if disk_mode == "tmpfs" else ("disk_watchdog",)
  disk_limit = fields.get("disk_limit", "no") != "no"
  stdout = _read_head(os.path.join(workdir, "out.txt"), limits.max_output_chars)
  lines = _read_head(os.path.join(workdir, "err.txt"), 20_000).splitlines()
  error = lines[-1] if lines else ""
  if workspace is not None:  # a shell's stderr went to its output, in order
    error = ""
  notes = ([f"killed: wall-clock limit {limits.wall_seconds:g}s"] if timed_out else []) + (
    [_disk_note(limits, fields["disk_limit"])] if disk_limit else []
  )
  if notes:
    error = "; ".join(notes)
  elif rc < 0:
    error = _SIGNAL_NOTES.get(-rc, f"killed: signal {-rc}")
  elif rc in (120, 121) and not lines:
    error = "sandbox: could not drop privileges"
  return SandboxResult(
    stdout=stdout,
    error=error[: limits.max_output_chars],
    returncode=rc,
    timed_out=timed_out,
    seconds=time.monotonic() - start,
    isolation=isolation,
    mount_error=mount_error,
    disk_limit=disk_limit,
    tmpfs_error=fields.get("tmpfs_error", ""),
  )


def _disk_note(limits: SandboxLimits, how: str) -> str:
  """What the model reads when its call ended at the disk limits: the tmpfs
  was "full", the watchdog "killed" it, or it was "over" after the call."""
  where = "in the workspace and /tmp together"
  if how == "full":
    return (
      f"disk limit: at most {limits.max_disk_bytes} bytes and {limits.max_disk_files} "
      f"entries {where}; writes past that fail (No space left on device)"
    )
  return (
    ("killed: " if how == "killed" else "") + f"disk limit: went over "
    f"{limits.max_disk_bytes} bytes or {limits.max_disk_files} entries {where}"
  )


def _wait(proc: subprocess.Popen, timeout: float) -> None:
  """`proc.wait(timeout)`, but woken by the exit itself, not by polling.

  (Popen.wait with a timeout polls with growing sleeps, up to 50 ms late.)
  """
  try:
    pidfd = os.pidfd_open(proc.pid)
  except (AttributeError, OSError):
    proc.wait(timeout=timeout)
    return
  try:
    poll = select.poll()  # not select(): the trainer may hold over 1024 fds
    poll.register(pidfd, select.POLLIN)
    if not poll.poll(timeout * 1000):
      raise subprocess.TimeoutExpired(proc.args, timeout)
  finally:
    os.close(pidfd)
  proc.wait()


def _kill_uid(uid: int) -> None:
  """SIGKILLs every process of `uid` (found in /proc); for emergencies only."""
  me = str(uid)
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status", encoding="ascii", errors="replace") as f:
        uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
      if me in uids:
        os.kill(int(name), signal.SIGKILL)
    except (OSError, StopIteration, ValueError):
      pass


def _read_head(path: str, max_chars: int) -> str:
  with open(path, "rb") as f:
    data = f.read(max_chars + 1)
  text = data.decode("utf-8", errors="replace")
  return text[:max_chars] + ("...[truncated]" if len(text) > max_chars else "")


# --- reporting and refusal --------------------------------------------------------

# What must apply before model code may run: (measure, the names that
# provide it, what model code could do without it).
_REQUIRED = (
  ("network namespace (netns)", ("netns",), "reach the network"),
  ("a private root directory (chroot)", ("chroot",), "read and write the trainer's files"),
  (
    "a user of its own (uid_pool as root, or userns)",
    ("uid_pool", "userns"),
    "signal or ptrace the trainer and other sandboxes, as uid {uid}",
  ),
  (
    "process cleanup (pidns or subreaper)",
    ("pidns", "subreaper"),
    "leave processes running after the call",
  ),
)


# And for a shell (`run_shell`), which finds its programs through the mounts.
_SHELL_REQUIRED = (
  (
    "a shell's read-only system directories (mounts)",
    ("mounts",),
    "run without a chroot, in the trainer's filesystem",
  ),
)


@functools.lru_cache(maxsize=1)
def isolation() -> tuple[str, ...]:
  """Which isolation measures apply on this machine (besides rlimits)."""
  return run_python("pass").isolation


def _probe_shell() -> SandboxResult:
  """`true` run by a shell in an empty workspace."""
  workspace = tempfile.mkdtemp(prefix="sao_shell_probe_")
  try:
    return run_shell("true", Workspace(workspace))
  finally:
    shutil.rmtree(workspace, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def shell_isolation() -> tuple[tuple[str, ...], str]:
  """Which isolation a shell (`run_shell`) gets here, and why its mounts failed ("")."""
  result = _probe_shell()
  if result.mount_error or result.ok:
    return result.isolation, result.mount_error
  # Mounted, but no shell ran: the chroot has no working /bin/sh.
  return (
    tuple(x for x in result.isolation if x != "mounts"),
    f"the probe shell failed: {result.observation()[:200]}",
  )


@functools.lru_cache(maxsize=1)
def disk_limits() -> tuple[str, str]:
  """How a shell's disk limits hold here: ("tmpfs", "") or ("watchdog", why no tmpfs)."""
  result = _probe_shell()
  if "tmpfs" in result.isolation:
    return "tmpfs", ""
  return "watchdog", result.tmpfs_error or result.mount_error or "not mounted"


def check_isolation(
  allow_unisolated: bool = False, limits: SandboxLimits | None = None, shell: bool = False
) -> tuple[str, ...]:
  """Logs which isolation applies; refuses to go on without it unless allowed.

  Raises RuntimeError naming every missing measure when model-written code
  would run without network, filesystem, user or process isolation, unless
  `allow_unisolated`, in which case it logs a loud warning instead. Returns
  the measures that apply. `shell`: for shell commands (`run_shell`), whose
  chroot needs the workspace's mounts (the reason they failed is logged).
  """
  applied, mount_error = shell_isolation() if shell else (isolation(), "")
  if mount_error:
    _log(f"shell workspace mounts failed: {mount_error}")
  if shell:
    mechanism, why = disk_limits()
    if limits is not None and not limits.isolate:
      mechanism, why = "watchdog", "isolate=False"
    _log(
      "shell disk limits (max_disk_bytes, max_disk_files): "
      + (
        "tmpfs, held by the kernel"
        if mechanism == "tmpfs"
        else f"WARNING: watchdog, polled every {_WATCH_MS} ms, no tmpfs ({why})"
      )
    )
  if limits is not None and not limits.isolate:  # isolation switched off
    applied = tuple(x for x in applied if x == "subreaper")
  required = _REQUIRED + (_SHELL_REQUIRED if shell else ())
  missing = [(what, risk) for what, names, risk in required if not set(names) & set(applied)]
  _log(
    f"isolation: {', '.join(applied) or 'none'}"
    + (f"; missing: {'; '.join(what for what, _ in missing)}" if missing else "")
  )
  if missing:
    message = (
      "model-written code would run unisolated, missing: "
      + "; ".join(what for what, _ in missing)
      + ". It could "
      + ", ".join(risk for _, risk in missing).format(uid=os.geteuid())
      + ". Run the "
      "trainer as root on Linux (in a container: with CAP_SYS_ADMIN), or as a user "
      "where unprivileged user namespaces are allowed, or set env.allow_unisolated=True "
      "to accept this."
    )
    if not allow_unisolated:
      raise RuntimeError("sandbox: " + message)
    _log("WARNING: " + "!" * 20 + " UNISOLATED SANDBOX (env.allow_unisolated=True): " + message)
  return applied


def _log(message: str) -> None:
  print(f"[sandbox] {message}", file=sys.stderr, flush=True)
