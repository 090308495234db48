"""A user's own task, trained by import string from outside the repository.

The package `my_tasks` (an environment with a `digits` option and a reward
function) is written into tmp_path and is importable only through what the
test hands over: `sys.path` for the in-process trainer, `PYTHONPATH` for the
fleet's trainer and rollout processes. The environment's own reward pays
0 or 1; the user's reward pays 1 for the sum and 0.25 for anything else, so a
trajectory worth 0.25 (or a mean reward of at least 0.25) can only come from
the user's function. The factory and the reward append one JSON line per call
to logs in tmp_path, with the calling process's pid: which process built the
environment with which kwargs, and which process paid the rewards.

Unknown names fail validation with one line listing the known ones:
env.name in tests/envs/test_env_registry.py
(`test_unknown_env_names_fail_validation_in_one_line`), rl.advantage and
rl.policy_loss in tests/train/test_extension_points.py
(`test_unknown_names_fail_validation_with_the_known_ones`).
"""

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import runs

from sao_jax.data import store
from sao_jax.envs import registry
from sao_jax.envs.base import Action
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.train import configuration, trainer
from sao_jax.transport import fleet

ENV_PY = '''
"""Add two numbers of `digits` digits each, in one turn."""
import json
import os
import random

from sao_jax.envs.base import StepResult, Task


class Add:
  name, max_turns = "add", 1
  runs_code = False

  def __init__(self, digits, log_dir):
    self.digits, self.log_dir = digits, log_dir

  def task(self, index):
    rng = random.Random(index)
    lo, hi = 10 ** (self.digits - 1), 10 ** self.digits
    a, b = rng.randrange(lo, hi), rng.randrange(lo, hi)
    return Task(index, f"add {a} {b}\\n", str(a + b), {"log_dir": self.log_dir})

  def episode(self, task):
    return Episode(task)

  def demonstration(self, task):
    return [(task.answer, "")]


class Episode:

  def __init__(self, task):
    self.task = task

  def step(self, action):
    return StepResult("", float(action.strip() == self.task.answer), True, {})


def make_env(digits, log_dir):  # no defaults: lost kwargs fail loudly
  with open(os.path.join(log_dir, "factory.jsonl"), "a", encoding="utf-8") as f:
    f.write(json.dumps({"pid": os.getpid(), "digits": digits}) + "\\n")
  return Add(digits, log_dir)
'''

REWARD_PY = '''
"""The user's reward: 1 for the sum, 0.25 for any other answer."""
import json
import os


def score(task, response, info):
  reward = 1.0 if response.strip() == task.answer else 0.25
  line = json.dumps({"pid": os.getpid(), "prompt": task.prompt, "reward": reward})
  with open(os.path.join(task.meta["log_dir"], "rewards.jsonl"), "a", encoding="utf-8") as f:
    f.write(line + "\\n")
  return reward
'''

DIGITS = 2
USER_REWARDS = {0.25, 1.0}  # the environment's own: {0.0, 1.0}


@pytest.fixture
def user_site(tmp_path):
  """<tmp_path>/site holding the package my_tasks, not yet on any path."""
  assert importlib.util.find_spec("my_tasks") is None
  site = tmp_path / "site"
  pkg = site / "my_tasks"
  pkg.mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "env.py").write_text(textwrap.dedent(ENV_PY))
  (pkg / "reward.py").write_text(textwrap.dedent(REWARD_PY))
  (tmp_path / "logs").mkdir()
  yield site
  for name in [m for m in sys.modules if m.startswith(("my_tasks", "sao_jax_user_"))]:
    del sys.modules[name]


def read_jsonl(path):
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def operands(prompt):
  return re.fullmatch(r"add (\d+) (\d+)\n", prompt).groups()


def check_logs(log_dir, pid):
  """Process `pid` built the env with its kwargs and paid user rewards; all
  rewards it paid are the user's."""
  built = read_jsonl(os.path.join(log_dir, "factory.jsonl"))
  assert {"pid": pid, "digits": DIGITS} in built, built
  paid = [r for r in read_jsonl(os.path.join(log_dir, "rewards.jsonl")) if r["pid"] == pid]
  assert paid, "the user's reward never ran in this process"
  assert {r["reward"] for r in paid} <= USER_REWARDS
  assert all(len(x) == DIGITS for r in paid for x in operands(r["prompt"]))


# One tiny run for both modes: the same shapes and schedules, so that the
# fleet's processes reuse what the in-process run compiled (conftest's cache).
RL_STEPS = 3
TINY = {
  "sft.steps": 2,
  "sft.batch_size": 8,
  "sft.warmup": 1,
  "value_pretrain.steps": 1,
  "value_pretrain.num_trajectories": 8,
  "rl.steps": RL_STEPS,
  "rl.batch_size": 8,
  "rl.warmup": 1,
  "rollout.slots": 8,
  "rollout.max_len": 64,
  "rollout.max_turn_tokens": 8,
  "eval.num_tasks": 2,
  "eval.slots": 2,
  "log_every": 1,
  "checkpoint.every": 100,
  "tensorboard": False,
}


def tiny_config(**fields):
  c = runs.load_config_module("sao_tiny.py").get_config()
  for field, value in {**TINY, **fields}.items():
    configuration.set_field(c, field, value)
  return c


def test_async_trains_on_the_users_package(user_site, tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(user_site))
  log_dir = str(tmp_path / "logs")
  config = tiny_config(
    **{
      "rl.mode": "async",
      "env.name": "my_tasks.env:make_env",
      "env.kwargs": {"digits": DIGITS, "log_dir": log_dir},
      "env.reward": "my_tasks.reward:score",
    }
  )
  workdir = str(tmp_path / "run")
  summary = trainer.train(config, workdir)
  assert summary["rl_steps"] == RL_STEPS and os.path.exists(os.path.join(workdir, "summary.json"))
  rl = runs.read_metrics(workdir, "rl")
  assert [r["step"] for r in rl] == list(range(1, RL_STEPS + 1))
  # Every episode ends in a step (max_len is never reached), so every
  # reward is the user's: at least 0.25 each.
  assert all(r["rollout/reward_mean"] >= 0.25 for r in rl), [r["rollout/reward_mean"] for r in rl]
  check_logs(log_dir, os.getpid())


def test_a_relative_file_import_string(user_site, tmp_path, monkeypatch):
  """`path/file.py:factory`, relative to the cwd, with nothing on sys.path."""
  monkeypatch.chdir(user_site)
  log_dir = str(tmp_path / "logs")
  config = tiny_config(
    **{
      "env.name": "my_tasks/env.py:make_env",
      "env.kwargs": {"digits": DIGITS, "log_dir": log_dir},
      "env.reward": "my_tasks/reward.py:score",
    }
  )
  configuration.validate(config, num_devices=8)
  env = registry.make_env(config.env)
  task = env.task(5)
  assert env.episode(task).step(Action(task.answer)).reward == 1.0
  assert env.episode(task).step(Action("no")).reward == 0.25  # the env's own: 0
  check_logs(log_dir, os.getpid())
  assert not [m for m in sys.modules if m.startswith("my_tasks")]  # loaded by path only


FLEET_RUN = tuple(f"--config.{k}={v}" for k, v in TINY.items()) + (
  "--config.rl.mode=fleet",
  "--config.fleet.shard_trajectories=4",
  "--config.fleet.shard_seconds=2.0",
  "--config.fleet.poll_seconds=0.2",
)
HANG_GUARD_S = 600


@pytest.mark.slow  # test_async_trains_on_the_users_package loads the same package
def test_fleet_trains_on_the_users_package(user_site, tmp_path):
  """The trainer and a rollout process each import the package from PYTHONPATH;
  the reward is named by its file."""
  log_dir = str(tmp_path / "logs")
  workdir = str(tmp_path / "run")
  user = (
    "--config.env.name=my_tasks.env:make_env",
    "--config.env.kwargs=" + json.dumps({"digits": DIGITS, "log_dir": log_dir}),
    f"--config.env.reward={user_site / 'my_tasks' / 'reward.py'}:score",
  )
  path = os.pathsep.join(p for p in (str(user_site), os.environ.get("PYTHONPATH")) if p)
  procs = {}
  deadline = time.time() + HANG_GUARD_S
  with contextlib.ExitStack() as logs:
    try:
      for name, script, devices, flags in (
        ("trainer", "train.py", 8, ()),
        ("r0", "rollout.py", 1, ("--rollout_id=r0",)),
      ):
        cmd = runs.command(
          script,
          workdir,
          f"--config.sharding.mesh={{'data': {devices}}}",
          *user,
          *flags,
          run_flags=FLEET_RUN,
        )
        log = logs.enter_context(open(tmp_path / f"{name}.log", "w", encoding="utf-8"))
        procs[name] = subprocess.Popen(
          cmd,
          env=runs.child_env(devices, PYTHONPATH=path),
          stdout=log,
          stderr=subprocess.STDOUT,
          cwd=runs.ROOT,
        )
      for name, p in procs.items():  # the rollout exits when the trainer marks RL done
        try:
          rc = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
          rc = f"still running after {HANG_GUARD_S} s"
        assert rc == 0, (tmp_path / f"{name}.log").read_text(encoding="utf-8")[-3000:]
    finally:
      for p in procs.values():
        if p.poll() is None:
          p.kill()
          p.wait()

  trainer_log = (tmp_path / "trainer.log").read_text(encoding="utf-8")
  assert "[fleet] consumed r0-" in trainer_log, trainer_log[-3000:]
  rl = runs.read_metrics(workdir, "rl")
  assert [r["step"] for r in rl] == list(range(1, RL_STEPS + 1))
  assert rl[-1]["fleet/shards_consumed"] >= 1
  assert all(r["rollout/reward_mean"] >= 0.25 for r in rl)
  assert os.path.exists(os.path.join(workdir, "summary.json"))
  # The rollout's trajectories carry the user's rewards, paid in its process.
  shard_dir = fleet.trajectories_dir(os.path.join(workdir, "fleet"))
  trajs, _ = store.read_valid_trajectories(
    [os.path.join(shard_dir, n) for n in sorted(os.listdir(shard_dir))],
    CharTokenizer().vocab_size,
    64,
  )
  assert trajs and {t.total_reward for t in trajs} <= USER_REWARDS
  check_logs(log_dir, procs["r0"].pid)
  check_logs(log_dir, procs["trainer"].pid)  # built too; paid the evaluation's rewards
