"""A sandbox for model-written Python: a separate, limited, isolated process.

`run_python(code, limits)` starts `python -I -S` with an empty environment in
a fresh private temporary directory, and before the model's code runs the
child process:

* sets resource limits: CPU seconds (RLIMIT_CPU), address space
  (RLIMIT_AS), the size of any file it writes (RLIMIT_FSIZE; its output goes
  to a file, so this caps output too), open files (RLIMIT_NOFILE), and
  processes (RLIMIT_NPROC);
* where it can (Linux, as root): moves into a new, empty network namespace
  (no interfaces but a down loopback, so no network at all), chroots into
  its temporary directory (the trainer's files are not visible), and drops
  to the `nobody` user (so RLIMIT_NPROC binds; root ignores it);
* is killed with its whole process group after a wall-clock timeout.

Which of these applied on this machine is reported by `isolation()` and in
every `SandboxResult.isolation`; none of them is silently assumed. Without
root (or on non-Linux platforms) only the resource limits and the wall-clock
kill apply: run the trainer as root in a container, or in a VM, for the full
set.

Output is truncated to `limits.max_output_chars`, and whatever happened
(exception, limit hit, timeout) comes back as text for the observation.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# Runs inside the child, before the model's code. Kept free of imports that
# would touch the filesystem after the chroot.
_RUNNER = r'''
import os, resource, sys
lim = {lim!r}
def setlim(which, value, hard=None):
    try:
        resource.setrlimit(which, (value, value if hard is None else hard))
    except (ValueError, OSError):
        pass
# Soft < hard: SIGXCPU at the soft limit, so the kill is reported as such.
setlim(resource.RLIMIT_CPU, lim["cpu_seconds"], lim["cpu_seconds"] + 1)
setlim(resource.RLIMIT_FSIZE, lim["max_file_bytes"])
setlim(resource.RLIMIT_NOFILE, lim["max_open_files"])
code = open("code.py").read()
# Preloaded so that model code can use them after the chroot; the network
# namespace, not a missing module, is what keeps sockets from connecting.
import math, socket
applied = []
if lim["isolate"]:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) == 0:  # CLONE_NEWNET
        applied.append("netns")
    try:
        os.chroot(".")
        os.chdir("/")
        applied.append("chroot")
    except OSError:
        pass
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        applied.append("nobody")
    except OSError:
        pass
setlim(resource.RLIMIT_NPROC, lim["max_processes"])
setlim(resource.RLIMIT_AS, lim["memory_bytes"])
sys.stderr.write("#isolation:" + ",".join(applied) + "\n")
sys.stderr.flush()
del os, resource, lim, setlim
g = {{"__name__": "__main__", "__builtins__": __builtins__}}
exec(compile(code, "<tool>", "exec"), g)
'''


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  cpu_seconds: int = 2
  wall_seconds: float = 5.0
  memory_bytes: int = 512 * 2**20
  max_file_bytes: int = 64 * 2**10
  max_open_files: int = 32
  max_processes: int = 16
  max_output_chars: int = 400
  # Network namespace, chroot and dropping to `nobody`, where permitted.
  isolate: bool = True


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  stdout: str
  error: str  # last line of stderr (e.g. the exception), or a limit note
  returncode: int
  timed_out: bool
  seconds: float
  isolation: tuple[str, ...]

  @property
  def ok(self) -> bool:
    return self.returncode == 0 and not self.timed_out

  def observation(self) -> str:
    """What the agent sees: output, then the error if the run failed."""
    if self.ok:
      return self.stdout
    return (self.stdout + ("\n" if self.stdout else "") + self.error).strip("\n")


_SIGNAL_NOTES = {
    signal.SIGXCPU: "killed: cpu time limit",
    signal.SIGKILL: "killed",
    signal.SIGXFSZ: "killed: output size limit",
    signal.SIGSEGV: "killed: segmentation fault",
}


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
  """Runs `code` in the sandbox and returns its (truncated) result."""
  workdir = tempfile.mkdtemp(prefix="sao_sandbox_")
  start = time.monotonic()
  try:
    os.chmod(workdir, 0o755)
    with open(os.path.join(workdir, "code.py"), "w", encoding="utf-8") as f:
      f.write(code)
    out_path = os.path.join(workdir, "out.txt")
    err_path = os.path.join(workdir, "err.txt")
    lim = dataclasses.asdict(limits)
    lim["isolate"] = bool(limits.isolate and os.name == "posix" and os.geteuid() == 0)
    runner = _RUNNER.format(lim=lim)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
      proc = subprocess.Popen(
          [sys.executable, "-I", "-S", "-c", runner], cwd=workdir, env={},
          stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
          close_fds=True)
      timed_out = False
      try:
        proc.wait(timeout=limits.wall_seconds)
      except subprocess.TimeoutExpired:
        timed_out = True
      finally:
        try:  # the whole group: forked children die too
          os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          pass
        proc.wait()
    stdout = _read_head(out_path, limits.max_output_chars)
    stderr = _read_head(err_path, 20_000)
    isolation = ()
    lines = stderr.splitlines()
    if lines and lines[0].startswith("#isolation:"):
      isolation = tuple(x for x in lines[0][len("#isolation:"):].split(",") if x)
      lines = lines[1:]
    error = lines[-1] if lines else ""
    rc = proc.returncode
    if timed_out:
      error = f"killed: wall-clock limit {limits.wall_seconds:g}s"
    elif rc < 0:
      error = _SIGNAL_NOTES.get(-rc, f"killed: signal {-rc}")
    return SandboxResult(stdout=stdout, error=error[:limits.max_output_chars],
                         returncode=rc, timed_out=timed_out,
                         seconds=time.monotonic() - start, isolation=isolation)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def _read_head(path: str, max_chars: int) -> str:
  with open(path, "rb") as f:
    data = f.read(max_chars + 1)
  text = data.decode("utf-8", errors="replace")
  return text[:max_chars] + ("...[truncated]" if len(text) > max_chars else "")


@functools.lru_cache(maxsize=1)
def isolation() -> tuple[str, ...]:
  """Which isolation measures apply on this machine (besides rlimits)."""
  return run_python("pass").isolation
