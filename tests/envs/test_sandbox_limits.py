"""The sandbox's limits: a shell's disk limits hold during the call; every limit is checked.

Disk: writers far past the limits (one large file, many small files, /tmp)
must stop at them, say so and be counted. With a tmpfs the kernel holds the
limit, so the bytes left on disk are checked against it exactly; with the
watchdog (no tmpfs) how far a writer overshoots depends on timing, so only
the verdict is checked, which the supervisor's last measure after the call
makes certain. Nothing here depends on timing or load: every writer ends by
itself, far inside generous wall clocks.
"""

import dataclasses
import os
import re
import resource
import stat
import subprocess
import sys

import pytest

from sao_jax.config import sections
from sao_jax.envs import registry, repo_repair, sandbox
from sao_jax.envs.base import Action
from sao_jax.envs.chat import ToolCall

_APPLIED, _MOUNT_ERROR = sandbox.shell_isolation()
needs_shell = pytest.mark.skipif(
  "chroot" not in _APPLIED or "mounts" not in _APPLIED,
  reason=f"no isolated shell here ({_MOUNT_ERROR or ', '.join(_APPLIED)})",
)
needs_tmpfs = pytest.mark.skipif(
  sandbox.disk_limits()[0] != "tmpfs", reason=f"no tmpfs here ({sandbox.disk_limits()[1]})"
)

MIB = 1 << 20
# Single files may be large: the disk limits, not RLIMIT_FSIZE, must stop them.
DISK = sandbox.SandboxLimits(
  cpu_seconds=30,
  wall_seconds=60.0,
  max_file_bytes=256 * MIB,
  max_output_chars=2000,
  max_disk_bytes=MIB,
  max_disk_files=50,
)
BIG_FILE = "dd if=/dev/zero of={path} bs=64k count=800 2>&1 | tail -1"  # 50 MiB
MANY_FILES = "i=0; while [ $i -lt 1000 ]; do true > {dir}/f$i || break; i=$((i+1)); done"


def _usage(root):
  """(allocated bytes of non-directories, entries) under `root`."""
  size = files = 0
  for top, dirs, names in os.walk(root):
    files += len(dirs) + len(names)
    for name in names:
      size += os.lstat(os.path.join(top, name)).st_blocks * 512
  return size, files


# --- a shell's disk limits, held by a tmpfs ---------------------------------------


@needs_shell
@needs_tmpfs
@pytest.mark.parametrize("where", ["workspace", "tmp"])
def test_one_large_file_stops_at_the_limit(tmp_path, where):
  path = "big" if where == "workspace" else "/tmp/big"
  r = sandbox.run_shell(
    BIG_FILE.format(path=path) + "; ls -l " + path, sandbox.Workspace(str(tmp_path)), DISK
  )
  assert r.disk_limit and not r.ok and "tmpfs" in r.isolation
  assert "disk limit: at most 1048576 bytes and 50 entries" in r.observation()
  assert "No space left on device" in r.observation()
  written = int(r.stdout.split()[0])  # dd's count: the kernel stopped it at the limit
  assert 0.9 * MIB < written <= MIB
  size, _ = _usage(tmp_path)
  assert size <= (MIB if where == "workspace" else 0)  # /tmp ended with the call


@needs_shell
@needs_tmpfs
@pytest.mark.parametrize("where", ["workspace", "tmp"])
def test_many_small_files_stop_at_the_limit(tmp_path, where):
  directory = "." if where == "workspace" else "/tmp"
  r = sandbox.run_shell(
    MANY_FILES.format(dir=directory) + "; ls " + directory + " | wc -l",
    sandbox.Workspace(str(tmp_path)),
    DISK,
  )
  assert r.disk_limit and "disk limit" in r.observation()
  assert "No space left on device" in r.observation()
  made = int(r.stdout.split()[-1])
  assert 40 <= made <= 50
  _, entries = _usage(tmp_path)
  assert entries == (made if where == "workspace" else 0)


@needs_shell
@needs_tmpfs
def test_tmp_and_the_workspace_share_one_limit(tmp_path):
  with open(tmp_path / "data.bin", "wb") as f:
    f.write(os.urandom(600 << 10))
  workspace = sandbox.Workspace(str(tmp_path))
  small = sandbox.run_shell("head -c 300000 /dev/zero > /tmp/x && echo fits", workspace, DISK)
  assert small.ok and small.stdout == "fits\n" and not small.disk_limit
  full = sandbox.run_shell("head -c 600000 /dev/zero > /tmp/x || echo refused", workspace, DISK)
  assert full.disk_limit and "refused" in full.stdout
  assert os.path.getsize(tmp_path / "data.bin") == 600 << 10  # the workspace, intact


@needs_shell
@needs_tmpfs
def test_a_workspace_already_over_the_limit_runs_without_room(tmp_path):
  with open(tmp_path / "data.bin", "wb") as f:
    f.write(b"x" * (2 * MIB))
  r = sandbox.run_shell(
    "wc -c < data.bin; echo more > more.txt || echo refused", sandbox.Workspace(str(tmp_path)), DISK
  )
  lines = r.stdout.splitlines()
  assert (lines[0], lines[-1]) == (str(2 * MIB), "refused") and r.disk_limit
  assert os.path.getsize(tmp_path / "data.bin") == 2 * MIB
  assert os.path.getsize(tmp_path / "more.txt") == 0  # an inode was left, no page


@needs_shell
@needs_tmpfs
def test_the_workspace_comes_back_as_the_shell_left_it(tmp_path):
  """Copied in and out: contents, modes (no setuid), links, holes, times, depth."""
  root = str(tmp_path)
  os.makedirs(os.path.join(root, "sub/dir"))
  for name, mode in (
    ("run.sh", 0o755),
    ("suid", 0o4755),
    ("gone.txt", 0o644),
    ("sub/dir/old.txt", 0o600),
  ):
    with open(os.path.join(root, name), "w") as f:
      f.write(name)
    os.chmod(os.path.join(root, name), mode)
  os.utime(os.path.join(root, "sub/dir/old.txt"), ns=(10**18, 10**18))
  os.symlink("run.sh", os.path.join(root, "link"))
  os.symlink("/etc/shadow", os.path.join(root, "outside"))
  os.link(os.path.join(root, "run.sh"), os.path.join(root, "hard"))
  os.mkfifo(os.path.join(root, "fifo"))
  with open(os.path.join(root, "sparse"), "wb") as f:
    f.truncate(8 * MIB)
  deep = "d" * 100  # 60 levels: past PATH_MAX
  fd = os.open(root, os.O_RDONLY)
  for _ in range(60):
    os.mkdir(deep, dir_fd=fd)
    fd, parent = os.open(deep, os.O_RDONLY, dir_fd=fd), fd
    os.close(parent)
  os.close(os.open("bottom", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
  os.close(fd)
  command = (
    "rm gone.txt; echo new > new.txt; ln -s new.txt newlink; cat outside; "
    "find . -name bottom | wc -l"
  )
  limits = dataclasses.replace(DISK, max_disk_files=200)
  r = sandbox.run_shell(command, sandbox.Workspace(root), limits)
  assert not r.disk_limit and "No such file" in r.stdout  # the link was not followed
  assert r.stdout.endswith("\n1\n")  # the deep file, in the shell
  names = set(os.listdir(root))
  assert names == {
    "run.sh",
    "suid",
    "sub",
    "link",
    "outside",
    "hard",
    "sparse",
    "new.txt",
    "newlink",
    deep,
  }  # fifo: left out; gone.txt: removed
  st = {n: os.lstat(os.path.join(root, n)) for n in names}
  assert stat.S_IMODE(st["run.sh"].st_mode) == 0o755
  assert stat.S_IMODE(st["suid"].st_mode) == 0o755  # never setuid on the host
  assert st["hard"].st_ino == st["run.sh"].st_ino and st["run.sh"].st_nlink == 2
  assert os.readlink(os.path.join(root, "outside")) == "/etc/shadow"
  assert os.readlink(os.path.join(root, "newlink")) == "new.txt"
  assert st["sparse"].st_size == 8 * MIB and st["sparse"].st_blocks * 512 < 64 << 10
  old = os.lstat(os.path.join(root, "sub/dir/old.txt"))
  assert old.st_mtime_ns == 10**18 and stat.S_IMODE(old.st_mode) == 0o600
  fd = os.open(root, os.O_RDONLY)
  for _ in range(60):
    fd, parent = os.open(deep, os.O_RDONLY, dir_fd=fd), fd
    os.close(parent)
  os.close(os.open("bottom", os.O_RDONLY, dir_fd=fd))  # and back on the host
  os.close(fd)


# --- the watchdog, where no tmpfs can be mounted ----------------------------------


@pytest.mark.parametrize(
  "isolate,where", [(True, "workspace"), (True, "tmp"), (False, "workspace")]
)
def test_the_watchdog_kills_or_reports_a_writer_past_the_limit(
  tmp_path, monkeypatch, isolate, where
):
  """Without a tmpfs, a writer past the limit is killed or, if it finished
  first, reported by the last measure: the verdict never depends on timing."""
  if isolate and "mounts" not in _APPLIED:
    pytest.skip("no isolated shell here")
  monkeypatch.setattr(sandbox, "_TMPFS", False)
  directory = "." if where == "workspace" else "/tmp"
  writer = (
    "i=0; while [ $i -lt 300 ]; do head -c 8192 /dev/zero > "
    + directory
    + "/f$i; i=$((i+1)); done; echo done"
  )  # 300 entries, 2.4 MB
  r = sandbox.run_shell(
    writer, sandbox.Workspace(str(tmp_path)), dataclasses.replace(DISK, isolate=isolate)
  )
  assert r.disk_limit and not r.ok and "disk_watchdog" in r.isolation
  assert "disk limit: went over 1048576 bytes or 50 entries" in r.observation()
  assert r.stdout in ("", "done\n") and "tmpfs" not in r.isolation


# --- the counter -------------------------------------------------------------------


@needs_shell
def test_repo_repair_answers_and_counts_the_disk_limit():
  config = repo_repair.RepoRepairConfig(
    max_turns=4, bash_seconds=30.0, max_tree_bytes=MIB, max_tree_files=200, max_output_chars=600
  )
  env = repo_repair.RepoRepair(config)
  assert (env.shell_limits.max_disk_bytes, env.shell_limits.max_disk_files) == (MIB, 200)
  ep = env.episode(env.task(0))
  for command in (BIG_FILE.format(path="big"), BIG_FILE.format(path="/tmp/big")):
    call = ToolCall("bash", {"command": command})
    out = ep.step(Action("turn", tool_calls=(call,), tool_sequence=(call,)))
    assert "disk limit" in out.observation[0]["content"]
    assert "bash_disk_limit" in out.info["events"] and not out.done  # a tool error, counted
  size, _ = _usage(ep.root)
  assert size <= MIB


# --- every limit is checked --------------------------------------------------------

_PHYSICAL = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
BAD = [
  ("cpu_seconds", -1),
  ("cpu_seconds", 0),
  ("cpu_seconds", 1.5),
  ("cpu_seconds", 10**9),
  ("wall_seconds", -1),
  ("wall_seconds", 0),
  ("wall_seconds", float("nan")),
  ("wall_seconds", float("inf")),
  ("wall_seconds", "5"),
  ("memory_bytes", -1),
  ("memory_bytes", 0),
  ("memory_bytes", MIB),
  ("memory_bytes", _PHYSICAL + 1),
  ("max_file_bytes", -1),
  ("max_file_bytes", 0),
  ("max_open_files", -1),
  ("max_open_files", 3),
  ("max_open_files", _NOFILE + 1),
  ("max_processes", -1),
  ("max_processes", 0),
  ("max_processes", True),
  ("max_output_chars", -1),
  ("max_output_chars", 0),
  ("max_disk_bytes", -1),
  ("max_disk_bytes", 0),
  ("max_disk_bytes", _PHYSICAL + 1),
  ("max_disk_files", -1),
  ("max_disk_files", 0),
  ("max_disk_files", 1 << 21),
  ("isolate", 1),
  ("isolate", "yes"),
]


def test_every_limit_has_bad_values_below():
  assert {name for name, _ in BAD} == {f.name for f in dataclasses.fields(sandbox.SandboxLimits)}


@pytest.mark.parametrize("name,value", BAD)
def test_a_limit_out_of_range_is_refused_in_one_line(name, value):
  with pytest.raises(ValueError) as e:
    sandbox.SandboxLimits(**{name: value})
  message = str(e.value)
  assert message.startswith(f"sandbox limit {name} = {value!r}: must be") and "\n" not in message
  if name != "isolate":
    assert "[" in message and "]" in message  # the allowed range


def test_the_ends_of_each_range_are_allowed():
  sandbox.SandboxLimits(
    cpu_seconds=1,
    wall_seconds=0.01,
    memory_bytes=32 * MIB,
    max_file_bytes=1,
    max_open_files=8,
    max_processes=1,
    max_output_chars=1,
    max_disk_bytes=os.sysconf("SC_PAGE_SIZE"),
    max_disk_files=1,
  )
  sandbox.SandboxLimits(max_open_files=_NOFILE, wall_seconds=86400)


def test_env_sandbox_is_checked_before_the_run():
  with pytest.raises(
    sections.ConfigError, match=r"env.sandbox: sandbox limit memory_bytes = -1: must be an integer"
  ):
    registry.check_env_section(sections.Env(sandbox={"memory_bytes": -1}))
  registry.check_env_section(sections.Env(sandbox={"memory_bytes": 64 * MIB}))


_REFUSED = """\
import importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("sandbox", {path!r})
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)
limits = sandbox.SandboxLimits(max_file_bytes=2 << 20)  # valid when made
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # now beyond the hard limit
try:
  print("ran", sandbox.run_python("print('ran')", limits).observation())
except RuntimeError as e:
  print("raised", e)
"""


def test_a_limit_the_system_refuses_is_an_error_not_a_silence():
  """A call whose rlimit cannot be set does not run without it (in a child
  process: its lowered hard limit could not be raised again)."""
  out = subprocess.run(
    [sys.executable, "-I", "-c", _REFUSED.format(path=sandbox.__file__)],
    capture_output=True,
    text=True,
    check=True,
    timeout=120,
  )
  assert re.fullmatch(
    r"raised sandbox: setrlimit\(RLIMIT_FSIZE, 2097152\) failed: .*; "
    r"the code was not run\n",
    out.stdout,
  ), out.stdout + out.stderr
