"""The sandbox: containment, process cleanup, uid separation, refusal.

Nothing here depends on timing: processes are found by a marker (their
`comm`, set with prctl) or by their uid in /proc, concurrency is made certain
by waiting until the processes are seen, and the only time checks are
generous upper bounds. Checks that need root skip with a reason without it.
"""

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import ml_collections
import pytest

from sao_jax.envs import registry, sandbox

LIMITS = sandbox.SandboxLimits(cpu_seconds=1, wall_seconds=3.0, max_output_chars=100)
# For code that must finish by itself: far from any limit, however loaded.
SLOW_OK = sandbox.SandboxLimits(cpu_seconds=20, wall_seconds=60.0, max_output_chars=400)
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (uid pool, namespaces)")
needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _marker():
  return "sao" + uuid.uuid4().hex[:12]  # fits comm's 15 characters


def _pids_named(marker):
  pids = []
  for name in os.listdir("/proc"):
    try:
      with open(f"/proc/{name}/comm", encoding="utf-8", errors="replace") as f:
        if f.read().strip() == marker:
          pids.append(int(name))
    except (OSError, ValueError):
      pass
  return pids


def _uid_of(pid):
  """The real uid of process `pid`, or None if it is gone."""
  try:
    with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
      return int(next(line for line in f if line.startswith("Uid:")).split()[1])
  except (OSError, StopIteration):
    return None


def _pids_of_uid(uid):
  return [int(p) for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid]


def _wait_for(fn, what, timeout=60.0):
  """Polls `fn` until it returns something truthy (a condition, not a race)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    value = fn()
    if value:
      return value
    time.sleep(0.01)
  raise AssertionError(f"timed out waiting for {what}")


def _kill_all(pids):
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass


@pytest.fixture(params=["pidns", "no_pidns"])
def cleanup(request, monkeypatch):
  """Each cleanup path: the PID namespace, and the fallback without one."""
  if request.param == "no_pidns":
    monkeypatch.setattr(sandbox, "_PIDNS", False)
  return request.param


# Sets the calling process's comm (as seen in /proc) to MARKER.
_NAME = "import ctypes\nctypes.CDLL(None).prctl(15, {marker!r}.encode(), 0, 0, 0)\n"


# --- containment (moved from test_rollout.py) ----------------------------------


@pytest.mark.parametrize(
  "code,expect,limits",
  [
    (
      "while True: pass",
      "killed: cpu time limit",
      sandbox.SandboxLimits(cpu_seconds=1, wall_seconds=60.0, max_output_chars=100),
    ),
    ("import time\ntime.sleep(30)", "killed: wall-clock limit", LIMITS),
    ("x = bytearray(8 * 2**30)", "MemoryError", LIMITS),
    # Time limits far away: under load, writing 10^8 characters once ran
    # past a 1 s CPU limit, and this case is about the output cap.
    (
      "print('y' * 10**7)",
      "...[truncated]",
      sandbox.SandboxLimits(cpu_seconds=20, wall_seconds=60.0, max_output_chars=100),
    ),
  ],
)
def test_sandbox_contains(code, expect, limits):
  r = sandbox.run_python(code, limits)
  assert not r.ok and expect in r.observation()
  assert len(r.stdout) <= limits.max_output_chars + len("...[truncated]")
  assert r.seconds < limits.wall_seconds + 2


def test_sandbox_isolation():
  applied = sandbox.isolation()
  if "uid_pool" in applied or "userns" in applied:  # process limit binds
    r = sandbox.run_python("import os\nfor _ in range(200):\n  os.fork()", LIMITS)
    assert "BlockingIOError" in r.observation() or "Resource temporarily" in r.observation()
  if "chroot" in applied:
    r = sandbox.run_python(f"print(open({__file__!r}).read())", LIMITS)
    assert "FileNotFoundError" in r.observation()
  if "netns" in applied:
    r = sandbox.run_python(
      "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', 22))\n"
      "print('connected')",
      LIMITS,
    )
    assert "connected" not in r.stdout and "Error" in r.observation()
  assert sandbox.run_python("print(6 * 7)", LIMITS).observation() == "42\n"
  # Report what applied (visible with -s); the tests above ran what applies.
  print("sandbox isolation on this machine:", applied)


@needs_root
@needs_linux
def test_full_isolation_as_root():
  """Every measure this machine permits applies (a container may refuse namespaces)."""
  expected = {"chroot", "uid_pool", "subreaper"}
  probe = "import ctypes, sys\nsys.exit(ctypes.CDLL(None).unshare(0x40000000 | 0x20000000))"
  if subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0:
    expected |= {"netns", "pidns"}
  assert expected <= set(sandbox.isolation())
  r = sandbox.run_python("import os\nprint(os.getuid(), os.getgid(), os.getgroups())", LIMITS)
  uid, gid, groups = r.stdout.split(" ", 2)
  first, last = sandbox.DEFAULT_UIDS
  assert first <= int(uid) <= last and gid == uid and groups.strip() == "[]"


# --- process cleanup ------------------------------------------------------------

# A grandchild that leaves the sandbox's session or process group, renames
# itself to the marker and then sleeps forever; the model process returns
# only once the grandchild is named, so a survivor cannot be missed.
_DAEMON = """\
import os, time
r, w = os.pipe()
if os.fork() == 0:
  {leave}
  if os.fork() == 0:
    {name}
    os.write(w, b"x")
    while True:
      time.sleep(1)
  os._exit(0)
os.read(r, 1)
print("daemon", os.getuid(), flush=True)
"""


@needs_linux
@pytest.mark.parametrize("mode", ["pidns", "no_pidns", "unisolated"])
@pytest.mark.parametrize("leave", ["os.setsid()", "os.setpgid(0, 0)"])
def test_daemonized_grandchild_dies_with_the_call(leave, mode, monkeypatch):
  """Each cleanup path; unisolated: the subreaper's own search for descendants."""
  monkeypatch.setattr(sandbox, "_PIDNS", mode == "pidns")
  marker = _marker()
  name = _NAME.format(marker=marker).replace("\n", "\n    ")
  code = _DAEMON.format(leave=leave, name=name)
  try:
    r = sandbox.run_python(code, dataclasses.replace(SLOW_OK, isolate=mode != "unisolated"))
    assert r.ok and r.stdout.startswith("daemon"), r.observation()
    if mode != "pidns":
      assert "pidns" not in r.isolation
    assert _pids_named(marker) == []  # at return, not eventually
    if "uid_pool" in r.isolation:
      assert _pids_of_uid(int(r.stdout.split()[1])) == []
  finally:
    _kill_all(_pids_named(marker))


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
  except OSError:
    return False


@needs_root
def test_trainer_kills_a_stuck_supervisor(monkeypatch, cleanup):
  """If the supervisor never returns, the trainer kills the lot itself."""
  marker = _marker()
  name = _NAME.format(marker=marker).replace("\n", "\n    ")
  code = _DAEMON.format(leave="os.setsid()", name=name) + "time.sleep(10**6)\n"

  uids = []

  def stuck(proc, timeout):  # the daemon is up; then the wait "times out"
    [pid] = _wait_for(lambda: _pids_named(marker), "the daemon")
    uids.append(_uid_of(pid))
    raise subprocess.TimeoutExpired(proc.args, timeout)

  monkeypatch.setattr(sandbox, "_wait", stuck)
  first, last = sandbox.DEFAULT_UIDS
  sandbox.set_uid_range(first, last)  # a fresh pool, to look at
  pool = sandbox._uid_pool()
  try:
    r = sandbox.run_python(code, SLOW_OK)
    assert r.timed_out and "killed: wall-clock limit" in r.observation()
    [uid] = uids
    assert uid in pool.quarantined  # never lent again
    _wait_for(
      lambda: not [p for p in _pids_named(marker) + _pids_of_uid(uid) if _alive(p)],
      "the sandbox's processes to die",
    )
  finally:
    _kill_all(_pids_named(marker))
    sandbox.set_uid_range(first, last)


@needs_root
def test_fork_bomb_leaves_nothing_for_the_next_call_of_the_same_uid(cleanup):
  """With a pool of one uid both calls share it: the second forks freely."""
  first, last = sandbox.DEFAULT_UIDS
  sandbox.set_uid_range(last, last)
  try:
    bomb = (
      "import os, time\nn = 0\nwhile True:\n"
      "  try:\n    pid = os.fork()\n  except OSError:\n    break\n"
      "  if pid == 0:\n    if n % 2:\n      os._exit(0)  # a zombie: never reaped here\n"
      "    time.sleep(10**6)\n    os._exit(0)\n"
      "  n += 1\nprint('bomb', n, os.getuid())\n"
    )
    r = sandbox.run_python(bomb, SLOW_OK)
    assert r.ok and r.stdout.startswith("bomb"), r.observation()
    n, uid = map(int, r.stdout.split()[1:])
    assert uid == last and 0 < n < SLOW_OK.max_processes
    forks = (
      "import os, time\nkids = []\nfor _ in range(5):\n  kids.append(os.fork())\n"
      "  if kids[-1] == 0:\n    time.sleep(0.1)\n    os._exit(0)\n"
      "for k in kids:\n  os.waitpid(k, 0)\nprint('forked', len(kids), os.getuid())\n"
    )
    r = sandbox.run_python(forks, SLOW_OK)
    assert r.observation() == f"forked 5 {last}\n"
  finally:
    sandbox.set_uid_range(first, last)


# --- separation of concurrent calls ----------------------------------------------


def _start(code, limits=SLOW_OK):
  """Runs `code` in a thread; returns (thread, box) where box gets the result."""
  box = []
  thread = threading.Thread(target=lambda: box.append(sandbox.run_python(code, limits)))
  thread.start()
  return thread, box


@needs_root
def test_concurrent_calls_get_distinct_uids():
  marker = _marker()
  code = "import os, time\n" + _NAME.format(marker=marker) + "time.sleep(10**6)\n"
  runs = [_start(code) for _ in range(3)]
  try:
    pids = _wait_for(
      lambda: len(_pids_named(marker)) == 3 and _pids_named(marker), "three sandboxes alive at once"
    )
    uids = {_uid_of(pid) for pid in pids}
    first, last = sandbox.DEFAULT_UIDS
    assert len(uids) == 3 and all(first <= u <= last for u in uids), uids
  finally:
    _kill_all(_pids_named(marker))  # ends the three calls
    for thread, _ in runs:
      thread.join()


@needs_linux
def test_a_sandbox_cannot_kill_another_or_the_trainer(cleanup):
  """B waits for SIGUSR1 from the test; meanwhile A kills all it can reach."""
  available = set(sandbox.isolation()) - ({"pidns"} if cleanup == "no_pidns" else set())
  if not {"pidns", "uid_pool"} & available:
    pytest.skip("no PID namespace or uid of its own: a sandbox could kill the trainer")
  marker = _marker()
  victim = (
    "import os, signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
    + _NAME.format(marker=marker)
    + "signal.sigwait({signal.SIGUSR1})\nprint('survived')\n"
  )
  thread, box = _start(victim)
  try:
    [pid] = _wait_for(lambda: _pids_named(marker), "the victim sandbox")
    pidfd = os.pidfd_open(pid)  # from here on, signals reach B and only B
    assert _pids_named(marker) == [pid]
    targets = [pid, os.getpid(), os.getppid(), 1]
    attack = (
      "import os, signal\nown = {os.getpid(), -os.getpgrp()}\n"
      "for sig in (signal.SIGKILL, signal.SIGTERM):\n"
      "  for target in [-1] + %r + list(range(1, 5000)):\n"
      "    for t in {target, -target} - own:\n"
      "      try:\n        os.kill(t, sig)\n"
      "      except OSError:\n        pass\n"
      "print('attacked')\n" % targets
    )
    r = sandbox.run_python(attack, SLOW_OK)
    assert "attacked" in r.stdout, r.observation()
    signal.pidfd_send_signal(pidfd, signal.SIGUSR1)
    os.close(pidfd)
    thread.join()
    assert box[0].ok and box[0].stdout == "survived\n", box[0].observation()
  finally:
    _kill_all(_pids_named(marker))
    thread.join()


# --- the unprivileged path ------------------------------------------------------

_AS_NOBODY = """\
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("sandbox", {path!r})
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)
applied = sandbox.isolation()
print("applied", ",".join(applied))
def named(pid):
  try:
    with open("/proc/%s/comm" % pid) as f:
      return f.read().strip() == {marker!r}
  except OSError:
    return False
limits = sandbox.SandboxLimits(cpu_seconds=20, wall_seconds=60.0)
for isolate in (True, False):  # False: the subreaper's own search
  r = sandbox.run_python({daemon!r}, sandbox.SandboxLimits(wall_seconds=60.0, isolate=isolate))
  print("daemon_%d" % isolate, r.ok, r.stdout.split()[:1])
  print("alive_%d" % isolate, len([p for p in os.listdir("/proc") if p.isdigit() and named(p)]))
if "pidns" in applied:
  attack = "import os\\nfor pid in (-1, %d, %d):\\n  try:\\n    os.kill(pid, 9)\\n"
  attack += "  except OSError:\\n    pass\\nprint('done')"
  r = sandbox.run_python(attack % (os.getpid(), os.getppid()), limits)
  print("kill", r.ok, r.stdout.strip())
"""


def _python_for_nobody():
  for exe in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
    try:
      if (
        subprocess.run(
          [exe, "-c", "pass"],
          user=65534,
          group=65534,
          extra_groups=[],
          capture_output=True,
          check=False,
          cwd="/",
          env={},
        ).returncode
        == 0
      ):
        return exe
    except OSError:
      pass
  return None


@needs_root
@needs_linux
def test_unprivileged_sandbox_still_cleans_up():
  """As `nobody`: a user namespace where allowed, else the subreaper."""
  exe = _python_for_nobody()
  if exe is None:
    pytest.skip("no Python that user nobody may run")
  marker = _marker()
  name = _NAME.format(marker=marker).replace("\n", "\n    ")
  script = _AS_NOBODY.format(
    path=sandbox.__file__, marker=marker, daemon=_DAEMON.format(leave="os.setsid()", name=name)
  )
  try:
    out = subprocess.run(
      [exe, "-I", "-c", script],
      user=65534,
      group=65534,
      extra_groups=[],
      capture_output=True,
      text=True,
      check=False,
      cwd="/",
      env={},
      timeout=300,
    )
    assert out.returncode == 0, out.stderr  # nobody, the 'trainer', survived kill(-1)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    applied = lines["applied"].split(",")
    print("unprivileged sandbox isolation:", applied)
    assert "subreaper" in applied and "uid_pool" not in applied
    for isolate in (0, 1):
      assert lines[f"daemon_{isolate}"] == "True ['daemon']"
      assert lines[f"alive_{isolate}"] == "0"
    if "pidns" in applied:
      assert {"userns", "netns", "chroot"} <= set(applied)
      assert lines["kill"] == "True done"
  finally:
    _kill_all(_pids_named(marker))


# --- reporting and refusal --------------------------------------------------------


def test_check_isolation_refuses_unless_allowed(monkeypatch, capsys):
  monkeypatch.setattr(sandbox, "isolation", lambda: ("subreaper",))
  with pytest.raises(RuntimeError) as e:
    sandbox.check_isolation(False)
  for name in ("netns", "chroot", "uid_pool", "userns"):
    assert name in str(e.value)
  assert "allow_unisolated" in str(e.value) and "pidns" not in str(e.value)
  assert sandbox.check_isolation(True) == ("subreaper",)
  err = capsys.readouterr().err
  assert "WARNING" in err and "UNISOLATED" in err

  full = ("chroot", "ipcns", "netns", "pidns", "subreaper", "uid_pool")
  monkeypatch.setattr(sandbox, "isolation", lambda: full)
  assert sandbox.check_isolation(False) == full
  assert "isolation: chroot, ipcns" in capsys.readouterr().err
  with pytest.raises(RuntimeError, match="netns"):  # isolation switched off
    sandbox.check_isolation(False, sandbox.SandboxLimits(isolate=False))
  # A user namespace stands in for the uid of its own.
  monkeypatch.setattr(
    sandbox, "isolation", lambda: ("chroot", "netns", "pidns", "subreaper", "userns")
  )
  sandbox.check_isolation(False)


@pytest.mark.parametrize("name", ["python_tool", "code_fix"])
def test_make_env_checks_isolation(monkeypatch, name):
  monkeypatch.setattr(sandbox, "isolation", lambda: ("subreaper",))
  config = ml_collections.ConfigDict({"name": name, "kwargs": {}})
  with pytest.raises(RuntimeError, match="unisolated"):
    registry.make_env(config)
  config.allow_unisolated = True
  assert registry.make_env(config) is not None
  # Environments that run no code don't ask.
  registry.make_env(ml_collections.ConfigDict({"name": "online_style", "kwargs": {}}))


def test_a_silent_nonzero_exit_still_tells_the_model_something():
  result = sandbox.run_python("import os\nos._exit(3)", LIMITS)
  assert (result.returncode, result.error) == (3, "")
  assert result.observation() == "error: exited with status 3 (nothing on stderr)"
  printed = sandbox.run_python(
    "print('partial', flush=True)\nimport sys\nsys.stderr.close()\nraise SystemExit(4)", LIMITS
  )
  assert printed.observation().startswith("partial\n")
  assert printed.observation().endswith("\nerror: exited with status 4 (nothing on stderr)")


_SHELL_AS_NOBODY = """\
import importlib.util, os, sys, tempfile
spec = importlib.util.spec_from_file_location("sandbox", {path!r})
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)
work = tempfile.mkdtemp()
r = sandbox.run_shell("pwd; echo made > made.txt; touch /usr/x", sandbox.Workspace(work))
print("applied", ",".join(r.isolation))
print("mount_error", r.mount_error or "-")
print("out", r.stdout.replace(chr(10), "|"))
print("made", os.path.exists(os.path.join(work, "made.txt")))
"""


@needs_root
@needs_linux
def test_unprivileged_shell_gets_its_mounts_or_says_why():
  """As `nobody`: a user namespace's mount namespace gives the shell its chroot;
  where it is refused the command does not run and the result says why."""
  exe = _python_for_nobody()
  if exe is None:
    pytest.skip("no Python that user nobody may run")
  out = subprocess.run(
    [exe, "-I", "-c", _SHELL_AS_NOBODY.format(path=sandbox.__file__)],
    user=65534,
    group=65534,
    extra_groups=[],
    capture_output=True,
    text=True,
    check=False,
    cwd="/",
    env={},
    timeout=120,
  )
  assert out.returncode == 0, out.stderr
  lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
  applied = lines["applied"].split(",")
  print("unprivileged shell isolation:", applied, lines["mount_error"])
  if "mounts" in applied:
    assert {"userns", "chroot"} <= set(applied) and lines["mount_error"] == "-"
    assert lines["out"].startswith("/repo|") and "Read-only file system" in lines["out"]
    assert lines["made"] == "True"  # the workspace is the shell's working directory
  else:  # never run unconfined
    assert "chroot" not in applied and lines["mount_error"] != "-"
    assert lines["made"] == "False" and "not run" in lines["out"]
