"""Launching the real entry points as subprocesses, for the end-to-end tests.

One place for how a test runs `launch/*.py`: the interpreter, the simulated
devices, the tiny run's flags and reading a run's metrics back. The
persistent compile cache that tests/conftest.py configures reaches the
children through the environment.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A whole tiny run in about a minute: every stage, checkpoints every 2 steps.
TINY_RUN = (
  "--config.sft.steps=6",
  "--config.sft.batch_size=8",
  "--config.value_pretrain.steps=2",
  "--config.value_pretrain.num_trajectories=8",
  "--config.rl.steps=6",
  "--config.rl.batch_size=8",
  "--config.rollout.slots=8",
  "--config.eval.num_tasks=8",
  "--config.eval.slots=8",
  "--config.log_every=1",
  "--config.checkpoint.every=2",
  "--config.tensorboard=False",
)


def child_env(devices: int = 8, **extra) -> dict:
  """The environment of a child JAX process on `devices` simulated CPU devices."""
  return dict(
    os.environ,
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    JAX_PLATFORMS="cpu",
    PYTHONUNBUFFERED="1",
    **extra,
  )


def command(
  script: str, workdir: str, *flags, config: str = "sao_tiny.py", run_flags=TINY_RUN
) -> list[str]:
  """The command line of `launch/<script>` on `configs/<config>` and 8 devices
  in one data-parallel mesh; later flags win."""
  return [
    sys.executable,
    os.path.join(ROOT, "launch", script),
    f"--config={os.path.join(ROOT, 'configs', config)}",
    f"--workdir={workdir}",
    "--config.sharding.mesh={'data': 8}",
    *run_flags,
    *flags,
  ]


def launch(
  workdir,
  *flags,
  wait=True,
  script="train.py",
  config="sao_tiny.py",
  run_flags=TINY_RUN,
  check=True,
  devices=8,
):
  """Runs an entry point on `devices` simulated devices; its output (asserting
  success when `check`), or the running Popen (stdout and stderr merged) when
  not `wait`."""
  proc = subprocess.Popen(
    command(script, workdir, *flags, config=config, run_flags=run_flags),
    env=child_env(devices),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    cwd=ROOT,
  )
  if not wait:
    return proc
  out = finish(proc)
  if check:
    assert proc.returncode == 0, out[-4000:]
  return out


def finish(proc, timeout: float = 900) -> str:
  """Waits for a `launch(wait=False)` child; its merged output. A child
  still running after `timeout` seconds is killed (a hung run must not
  outlive its test) and the test fails with its last output."""
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate()
    raise AssertionError(
      f"{proc.args[:3]} ran past {timeout:.0f} s; its last output:\n{out[-4000:]}"
    ) from None
  return out


def run(workdir, *flags, script="train.py", config="sao_tiny.py", run_flags=TINY_RUN):
  """Runs an entry point to its end: the CompletedProcess (stdout and stderr apart)."""
  return subprocess.run(
    command(script, workdir, *flags, config=config, run_flags=run_flags),
    env=child_env(),
    capture_output=True,
    text=True,
    timeout=900,
    cwd=ROOT,
  )


def read_metrics(workdir, stage=None) -> list[dict]:
  """The records of `<workdir>/metrics.jsonl`, of one stage if given."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  return [r for r in records if stage is None or r["stage"] == stage]


def shipped_configs() -> list[str]:
  """The file names of the run configs in configs/: every module but the
  package's `__init__.py` and the shared defaults of `common.py`."""
  return sorted(
    n
    for n in os.listdir(os.path.join(ROOT, "configs"))
    if n.endswith(".py") and n not in ("__init__.py", "common.py")
  )


def load_config_module(name: str):
  """The module of `configs/<name>` (a path or a file name), imported by path.

  Its own imports (`from configs import common`) resolve through the
  repository root that tests/conftest.py puts on `sys.path`."""
  path = name if os.path.isabs(name) else os.path.join(ROOT, "configs", name)
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def free_port() -> int:
  """A TCP port free on localhost now (a jax.distributed coordinator's)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_together(jobs, log_dir, timeout: float) -> None:
  """Starts every `(name, argv, env)` of `jobs` at once (output in
  `<log_dir>/<name>.log`, cwd the repository), waits for all, kills what is
  left after `timeout` s or on an error, and asserts each exited 0 (the
  failing one's log tail in the message)."""
  procs, logs = [], []
  try:
    for name, argv, env in jobs:
      log = open(os.path.join(log_dir, f"{name}.log"), "w", encoding="utf-8")
      logs.append(log)
      procs.append(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    for p in procs:
      p.wait(timeout=timeout)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for log in logs:
      log.close()
  for p, log in zip(procs, logs):
    with open(log.name, encoding="utf-8") as f:
      assert p.returncode == 0, f"{log.name}:\n{f.read()[-5000:]}"


def wait_for(
  what: str, condition, procs: dict, guard_s: float, *, tail=None, poll_s: float = 0.5
) -> None:
  """Polls `condition` until true, failing the test (pytest.fail) when a process
  of `procs` ({name: Popen}) exits first or the hang guard of `guard_s` runs
  out; `tail(name)` (None: the whole output, for the guard) adds the end of
  a log to the message."""
  import pytest

  tail = tail or (lambda name: "")
  deadline = time.time() + guard_s
  while time.time() < deadline:
    if condition():
      return
    for name, p in procs.items():
      if p.poll() is not None:
        pytest.fail(f"{name} exited ({p.returncode}) waiting for {what}:\n{tail(name)}")
    time.sleep(poll_s)
  pytest.fail(f"hang guard: no {what} within {guard_s} s:\n{tail(None)}")
