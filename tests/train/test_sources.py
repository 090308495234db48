"""Trajectory sources (sao_jax/train/sources.py) against a fake driver: grouping,
sync vs async generation, restarts, counted rejections, state, the registry."""

import dataclasses
import threading

import numpy as np
import pytest

from sao_jax.data import prompts as prompt_data
from sao_jax.envs import python_tool, tokenizer
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.rollout.stats import DriverStats
from sao_jax.train import configuration, sources

ENV, TOK = python_tool.PythonTool(), tokenizer.CharTokenizer()
MAX_LEN = 512


def sampled(i: int, group_id: int):
  t = demonstration_trajectory(ENV, ENV.task(i), TOK)
  t.rollout_logprobs = np.where(t.action_mask, -0.5, 0).astype(np.float32)
  return dataclasses.replace(t, group_id=group_id) if dataclasses.is_dataclass(t) else t


class FakeEngine:
  version = 0


class FakeDriver:
  """Emits `plan` (a list of trajectories) through `emit`; fails where told to."""

  def __init__(self, emit, plan, fail_after=None):
    self.emit, self.plan, self.fail_after = emit, list(plan), fail_after
    self.engine, self.stats = FakeEngine(), DriverStats()
    self.alive, self.error, self.started, self.stopped = False, None, False, False
    self.swaps = []
    self._thread = None

  def _emit_one(self):
    if self.fail_after is not None and self.stats.finished >= self.fail_after:
      raise RuntimeError("injected driver failure")
    t = self.plan.pop(0)
    self.stats.generated_tokens += int(t.action_mask.sum())
    self.stats.finished += 1
    self.emit(t)

  def start(self):
    self.started = self.alive = True

    def loop():
      try:
        while self.plan and not self.stopped:
          self._emit_one()
      except RuntimeError as e:
        self.error = e
      self.alive = False

    self._thread = threading.Thread(target=loop, daemon=True)
    self._thread.start()

  def run(self, max_trajectories):
    for _ in range(min(max_trajectories, len(self.plan))):
      self._emit_one()

  def check(self):
    if self.error is not None:
      raise RuntimeError("driver thread died") from self.error

  def update_params(self, params, version):
    self.swaps.append(version)
    self.engine.version = version

  def stop(self):
    self.stopped = True
    if self._thread is not None:
      self._thread.join(timeout=10)


def make_source(plans, synchronous=False, group_size=1, max_restarts=2, wrap_emit=None):
  """A DriverSource whose k-th driver emits plans[k] (fails after `fail_after`)."""
  drivers = []

  def new_driver(emit):
    plan, fail_after = plans[len(drivers)]
    drivers.append(FakeDriver(emit, plan, fail_after))
    return drivers[-1]

  kwargs = {} if wrap_emit is None else {"wrap_emit": wrap_emit}
  src = sources.DriverSource(
    new_driver,
    prompt_data.train_prompts(100, 0),
    synchronous=synchronous,
    queue_size=8,
    vocab_size=TOK.vocab_size,
    max_len=MAX_LEN,
    max_staleness=None,
    group_size=group_size,
    max_restarts=max_restarts,
    last_checkpoint=lambda: 7,
    **kwargs,
  )
  return src, drivers


@pytest.mark.parametrize("synchronous", [False, True])
def test_take_returns_batches_in_completion_order(synchronous):
  plan = [sampled(i, group_id=i) for i in range(8)]
  src, drivers = make_source([(plan, None)], synchronous=synchronous)
  assert drivers[0].started is (not synchronous)
  first, second = src.take(4), src.take(4)
  assert [t.group_id for t in first + second] == list(range(8))
  report = src.report()
  assert report.restarts == 0 and report.rejected == {}
  assert report.counts.generated_tokens == sum(int(t.action_mask.sum()) for t in plan)
  src.publish(params=None, version=3)
  assert drivers[0].swaps == [3]
  src.close(finished=True)
  assert drivers[0].stopped


def test_groups_are_handed_out_whole():
  # Two groups of 2 interleaved: 0, 1, 0, 1 -> a batch of 2 is one whole group.
  plan = [sampled(i, group_id=g) for i, g in enumerate([0, 1, 0, 1, 2, 2])]
  src, _ = make_source([(plan, None)], synchronous=True, group_size=2)
  batches = [[t.group_id for t in src.take(2)] for _ in range(3)]
  assert sorted(map(tuple, batches)) == [(0, 0), (1, 1), (2, 2)]
  src.close(finished=True)


def test_a_malformed_trajectory_is_rejected_with_a_reason_and_never_handed_out():
  bad = sampled(1, group_id=1)
  bad.tokens = bad.tokens.copy()
  bad.tokens[0] = TOK.vocab_size + 5  # out of vocabulary
  plan = [sampled(0, 0), bad, sampled(2, 2), sampled(3, 3)]
  src, _ = make_source([(plan, None)], synchronous=True)
  got = src.take(3)
  assert [t.group_id for t in got] == [0, 2, 3]
  assert sum(src.report().rejected.values()) == 1
  src.close(finished=True)


@pytest.mark.parametrize("synchronous", [False, True])
def test_a_dead_driver_is_replaced_and_its_counts_kept(synchronous):
  plans = [
    ([sampled(i, i) for i in range(4)], 2),  # emits two, then fails
    ([sampled(i, i) for i in range(4, 8)], None),
  ]
  src, drivers = make_source(plans, synchronous=synchronous)
  got = src.take(4)
  assert len(drivers) == 2 and drivers[0].stopped
  assert [t.group_id for t in got] == [0, 1, 4, 5]
  src.close(finished=True)  # async: the new driver may have emitted more since
  report = src.report()
  assert report.restarts == 1
  # Cumulative: the dead driver's tokens stay counted beside the live one's.
  assert report.counts.generated_tokens == sum(d.stats.generated_tokens for d in drivers)
  assert drivers[0].stats.generated_tokens > 0


def test_too_many_restarts_stop_the_run_with_the_error():
  plans = [([sampled(0, 0)], 0), ([sampled(1, 1)], 0)]
  src, _ = make_source(plans, synchronous=True, max_restarts=1)
  with pytest.raises(
    configuration.StopTraining, match=r"failed 2 times .* last checkpoint \(7\) is intact"
  ):
    src.take(1)


def test_state_resumes_the_prompt_order():
  src, _ = make_source([([], None)], synchronous=True)
  it = src._prompt_iter
  for _ in range(5):
    next(it)
  saved = src.state()
  expected = [next(it) for _ in range(3)]
  resumed = prompt_data.train_prompts(100, 0)
  resumed.set_state(saved["prompt_state"])
  assert [next(resumed) for _ in range(3)] == expected


def test_the_registry_is_what_config_validation_accepts():
  assert set(sources.SOURCES) == {"async", "sync", "fleet"}
  config = __import__("configs.sao_tiny", fromlist=["get_config"]).get_config()
  with config.unlocked():
    config.rl.mode = "pipelined"
  with pytest.raises(configuration.ConfigError, match="rl.mode"):
    configuration.validate(config)


@pytest.mark.parametrize(
  "mode,old,expected",
  [
    ("async", {"prompt_state": {"i": 3}, "fleet": None}, {"prompt_state": {"i": 3}}),
    ("sync", {"prompt_state": None}, None),
    (
      "fleet",
      {"prompt_state": {"i": 3}, "fleet": {"consumed": {"r0": 2}}},
      {"consumed": {"r0": 2}},
    ),
  ],
)
def test_checkpoints_from_before_sources_resume_their_state(mode, old, expected):
  from sao_jax.train import run as run_lib

  meta = dict(old, stage="rl")
  run_lib._upgrade_meta(meta, mode, "value")
  assert meta == {"stage": "rl", "source": expected, "estimator_state": {}}
  run_lib._upgrade_meta(meta, mode, "value")
  assert meta["source"] == expected  # idempotent


def test_an_old_running_mean_key_restores_under_the_estimators_name():
  """Checkpoints before estimator_state kept any estimator's host state under
  "running_mean"; it belongs to the run's rl.advantage."""
  from sao_jax.train import run as run_lib

  window = [[0.5, 1.0], [2.0]]
  meta = {"stage": "rl", "source": None, "running_mean": window}
  run_lib._upgrade_meta(meta, "async", "running_mean")
  assert meta == {"stage": "rl", "source": None, "estimator_state": {"running_mean": window}}
  run_lib._upgrade_meta(meta, "async", "running_mean")
  assert meta["estimator_state"] == {"running_mean": window}
