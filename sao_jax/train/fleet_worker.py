"""A fleet rollout worker: generation apart from the trainer (rl.mode = "fleet").

`run_rollout_worker` is the whole of a rollout process (launch/rollout.py
adds only flags, signal handlers and faulthandler around it). It waits for
the trainer's first published weights, then runs the engine and driver of
the in-process mode (factories.make_engine / make_driver) on this process's
devices, writes finished trajectories into atomic shards of the trajectory
store (fleet.ShardWriter), waits while the trainer is `fleet.max_unread_shards`
shards behind (backpressure), follows newer weight versions as they are
published (through the run's weight channel, transport/weight_channel.py:
pulled over the network or restored from checkpoints; generation goes on
while a version arrives; with LoRA a version is the adapters, merged here
onto a base this process builds, `AdapterVersions`), and returns when the
trainer marks RL done or `stop` is set, its open shard renamed. A
SIGKILLed process loses only its open shard; started again with the same
rollout id it continues its shard sequence. One process per rollout id:
a second one started with the id of a live one stops at start-up with one
line (StopTraining; the id's lock, fleet.RolloutLock / RolloutLease),
before it touches the first one's files. The transport is sao_jax/transport/fleet.py.
"""

from __future__ import annotations

import functools
import threading
import zlib
from typing import Callable

import jax

from sao_jax.config import sections
from sao_jax.data import prompts as prompt_data
from sao_jax.envs import registry
from sao_jax.models import lora, policy, precision
from sao_jax.train import configuration, factories, sources
from sao_jax.train import run as run_lib
from sao_jax.train.faults import FaultInjector
from sao_jax.train.stopping import StopTraining
from sao_jax.transport import fleet, weight_channel


def _print(line: str) -> None:
  print(line, flush=True)


def run_rollout_worker(
  config, workdir: str, rollout_id: str, stop: threading.Event, log: Callable[[str], None] = _print
) -> dict:
  """Generates into the fleet under `fleet.root_of(config, workdir)` until
  the trainer marks RL done or `stop` is set (set on return, too).

  `config` is the trainer's (not modified: the engine's mesh is this
  process's devices, not the trainer's); `rollout_id` names this worker's
  shards (letters, digits, _). `log` gets the progress lines. Returns the
  counts: trajectories written, the last renamed shard's sequence number
  (`last_shard`, -1 for none), the last weight version held (`version`,
  None if none was ever published) and the tokens generated. A dead driver
  thread raises its error (after everything is closed); a rollout id that
  another live process holds (at start-up, or a lease lost later) raises
  StopTraining.
  """
  try:
    return _run(config, workdir, rollout_id, stop, log)
  except fleet.RolloutIdInUse as e:
    raise StopTraining(str(e)) from None


def _run(
  config, workdir: str, rollout_id: str, stop: threading.Event, log: Callable[[str], None]
) -> dict:
  config = rollout_config(config)
  configuration.validate(config)
  f = config.fleet
  rid = rollout_id
  root = fleet.root_of(config, workdir)
  # An unreachable or unwritable root (a missing bucket, no credentials) is
  # one line here, not a traceback at the first shard.
  configuration.check_workdir(root, min_free_gb=0.0)
  # The rollout id's lock first: a second process with a live id stops here.
  writer = fleet.ShardWriter(root, rid, f.shard_trajectories, f.shard_seconds, log=log)
  try:
    return _generate(config, root, rid, writer, stop, log)
  finally:
    writer.close()  # the id is released however this ends (idempotent)


def rollout_config(config) -> sections.Sections:
  """The trainer's config (a ConfigDict or Sections) as a rollout process
  runs it: the trainer's mesh is not ours, its axes are this process's
  devices ({"data": -1})."""
  config = sections.load(config)
  return config.replace(sharding=config.sharding.replace(mesh={"data": -1}))


def _generate(
  config, root: str, rid: str, writer, stop: threading.Event, log: Callable[[str], None]
) -> dict:
  f = config.fleet
  if writer.lock.note:
    log(f"[rollout {rid}] {writer.lock.note}")
  tok = registry.make_tokenizer(config.env)
  faults = FaultInjector(config.faults)
  env = faults.wrap_env(registry.make_env(config.env))
  model_cfg = factories.build_model_config(config, tok)
  # Each shard carries what the driver's counters grew by while it was open
  # (`driver` is bound below, before anything is written).
  writer.counters = lambda: {k: getattr(driver.stats, k) for k in fleet.SHARD_COUNTERS}
  # Each process (and each restart of it) draws its own prompt order and samples.
  seed = zlib.crc32(f"{config.seed}/{rid}/{writer.first_seq}".encode())
  follower = _make_follower(config, model_cfg, tok, root, rid, log)

  log(f"[rollout {rid}] waiting for weights under {root}")
  first = _first_version(follower, root, stop, f.poll_seconds)
  if first is None:
    why = "the trainer is done" if fleet.is_done(root) else "stopped"
    log(f"[rollout {rid}] {why} before any weights were published")
    stop.set()
    return dict(trajectories=0, last_shard=writer.last_closed, version=None, generated_tokens=0)
  params, version, first_meta = first
  # rollout.mesh over this host's devices; else {"data": -1} over them with
  # rollout.sharded_engine; else one device (factories.engine_mesh).
  engine = factories.make_engine(
    config,
    model_cfg,
    params,
    version,
    seed=seed,
    devices=jax.local_devices(),
    record_routing=bool(config.rl.routing_replay),
  )
  follower.retarget(engine.abstract_params())  # later versions restore into its layout

  driver = factories.make_driver(
    config,
    engine,
    env,
    tok,
    prompt_data.train_prompts(config.data.num_train_tasks, seed),
    faults.wrap_emit(_backpressured(writer, root, rid, f, stop), tok.vocab_size),
  )
  driver.identity.note(version, first_meta)  # the run id and fingerprint it came with
  pulls = PullWatch(lambda version: log(f"[rollout {rid}] pulling version {version}"))
  driver.start()
  log(
    f"[rollout {rid}] generating at version {version}, shards from "
    f"{fleet.shard_name(rid, writer.first_seq)}"
  )
  try:
    _follow(
      driver,
      follower,
      writer,
      pulls,
      root,
      stop,
      f.poll_seconds,
      lambda line: log(f"[rollout {rid}] {line}"),
    )
  finally:
    stop.set()  # releases an emit waiting on backpressure
    driver.stop()
    writer.close()
    follower.close()
    log(
      f"[rollout {rid}] exiting: {writer.trajectories} trajectories, shards up to "
      f"{writer.last_closed}, last version {follower.version}, "
      f"{driver.stats.generated_tokens} tokens"
    )
  return dict(
    trajectories=writer.trajectories,
    last_shard=writer.last_closed,
    version=follower.version,
    generated_tokens=driver.stats.generated_tokens,
    tokens_during_pulls=pulls.tokens,
    shard_names_taken=writer.names_taken,
    **weight_channel.follower_counts(follower, f),
  )


def _make_follower(config, model_cfg, tok, root: str, rid: str, log: Callable[[str], None]):
  """The run's weight channel's follower. Without LoRA versions are the
  served params, published in the compute dtype the engine holds
  (precision.py); with LoRA they are the adapters (sources.published_policy),
  followed in the layout this host's programs give them and merged onto the
  base this host builds as the trainer built its own (`AdapterVersions`)."""
  f = config.fleet
  if not config.lora.enabled:
    abstract = jax.eval_shape(
      lambda: policy.init_params(precision.serving_config(model_cfg), jax.random.key(0))
    )
    return weight_channel.make_follower(root, rid, abstract, f, log)
  # The base, the adapters and the merged params in the engine's layout; the
  # base built as the trainer built its own: the config's seed or
  # model.hf_dir, then lora.base_dtype.
  p, mesh = factories.rollout_programs(config, model_cfg, jax.local_devices())
  base = p.lora.policy_base(run_lib.initial_policy(config, model_cfg, tok, p, mesh))
  where = (
    f"sft.init_from_run {run_lib.pinned_source(config.sft.init_from_run)}"
    if config.sft.init_from_run
    else f"model.hf_dir {config.model.hf_dir!r}"
    if config.model.hf_dir
    else f"seed {config.seed}"
  )
  cast = jax.jit(functools.partial(precision.cast_for_serving, model_cfg))
  fingerprint = lora.fingerprint(base)
  log(f"[rollout {rid}] LoRA base {fingerprint} from {where}; versions are its adapters")
  return AdapterVersions(
    weight_channel.make_follower(root, rid, p.abstract_state.policy, sources.adapter_fleet(f), log),
    lambda adapters: cast(factories.policy_merger(p)(adapters, (base, None))),
    fingerprint,
    where,
  )


class AdapterVersions:
  """A LoRA run's rollout follower: each version the channel's follower
  (`inner`) brings is the adapters alone; `poll` hands back
  `merge(adapters)`, the trainer's own merge (`factories.policy_merger`,
  i.e. `lora.merge`) onto this host's base, cast to the engine's dtype: bit for
  bit the params a full version would have carried. A version whose
  meta's `lora_base` is not `base_fingerprint` (`lora.fingerprint` of this
  host's base; `where` says what it was built from) raises StopTraining in
  one line: its adapters belong to another base. Everything else (version,
  pulling, counters, close) is the inner follower's."""

  def __init__(self, inner, merge: Callable, base_fingerprint: str, where: str):
    self._inner, self._merge = inner, merge
    self.base_fingerprint, self._where = base_fingerprint, where

  def poll(self, final: bool = False):
    got = self._inner.poll(final)
    if got is None:
      return None
    adapters, version, meta = got
    theirs = meta.get("lora_base")
    if theirs != self.base_fingerprint:
      raise StopTraining(
        f"LoRA weights version {version} was trained on base {theirs}, this rollout built "
        f"base {self.base_fingerprint} from {self._where}: refused (the trainer's config, "
        "seed and model.hf_dir must be this host's)"
      )
    return self._merge(adapters), version, meta

  def retarget(self, abstract_params) -> None:
    """The adapters keep their layout (the engine reshards what `poll` returns)."""
    del abstract_params

  def __getattr__(self, name: str):
    return getattr(self._inner, name)


def _first_version(follower, root: str, stop: threading.Event, poll_seconds: float):
  """The first published version (params, version, meta), or None when the
  trainer is done or `stop` is set before one appears."""
  while not stop.is_set() and not fleet.is_done(root):
    first = follower.poll()
    if first is not None:
      return first
    stop.wait(poll_seconds)
  return None


def _backpressured(writer, root: str, rid: str, f, stop: threading.Event):
  """The driver's emit: writes a trajectory into the open shard, first waiting
  while the trainer is `f.max_unread_shards` shards behind on this process.

  What is unread grows only when a shard closes, so the watermarks (one read,
  an object GET on gs://) are checked once per closed shard."""
  checked = [None]  # writer.last_closed when the trainer was last seen close enough

  def emit(t):
    if writer.last_closed != checked[0]:
      while (
        not stop.is_set()
        and fleet.unread_shards(fleet.read_consumed(root), rid, writer.last_closed)
        >= f.max_unread_shards
      ):
        stop.wait(f.poll_seconds)
      checked[0] = writer.last_closed
    writer.write(t)

  return emit


def _follow(
  driver,
  follower,
  writer,
  pulls,
  root: str,
  stop: threading.Event,
  poll_seconds: float,
  log: Callable[[str], None],
) -> None:
  """Until the trainer is done or `stop` is set: checks the driver thread
  (its error ends the worker), swaps in each complete new version, rotates
  an old open shard."""
  while not stop.wait(poll_seconds):
    driver.check()
    # DONE is written after the last version is complete: poll once more.
    done = fleet.is_done(root)
    held = follower.version
    got = follower.poll(final=done)
    pulls.observe(follower, driver.stats.generated_tokens)
    if got is not None:
      driver.update_params(got[0], got[1], got[2])
      log(f"weights version {held} -> {got[1]}")
    writer.rotate_if_older()
    if done:
      log("the trainer is done")
      return


class PullWatch:
  """Tokens the driver generated while a direct pull was in flight (the
  proof that a version arrives without stalling generation)."""

  def __init__(self, on_start: Callable[[int], None]):
    self._on_start = on_start
    self._from: int | None = None  # generated tokens at the last poll with a pull in flight
    self._seen = None  # the offer whose start was reported
    self.tokens = 0

  def observe(self, follower, generated: int) -> None:
    pulling = getattr(follower, "pulling", None)
    if self._from is not None:
      self.tokens += generated - self._from
      self._from = None
    if pulling is not None:
      self._from = generated
      if pulling != self._seen:
        self._seen = pulling
        self._on_start(pulling.version)
