"""The programs a pod runs, as abstract calls the TPU compiler can lower on a CPU host.

A `Program` is a jitted function, its abstract arguments (sharded
`jax.ShapeDtypeStruct`s from `jax.eval_shape` of the initialisers: nothing
is allocated) and the context it is traced in. `train_programs` gives the
trainer's sft / value / rl steps as `factories.build_programs` builds them
for the trainer, at the largest bucket; `engine_programs` the rollout
engine's prefill / decode / decode_loop as `EnginePrograms.for_rollout`
builds them for `PolicyEngine`, on the layout the run would use
(`factories.engine_mesh`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import flax.linen as nn
import jax

from sao_jax.config import sections
from sao_jax.data import packing
from sao_jax.models import policy
from sao_jax.rollout import programs as programs_lib
from sao_jax.train import configuration, factories


@dataclasses.dataclass
class Program:
  """One program to compile: the jitted function, abstract args, how it is traced."""

  name: str
  fn: object  # a jax.jit-wrapped function
  args: tuple
  shape: str  # the batch / cache shape, in words
  topology: str
  hbm: float
  context: object = contextlib.nullcontext


def abstract_batch(
  rows: int,
  length: int,
  batch_sharding,
  action_index: bool = False,
  routing: tuple[int, int] | None = None,
) -> dict:
  """A packed batch `[rows, length]` of ShapeDtypeStructs, dtypes from `packing.pack`.

  With `action_index` (`data.logits_at_actions`) the batch carries it at its
  widest, `[rows, length]` (a row of action tokens only): the head's worst case.
  With `routing` (M, k) (`rl.routing_replay`) it carries the recorded expert
  choices `[rows, length, M, k]`.
  """
  example = packing.pack([], 1, (8,), action_index=action_index, routing=routing)
  return {
    k: jax.ShapeDtypeStruct((rows, length) + v.shape[2:], v.dtype, sharding=batch_sharding)
    for k, v in example.items()
  }


@contextlib.contextmanager
def in_mesh(mesh, rules):
  """A mesh and logical-axis rules for tracing, as the trainer and the engine set them.

  `jax.set_mesh`, not `with mesh:`: flax resolves the model's activation
  constraints against the abstract mesh, which the old context manager no
  longer sets, so under it every constraint would be silently dropped.
  """
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def train_programs(
  config,
  progs: factories.Programs,
  mesh,
  topo: str,
  hbm: float,
  model_cfg,
  bases=None,
  rows: int | None = None,
  length: int | None = None,
) -> dict:
  """The trainer's sft / value / rl steps at the largest bucket, as it calls them:
  with LoRA, the bases (`factories.abstract_bases`) as each step's last
  argument, the critic's trunk passed once (`shared_trunk`). `rows` and
  `length` override the config's batch sizes and max(data.buckets)."""
  length = length or max(config.data.buckets)
  rl_rows = rows or config.rl.batch_size
  sft_rows = rows or config.sft.batch_size
  state = progs.abstract_state
  # The trainer calls its sft, value and rl steps inside its mesh and
  # logical-axis rules, which turn the model's activation annotations into
  # sharding constraints; all three are lowered the same way here.
  ctx = lambda: in_mesh(mesh, progs.rules)
  at_actions = config.data.get("logits_at_actions", False)
  replay = (
    (model_cfg.num_moe_layers, model_cfg.experts_per_token)
    if config.rl.get("routing_replay")
    else None
  )
  rl_batch = abstract_batch(rl_rows, length, progs.batch_sharding, at_actions, replay)
  sft_batch = abstract_batch(sft_rows, length, progs.batch_sharding, at_actions)
  step, tail = (lambda fn, donate: fn), ()
  if bases is not None:
    step = shared_trunk
    tail = (bases[0], {k: v for k, v in bases[1].items() if k not in bases[0]})
  return {
    "sft": Program(
      "sft",
      step(progs.sft_step, (0, 1)),
      (state.policy, state.policy_opt, sft_batch) + tail,
      f"{sft_rows}x{length}",
      topo,
      hbm,
      ctx,
    ),
    "value": Program(
      "value",
      step(progs.value_step, (0,)),  # packed without action_index
      (state, abstract_batch(rl_rows, length, progs.batch_sharding)) + tail,
      f"{rl_rows}x{length}",
      topo,
      hbm,
      ctx,
    ),
    "rl": Program(
      "rl",
      step(progs.rl_step, (0,)),
      (state, rl_batch) + tail,
      f"{rl_rows}x{length} K={config.rl.critic_updates}",
      topo,
      hbm,
      ctx,
    ),
  }


def shared_trunk(step, donate: tuple):
  """LoRA's `step(*args, (policy base, critic base))` as a program of
  `(*args, policy base, critic head)`: the critic base's trunk is the policy
  base's own arrays (`LoraPrograms.bases`), one buffer when the trainer calls
  the step, but XLA counts a buffer passed twice twice (the RL step's
  argument bytes would hold the trunk twice). The jitted step is inlined:
  the same computation, shardings from the arguments, the same donation."""

  def call(*args):
    *rest, base, head = args
    return step(*rest, (base, policy.value_params_from_policy(base, head)))

  return jax.jit(call, donate_argnums=donate)


def rollout_section(config, rollout_mesh: str | None = None) -> sections.Rollout:
  """The config's rollout section, with `rollout_mesh` (--rollout_mesh) as its mesh when given."""
  r = sections.rollout(config)
  if rollout_mesh:
    try:
      r = r.replace(mesh=rollout_mesh)
    except configuration.ConfigError as e:
      raise configuration.ConfigError(f"--rollout_mesh={rollout_mesh}: {e}") from None
  return r


def _engine_layout(r: sections.Rollout, model_cfg, devices, train_mesh, routing: bool):
  """(`EnginePrograms.for_rollout` on the run's layout, that layout in words)."""
  where = (
    f"rollout.mesh={r.mesh}"
    if r.mesh
    else "one chip"
    if not r.sharded_engine
    else "the trainer's mesh (colocated)"
    if train_mesh is not None
    else "data:-1 over the rollout topology"
  )
  try:
    mesh = factories.engine_mesh(r, devices, trainer_mesh=train_mesh)
    if mesh is not None:
      progs = programs_lib.EnginePrograms.for_rollout(
        model_cfg, r, mesh=mesh, record_routing=routing
      )
      return progs, f"mesh {dict(mesh.shape)}"
    # A one-device mesh on the target's first chip (EnginePrograms(device=)),
    # so that the model traces the TPU paths (attention.compile_platform),
    # not the host's.
    progs = programs_lib.EnginePrograms.for_rollout(
      model_cfg, r, device=devices[0], record_routing=routing
    )
    return progs, "1 chip"
  except ValueError as e:  # a mesh, slots or pages that do not split over the devices
    raise configuration.ConfigError(
      f"the rollout engine on {where}: {e}; give the rollout slice its own layout "
      "(--rollout_topology, rollout.mesh or --rollout_mesh) or compile "
      "--programs=sft,value,rl"
    ) from None


def engine_programs(
  config,
  r: sections.Rollout,
  model_cfg,
  abstract_policy,
  devices,
  topo: str,
  hbm: float,
  width: int | None = None,
  train_mesh=None,
) -> tuple[dict, str, dict]:
  """The rollout engine's programs: prefill, decode (one token) and decode_loop.

  Returns ({name: Program}, the engine's layout in words, its KV capacity:
  `EnginePrograms.capacity`, the live tokens its cache or page pool holds).

  The layout is the one the run would use (`factories.engine_mesh`): `r.mesh`
  over the rollout topology's devices; else with `rollout.sharded_engine`
  the trainer's colocated engine on the trainer's mesh (`train_mesh`), or,
  on a rollout topology of its own, {"data": -1} over its devices (a fleet
  rollout process's engine over its host's chips); else one device holding
  params and the dense [slots, max_len] cache (or, with `rollout.kv_cache`
  "paged", the pool of pages), on the rollout topology's first chip.

  The programs are the engine's own (the same jitted functions, static args,
  shardings and donation `PolicyEngine` runs), built without an engine,
  which would copy real params onto devices. prefill and decode are
  `PolicyEngine.step` at [slots, width] (default max_len) and [slots, 1];
  decode_loop is `PolicyEngine.decode`, the driver's decode, at
  `rollout.decode_steps` iterations, with no stop token (the driver's
  turn-end id is a constant of the loop, not a shape). All attend over the
  whole cache (kv bucket max_len).
  """
  width = width or r.max_len
  progs, layout = _engine_layout(
    r, model_cfg, devices, train_mesh, bool(config.rl.get("routing_replay"))
  )
  steps = r.decode_steps
  cap = progs.capacity()
  cache_shape = f"cache {r.slots}x{r.max_len}, {layout}"
  if progs.paged:
    cache_shape = (
      f"cache {r.slots}x{r.max_len} paged: {progs.num_pages} pages of "
      f"{progs.page_size} = {cap['live_tokens']:,} live tokens "
      f"({cap['fraction_of_dense']:.3f} of slots x max_len), {layout}"
    )
  step = progs.step(None)
  return (
    {
      "prefill": Program(
        "prefill",
        step,
        progs.step_args(abstract_policy, width),
        f"{r.slots}x{width}, {cache_shape}",
        topo,
        hbm,
        progs.context,
      ),
      "decode": Program(
        "decode",
        step,
        progs.step_args(abstract_policy, 1),
        f"{r.slots}x1, {cache_shape}",
        topo,
        hbm,
        progs.context,
      ),
      "decode_loop": Program(
        "decode_loop",
        progs.decode(None, steps, -1),
        progs.decode_args(abstract_policy),
        f"{r.slots}x1 x {steps} steps, {cache_shape}",
        topo,
        hbm,
        progs.context,
      ),
    },
    layout,
    cap,
  )


def merge_program(config, r: sections.Rollout, model_cfg, devices, topo: str, hbm: float):
  """A LoRA fleet rollout's merge at each version swap, or None without LoRA.

  The trainer's jitted merge (`factories.policy_merger`: `lora.merge` of
  the adapters onto the frozen base), on the programs a fleet rollout
  process builds (`factories.rollout_programs`: the engine's mesh and rules
  over the rollout topology's devices, `r` its rollout section). Its
  arguments are what that host holds beside the engine, the base and the
  adapters of a version; its output the merged params, which the engine
  then copies in (the cast for serving, elementwise, is not compiled here).
  """
  typed = sections.load(config).replace(rollout=r)
  if not typed.lora.enabled:
    return None
  progs, mesh = factories.rollout_programs(typed, model_cfg, devices)
  return Program(
    "merge",
    factories.policy_merger(progs),
    (progs.abstract_state.policy, (progs.lora.abstract_base, None)),
    f"adapters onto the {progs.lora.base_dtype or model_cfg.param_dtype} base, mesh "
    f"{dict(mesh.shape)}",
    topo,
    hbm,
    lambda: in_mesh(mesh, progs.rules),
  )
