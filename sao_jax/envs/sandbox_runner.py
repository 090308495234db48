"""The sandbox's runner: the supervisor, the init and the model process of one call.

`sandbox._run` starts `python -I -S -c` with this file's text, then
sandbox_disk.py's (a shell's disk limits: `mount_disk`, `disk_watchdog`,
`finish_disk`), then one line, `exec(*main({...}))`, the call's settings as
a dict literal (the limits, the uid, the report pipe's fd, the shell's
binds, ...), in the call's fresh temporary directory, with an empty
environment. `main` sets up the isolation and forks (docs/design/sandbox.md
describes the three processes); the supervisor and the init always
leave through os._exit, so only the model process returns from it, with the
model code compiled and fresh globals, and the `exec` runs it at the top
level of the script, where exceptions, sys.exit, threads and atexit behave
as in any script.

The protocol with the trainer: the supervisor writes `key value` lines to
the report fd (rc, timed_out, clean, applied, mount_error; for a shell
disk_mode, disk_limit, disk_error, tmpfs_error; rlimit_error); the init and
the model process write theirs (status, applied, rlimit_error) to the
supervisor through a pipe. Exit statuses 120 and 121 mean privileges could
not be dropped, 122 that a resource limit could not be set, 126 that a
shell's mounts failed, 127 that the shell could not be started.

The standard library only, and no sao_jax: the file runs on its own, in an
interpreter without site-packages. After the chroot only modules already
loaded can be imported (model code gets those too), so nothing here imports
anything that would touch the filesystem later. No `from __future__`
imports either: `compile` would pass them on to the model code. Importing
the file runs nothing.
"""

import os
import resource
import signal
import sys
import time

LINUX = sys.platform.startswith("linux")
NEWNS, NEWIPC, NEWUSER = 0x20000, 0x8000000, 0x10000000
NEWPID, NEWNET = 0x20000000, 0x40000000
# Imported before the chroot so that model code can use them after it; the
# network namespace, not a missing module, is what keeps sockets from connecting.
ALWAYS_LOADED = ("math", "socket")


def main(lim):
  """Runs one call; returns, in the model process only, (its code compiled, its globals)."""
  code = open("code.py", encoding="utf-8").read()
  script = os.path.abspath("code.py")
  preload(lim["preload"])
  call = Call(lim)
  call.isolate()
  rfd, wfd = os.pipe()  # init and model process -> supervisor
  child = os.fork()  # in a new PID namespace, the init: its PID 1
  if child:
    os.close(wfd)
    supervise(call, child, rfd)  # never returns
  os.close(rfd)
  os.close(call.report)
  if call.pidns:
    run_init(call, wfd)  # returns in the model process only
  enter_model(call, wfd, script)
  return compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__}


def preload(names):
  """Imports `ALWAYS_LOADED`, then the caller's modules (`run_python(preload=...)`) that exist."""
  for name in ALWAYS_LOADED:
    __import__(name)
  for name in names:
    try:
      __import__(name)
    except ImportError:
      pass


def setlim(name, value, hard=None):
  """Sets resource limit RLIMIT_`name` (hard = soft unless given); OSError, one
  line naming it, where the system refuses (never a call with a limit missing)."""
  try:
    resource.setrlimit(
      getattr(resource, "RLIMIT_" + name), (value, value if hard is None else hard)
    )
  except (ValueError, OSError) as e:
    raise OSError("setrlimit(RLIMIT_%s, %d) failed: %s" % (name, value, e)) from None


class Call:
  """One call's settings and what its processes share: libc, the measures applied."""

  def __init__(self, lim):
    self.lim = lim
    self.uid = lim["uid"]
    self.report = lim["report_fd"]
    self.applied = []
    self.pidns = self.userns = False
    # A shell's filesystem (`Workspace`): bind mounts into the chroot, made in a
    # mount namespace of the supervisor's before the model process forks. Not
    # possible -> the model process does not run the command, and says why.
    self.mount_error = "mount namespace refused or switched off" if lim["binds"] else ""
    self.ctypes = self.libc = None
    # A shell's disk limits (sandbox_disk.py, appended to this file's text):
    # held by a tmpfs, or why not (then by the watchdog).
    self.tmpfs, self.tmpfs_error = False, ""
    if LINUX:
      import ctypes

      self.ctypes = ctypes
      self.libc = ctypes.CDLL(None, use_errno=True)

  def prctl(self, *args):
    args = args + (0,) * (5 - len(args))
    return self.libc.prctl(*[self.ctypes.c_ulong(a) for a in args])

  def strerror(self):
    """The error of libc's last call, as text."""
    return os.strerror(self.ctypes.get_errno())

  def isolate(self):
    """The supervisor's measures: subreaper, namespaces, a shell's mounts, not dumpable."""
    if not LINUX:
      return
    lim, libc = self.lim, self.libc
    if self.prctl(36, 1) == 0:  # PR_SET_CHILD_SUBREAPER
      self.applied.append("subreaper")
    if lim["isolate"] and self.uid is not None:  # root
      if libc.unshare(NEWNET | NEWIPC) == 0:
        self.applied += ["netns", "ipcns"]
      elif libc.unshare(NEWNET) == 0:
        self.applied.append("netns")
      if lim["pidns"] and libc.unshare(NEWPID) == 0:
        self.pidns = True
      if lim["binds"] and lim["mountns"]:
        self.mount_error = self.mount_binds(libc.unshare(NEWNS) == 0)
    elif lim["isolate"]:
      self.enter_userns()
    # Not dumpable (after the maps of enter_userns: it makes /proc/self root's):
    # the model process cannot ptrace the supervisor or the init, which keep
    # capabilities in a user namespace.
    self.prctl(4, 0)  # PR_SET_DUMPABLE

  def enter_userns(self):
    """Without root: a new user namespace, and with it the other namespaces."""
    lim = self.lim
    euid, egid = os.geteuid(), os.getegid()
    newns = NEWNS if lim["binds"] and lim["mountns"] else 0
    if self.libc.unshare(NEWUSER | NEWNET | NEWIPC | newns | (NEWPID if lim["pidns"] else 0)) != 0:
      return
    self.pidns, self.userns = lim["pidns"], True  # with every capability in the user namespace
    self.applied += ["netns", "ipcns"]
    try:
      for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{euid} {euid} 1"),
        ("gid_map", f"{egid} {egid} 1"),
      ):
        with open(f"/proc/self/{name}", "w") as f:
          f.write(text)
      self.applied.append("userns")
    except OSError:
      pass
    if newns:
      self.mount_error = self.mount_binds(True)

  def mount_binds(self, have_namespace):
    """Makes the shell's bind mounts; returns why they failed ("": they did not)."""
    if not have_namespace:
      return "mount namespace refused: " + self.strerror()
    ctypes, libc = self.ctypes, self.libc
    ms_rdonly, ms_nosuid, ms_nodev, ms_noexec = 1, 2, 4, 8
    ms_remount, ms_bind, ms_rec, ms_private = 32, 4096, 16384, 1 << 18
    # Flags of a mount that a user namespace may not clear on a bind's remount.
    locked = {
      1: ms_rdonly,
      2: ms_nosuid,
      4: ms_nodev,
      8: ms_noexec,
      1024: 1024,
      2048: 2048,
      4096: 1 << 21,
    }
    libc.mount.argtypes = (
      ctypes.c_char_p,
      ctypes.c_char_p,
      ctypes.c_char_p,
      ctypes.c_ulong,
      ctypes.c_void_p,
    )
    # First, nothing mounted here may propagate back to the trainer's namespace.
    if libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0:
      return "making mounts private failed: " + self.strerror()
    for source, target, writable, required in self.lim["binds"]:
      if libc.mount(source.encode(), target.encode(), None, ms_bind | ms_rec, None) != 0:
        if required:
          return f"bind mount of {source} failed: " + self.strerror()
        continue
      flags = ms_bind | ms_remount | ms_nosuid | (0 if writable else ms_rdonly)
      try:
        have = os.statvfs(source).f_flag
      except OSError:
        have = 0
      flags |= sum(v for k, v in locked.items() if have & k)
      if libc.mount(None, target.encode(), None, flags, None) != 0 and required:
        return f"read-only remount of {source} failed: " + self.strerror()
    if self.lim["disk"] and self.lim["disk"]["tmpfs"]:
      self.tmpfs_error = mount_disk(self)  # noqa: F821  # sandbox_disk.py's, joined at run time
    self.applied.append("mounts")
    return ""


# --- the supervisor -----------------------------------------------------------------


def supervise(call, child, rfd):
  """Waits for the init (wall-clock limit), leaves nothing behind, reports; exits."""
  watchdog = disk_watchdog(call)  # noqa: F821  # sandbox_disk.py's; None where a tmpfs holds a shell's disk limits
  timed_out, status = wait_for(child, call.lim["wall_seconds"], watchdog)
  if call.pidns:
    status = None  # the init's; the model process's comes through the pipe
    call.applied.append("pidns")
  # Nothing of the sandbox may outlive this call.
  kill_leftovers(call, child)
  while True:  # reap everything reparented to us
    try:
      os.waitpid(-1, 0)
    except ChildProcessError:
      break
  extra = finish_disk(call, watchdog)  # noqa: F821  # sandbox_disk.py's; report lines
  clean = True
  if call.uid is not None and LINUX and not call.pidns:
    # Without a PID namespace, confirm that no process of the uid is left
    # (kill(-1) cannot tell: it succeeds even if it signalled nothing).
    clean = not uid_has_processes(call.uid)
  applied = call.applied
  for line in read_all(rfd).decode().splitlines():
    key, _, value = line.partition(" ")
    if key == "applied":
      applied = [x for x in value.split(",") if x]
      if call.pidns:
        applied.append("pidns")
    elif key == "status" and call.pidns:
      status = int(value)
    elif key == "rlimit_error":
      extra += "rlimit_error %s\n" % value
  if timed_out:
    rc = -signal.SIGKILL
  elif status is None:
    rc = -signal.SIGKILL
  else:
    rc = os.waitstatus_to_exitcode(status)
  os.write(
    call.report,
    (
      "rc %d\ntimed_out %d\nclean %d\napplied %s\nmount_error %s\n"
      % (
        rc,
        bool(timed_out),
        clean,
        ",".join(sorted(set(applied))),
        " ".join(call.mount_error.split()),
      )
      + extra
    ).encode(),
  )
  os._exit(0)


def wait_for(child, wall_seconds, check=None):
  """Waits for `child` to exit, SIGKILLing it at the limit, or once `check()`
  (a shell's disk watchdog, asked every WATCH_SECONDS) says so; (timed out,
  its wait status)."""
  timed_out = []
  deadline = time.monotonic() + wall_seconds

  def arm():
    left = max(deadline - time.monotonic(), 1e-6)
    signal.setitimer(signal.ITIMER_REAL, left if check is None else min(left, WATCH_SECONDS))  # noqa: F821  # sandbox_disk.py's

  def on_alarm(signum, frame):
    if time.monotonic() >= deadline:
      timed_out.append(True)
    elif check is None or not check():
      arm()
      return
    try:  # not reaped yet (WNOWAIT below), so the pid is still ours
      os.kill(child, signal.SIGKILL)
    except OSError:
      pass

  signal.signal(signal.SIGALRM, on_alarm)
  arm()
  if hasattr(os, "waitid"):
    os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)
  else:
    while os.waitpid(child, os.WNOHANG) == (0, 0):
      time.sleep(0.005)
  signal.setitimer(signal.ITIMER_REAL, 0)
  signal.signal(signal.SIGALRM, signal.SIG_IGN)
  status = None
  try:
    _, status = os.waitpid(child, 0)
  except ChildProcessError:
    pass
  return timed_out, status


def kill_leftovers(call, child):
  """SIGKILLs what the call left: every process of its uid, else our descendants."""
  uid = call.uid
  if uid is not None and LINUX:
    try:  # as the uid, without losing root: kill() then hits that uid only
      os.setresuid(uid, uid, 0)
    except OSError:  # not a valid uid here: the model process never ran
      pass
    else:
      try:
        os.kill(-1, signal.SIGKILL)
      except OSError:
        pass
      os.setresuid(0, 0, 0)
  if LINUX and uid is None and not call.pidns:  # no uid of its own: find descendants
    kill_children()
  elif not LINUX:
    try:
      os.killpg(child, signal.SIGKILL)
    except OSError:
      pass


def kill_children():
  """SIGKILLs our children (found in /proc) and reaps, until none is left."""
  me = str(os.getpid()).encode()
  while True:
    for name in os.listdir("/proc"):
      try:
        with open(f"/proc/{name}/stat", "rb") as f:
          fields = f.read().rsplit(b")", 1)[1].split()
      except (OSError, IndexError):
        continue
      if fields[1] == me:  # our child: only we can reap it, so the pid is safe
        try:
          os.kill(int(name), signal.SIGKILL)
        except OSError:
          pass
    try:
      if os.waitpid(-1, os.WNOHANG) == (0, 0):
        time.sleep(0.001)
    except ChildProcessError:
      break


def uid_has_processes(uid):
  """Whether /proc shows a process of `uid`."""
  me = str(uid).encode()
  for name in os.listdir("/proc"):
    try:
      with open(f"/proc/{name}/status", "rb") as f:
        line = next(x for x in f if x.startswith(b"Uid:"))
    except (OSError, StopIteration):
      continue
    if me in line.split()[1:]:
      return True
  return False


def read_all(fd):
  """Reads `fd` to its end."""
  data = b""
  while True:
    chunk = os.read(fd, 4096)
    if not chunk:
      break
    data += chunk
  return data


# --- the init and the model process ---------------------------------------------------


def run_init(call, wfd):
  """PID 1 of the sandbox's PID namespace: forks the model process and reaps orphans.

  Its exit makes the kernel kill and reap everything else in the namespace.
  Returns in the model process only.
  """
  call.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the supervisor
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  model = os.fork()
  if model:
    while True:
      try:
        pid, status = os.waitpid(-1, 0)
      except ChildProcessError:
        os._exit(0)
      if pid == model:
        os.write(wfd, b"status %d\n" % status)
        os._exit(0)


def enter_model(call, wfd, script):
  """The model process: confined, limited, reported; a shell command is exec'd here."""
  lim = call.lim
  if lim["isolate"] and LINUX:
    confine(call)
  if lim["host_cwd"] and "chroot" not in call.applied:
    os.chdir(lim["host_cwd"])  # isolation switched off: the shell runs in the workspace itself
  if LINUX:
    call.prctl(38, 1)  # PR_SET_NO_NEW_PRIVS
  elif not call.pidns:
    os.setpgid(0, 0)  # so that the supervisor can kill the group
  # Soft < hard: SIGXCPU at the soft limit, so the kill is reported as such.
  try:
    setlim("CPU", lim["cpu_seconds"], lim["cpu_seconds"] + 1)
    setlim("FSIZE", lim["max_file_bytes"])
    setlim("NOFILE", lim["max_open_files"])
    setlim("NPROC", lim["max_processes"])
    setlim("AS", lim["memory_bytes"])
  except OSError as e:  # reported to the trainer, which raises; no model code runs
    os.write(wfd, ("rlimit_error %s\n" % " ".join(str(e).split())).encode())
    os._exit(122)
  os.write(wfd, ("applied " + ",".join(call.applied) + "\n").encode())
  os.close(wfd)
  if lim["argv"]:  # a shell command (`run_shell`), not Python: the script is code.py
    try:
      path = "/code.py" if "chroot" in call.applied else script
      os.execve(lim["argv"][0], lim["argv"] + [path], lim["env"])
    except OSError as e:
      os.write(2, f"sandbox: cannot run {lim['argv'][0]}: {e.strerror}\n".encode())
      os._exit(127)


def confine(call):
  """The chroot, then the call's uid (root) or no capabilities (a user namespace)."""
  if call.mount_error:  # a shell without its mounts is never run unconfined
    os.write(
      2,
      (
        "sandbox: the shell's mounts failed (%s); the command was not run\n" % call.mount_error
      ).encode(),
    )
    os._exit(126)
  try:
    os.chroot(".")
    os.chdir(call.lim["cwd"] or "/")
    call.applied.append("chroot")
  except OSError:
    pass
  uid = call.uid
  if uid is not None:
    try:
      os.setgroups([])
      os.setresgid(uid, uid, uid)
      os.setresuid(uid, uid, uid)
      call.applied.append("uid_pool")
    except OSError:
      os._exit(120)  # never run model code as root
  elif call.userns:
    cap = 0
    while call.prctl(24, cap) == 0:  # PR_CAPBSET_DROP, until EINVAL past the last
      cap += 1
    ctypes = call.ctypes
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    if call.libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
      os._exit(121)  # never run model code with capabilities
