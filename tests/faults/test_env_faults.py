"""The rollout driver against environments that raise, hang or return garbage.

Each fake environment below plays EchoEnv's episodes (2-4 turns, 0.25 reward
per intermediate turn, 1.0 at the end; always "done" well within MAX_LEN)
except on chosen tasks, where a step misbehaves. Outcomes are therefore known
per prompt, whatever the random policy samples. Hangs block on an Event the
test releases, so they always outlast `env_timeout`; no assertion is on a
duration.
"""

import collections
import threading

import jax
import numpy as np
import pytest

from sao_jax.config import sections
from sao_jax.data.trajectory import validate
from sao_jax.envs.base import GraderError, StepResult, Task
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy
from sao_jax.rollout.driver import MAX_GRADER_RERUNS, RolloutDriver
from sao_jax.rollout.engine import PolicyEngine

TOK = CharTokenizer()
CFG = mcfg.tiny(vocab_size=TOK.vocab_size)
MAX_LEN = 128
# Seconds. Only hangs (which last until the test releases them) reach it: a
# healthy step takes microseconds, and would have to be starved of CPU for
# this long to be cut, far beyond what load on a 2-core machine does.
TIMEOUT = 2.0
# The engine's and the drivers' section: turns of 6 tokens, 2 environment
# workers and the timeout above (swap policy keep and 8 decode steps, fixed
# here).
ROLLOUT = sections.Rollout(
  slots=4,
  max_len=MAX_LEN,
  max_turn_tokens=6,
  env_workers=2,
  env_timeout=TIMEOUT,
  swap_policy="keep",
  decode_steps=8,
)


def turns_of(i):
  return 2 + i % 3


def normal_step(n, turns):
  done = n >= turns
  return StepResult("" if done else ">" + "ab" * n + "\n", 1.0 if done else 0.25, done)


def normal_reward(i):
  return 0.25 * (turns_of(i) - 1) + 1.0


NORMAL = object()  # a fault's "act normally on this step"


def at_turn(turn, fn):
  """A fault that misbehaves (calls `fn`) on step `turn` and acts normally otherwise."""
  return lambda n: fn() if n == turn else NORMAL


class FaultyEnv:
  """EchoEnv-like episodes; `faults[i](n)` may take over step n of task i.

  A fault returns what the step returns (NORMAL: the normal result) or raises.
  """

  name, max_turns = "faulty", 4

  def __init__(self, faults=None):
    self.faults = faults or {}

  def task(self, i):
    return Task(i, f"q{i % 10}\n", None, {"turns": turns_of(i)})

  def episode(self, task):
    turns, fault = task.meta["turns"], self.faults.get(task.index)

    class Ep:
      n = 0

      def step(self, action):
        del action
        self.n += 1
        result = fault(self.n) if fault is not None else NORMAL
        return normal_step(self.n, turns) if result is NORMAL else result

    return Ep()

  def demonstration(self, task):
    del task
    return [("x", ">ab\n"), ("y", "")]


class Hang:
  """A step that blocks until `release`; counts how many are blocked."""

  def __init__(self):
    self.release = threading.Event()
    self.entered = threading.Event()

  def __call__(self):
    self.entered.set()
    self.release.wait()
    return StepResult("", 1.0, True)  # a late result: must never be used


@pytest.fixture(scope="module")
def engine():
  # One engine for the module: its compiled steps are reused by every driver.
  return PolicyEngine(CFG, policy.init_params(CFG, jax.random.key(0)), ROLLOUT, seed=3)


def make_driver(engine, env, prompts, out, rollout=ROLLOUT, **kw):
  return RolloutDriver(engine, env, TOK, iter(prompts), out.append, rollout, **kw)


def run_driver(engine, env, prompts, rollout=ROLLOUT, **kw):
  out = []
  driver = make_driver(engine, env, prompts, out, rollout, **kw)
  try:
    driver.run()
  finally:
    driver.stop()
  return out, driver


def check_outcomes(out, prompts, expect):
  """Every prompt finished once; `expect[i]` = (reason, total reward), else normal."""
  assert sorted(t.prompt_id for t in out) == sorted(prompts)
  for t in out:
    assert validate(t, TOK.vocab_size, MAX_LEN) is None, (t.prompt_id, t.finish_reason)
    reason, reward = expect.get(t.prompt_id, ("done", normal_reward(t.prompt_id)))
    assert (t.prompt_id, t.finish_reason) == (t.prompt_id, reason)
    assert t.total_reward == pytest.approx(reward), t.prompt_id
    if reason.startswith("env_"):
      assert not t.rewards.any()  # earlier turns' rewards are zeroed too


def test_raising_steps_end_only_their_episodes(engine):

  class UnprintableError(Exception):
    def __str__(self):
      raise RuntimeError("no message for you")

  def boom(i):
    def fn():
      raise ValueError(f"boom {i}")

    return fn

  def unprintable():
    raise UnprintableError()

  def system_exit():
    raise SystemExit(3)  # not an Exception: escapes the step's handler

  faults = {
    1: at_turn(2, boom(1)),
    5: at_turn(2, unprintable),
    6: at_turn(1, boom(6)),
    8: at_turn(2, system_exit),
  }
  prompts = list(range(10))
  out, driver = run_driver(engine, FaultyEnv(faults), prompts)
  check_outcomes(out, prompts, {i: ("env_error", 0.0) for i in faults})
  assert driver.stats.env_faults == collections.Counter({"env_error": 4})
  log = "\n".join(driver.stats.env_fault_log)
  assert "env_error prompt 1 turn 2: ValueError: boom 1" in log
  assert "env_error prompt 6 turn 1: ValueError: boom 6" in log
  assert "prompt 5 turn 2: UnprintableError" in log and "SystemExit" in log


class ExplodingResult(StepResult):
  """A StepResult whose reward raises when read."""

  def __getattribute__(self, name):
    if name == "reward":
      raise RuntimeError("reward unavailable")
    return super().__getattribute__(name)


GARBAGE = [
  lambda: ("obs", 1.0, False),
  lambda: None,
  lambda: StepResult("x\n", None, False),
  lambda: StepResult("x\n", "1", False),
  lambda: StepResult("x\n", float("nan"), False),
  lambda: StepResult("", float("-inf"), True),
  lambda: StepResult("", 1e39, True),  # finite, but inf in float32
  lambda: StepResult("", True, True),  # a bool reward: fields out of place
  lambda: StepResult("", np.ones(2), True),
  lambda: StepResult("x\n", 1.0, 1),
  lambda: StepResult("x\n", 0.0, None),
  lambda: StepResult(None, 0.0, False),
  lambda: StepResult(b"x\n", 0.0, False),
  lambda: StepResult("", 1.0, True, [("finish_reason", "done")]),
  lambda: StepResult("", 1.0, True, {"finish_reason": "won"}),
  lambda: StepResult("", 1.0, True, {"finish_reason": 7}),
  lambda: ExplodingResult("x\n", 1.0, False),
]
# Not garbage: numpy scalars, an int reward, a known finish reason.
LENIENT = [
  (lambda: StepResult("", np.float32(1.0), np.bool_(True)), ("done", 1.25)),
  (lambda: StepResult(">a\n", 2, False), None),  # pays 2 instead of 0.25, goes on
  (lambda: StepResult("", 1.0, True, {"finish_reason": "max_turns"}), ("max_turns", 1.25)),
]


def test_garbage_results_end_only_their_episodes(engine):
  faults, expect = {}, {}
  for i, fn in enumerate(GARBAGE):
    faults[i] = at_turn(2, fn)
    expect[i] = ("env_garbage", 0.0)
  # The environment reporting its own failure: counted, and it cannot pay out.
  n = len(GARBAGE)
  faults[n] = at_turn(2, lambda: StepResult("", 5.0, True, {"finish_reason": "env_error"}))
  expect[n] = ("env_error", 0.0)
  for j, (fn, outcome) in enumerate(LENIENT):
    i = n + 1 + j
    faults[i] = at_turn(2, fn)
    if outcome is not None:
      expect[i] = outcome
    else:
      assert turns_of(i) >= 3
      expect[i] = ("done", normal_reward(i) - 0.25 + 2)
  prompts = list(range(n + 1 + len(LENIENT) + 3))
  out, driver = run_driver(engine, FaultyEnv(faults), prompts)
  check_outcomes(out, prompts, expect)
  assert driver.stats.env_faults == collections.Counter(
    {"env_garbage": len(GARBAGE), "env_error": 1}
  )
  log = "\n".join(driver.stats.env_fault_log)
  assert "RuntimeError: reward unavailable" in log and "reported by the environment" in log
  assert len(driver.stats.env_fault_log) == 16  # bounded: the latest faults only


def test_long_observation_is_cut_not_failed(engine):
  faults = {0: at_turn(1, lambda: StepResult("x" * 10**6 + "\n", 0.25, False))}
  out, driver = run_driver(engine, FaultyEnv(faults), [0, 1], max_observation_chars=20)
  check_outcomes(out, [0, 1], {})
  text = TOK.decode(next(t for t in out if t.prompt_id == 0).tokens)
  assert "x" * 20 in text and "x" * 21 not in text
  assert driver.stats.observations_truncated == 1 and not driver.stats.env_faults


def test_hanging_step_times_out(engine):
  hang = Hang()
  prompts = list(range(8))
  try:
    out, driver = run_driver(engine, FaultyEnv({3: at_turn(1, hang)}), prompts)
    check_outcomes(out, prompts, {3: ("env_timeout", 0.0)})
    assert driver.stats.env_faults == collections.Counter({"env_timeout": 1})
    assert driver.stuck_env_steps == 1  # still blocked: abandoned, not waited for
  finally:
    hang.release.set()


def test_repeated_hangs_do_not_starve_the_workers(engine):
  # 8 hangs on 2 workers: without replacing stuck workers, the third hang
  # would find none free and the driver would wait forever.
  hang = Hang()
  prompts = list(range(16))
  faults = {i: at_turn(1 + i % 3, hang) for i in prompts if i % 2 == 0}
  try:
    out, driver = run_driver(engine, FaultyEnv(faults), prompts, max_stuck_env_steps=16)
    check_outcomes(out, prompts, {i: ("env_timeout", 0.0) for i in faults})
    assert driver.stats.env_faults == collections.Counter({"env_timeout": 8})
    assert driver.stuck_env_steps == 8
  finally:
    hang.release.set()


def test_systematic_hangs_are_counted_and_never_stop_the_run(engine):
  # Every step hangs: past max_stuck_env_steps each further timeout is also
  # counted as env_stuck, and the run goes on to its last prompt (a policy
  # whose tool calls hang must not be able to stop its own training).
  hang = Hang()
  env = FaultyEnv({i: at_turn(1, hang) for i in range(5)})
  try:
    out, driver = run_driver(engine, env, range(5), max_stuck_env_steps=2)
    assert [t.finish_reason for t in out] == ["env_timeout"] * 5
    assert all(validate(t, TOK.vocab_size, MAX_LEN) is None for t in out)
    assert driver.stats.env_faults == collections.Counter({"env_timeout": 5, "env_stuck": 3})
    assert "env_stuck" in "\n".join(driver.stats.env_fault_log)
  finally:
    hang.release.set()


class FailingGrader:
  """A step whose grader fails (GraderError) the first `times` times it is reached."""

  def __init__(self, times):
    self.left = times

  def __call__(self):
    if self.left > 0:
      self.left -= 1
      raise GraderError("the grader's sandbox did not start")
    return NORMAL


def test_grader_errors_rerun_the_episode_instead_of_scoring_it(engine):
  # Prompt 1's grader fails once: its episode runs again from the prompt and
  # its (full) reward is emitted, once; prompt 2's always fails: after
  # MAX_GRADER_RERUNS reruns it ends as an env_error (zero reward).
  faults = {1: at_turn(2, FailingGrader(1)), 2: at_turn(2, FailingGrader(10**6))}
  prompts = list(range(5))
  out, driver = run_driver(engine, FaultyEnv(faults), prompts)
  check_outcomes(out, prompts, {2: ("env_error", 0.0)})
  attempts = 1 + MAX_GRADER_RERUNS
  assert driver.stats.env_faults == collections.Counter(
    {"grader_error": 1 + attempts, "env_error": 1}
  )
  assert driver.stats.reruns == 1 + MAX_GRADER_RERUNS
  assert "grader_error prompt 1 turn 2: GraderError" in "\n".join(driver.stats.env_fault_log)


def test_stop_wakes_a_driver_waiting_on_a_hung_step(engine):
  hang = Hang()
  driver = make_driver(
    engine,
    FaultyEnv({i: at_turn(1, hang) for i in range(4)}),
    range(4),
    [],
    ROLLOUT.replace(env_timeout=None),
  )
  try:
    driver.start()
    assert hang.entered.wait(60)
    driver.stop(timeout=60)  # without the wake-up, this would wait for the step forever
    assert not driver.alive
    driver.check()
    driver.stop()
  finally:
    hang.release.set()


class AdmissionFaultsEnv(FaultyEnv):
  """`task` raises on 2, returns garbage on 4 and 6; `episode` fails on 3's second copy."""

  def __init__(self):
    super().__init__()
    self.opened = collections.Counter()

  def task(self, i):
    if i == 2:
      raise KeyError("no task 2")
    if i == 4:
      return {"prompt": "q4\n"}
    if i == 6:
      return Task(6, "Q6 is upper case\n")  # not in the character vocabulary
    return super().task(i)

  def episode(self, task):
    self.opened[task.index] += 1
    if task.index == 3 and self.opened[3] == 2:
      raise OSError("sandbox pool exhausted")
    return super().episode(task)


def test_admission_faults_skip_the_prompt(engine):
  env = AdmissionFaultsEnv()
  out, driver = run_driver(engine, env, range(8), ROLLOUT.replace(samples_per_prompt=2))
  kept = [0, 1, 5, 7]
  check_outcomes(out, kept + kept, {})
  groups = collections.Counter(t.group_id for t in out)
  assert len(groups) == 4 and set(groups.values()) == {2}  # whole groups only
  assert driver.stats.env_faults == collections.Counter({"task_error": 3, "episode_error": 1})
  log = "\n".join(driver.stats.env_fault_log)
  assert "task_error prompt 2: KeyError" in log and "episode_error prompt 3: OSError" in log
  assert "not a Task" in log and "not in the vocabulary" in log


def test_an_env_that_opens_no_episode_fails_the_driver(engine):
  class Broken(FaultyEnv):
    def task(self, i):
      raise RuntimeError("misconfigured")

  out, driver = run_driver(engine, Broken(), range(50))
  assert not out and driver.stats.env_faults == collections.Counter({"task_error": 50})
  with pytest.raises(RuntimeError, match="failed to open 100 prompts in a row"):
    run_driver(engine, Broken(), range(1000))


def test_bad_arguments(engine):
  with pytest.raises(ValueError, match="env_timeout"):
    make_driver(engine, FaultyEnv(), range(1), [], ROLLOUT.replace(env_timeout=0))
  driver = make_driver(engine, FaultyEnv(), range(1), [])
  driver.stop()  # never started: safe, and twice
  driver.stop()
  driver.check()
