"""Trajectory sources: where the RL loop's batches come from.

The RL loop (`sao_jax/train/rl_loop.py`) asks a source for the next batch, hands
it new weights, reads its counters for the metrics, checkpoints its state and
closes it; it never knows which source it has. One source per `rl.mode`,
built by the builder registered in `SOURCES`:

    async  a rollout driver in a thread of its own fills a bounded queue that
           validates every trajectory; the trainer takes batches in
           completion order while generation goes on
    sync   the same driver generates each batch in the trainer's thread and
           stops; the trainer waits for all of it (on-policy)
    fleet  rollout processes (`sao_jax/train/fleet_worker.py`) write shards of the
           trajectory store; weights go back through the run's weight
           channel (`sao_jax/transport/weight_channel.py`: over the network
           or as versioned checkpoints); with LoRA a version is the
           adapters alone, merged by each rollout onto its own base

In-process sources hand out whole groups (rollout.samples_per_prompt > 1,
GRPO) and restart a driver whose thread died, up to rl.max_rollout_restarts.
Fault injection (`sao_jax/train/faults.py`) wraps their environment and their
emit, so an injected malformed trajectory meets the same validation as a
real one and is counted the same way.

Adding a source is one class with the protocol's five methods and one
`SourceSpec` in `SOURCES` (docs/DESIGN.md, "Extension points").
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import queue
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp

from sao_jax.data import identity as identity_lib
from sao_jax.data import prompts as prompt_data
from sao_jax.data.ingestion import TrajectoryQueue
from sao_jax.data.trajectory import Trajectory
from sao_jax.models import precision
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.train import distributed
from sao_jax.train.stopping import StopTraining
from sao_jax.transport import fleet, weight_channel


def _copy(counter) -> collections.Counter:
  """A snapshot of a Counter another thread may be adding keys to.

  `dict(c)` copies in one C call under the GIL; iterating `c` in Python (as
  `Counter.__add__` does) could meet a key the driver thread just inserted.
  """
  return collections.Counter(dict(counter))


@dataclasses.dataclass(frozen=True)
class RolloutCounts:
  """What the rollout side has done in this launch, for the RL metrics.

  In-process, the sum over this launch's drivers: a driver that died and was
  replaced keeps counting (`plus` its stats before it goes). In fleet mode,
  what the consumed shards carried (`fleet.ShardFeed`); the generate and
  environment-wait seconds are the rollout processes' own there (None).
  """

  generated_tokens: int = 0
  generate_seconds: float | None = 0.0
  env_wait_seconds: float | None = 0.0
  env_faults: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  # Malformed tool calls by reason (chat.CALL_ERRORS, "unknown_tool", ...).
  tool_call_errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  # What environments reported in `info["events"]`, by name.
  env_events: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def plus(self, stats) -> RolloutCounts:
    """These counts and a driver's `DriverStats` (read while it may run)."""
    return RolloutCounts(
      self.generated_tokens + stats.generated_tokens,
      self.generate_seconds + stats.generate_seconds,
      self.env_wait_seconds + stats.env_wait_seconds,
      self.env_faults + _copy(stats.env_faults),
      self.tool_call_errors + _copy(stats.tool_call_errors),
      self.env_events + _copy(stats.env_events),
    )


@dataclasses.dataclass(frozen=True)
class SourceReport:
  """A source's counters at one RL step (cumulative over the launch)."""

  counts: RolloutCounts
  restarts: int  # rollout threads restarted after a failure
  queue_depth: int  # trajectories ready, not yet taken
  rejected: dict  # trajectories refused by reason: one copy, so total and reasons agree
  extra: dict = dataclasses.field(default_factory=dict)  # source-specific metrics


class TrajectorySource(Protocol):
  """What the RL loop needs of wherever its trajectories come from."""

  def take(self, n: int) -> list[Trajectory]:
    """The next `n` valid trajectories in completion order (whole groups); blocks."""

  def publish(self, params, version: int) -> dict:
    """New policy weights after `version` actor updates (`published_policy`:
    the served params, or a LoRA run's adapters where the source's
    `SourceSpec.adapters` says so); metrics of the hand-over."""

  def report(self) -> SourceReport:
    """The counters for this step's metrics."""

  def state(self) -> Any:
    """What a resumed run needs to continue where this one stands (JSON-able)."""

  def close(self, finished: bool) -> None:
    """Stops generation; `finished`: RL ended normally (not on an error)."""


# ----------------------------------------------------------------- in-process
class DriverSource:
  """A rollout driver feeding a bounded, validating queue, in this process.

  `new_driver(version, emit)` builds a driver on the trainer's current
  params (at start and after a crash); `emit` puts into the queue (through
  the fault injector, if any). `synchronous`: the driver runs in the
  caller's thread, one batch at a time, instead of a thread of its own.
  """

  def __init__(
    self,
    new_driver: Callable[[Callable], RolloutDriver],
    prompt_iter,
    *,
    synchronous: bool,
    queue_size: int,
    vocab_size: int,
    max_len: int,
    max_staleness: int | None,
    group_size: int,
    max_restarts: int,
    wrap_emit: Callable[[Callable], Callable] = lambda emit: emit,
    last_checkpoint: Callable[[], int | None] = lambda: None,
    routing_shape: tuple[int, int, int] | None = None,
  ):
    self._new_driver, self._prompt_iter = new_driver, prompt_iter
    self._synchronous, self._group_size = synchronous, group_size
    self._max_restarts, self._last_checkpoint = max_restarts, last_checkpoint
    # The engine's (host-side) version: the trainer's state lives on device
    # and is donated step after step, so the rollout thread must not read it.
    self._queue = TrajectoryQueue(
      queue_size,
      vocab_size,
      max_len,
      current_version=lambda: self._driver.engine.version,
      max_staleness=max_staleness,
      routing_shape=routing_shape,
    )
    self._emit = wrap_emit(self._queue.put)
    self._pending: dict[int, list[Trajectory]] = collections.defaultdict(list)
    self._dead = RolloutCounts()  # counts of drivers that died, so metrics stay cumulative
    self._restarts = 0
    self._driver: RolloutDriver | None = None
    self._start()

  def _start(self):
    self._driver = self._new_driver(self._emit)
    if not self._synchronous:
      self._driver.start()

  def _restart(self, error: BaseException):
    """The rollout thread died: restart it, or stop the run with its error."""
    self._driver.stop()
    self._dead = self._dead.plus(self._driver.stats)
    self._restarts += 1
    if self._restarts > self._max_restarts:
      raise StopTraining(
        f"the rollout thread failed {self._restarts} times (rl.max_rollout_restarts = "
        f"{self._max_restarts}); last error: {error!r}; the last checkpoint "
        f"({self._last_checkpoint()}) is intact"
      ) from error
    print(
      f"[rl] rollout thread failed ({error!r}); restart {self._restarts} of {self._max_restarts}",
      flush=True,
    )
    self._start()

  def _incoming(self, n: int) -> list[Trajectory]:
    if self._synchronous:  # generate a whole batch, wait for all of it
      if self._queue.qsize() == 0:
        try:
          self._driver.run(max_trajectories=n)
        except Exception as e:  # noqa: BLE001
          self._restart(e)
      return self._queue.drain()
    try:
      return [self._queue.get(timeout=5.0)]
    except queue.Empty:
      try:
        self._driver.check()
        if not self._driver.alive:
          raise RuntimeError("rollout driver stopped without an error")
      except RuntimeError as e:
        self._restart(e.__cause__ or e)
      return []

  def take(self, n: int) -> list[Trajectory]:
    out: list[Trajectory] = []
    while len(out) < n:
      for t in self._incoming(n):
        self._pending[t.group_id].append(t)
      for gid in [g for g, ts in self._pending.items() if len(ts) >= self._group_size]:
        if len(out) + self._group_size <= n:
          out.extend(self._pending.pop(gid))
    return out

  def publish(self, params, version: int) -> dict:
    self._driver.update_params(params, version)
    return {}

  def report(self) -> SourceReport:
    return SourceReport(
      self._dead.plus(self._driver.stats),
      self._restarts,
      self._queue.qsize(),
      dict(self._queue.rejected),
    )

  def state(self) -> dict:
    return {"prompt_state": self._prompt_iter.get_state()}

  def close(self, finished: bool) -> None:
    del finished
    self._driver.stop()


# ----------------------------------------------------------------- fleet
class FleetSource:
  """Rollout processes apart from the trainer, over shared storage (sao_jax/transport/fleet.py).

  Publishes the current weights at once (the rollouts wait for a first
  version) through `weights`, the publisher of the run's weight channel
  (transport/weight_channel.py: checkpoints, or served over the network
  with checkpoints as bootstrap and fallback), reads the rollouts' shards
  through `fleet.ShardFeed` and marks RL done when it closes after a
  normal finish, so that the rollouts exit.
  """

  def __init__(self, root: str, feed: fleet.ShardFeed, weights, params, version: int):
    self._root, self._feed, self._weights = root, feed, weights
    self._version = version
    self.publish(params, version)
    fleet.clear_done(root)
    print(
      f"[fleet] trainer at version {version}; shared storage {root}; weights: {weights.describe}",
      flush=True,
    )

  def take(self, n: int) -> list[Trajectory]:
    return self._feed.take(n)

  def publish(self, params, version: int) -> dict:
    out = self._weights.publish(params, version)
    self._version = version
    return out

  def report(self) -> SourceReport:
    f = self._feed
    counts = RolloutCounts(
      f.generated_tokens, None, None, f.env_faults, f.tool_call_errors, f.env_events
    )
    extra = {
      "fleet/shards_consumed": f.shards_consumed,
      "fleet/shard_age_s": f.last_shard_age_s,
      **self._weights.report(),
    }
    return SourceReport(counts, 0, f.qsize(), dict(f.rejected), extra)

  def state(self) -> dict:
    return self._feed.state()

  def close(self, finished: bool) -> None:
    self._weights.close(finished)
    if finished:
      fleet.mark_done(self._root, self._version)


# ----------------------------------------------------------------- builders
def _driver_source(run, saved, *, synchronous: bool) -> DriverSource:
  config = run.config
  r = config.rollout
  prompt_iter = prompt_data.train_prompts(config.data.num_train_tasks, config.seed)
  if saved is not None:
    prompt_iter.set_state(saved["prompt_state"])
  env = run.faults.wrap_env(run.env)

  def new_driver(emit):
    """A fresh engine and driver on the trainer's current params."""
    engine = run.engine(
      run.policy_params(), int(run.state.step), record_routing=run.routing_shape is not None
    )
    return run.driver(engine, env, prompt_iter, emit)

  return DriverSource(
    new_driver,
    prompt_iter,
    synchronous=synchronous,
    queue_size=r.queue_size,
    vocab_size=run.tok.vocab_size,
    max_len=r.max_len,
    max_staleness=r.max_staleness,
    group_size=r.samples_per_prompt,
    max_restarts=config.rl.max_rollout_restarts,
    wrap_emit=lambda put: run.faults.wrap_emit(put, run.tok.vocab_size),
    last_checkpoint=run.ckpt.latest_step,
    routing_shape=run.routing_shape,
  )


def _fleet_source(run, saved) -> FleetSource:
  config = run.config
  root = fleet.root_of(config, run.workdir)
  # The run id (kept in the workdir across resumes) and the fingerprints
  # published up to the checkpoint's version (identity.py).
  published = identity_lib.Published.restore(
    identity_lib.run_id(run.workdir, distributed.share_from_primary),
    (saved or {}).get("identity"),
    int(run.state.step),
  )
  feed = fleet.ShardFeed(
    root,
    run.tok.vocab_size,
    config.rollout.max_len,
    current_version=lambda: int(run.state.step),
    max_staleness=config.rollout.max_staleness,
    state=saved,
    poll_seconds=config.fleet.poll_seconds,
    share=distributed.share_from_primary,
    routing_shape=run.routing_shape,
    identity=published,
  )
  version = int(run.state.step)
  weights = weight_publisher(run, root, version, published, distributed.share_from_primary)
  return FleetSource(root, feed, weights, published_policy(run), version)


def weight_publisher(run, root: str, version: int, published=None, share=None):
  """The publisher of the run's weight channel (weight_channel.make_publisher)
  for versions as `published_policy` gives them; with LoRA each carries the
  base's fingerprint (`lora_base`, the run's meta), which a rollout checks
  against the base it built. `published`: the identity.Published or None;
  `share`: distributed.share_from_primary (default: this process alone)."""
  lora_run = run.programs.lora is not None
  return weight_channel.make_publisher(
    root,
    adapter_fleet(run.config.fleet) if lora_run else run.config.fleet,
    version,
    _version_cast(run),
    identity=published,
    share=share or (lambda key, make: make()),
    meta={"lora_base": run.meta["lora_base"]} if lora_run else None,
  )


@jax.jit
def _fresh(tree):
  """`tree` in buffers of its own (the train step donates the state's)."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _version_cast(run) -> Callable:
  """What the weight channel applies to each version: the cast to the
  engines' compute dtype (precision.py), once per version; a LoRA run's
  adapters go as they are (float32: the rollout merges them exactly as the
  trainer does), copied out of the state the next step donates."""
  if run.programs.lora is not None:
    return _fresh
  return jax.jit(functools.partial(precision.cast_for_serving, run.model_cfg))


def adapter_fleet(f):
  """The fleet section a LoRA run's versions travel under: whole versions
  (`fleet.delta_versions` off), since every adapter element moves each step
  under Adam (benchmarks/RESULTS.md#fleet-and-weight-sync)."""
  return f.replace(delta_versions=False)


def published_policy(run):
  """What the run's source is handed at each version (`TrajectorySource.publish`):
  the served params (`Run.policy_params`, merged with LoRA), or a LoRA run's
  adapters alone (`run.state.policy`) where its source's `SourceSpec.adapters`
  says its rollouts merge them onto a base of their own."""
  if run.programs.lora is not None and SOURCES[run.config.rl.mode].adapters:
    return run.state.policy
  return run.policy_params()


@dataclasses.dataclass(frozen=True)
class SourceSpec:
  """One `rl.mode`: how to build its source, and what the config checks need
  to know of it (train/configuration.py asks these, never the mode's name).

  Attributes:
    build: (run, the state a checkpoint saved or None) -> TrajectorySource.
    in_process: generation runs in the trainer's own process. Such a source
      cannot feed a multi-host trainer: every host must train on the same
      batches, and each host's rollout finishes episodes in its own order.
    groups: it can hand out whole GRPO groups (rollout.samples_per_prompt
      > 1); a source whose resume cursor is per trajectory cannot (a group
      split by a restart would be half trained).
    adapters: with LoRA, `publish` gets the adapters alone (its rollouts
      hold the frozen base and merge each version onto it); else the
      merged params (an in-process engine's path: the merge runs on the
      trainer's devices).
  """

  build: Callable[[Any, Any], TrajectorySource]
  in_process: bool = True
  groups: bool = True
  adapters: bool = False


SOURCES: dict[str, SourceSpec] = {
  "async": SourceSpec(lambda run, saved: _driver_source(run, saved, synchronous=False)),
  "sync": SourceSpec(lambda run, saved: _driver_source(run, saved, synchronous=True)),
  "fleet": SourceSpec(_fleet_source, in_process=False, groups=False, adapters=True),
}


def make_source(run, saved=None) -> TrajectorySource:
  """The source `run.config.rl.mode` names, resumed from `saved` (a `state()`)."""
  return SOURCES[run.config.rl.mode].build(run, saved)
