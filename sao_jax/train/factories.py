"""One factory per object a run is made of, from its config.

The trainer, evaluation, the fleet's rollout worker, serving, launch/compile.py
and the benchmarks all build models, engines, drivers and jitted programs
here, so a config field reaches its object in one place.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.algo import optim
from sao_jax.config import sections
from sao_jax.envs import registry
from sao_jax.models import config as model_config
from sao_jax.models import lora, policy, sharding
from sao_jax.rollout import backends
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine, rollout_rules
from sao_jax.train import configuration
from sao_jax.train.train_step import (
  Adapters,
  StepConfig,
  TrainState,
  full_critic,
  full_policy,
  jit_sharded,
  make_sft_step,
  make_train_step,
)


def validate_config(config, num_devices: int | None = None) -> None:
  """Fails fast, before anything is written, on settings that cannot work."""
  configuration.validate(config, num_devices)


def build_model_config(config, tokenizer=None, env=None) -> model_config.ModelConfig:
  """The ModelConfig of the config's model section: its architecture
  (`configuration.model_architecture`), the
  compute dtype, and with `model.vocab_subset` the head's ids
  (sao_jax/envs/head_vocab.py, from `env` when the caller has built it)."""
  m = sections.Model.of(config.model)
  if (
    m.vocab_from_tokenizer
    and m.preset in model_config.TOY_PRESETS
    and not m.hf_dir
    and tokenizer is None
  ):
    tokenizer = registry.make_tokenizer(config.env)
  base = configuration.model_architecture(m, tokenizer)
  overrides = {}
  if m.compute_dtype:
    overrides["dtype"] = m.compute_dtype
  if m.vocab_subset == "env":
    from sao_jax.envs import head_vocab

    overrides["vocab_ids"] = head_vocab.ids_for(config.env, env, tokenizer)
  return dataclasses.replace(base, **overrides) if overrides else base


def engine_mesh(
  rollout: sections.Rollout, devices=None, trainer_mesh: jax.sharding.Mesh | None = None
) -> jax.sharding.Mesh | None:
  """The mesh a rollout section puts its engine on; None: one device.

  `rollout.mesh` ("expert:2,tensor:2") over `devices` (default: this
  host's), the first of them when no size is -1; else, with
  `rollout.sharded_engine`, the trainer's mesh when the engine is colocated
  (`trainer_mesh`) or {"data": -1} over `devices` when the caller gives
  them (a fleet rollout process, a process of a multi-host run); else
  (evaluation, serving, the engine off the mesh) one device.
  launch/compile.py compiles the engine on the same mesh over the rollout
  topology's devices.
  """
  given = devices is not None
  devices = list(jax.local_devices() if devices is None else devices)
  if rollout.mesh:
    axes = sections.parse_mesh(rollout.mesh)
    size = math.prod(axes.values())
    if size > 0 and size < len(devices):
      devices = devices[:size]  # the host's first devices; -1 takes them all
    try:
      return sharding.make_mesh(axes, devices)
    except ValueError as e:
      raise sections.ConfigError(f"rollout.mesh = {rollout.mesh!r}: {e}") from None
  if not rollout.sharded_engine:
    return None
  if trainer_mesh is not None:
    return trainer_mesh
  return sharding.make_mesh({"data": -1}, devices) if given else None


def make_engine(
  config,
  model_cfg: model_config.ModelConfig,
  params,
  version: int = 0,
  *,
  seed: int | None = None,
  mesh: jax.sharding.Mesh | None = None,
  devices=None,
  record_routing: bool = False,
  **rollout_changes,
) -> PolicyEngine:
  """The rollout engine a config asks for, on `params` at `version`.

  It takes the config's rollout section whole (sao_jax/config/sections.py: slots,
  max_len, sampling, the dense or paged cache, prefill buckets), with
  `rollout_changes` applied (evaluation's own slots and temperature,
  serving's slots), on `engine_mesh(rollout, devices, mesh)`: the
  section's own mesh, the trainer's `mesh` for a colocated sharded engine,
  or one device. `seed` defaults to seed + version. `record_routing`: the
  engine records MoE expert choices (the RL rollout's, with
  `rl.routing_replay`; evaluation and value pretraining need none).
  """
  r = sections.rollout(config)
  if rollout_changes:
    r = r.replace(**rollout_changes)
  # The backend's builder (sao_jax/rollout/backends.py; "jax": make_policy_engine).
  build = backends.get(r.backend).build()
  return build(
    config,
    model_cfg,
    params,
    version,
    rollout=r,
    seed=config.seed + int(version) if seed is None else seed,
    mesh=mesh,
    devices=devices,
    record_routing=record_routing,
  )


def make_policy_engine(
  config,
  model_cfg: model_config.ModelConfig,
  params,
  version: int,
  *,
  rollout: sections.Rollout,
  seed: int,
  mesh=None,
  devices=None,
  record_routing: bool = False,
) -> PolicyEngine:
  """The "jax" backend's builder (`make_engine`'s arguments, the section
  resolved): the project's PolicyEngine on `engine_mesh`."""
  del config  # the section carries what the JAX engine reads
  on = engine_mesh(rollout, devices, trainer_mesh=mesh)
  placement = dict(mesh=on, rules=rollout_rules(on)) if on is not None else {}
  return PolicyEngine(
    model_cfg,
    params,
    rollout,
    seed=seed,
    version=version,
    record_routing=record_routing,
    **placement,
  )


def make_driver(
  config,
  engine: PolicyEngine,
  env,
  tok,
  prompt_iter,
  emit,
  rollout: sections.Rollout | None = None,
  **options,
) -> RolloutDriver:
  """The rollout driver a config asks for: the trainer's thread, a fleet
  rollout process, value pretraining and evaluation build it here.

  It takes the engine's rollout section (or `rollout`) whole, the chat
  format and the tool-output cap of the config's environment, and
  `options` of the driver itself (on_finish, static_batching, ...).
  """
  options.setdefault("tool_latency_s", config.env.tool_latency_s)
  return RolloutDriver(
    engine,
    env,
    tok,
    prompt_iter,
    emit,
    rollout,
    chat_format=registry.make_format(config.env, tok),
    max_tool_output_tokens=config.env.max_tool_output_tokens,
    **options,
  )


def step_config(config) -> StepConfig:
  """The train steps' view of a config (a Sections or a ConfigDict)."""
  typed = sections.load(config)
  return StepConfig(typed.rl, typed.rollout.temperature)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: one per run
class LoraPrograms:
  """LoRA's part of the programs (config section `lora`): what the adapters
  adapt, the bases' dtype and shardings, and the adapters' initial draw."""

  adapters: Adapters
  base_dtype: str  # "": the model's param dtype
  base_shardings: tuple  # (policy, critic): the full params' shardings
  seed: int
  abstract_base: Any = None  # the policy's base, ShapeDtypeStructs with shardings

  def init(self, policy_params, critic_params) -> tuple:
    """(policy adapters, critic adapters) at step 0: B zero, so each model is its base."""
    rng = jax.random.key(self.seed)
    return (
      lora.init_adapters(policy_params, self.adapters.actor, jax.random.fold_in(rng, 2)),
      lora.init_adapters(critic_params, self.adapters.critic, jax.random.fold_in(rng, 3)),
    )

  def bases(self, policy_params, critic_params) -> tuple:
    """(policy base, critic base), eagerly (no copy where the dtype is kept): the
    critic's trunk is the policy's own arrays, its value head `critic_params`'
    (uncast: the critic trains it whole, from its float32 copy in the state)."""
    base = self.policy_base(policy_params)
    return base, policy.value_params_from_policy(base, critic_params)

  def policy_base(self, policy_params):
    """The policy's frozen base: `policy_params` in `base_dtype` (as they are
    without one). A fleet rollout builds its own with this (fleet_worker.py)."""
    if not self.base_dtype:
      return policy_params
    return jax.tree.map(
      lambda x: x.astype(self.base_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
      policy_params,
    )


def _lora_programs(
  config, c: sections.Lora, policy_params, critic_params, policy_shardings, critic_shardings
) -> LoraPrograms:
  """The `lora` section's adapters: the actor's targets minus rl.actor_frozen;
  the critic's targets, plus the actor's (it carries the SFT policy's
  adapters, `stages.sft`), plus its whole-trained value head."""
  if config.sft.init_from_hf:
    raise sections.ConfigError(
      f"sft.init_from_hf = {config.sft.init_from_hf!r} with lora.enabled: a LoRA run's base "
      "is fixed when it is built; set model.hf_dir to that checkpoint (and sft.steps = 0)"
    )
  actor = lora.LoraConfig(
    c.rank, c.alpha, tuple(c.actor_targets), frozen=tuple(config.rl.actor_frozen)
  )
  critic = lora.LoraConfig(
    c.rank, c.alpha, tuple(c.critic_targets) + tuple(c.actor_targets), whole=tuple(c.critic_whole)
  )
  for cfg, params in ((actor, policy_params), (critic, critic_params)):
    try:
      lora.plan(params, cfg)
    except ValueError as e:
      raise sections.ConfigError(str(e)) from None
  out = LoraPrograms(
    Adapters(actor, critic), c.base_dtype, (policy_shardings, critic_shardings), config.seed
  )
  base = jax.eval_shape(lambda p, v: out.bases(p, v)[0], policy_params, critic_params)
  return dataclasses.replace(out, abstract_base=_placed(base, policy_shardings))


def lora_bases(programs: "Programs", policy_params, critic_params) -> tuple | None:
  """The frozen bases a LoRA run's steps read (None without LoRA)."""
  if programs.lora is None:
    return None
  return programs.lora.bases(policy_params, critic_params)


def _placed(tree, shardings):
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def abstract_full_policy(programs: "Programs"):
  """The whole policy's params (never adapters) as ShapeDtypeStructs in their
  shardings: what a full-model checkpoint's policy restores into."""
  shapes = jax.eval_shape(lambda: nn.unbox(programs.policy_init()))
  return _placed(shapes, programs.policy_shardings)


def abstract_bases(programs: "Programs") -> tuple | None:
  """`lora_bases` of the initialisers' params as ShapeDtypeStructs in the bases'
  shardings (launch/compile.py's last argument to each step); None without LoRA."""
  if programs.lora is None:
    return None
  full = lambda init: jax.eval_shape(lambda: nn.unbox(init()))
  bases = jax.eval_shape(
    programs.lora.bases, full(programs.policy_init), full(programs.critic_init)
  )
  return _placed(bases, programs.lora.base_shardings)


def abstract_served_policy(programs: "Programs", bases=None):
  """The policy engines serve, abstract: the state's, or with LoRA `full_params`
  over `abstract_bases` (the base's shardings and dtype)."""
  if programs.lora is None:
    return programs.abstract_state.policy
  merged = jax.eval_shape(
    lambda p, b: full_params(programs, b, p), programs.abstract_state.policy, bases
  )
  return _placed(merged, programs.lora.base_shardings[0])


def with_bases(step: Callable, bases) -> Callable:
  """`step` with the bases bound as its last argument (a run's steps)."""
  return lambda *args: step(*args, bases)


def full_params(programs: "Programs", bases, trainable, which: str = "policy"):
  """The full params of `trainable` (the state's policy or critic): itself
  without LoRA, else merged onto its base: what engines serve, evaluation
  reads and exports write. One jitted merge (a new tree the base's size)."""
  if programs.lora is None:
    return trainable
  return _merger(programs.lora, which)(trainable, bases)


def policy_merger(programs: "Programs") -> Callable:
  """The jitted merge `full_params` serves the policy with, (adapters, bases)
  -> the merged params in the base's layout (LoRA programs only)."""
  return _merger(programs.lora, "policy")


def rollout_programs(config, model_cfg, devices) -> tuple["Programs", jax.sharding.Mesh]:
  """(programs, mesh) of a fleet rollout process holding a LoRA run's base:
  the run's programs on the mesh its engine runs on (`engine_mesh` over
  `devices`; one device without one) under the engine's rules
  (`rollout_rules`), so that the base, the adapters and the merged params
  are laid out as the engine holds params. launch/compile.py compiles the
  merge on the same."""
  devices = list(devices)
  mesh = engine_mesh(config.rollout, devices) or sharding.make_mesh({"data": 1}, devices[:1])
  config = config.replace(
    sharding=config.sharding.replace(mesh=dict(mesh.shape), rules=rollout_rules(mesh))
  )
  return build_programs(config, model_cfg, step_config(config), mesh), mesh


@functools.lru_cache(maxsize=8)
def _merger(lora_p: LoraPrograms, which: str) -> Callable:
  """The jitted merge of one model (traced once per run, not once per version)."""
  view = full_policy if which == "policy" else full_critic
  shardings = lora_p.base_shardings[0 if which == "policy" else 1]
  return jax.jit(functools.partial(view, lora_p.adapters), out_shardings=shardings)


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
  # LoRA: the state's policy and critic are adapters, and each step takes the
  # bases (`lora_bases`) as a last argument (`with_bases`).
  lora: LoraPrograms | None = None

  @property
  def abstract_resident(self):
    """What the trainer holds from the start (memory checks): the state, and
    with LoRA the frozen base beside it (the critic's trunk is the same arrays)."""
    if self.lora is None:
      return self.abstract_state
    return self.abstract_state, self.lora.abstract_base

  def init_state(self, policy_params, critic_params) -> TrainState:
    """The state at step 0 around given params (jit it with state_shardings)."""
    if self.lora is not None:
      policy_params, critic_params = self.lora.init(policy_params, critic_params)
    return TrainState(
      jnp.zeros((), jnp.int32),
      policy_params,
      critic_params,
      self.policy_tx.init(policy_params),
      self.critic_tx.init(critic_params),
    )


def build_programs(
  config, model_cfg: model_config.ModelConfig, step_cfg: StepConfig, mesh: jax.sharding.Mesh
) -> Programs:
  """Shardings from the config's rules, the optimizers and the jitted steps on `mesh`."""
  rules = tuple(tuple(r) for r in config.sharding.rules)
  rng = jax.random.key(config.seed)
  policy_init = lambda: policy.init_params(model_cfg, rng, boxed=True)
  critic_init = lambda: policy.init_params(
    model_cfg, jax.random.fold_in(rng, 1), "value", boxed=True
  )
  policy_shardings = sharding.logical_shardings(jax.eval_shape(policy_init), mesh, rules)
  critic_shardings = sharding.logical_shardings(jax.eval_shape(critic_init), mesh, rules)
  policy_params = jax.eval_shape(lambda: nn.unbox(policy_init()))
  critic_params = jax.eval_shape(lambda: nn.unbox(critic_init()))

  # One rule set for both of the actor's optimizers: SFT's state fills the same
  # checkpoint slot (TrainState.policy_opt) as RL's, so their layouts must agree.
  actor_rules = optim.freeze_rules(config.rl.actor_frozen)
  optim.check_rules_match(policy_params, actor_rules, "rl.actor_frozen")
  node = getattr(config, "lora", None)  # a ConfigDict written before the section: off
  lora_c = sections.Lora() if node is None else sections.Lora.of(node)
  lora_p = (
    _lora_programs(config, lora_c, policy_params, critic_params, policy_shardings, critic_shardings)
    if lora_c.enabled
    else None
  )
  # What the optimizers move: the params, or with LoRA the adapters, each laid
  # out like its weight (lora.adapter_shardings: replicated, sao_moe's
  # expert adapters would hold more state a chip than full fine-tuning;
  # benchmarks/RESULTS.md#pods-compile-and-fit).
  train_policy, train_critic = policy_params, critic_params
  train_shardings = (policy_shardings, critic_shardings)
  if lora_p is not None:
    train_policy, train_critic = jax.eval_shape(lora_p.init, policy_params, critic_params)
    train_shardings = (
      lora.adapter_shardings(policy_params, policy_shardings, lora_p.adapters.actor),
      lora.adapter_shardings(critic_params, critic_shardings, lora_p.adapters.critic),
    )

  def policy_tx(lr, steps, warmup):
    return optim.make_optimizer(
      train_policy,
      optim.warmup_cosine(lr, warmup, steps),
      rules=actor_rules,
      clip_norm=config.rl.clip_norm,
    )

  def opt_shardings(tx, params, param_shardings):
    return sharding.shardings_like_params(
      jax.eval_shape(tx.init, params), params, param_shardings, mesh
    )

  sft_tx = policy_tx(config.sft.lr, config.sft.steps, config.sft.warmup)
  rl_tx = policy_tx(config.rl.actor_lr, config.rl.steps, config.rl.warmup)
  critic_tx = optim.make_optimizer(
    train_critic,
    config.rl.critic_lr,
    rules=_critic_rules(config, lora_c, lora_p, train_critic),
    clip_norm=config.rl.clip_norm,
  )
  state_shardings = TrainState(
    step=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
    policy=train_shardings[0],
    critic=train_shardings[1],
    policy_opt=opt_shardings(rl_tx, train_policy, train_shardings[0]),
    critic_opt=opt_shardings(critic_tx, train_critic, train_shardings[1]),
  )
  batch_sharding = sharding.batch_sharding(mesh, rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    sft_step, value_step, rl_step = _jit_steps(
      config,
      model_cfg,
      step_cfg,
      (sft_tx, rl_tx, critic_tx),
      state_shardings,
      batch_sharding,
      lora_p,
    )
  programs = Programs(
    rules,
    batch_sharding,
    policy_init,
    critic_init,
    policy_shardings,
    critic_shardings,
    sft_tx,
    rl_tx,
    critic_tx,
    state_shardings,
    None,
    sft_step,
    value_step,
    rl_step,
    lora_p,
  )
  abstract = jax.eval_shape(programs.init_state, policy_params, critic_params)
  return dataclasses.replace(programs, abstract_state=_placed(abstract, state_shardings))


def _critic_rules(config, lora_c: sections.Lora, lora_p: LoraPrograms | None, train_critic):
  """The critic optimizer's freezing rules: the paper's frozen attention (or
  none), and with LoRA first the carried adapters its targets do not name."""
  rules = optim.CRITIC_FREEZE_RULES if config.rl.freeze_critic_attention else optim.TRAIN_ALL_RULES
  if lora_p is None:
    return rules
  trained = tuple(lora_c.critic_targets) + tuple(lora_c.critic_whole)
  return lora.optimizer_rules(train_critic, trained)[:-1] + rules


def _jit_steps(
  config,
  model_cfg,
  step_cfg: StepConfig,
  txs: tuple,
  state_shardings,
  batch_sharding,
  lora_p: LoraPrograms | None,
) -> tuple:
  """(sft_step, value_step, rl_step), jitted with shardings and donation; with
  LoRA each takes the bases (policy, critic) as a last, not donated, argument."""
  sft_tx, rl_tx, critic_tx = txs
  adapters = None if lora_p is None else lora_p.adapters
  base = {} if lora_p is None else {"base_shardings": lora_p.base_shardings}
  rl_step = jit_sharded(
    make_train_step(model_cfg, step_cfg, rl_tx, critic_tx, adapters=adapters),
    state_shardings,
    batch_sharding,
    **base,
  )
  value_step = jit_sharded(
    # The arm's own estimator: a token-GAE critic is pretrained where
    # that arm bootstraps, not on skip-observation targets.
    make_train_step(
      model_cfg,
      dataclasses.replace(step_cfg, rl=step_cfg.rl.replace(critic_updates=1)),
      rl_tx,
      critic_tx,
      update_actor=False,
      adapters=adapters,
    ),
    state_shardings,
    batch_sharding,
    **base,
  )
  sft = make_sft_step(model_cfg, sft_tx, config.rl.load_balance_coef, adapters)
  policy_in = (state_shardings.policy, state_shardings.policy_opt, batch_sharding)
  sft_step = jax.jit(
    sft,
    in_shardings=policy_in + tuple(base.values()),
    out_shardings=(state_shardings.policy, state_shardings.policy_opt, None),
    donate_argnums=(0, 1),
  )
  return sft_step, value_step, rl_step
