"""The SAO trainer: SFT warm start -> value pretraining -> RL (async or sync) -> eval.

`train(config, workdir)` is the whole run; `launch/train.py` only parses
flags. Each stage checkpoints as it goes and a restarted run resumes at the
stage and step of its latest checkpoint:

    sft             supervised warm start on the environment's demonstrations
    value_pretrain  the critic (initialised from the SFT policy) regresses
                    returns of trajectories the initial policy generated,
                    read back from the trajectory store
    rl              SAO (or a baseline arm): `async` mode runs the rollout
                    driver in its own thread, feeding a bounded queue the
                    trainer takes completion-ordered batches from; `sync`
                    mode generates each batch, waits for all of it, trains
    done            final evaluation written to <workdir>/summary.json

Only this module knows the whole loop.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from sao_jax import configuration, distributed, files, fleet, optim, sharding
from sao_jax.checkpoint import Checkpointer, abstract_like
from sao_jax.data import packing, prompts as prompt_data, store
from sao_jax.data.ingestion import TrajectoryQueue
from sao_jax.envs import registry
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.evaluation import pass_at_1, solved, write_samples
from sao_jax.faults import FaultInjector
from sao_jax.metrics import MetricsWriter, progress
from sao_jax.models import config as model_config
from sao_jax.models import hf_import, policy
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine, SamplingConfig, rollout_rules
from sao_jax.train_step import (StepConfig, TrainState, dis_warnings, jit_sharded, make_sft_step,
                                 make_train_step)

STAGES = ("sft", "value_pretrain", "rl", "done")


def validate_config(config, num_devices: int | None = None) -> None:
  """Fails fast, before anything is written, on settings that cannot work."""
  configuration.validate(config, num_devices)


def build_model_config(config, tokenizer=None) -> model_config.ModelConfig:
  preset = model_config.PRESETS[config.model.preset]
  if config.model.vocab_from_tokenizer and config.model.preset in ("tiny", "small"):
    tokenizer = tokenizer or registry.make_tokenizer(config.env)
    base = preset(vocab_size=tokenizer.vocab_size)
  else:
    base = preset()
  overrides = dict(config.model.get("overrides", {}))
  if config.model.get("compute_dtype", ""):
    overrides["dtype"] = config.model.compute_dtype
  return dataclasses.replace(base, **overrides) if overrides else base


def make_engine(config, model_cfg: model_config.ModelConfig, params, version: int, *,
                seed: int | None = None, mesh: jax.sharding.Mesh | None = None) -> PolicyEngine:
  """The rollout engine a config asks for, on `params` at `version`.

  With `rollout.sharded_engine` and a `mesh`, the engine lays params and KV
  cache out on it (slots over the batch axes, kv heads over "tensor");
  otherwise one device holds everything. `seed` defaults to seed + version.
  """
  r = config.rollout
  placement = dict(mesh=mesh, rules=rollout_rules(mesh)) if r.sharded_engine and mesh else {}
  return PolicyEngine(model_cfg, params, slots=r.slots, max_len=r.max_len,
                      sampling=SamplingConfig(r.temperature, r.top_k, r.top_p),
                      seed=config.seed + int(version) if seed is None else seed,
                      version=version, **placement)


def make_driver(config, engine: PolicyEngine, env, tok, prompt_iter, emit,
                **overrides) -> RolloutDriver:
  """The rollout driver a config asks for: the trainer's thread, a fleet
  rollout process and value pretraining (with `overrides`) build it here."""
  r = config.rollout
  kwargs = dict(samples_per_prompt=r.samples_per_prompt, max_turn_tokens=r.max_turn_tokens,
                env_workers=r.env_workers, swap_policy=r.swap_policy,
                env_timeout=r.env_timeout, decode_steps=r.decode_steps,
                tool_latency_s=config.env.tool_latency_s,
                chat_format=registry.make_format(config.env, tok),
                max_tool_output_tokens=config.env.max_tool_output_tokens)
  return RolloutDriver(engine, env, tok, prompt_iter, emit, **dict(kwargs, **overrides))


def step_config(config) -> StepConfig:
  t = config.rl
  return StepConfig(advantage=t.advantage, policy_loss=t.policy_loss, eps_low=t.eps_low,
                    eps_high=t.eps_high, gamma=t.gamma, lam=t.lam, critic_lam=t.critic_lam,
                    critic_updates=t.critic_updates, load_balance_coef=t.load_balance_coef,
                    temperature=config.rollout.temperature,
                    rollout_kl_coef=t.rollout_kl_coef, corrective_side=t.corrective_side,
                    geo_eps_low=t.geo_eps_low, geo_eps_high=t.geo_eps_high)


@dataclasses.dataclass(frozen=True)
class Programs:
  """A run's placement, optimizers and jitted steps on one mesh, from shapes alone.

  Building this touches no device memory (the initialisers are only
  `eval_shape`d), so the same construction serves the trainer, which then
  initialises into these shardings and calls these steps, and
  launch/compile.py, which lowers these very steps for a TPU topology it
  does not have (docs/DESIGN.md section 8): what the compile proves is about the
  programs the trainer runs, not about a copy of them.
  """
  rules: tuple
  batch_sharding: Any  # of every [R, L] field of a packed batch
  policy_init: Callable[[], Any]  # -> boxed params (flax logical-axis metadata)
  critic_init: Callable[[], Any]
  policy_shardings: Any
  critic_shardings: Any
  sft_tx: Any
  policy_tx: Any
  critic_tx: Any
  state_shardings: TrainState
  abstract_state: TrainState  # ShapeDtypeStructs carrying state_shardings
  sft_step: Callable  # (policy, policy_opt, batch) -> (policy, policy_opt, metrics)
  value_step: Callable  # (state, batch) -> (state, metrics); critic only
  rl_step: Callable  # (state, batch) -> (state, metrics)

  def init_state(self, policy_params, critic_params) -> TrainState:
    """The state at step 0 around given params (jit it with state_shardings)."""
    return TrainState(jnp.zeros((), jnp.int32), policy_params, critic_params,
                      self.policy_tx.init(policy_params), self.critic_tx.init(critic_params))


def build_programs(config, model_cfg: model_config.ModelConfig, step_cfg: StepConfig,
                   mesh: jax.sharding.Mesh) -> Programs:
  """Shardings from the config's rules, the optimizers and the jitted steps on `mesh`."""
  rules = tuple(tuple(r) for r in config.sharding.rules)
  rng = jax.random.key(config.seed)
  policy_init = lambda: policy.init_params(model_cfg, rng, boxed=True)
  critic_init = lambda: policy.init_params(model_cfg, jax.random.fold_in(rng, 1), "value",
                                           boxed=True)
  policy_shardings = sharding.logical_shardings(jax.eval_shape(policy_init), mesh, rules)
  critic_shardings = sharding.logical_shardings(jax.eval_shape(critic_init), mesh, rules)
  policy_params = jax.eval_shape(lambda: nn.unbox(policy_init()))
  critic_params = jax.eval_shape(lambda: nn.unbox(critic_init()))

  def policy_tx(lr, steps, warmup):
    return optim.make_optimizer(policy_params, optim.warmup_cosine(lr, warmup, steps),
                                clip_norm=config.rl.clip_norm)

  def opt_shardings(tx, params, param_shardings):
    return sharding.shardings_like_params(jax.eval_shape(tx.init, params), params,
                                          param_shardings, mesh)

  sft_tx = policy_tx(config.sft.lr, config.sft.steps, config.sft.warmup)
  rl_tx = policy_tx(config.rl.actor_lr, config.rl.steps, config.rl.warmup)
  critic_rules = (optim.CRITIC_FREEZE_RULES if config.rl.freeze_critic_attention
                  else optim.TRAIN_ALL_RULES)
  critic_tx = optim.make_optimizer(critic_params, config.rl.critic_lr, rules=critic_rules,
                                   clip_norm=config.rl.clip_norm)
  state_shardings = TrainState(
      step=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
      policy=policy_shardings, critic=critic_shardings,
      policy_opt=opt_shardings(rl_tx, policy_params, policy_shardings),
      critic_opt=opt_shardings(critic_tx, critic_params, critic_shardings))
  batch_sharding = sharding.batch_sharding(mesh, rules)

  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    rl_step = jit_sharded(make_train_step(model_cfg, step_cfg, rl_tx, critic_tx),
                          state_shardings, batch_sharding)
    value_step = jit_sharded(
        # The arm's own estimator: a token-GAE critic is pretrained where
        # that arm bootstraps, not on skip-observation targets.
        make_train_step(model_cfg, dataclasses.replace(step_cfg, critic_updates=1), rl_tx,
                        critic_tx, update_actor=False),
        state_shardings, batch_sharding)
    sft = make_sft_step(model_cfg, sft_tx, config.rl.load_balance_coef)
    sft_step = jax.jit(
        sft, in_shardings=(policy_shardings, state_shardings.policy_opt, batch_sharding),
        out_shardings=(policy_shardings, state_shardings.policy_opt, None),
        donate_argnums=(0, 1))

  programs = Programs(rules, batch_sharding, policy_init, critic_init, policy_shardings,
                      critic_shardings, sft_tx, rl_tx, critic_tx, state_shardings, None,
                      sft_step, value_step, rl_step)
  abstract = jax.eval_shape(programs.init_state, policy_params, critic_params)
  abstract_state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, state_shardings)
  return dataclasses.replace(programs, abstract_state=abstract_state)


# --- the RL step's metrics ---------------------------------------------------------


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
  tool_call_errors: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
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
        self.env_events + _copy(stats.env_events))


def rl_metrics(trajs, rewards: np.ndarray, counts: RolloutCounts, *, generated_total: int,
               elapsed: float, wait: float, wait_total: float, train_total: float,
               restarts: int, updates_skipped: int, queue_depth: int,
               rejected: dict) -> dict:
  """The rollout, queue and time metrics of one RL step (the train step's are apart).

  Counters are cumulative over the launch, so a plot of one shows its rate;
  each counter with reasons is written as a total and one metric per reason
  seen. `rejected` is one copy of the queue's rejections, so that the total
  and its reasons agree.
  """
  per_s = lambda x: x / max(elapsed, 1e-6)
  m = {
      "rollout/reward_mean": float(rewards.mean()),
      # Episodes with the full reward (pass@1's rule): differs from the
      # mean reward where an environment gives partial credit.
      "rollout/success_frac": float(solved(rewards).mean()),
      "rollout/length_mean": float(np.mean([len(t) for t in trajs])),
      "rollout/turns_mean": float(np.mean([t.num_turns for t in trajs])),
      "rollout/generated_tokens_per_s": per_s(counts.generated_tokens),
      "rollout/generated_tokens_total": generated_total,
      "rollout/restarts": restarts,
      "policy/updates_skipped_total": updates_skipped,
      "rollout/env_faults": sum(counts.env_faults.values()),
      "rollout/tool_call_errors": sum(counts.tool_call_errors.values()),
      "queue/depth": queue_depth,
      "queue/rejected": sum(rejected.values()),
      "trainer/idle_fraction": per_s(wait_total),
      "trainer/batch_wait_s": wait,
      # Wall-clock split: the trainer thread trains or waits for data; the
      # rollout thread (async: at the same time) generates or waits on
      # environment steps with no slot to decode.
      "time/train_frac": per_s(train_total),
      "time/wait_frac": per_s(wait_total),
  }
  if counts.generate_seconds is not None:
    m["time/generate_frac"] = per_s(counts.generate_seconds)
  if counts.env_wait_seconds is not None:
    m["time/env_frac"] = per_s(counts.env_wait_seconds)
  m.update({f"rollout/env_fault_{k}": v for k, v in counts.env_faults.items()})
  m.update({f"rollout/tool_call_error_{k}": v for k, v in counts.tool_call_errors.items()})
  m.update({f"rollout/env_event_{k}": v for k, v in counts.env_events.items()})
  m.update({f"queue/rejected_{k}": v for k, v in rejected.items()})
  return m


class _Run:
  """Everything one run holds; methods are the stages, in order."""

  # ---------------------------------------------------------------- set up
  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               restore_step: int | None = None):
    # Everything that can refuse the run does so before anything is written.
    validate_config(config)
    self.config, self.workdir = config, workdir
    self.tok = registry.make_tokenizer(config.env)
    self.format = registry.make_format(config.env, self.tok)
    self.env = registry.make_env(config.env)  # refuses unisolated code execution
    # Evaluation and value pretraining must not advance an environment's own
    # clock (online_style's preference schedule): only training episodes do.
    self.frozen_env = self.env.frozen() if hasattr(self.env, "frozen") else self.env
    configuration.check_workdir(workdir, config.checkpoint.min_free_gb)
    self.faults = FaultInjector.from_config(config.get("faults"))
    if self.faults.active:
      print(f"[faults] injecting faults: {config.faults.to_dict()}", flush=True)
    self.model_cfg = build_model_config(config, self.tok)
    self.step_cfg = step_config(config)
    self.max_len = config.rollout.max_len
    self.metrics = MetricsWriter(workdir, tensorboard=config.get("tensorboard", True))
    distributed.sync("setup")  # the hosts' set-up times differ; collectives follow
    self.ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint.keep)

    # Mesh, shardings, optimizers and steps (shapes first, then placement).
    self.mesh = sharding.make_mesh(dict(config.sharding.mesh))
    p = build_programs(config, self.model_cfg, self.step_cfg, self.mesh)
    self.rules, self.batch_sharding = p.rules, p.batch_sharding
    self.policy_shardings, self.critic_shardings = p.policy_shardings, p.critic_shardings
    self.sft_tx, self.policy_tx, self.critic_tx = p.sft_tx, p.policy_tx, p.critic_tx
    self.state_shardings = p.state_shardings
    self.rl_step, self.value_step, self.sft_step = (
        distributed.lockstep(f, name) for f, name in
        ((p.rl_step, "rl_step"), (p.value_step, "value_step"), (p.sft_step, "sft_step")))
    policy_params, _ = sharding.sharded_init(p.policy_init, self.mesh, self.rules)
    critic_params, _ = sharding.sharded_init(p.critic_init, self.mesh, self.rules)
    self.state = jax.jit(p.init_state, out_shardings=self.state_shardings)(policy_params,
                                                                           critic_params)
    self.meta = {"stage": "sft", "stage_step": 0, "ckpt_step": 0, "prompt_state": None,
                 "running_mean": None, "evals": {}}

    # Restore: the latest checkpoint decides where the run resumes.
    if self.ckpt.latest_step() is not None:
      restore_step = restore_step or self.ckpt.latest_step()
      self.state, self.meta = self.ckpt.restore(abstract_like(self.state), restore_step)
      print(f"Resumed from checkpoint {restore_step} at stage "
            f"{self.meta['stage']} step {self.meta['stage_step']}", flush=True)

  def _save(self, force=False):
    self.meta["ckpt_step"] += 1
    self.ckpt.save(self.meta["ckpt_step"], self.state, self.meta, force=force)

  def _advance(self, stage):
    self.meta.update(stage=stage, stage_step=0)
    self._save(force=True)

  def _put_batch(self, batch):
    """A whole packed numpy batch as global arrays (each process places its rows)."""
    return distributed.global_batch(batch, self.batch_sharding, len(batch["tokens"]))

  def _pack(self, trajs, rows, baseline_advantages=None, policy_head=True):
    """The batch of `trajs` in `rows` rows; this process builds only its own rows.

    `policy_head`: the step computes the policy's log-probs (SFT, RL), so
    with `data.logits_at_actions` the batch carries `action_index`; the
    value step reads none, and a batch without it compiles once per bucket.
    """
    return distributed.pack_batch(
        trajs, rows, self.config.data.buckets, self.batch_sharding, baseline_advantages,
        action_index=policy_head and self.config.data.logits_at_actions)

  def _eval(self, name, params, samples=None):
    e = self.config.eval
    params = distributed.host_local_copy(params, self.mesh)  # every process joins
    result = distributed.share_from_primary(f"eval/{name}", lambda: pass_at_1(
        self.model_cfg, params, self.frozen_env, self.tok, num_tasks=e.num_tasks,
        slots=e.slots, max_len=self.max_len, max_turn_tokens=self.config.rollout.max_turn_tokens,
        temperature=e.temperature, seed=self.config.seed + 7,
        samples_per_task=e.get("samples_per_task", 1), chat_format=self.format,
        max_tool_output_tokens=self.config.env.max_tool_output_tokens, samples=samples))
    self.meta["evals"][name] = result
    self.metrics.write(int(self.state.step), {f"eval/{k}": v for k, v in result.items()}, "eval")
    print(f"[eval] {name}: pass@1 {result['pass@1']:.3f} on {result['tasks']} held-out tasks "
          f"(mean {result['mean_turns']:.2f} turns)", flush=True)
    return result

  # ---------------------------------------------------------------- stages
  def sft(self):
    c = self.config.sft
    policy_params, opt = self.state.policy, self.state.policy_opt
    steps = c.steps
    if c.init_from_hf:  # start from an existing SFT checkpoint instead
      policy_params = hf_import.load_hf_checkpoint(c.init_from_hf, self.model_cfg,
                                                   self.policy_shardings)
      steps = 0
    elif self.meta["stage_step"] == 0:  # a fresh SFT: the optimizer starts empty
      opt = jax.jit(self.sft_tx.init, out_shardings=self.state_shardings.policy_opt)(
          policy_params)
    for step in range(self.meta["stage_step"], steps):
      # Demonstrations of training tasks; the step index seeds the draw, so a
      # resumed SFT sees the same data it would have.
      idx = np.random.default_rng([self.config.seed, 2, step]).integers(
          0, self.config.data.num_train_tasks, c.batch_size)
      # An environment whose tasks do not all have a demonstration (a
      # dataset's rows without a solution) maps the draw onto those that do.
      demo_task = getattr(self.env, "demonstration_task", self.env.task)
      trajs = [demonstration_trajectory(self.env, demo_task(int(i)), self.tok, self.format)
               for i in idx]
      batch = self._pack(trajs, c.batch_size)
      with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):  # activation constraints
        policy_params, opt, m = self.sft_step(policy_params, opt, batch)
      _wait(policy_params)
      self.meta["stage_step"] = step + 1
      if (step + 1) % self.config.log_every == 0 or step + 1 == steps:
        rec = self.metrics.write(step + 1, m, "sft")
        progress("sft", step + 1, steps, rec, {"sft/nll": "nll"})
      if (step + 1) % self.config.checkpoint.every == 0:
        self.state = self.state.replace(policy=policy_params, policy_opt=opt)
        self._save()
    # RL's actor optimizer starts fresh; the critic starts from the SFT trunk.
    critic = policy.value_params_from_policy(policy_params, self.state.critic)
    # A real copy: the trunk must not alias the policy's (donated) buffers.
    critic = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=self.critic_shardings)(
        critic)
    self.state = self.state.replace(
        policy=policy_params,
        policy_opt=jax.jit(self.policy_tx.init, out_shardings=self.state_shardings.policy_opt)(
            policy_params),
        critic=critic,
        critic_opt=jax.jit(self.critic_tx.init, out_shardings=self.state_shardings.critic_opt)(
            critic))
    self._eval("sft", self.state.policy)
    self._advance("value_pretrain")

  def value_pretrain(self):
    c = self.config.value_pretrain
    if c.steps == 0 or not self.step_cfg.uses_critic:
      return self._advance("rl")
    shard = os.path.join(self.workdir, "trajectories", "value_pretrain.array_record")
    if not self.meta.get("value_store_done"):
      # Trajectories of the initial policy, into the trajectory store (by
      # process 0 of a multi-host run; every process then reads it back).
      params = distributed.host_local_copy(self.state.policy, self.mesh)

      def generate() -> int:
        engine = self._engine(params, version=0)
        with store.TrajectoryWriter(shard) as writer:
          # One sample per prompt from a policy that never changes: no weight
          # swaps to wait for, so several tokens per decode call.
          driver = make_driver(self.config, engine, self.frozen_env, self.tok,
                               iter(range(10**9, 10**9 + c.num_trajectories)), writer.write,
                               samples_per_prompt=1, decode_steps=8)
          driver.run()
          driver.stop()
        return driver.stats.generated_tokens

      generated = distributed.share_from_primary("value_pretrain_store", generate)
      # Budgets count every token the policy generates, warm-up included.
      self.meta["generated_tokens"] = self.meta.get("generated_tokens", 0) + generated
      self.meta["value_store_done"] = True
      print(f"[value_pretrain] stored {c.num_trajectories} trajectories of the SFT policy",
            flush=True)
    # Read back through the same validation as the ingestion queue: a record
    # damaged on disk is dropped with a counted reason, never trained on.
    data, dropped = store.read_valid_trajectories([shard], self.tok.vocab_size, self.max_len,
                                                  shuffle_seed=self.config.seed)
    if dropped:
      print(f"[value_pretrain] dropped {sum(dropped.values())} stored records: {dict(dropped)}",
            flush=True)
    b = self.config.rl.batch_size
    for step in range(self.meta["stage_step"], c.steps):
      trajs = [data[(step * b + j) % len(data)] for j in range(b)]
      batch = self._pack(trajs, b, policy_head=False)
      with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
        self.state, m = self.value_step(self.state, batch)
        _wait(self.state)
      self.meta["stage_step"] = step + 1
      m = dict(m, **{f"value_pretrain/rejected_{k}": v for k, v in dropped.items()})
      if (step + 1) % self.config.log_every == 0 or step + 1 == c.steps:
        rec = self.metrics.write(step + 1, m, "value_pretrain")
        progress("value_pretrain", step + 1, c.steps, rec,
                 {"critic/value_loss": "value_loss", "critic/explained_variance": "expl_var"})
      if (step + 1) % self.config.checkpoint.every == 0:
        self._save()
    self._advance("rl")

  def _engine(self, params, version):
    # Colocated and sharded: the engine lays params and KV cache out on the
    # trainer's mesh (slots over the batch axes, kv heads over "tensor") and
    # weight swaps reshard on device. Off by default on CPU, where one device
    # serves the tiny model best.
    # With several processes an engine is one host's: its devices, a local copy.
    engine_mesh = (self.mesh if jax.process_count() == 1
                   else sharding.make_mesh({"data": -1}, jax.local_devices()))
    params = distributed.host_local_copy(params, self.mesh)  # collective on a global tree
    return make_engine(self.config, self.model_cfg, params, version, mesh=engine_mesh)

  def rl(self):
    c, r = self.config.rl, self.config.rollout
    prompt_iter = prompt_data.train_prompts(self.config.data.num_train_tasks, self.config.seed)
    if self.meta["prompt_state"] is not None:
      prompt_iter.set_state(self.meta["prompt_state"])
    group_size = r.samples_per_prompt
    # A critic-free estimator's host state (the running mean's window), checkpointed.
    estimator = self.step_cfg.estimator
    baseline_state = self.meta["running_mean"]
    if baseline_state is None and estimator.init_state is not None:
      baseline_state = estimator.init_state(c)

    # The rollout side's state; the driver is replaced if its thread dies.
    # Counts of drivers that died are kept here, so metrics stay cumulative.
    rollout = {"restarts": 0, "driver": None, "dead": RolloutCounts()}
    # The engine's (host-side) version: the trainer's state lives on device
    # and is donated step after step, so the rollout thread must not read it.
    trajq = TrajectoryQueue(r.queue_size, self.tok.vocab_size, self.max_len,
                            current_version=lambda: rollout["driver"].engine.version,
                            max_staleness=r.get("max_staleness"))
    env = self.faults.wrap_env(self.env)
    emit = self.faults.wrap_emit(trajq.put, self.tok.vocab_size)

    def start_driver():
      """A fresh engine and driver on the current params (after a crash too)."""
      version = int(self.state.step)
      engine = self._engine(self.state.policy, version)
      driver = make_driver(self.config, engine, env, self.tok, prompt_iter, emit)
      if c.mode == "async":
        driver.start()
      rollout["driver"] = driver

    def restart_driver(error: BaseException):
      """The rollout thread died: restart it, or stop with its error."""
      dead = rollout["driver"]
      dead.stop()
      rollout["dead"] = rollout["dead"].plus(dead.stats)
      rollout["restarts"] += 1
      last = self.ckpt.latest_step()
      if rollout["restarts"] > c.max_rollout_restarts:
        raise configuration.StopTraining(
            f"the rollout thread failed {rollout['restarts']} times (rl.max_rollout_restarts = "
            f"{c.max_rollout_restarts}); last error: {error!r}; the last checkpoint "
            f"({last}) is intact") from error
      print(f"[rl] rollout thread failed ({error!r}); restart {rollout['restarts']} of "
            f"{c.max_rollout_restarts}", flush=True)
      start_driver()

    def incoming() -> list:
      driver = rollout["driver"]
      if c.mode == "sync":  # generate a whole batch, wait for all of it
        if trajq.qsize() == 0:
          try:
            driver.run(max_trajectories=per_step)
          except Exception as e:  # pylint: disable=broad-except
            restart_driver(e)
        return trajq.drain()
      try:
        return [trajq.get(timeout=5.0)]
      except queue.Empty:
        try:
          driver.check()
          if not driver.alive:
            raise RuntimeError("rollout driver stopped without an error")
        except RuntimeError as e:
          restart_driver(e.__cause__ or e)
        return []

    per_step = c.batch_size  # trajectories per train step (groups x G for group arms)
    pending_groups: dict[int, list] = collections.defaultdict(list)

    # rl.mode = "fleet": rollout processes (launch/rollout.py) write shards the
    # feed reads; weights go back as versioned checkpoints (sao_jax/fleet.py).
    feed = publisher = None
    if c.mode == "fleet":
      root = fleet.root_of(self.config, self.workdir)
      feed = fleet.ShardFeed(root, self.tok.vocab_size, self.max_len,
                             current_version=lambda: int(self.state.step),
                             max_staleness=r.get("max_staleness"), state=self.meta.get("fleet"),
                             poll_seconds=self.config.fleet.poll_seconds,
                             share=distributed.share_from_primary)
      publisher = fleet.WeightPublisher(root, self.config.fleet.keep_versions,
                                        int(self.state.step))
      publisher.publish(self.state.policy, int(self.state.step))
      fleet.clear_done(root)
      print(f"[fleet] trainer at version {int(self.state.step)}; shared storage {root}",
            flush=True)

    def next_batch():
      """The next `per_step` trajectories in completion order (whole groups for GRPO)."""
      if feed is not None:
        return feed.take(per_step)
      out = []
      while len(out) < per_step:
        for t in incoming():
          pending_groups[t.group_id].append(t)
        for gid in [g for g, ts in pending_groups.items() if len(ts) >= group_size]:
          if len(out) + group_size <= per_step:
            out.extend(pending_groups.pop(gid))
      return out

    if feed is None:
      start_driver()
    wait_total, train_total, start_time = 0.0, 0.0, time.time()
    nonfinite_run = 0  # consecutive skipped actor updates
    # Tokens generated before this launch: value pretraining's and, after a
    # resume, the RL tokens up to the checkpoint (rl.max_generated_tokens).
    tokens_before = self.meta.get("generated_tokens", 0)
    budget = c.get("max_generated_tokens", 0)
    skipped_total = 0
    try:
      for step in range(self.meta["stage_step"], c.steps):
        t0 = time.time()
        trajs = next_batch()
        wait = time.time() - t0
        wait_total += wait
        rewards = np.array([t.total_reward for t in trajs], np.float32)
        baseline = None
        if estimator.baseline is not None:
          group_ids = np.asarray([t.group_id for t in trajs], np.int32)
          baseline_state, baseline = estimator.baseline(baseline_state, rewards, group_ids, c)
        batch = packing.pack(trajs, per_step, self.config.data.buckets, baseline,
                             action_index=self.config.data.logits_at_actions)
        batch = self._put_batch(self.faults.poison_batch(step + 1, batch))
        t1 = time.time()
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
          self.state, m = self.rl_step(self.state, batch)
          _wait(self.state)
        m = dict(jax.device_get(m))
        train_total += time.time() - t1
        # Skipped updates leave params and version unchanged; a run of them
        # means the run has diverged: stop before writing anything more.
        nonfinite_run = nonfinite_run + 1 if m["policy/update_skipped"] else 0
        skipped_total += int(m["policy/update_skipped"])
        if nonfinite_run >= c.max_nonfinite_updates:
          raise configuration.StopTraining(
              f"{nonfinite_run} consecutive RL steps had a non-finite loss or gradient "
              f"(rl.max_nonfinite_updates = {c.max_nonfinite_updates}), last at step {step + 1}; "
              f"params were not updated by them and the last checkpoint "
              f"({self.ckpt.latest_step()}) is intact")
        if nonfinite_run:
          print(f"[rl] step {step + 1}: non-finite loss or gradient, update skipped", flush=True)
        version = int(self.state.step)
        driver = rollout["driver"]
        if (step + 1) % c.sync_every == 0 and not m["policy/update_skipped"]:
          if publisher is not None:
            publisher.publish(self.state.policy, version)
            m["fleet/publish_s"] = publisher.last_publish_s
          else:
            driver.update_params(self.state.policy, version)
        self.meta["stage_step"] = step + 1
        elapsed = time.time() - start_time
        if feed is None:
          counts, source = rollout["dead"].plus(driver.stats), trajq
        else:  # what the rollout processes produced, as read from their shards
          counts = RolloutCounts(feed.generated_tokens, None, None, feed.env_faults,
                                 feed.tool_call_errors, feed.env_events)
          source = feed
          m.update({"fleet/shards_consumed": feed.shards_consumed,
                    "fleet/shard_age_s": feed.last_shard_age_s})
        generated = tokens_before + counts.generated_tokens
        self.meta["generated_tokens"] = generated
        budget_spent = bool(budget) and generated >= budget
        m.update(rl_metrics(
            trajs, rewards, counts, generated_total=generated, elapsed=elapsed,
            wait=wait, wait_total=wait_total, train_total=train_total,
            restarts=rollout["restarts"], updates_skipped=skipped_total,
            queue_depth=source.qsize(), rejected=dict(source.rejected)))
        # Read after the queue's counts: an injection is counted before its
        # rejection, so injected_malformed >= queue/rejected at every step.
        if self.faults.active:
          m.update({f"faults/injected_{k}": v for k, v in self.faults.counts().items()})
        if (step + 1) % self.config.log_every == 0 or step + 1 == c.steps or budget_spent:
          rec = self.metrics.write(step + 1, m, "rl")
          progress("rl", step + 1, c.steps, rec, {
              "rollout/reward_mean": "reward", "policy/loss": "pi_loss",
              "critic/explained_variance": "expl_var", "policy/masked_low_frac": "dis_low",
              "policy/masked_high_frac": "dis_high", "policy_lag/mean": "lag",
              "trainer/idle_fraction": "idle", "queue/rejected": "rejected"})
          if distributed.is_primary():  # DIS diagnostics past their warning levels
            for line in dis_warnings(rec):
              print(f"[rl] {step + 1}/{c.steps} warning: {line}", flush=True)
        if c.eval_every and (step + 1) % c.eval_every == 0 and step + 1 < c.steps:
          self._eval(f"rl_step_{step + 1}", self.state.policy)
        if (step + 1) % self.config.checkpoint.every == 0:
          self.meta["prompt_state"] = prompt_iter.get_state()
          self.meta["running_mean"] = (None if baseline_state is None else
                                       [np.asarray(x).tolist() for x in baseline_state])
          if feed is not None:
            self.meta["fleet"] = feed.state()
          self._save()
        self.faults.after_rl_step(step + 1)
        if budget_spent:
          print(f"[rl] generated-token budget spent ({generated} >= {budget}) at step "
                f"{step + 1}", flush=True)
          break
    finally:
      if feed is None:
        rollout["driver"].stop()
      else:
        publisher.close()
    if feed is not None:
      self.meta["fleet"] = feed.state()
      fleet.mark_done(fleet.root_of(self.config, self.workdir), int(self.state.step))
    self.meta["prompt_state"] = prompt_iter.get_state()
    self._advance("done")

  def done(self):
    final = self._eval("final", self.state.policy)
    summary = {"sft_pass@1": self.meta["evals"].get("sft", {}).get("pass@1"),
               "final_pass@1": final["pass@1"], "evals": self.meta["evals"],
               "rl_steps": int(self.state.step),
               "generated_tokens": self.meta.get("generated_tokens", 0)}
    if distributed.is_primary():
      # Written whole: a summary.json that exists marks a finished run (experiments/).
      files.write_json(os.path.join(self.workdir, "summary.json"), summary, indent=2)
    print(f"[done] pass@1 SFT {summary['sft_pass@1']} -> final {summary['final_pass@1']}",
          flush=True)
    self._save(force=True)
    return summary


def _wait(tree):
  """Blocks until a sharded step has finished on every device.

  With several (simulated) devices on few CPU cores, XLA:CPU can deadlock in
  a collective's rendezvous when many multi-device programs are dispatched
  ahead; one step in flight at a time avoids it. The host loop needs each
  step's metrics anyway, so this costs no overlap worth having.
  """
  jax.block_until_ready(tree)


def train(config: ml_collections.ConfigDict, workdir: str, until: str = "done") -> dict:
  """Runs (or resumes) the chain up to stage `until`; the summary when it ends."""
  if until not in STAGES:
    raise ValueError(f"until must be one of {STAGES}, got {until!r}")
  run = _Run(config, workdir)
  # Only training records its config: eval / serve tools reuse _Run on the
  # same workdir and must not overwrite the run's record.
  if distributed.is_primary():
    files.write_text(os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2))
  try:
    while run.meta["stage"] != until:
      getattr(run, run.meta["stage"])()
    return run.done() if until == "done" else dict(run.meta["evals"])
  finally:
    run.ckpt.close()
    run.metrics.close()


def load_run(config: ml_collections.ConfigDict, workdir: str, step: int | None = None) -> _Run:
  """A run restored from `workdir` (fresh if it has no checkpoint), for tools."""
  return _Run(config, workdir, restore_step=step)


def evaluate(config: ml_collections.ConfigDict, workdir: str, step: int | None = None,
             out: str | None = None) -> dict:
  """pass@1 of the policy in checkpoint `step` (default: the latest) of a run.

  Every sample is also written as one JSON line (`evaluation.sample_record`)
  to `out`, default `<workdir>/eval/checkpoint_<step>.jsonl`, whose path the
  result names as "samples_file".
  """
  run = _Run(config, workdir, restore_step=step)
  try:
    if run.ckpt.latest_step() is None:
      raise FileNotFoundError(f"no checkpoint under {workdir}")
    name, samples = f"checkpoint_{step or run.ckpt.latest_step()}", []
    result = run._eval(name, run.state.policy, samples)  # pylint: disable=protected-access
    out = out or os.path.join(workdir, "eval", f"{name}.jsonl")
    if distributed.is_primary():
      write_samples(out, samples)
    return {**result, "samples_file": out}
  finally:
    run.ckpt.close()
    run.metrics.close()
