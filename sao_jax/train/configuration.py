"""Config checks: every bad setting fails before anything is written.

`validate(config)` is called first thing by the trainer and by every launch
script. It raises `ConfigError` with one line that names the field, the
value and what is allowed, e.g.

    rl.eps_low = 2.0: must be in (0, 1)

Each field's own check, and the rules between fields of one section, live
with the field in its typed section (sao_jax/config/sections.py); what is here is
the top-level fields, whether the mesh fits the devices present, and the
rules that join sections.

Unknown keys cannot get this far: `configs/common.py` locks the config it
returns, so a config file that sets a misspelt field fails when it loads,
and `--config.x.y=...` overrides of unknown fields fail in flag parsing;
`run(main)` turns both into the same one-line error (exit status 2)
instead of a traceback.

`check_workdir` is the pre-flight check of the run directory (writable,
enough free space), also before training.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import sys
from typing import Callable

from absl import app

from sao_jax.algo.advantages import ESTIMATORS
from sao_jax.config import sections
from sao_jax.data import files
from sao_jax.envs import registry
from sao_jax.models import precision
from sao_jax.rollout import backends
from sao_jax.train import sources
from sao_jax.train.stopping import StopTraining  # (re-exported for launch/)
from sao_jax.transport import weight_channel

# The error every check raises; defined beside the section records.
ConfigError = sections.ConfigError


def parse_literal(text: str):
  """A command-line override's value: a Python literal where one parses (2,
  0.5, True, "(1, 2)"), `true` / `false` in any case as bools, else the text."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return {"true": True, "false": False}.get(text.lower(), text)


_fail = sections.fail


def get_field(config, field: str):
  """The value of the dotted `field` ("rl.actor_lr") of `config`."""
  node = config
  for part in field.split("."):
    node = node[part]
  return node


def set_field(config, field: str, value) -> None:
  """Sets the dotted `field` ("rl.actor_lr") of `config` to `value`, in place."""
  *parents, leaf = field.split(".")
  node = get_field(config, ".".join(parents)) if parents else config
  node[leaf] = value


def validate(
  config,
  num_devices: int | None = None,
  num_processes: int | None = None,
  host_devices: int | None = None,
) -> None:
  """Raises ConfigError on the first setting that cannot work.

  `num_devices` (default: all JAX devices of every process) checks that the
  mesh fits the devices, so a bad mesh fails before the workdir exists;
  `num_processes` (default: the processes JAX runs as) refuses what a
  multi-host run cannot do; `host_devices` (default: num_devices /
  num_processes) is what `rollout.mesh` must fit (launch/compile.py gives
  the rollout topology's).
  """
  # Every field of every typed section (the top-level ones too), and the
  # rules within a section (the mesh is well formed, ...); then the names
  # that the layers above the sections own. `config`: a ConfigDict or the
  # Sections it loads into.
  typed = sections.load(config)
  registry.check_env_section(typed.env)
  backends.check_rollout_section(typed.rollout)
  weight_channel.check_fleet_section(typed.fleet)
  spec = _source_spec(typed.rl.mode)
  _check_eval_sets(typed)
  _check_rollout(typed, spec)
  arch = _check_model(typed.model)
  backends.check_model(typed.rollout, arch)
  _check_sizes(typed)
  if num_devices is None:
    import jax

    num_devices = jax.device_count()
  _check_mesh(typed.sharding.mesh, num_devices)
  processes = _process_count() if num_processes is None else num_processes
  if typed.rollout.mesh:
    # An engine spans devices of its own host: fail now, not after SFT.
    _check_engine_mesh(typed.rollout.mesh, host_devices or max(num_devices // max(processes, 1), 1))
  # With several processes every host must train on the same batches, and
  # an in-process rollout's completion order differs from host to host.
  c = typed.rl
  if processes > 1 and c.steps > 0 and spec.in_process:
    raise ConfigError(
      f"rl.mode = {c.mode!r} with {processes} processes: the in-process "
      "rollout cannot feed a multi-host trainer; run rollout on its own "
      "slices (rl.mode = 'fleet'), or rl.steps = 0"
    )
  if typed.model.vocab_subset and typed.sft.init_from_hf:
    _fail(
      "model.vocab_subset",
      typed.model.vocab_subset,
      '"" with sft.init_from_hf: an imported checkpoint keeps its full head',
    )
  if typed.sft.init_from_run and (typed.sft.init_from_hf or typed.model.hf_dir):
    _fail(
      "sft.init_from_run",
      typed.sft.init_from_run,
      '"" with sft.init_from_hf or model.hf_dir (one starting policy)',
    )
  _check_update_precision(typed, arch)
  _check_routing_replay(typed, arch)
  for name in ("sigkill_after_rl_step", "sigterm_after_rl_step"):
    if getattr(typed.faults, name) > c.steps:
      # It would never fire: the run would end normally, not be signalled.
      _fail(f"faults.{name}", getattr(typed.faults, name), f"<= rl.steps ({c.steps})")
  if typed.faults.sigterm_after_sft_step > typed.sft.steps:
    _fail(
      "faults.sigterm_after_sft_step",
      typed.faults.sigterm_after_sft_step,
      f"<= sft.steps ({typed.sft.steps})",
    )


def _source_spec(mode: str) -> sources.SourceSpec:
  """The registered trajectory source of `rl.mode` (sources.SOURCES)."""
  if mode not in sources.SOURCES:
    _fail("rl.mode", mode, f"one of {sorted(sources.SOURCES)} (sao_jax/train/sources.py)")
  return sources.SOURCES[mode]


def _check_rollout(typed: sections.Sections, spec: sources.SourceSpec) -> None:
  """The rules joining the rollout section to the source, the estimator,
  the batch, the environment's tool clock and the data buckets."""
  c, r, e = typed.rl, typed.rollout, typed.env
  estimator = ESTIMATORS[c.advantage]
  if not spec.groups and r.samples_per_prompt != 1:
    # The source's checkpointed cursor is per trajectory; a GRPO group split
    # across a trainer restart would be half trained.
    _fail(
      "rollout.samples_per_prompt",
      r.samples_per_prompt,
      f"1 with rl.mode = {c.mode!r} (single-rollout arms)",
    )
  if r.samples_per_prompt < estimator.min_group:
    _fail(
      "rollout.samples_per_prompt",
      r.samples_per_prompt,
      f">= {estimator.min_group} for rl.advantage = {c.advantage!r}",
    )
  if c.batch_size % r.samples_per_prompt:
    _fail(
      "rl.batch_size",
      c.batch_size,
      f"a multiple of rollout.samples_per_prompt ({r.samples_per_prompt}): "
      "batches hold whole groups",
    )
  # The train step's log-probs apply the temperature only; truncated sampling
  # would bias every DIS / PPO ratio (an exactly on-policy step would show
  # ratios far from 1 and mask most tokens), so it is refused, not ignored.
  if r.top_k != 0:
    _fail(
      "rollout.top_k",
      r.top_k,
      "0: the train step's log-probs do not apply top-k, so the importance ratios would be biased",
    )
  if r.top_p != 1.0:
    _fail(
      "rollout.top_p",
      r.top_p,
      "1.0: the train step's log-probs do not apply top-p, "
      "so the importance ratios would be biased",
    )
  if r.env_timeout is not None and e.tool_seconds_per_turn >= r.env_timeout:
    # The tools would run into the step's timeout and the episode end as env_timeout.
    _fail(
      "env.tool_seconds_per_turn",
      e.tool_seconds_per_turn,
      f"< rollout.env_timeout ({r.env_timeout:g}): a turn's tools must finish before "
      "its environment step times out",
    )
  if r.max_turn_tokens >= r.max_len:
    _fail("rollout.max_turn_tokens", r.max_turn_tokens, f"< rollout.max_len ({r.max_len})")
  buckets = typed.data.buckets
  if max(buckets) < r.max_len:
    raise ConfigError(
      f"data.buckets = {buckets}: the largest data.buckets entry must be "
      f">= rollout.max_len ({r.max_len})"
    )


def model_architecture(m: sections.Model, tokenizer=None):
  """The model section's ModelConfig before the run's own settings: the preset
  (a toy preset's vocabulary sized to `tokenizer`'s), with the architecture of
  `model.hf_dir`'s config.json when set, then `model.overrides`."""
  from sao_jax.models import config as model_config

  preset = model_config.PRESETS[m.preset]
  if tokenizer is not None and m.vocab_from_tokenizer and m.preset in model_config.TOY_PRESETS:
    base = preset(vocab_size=tokenizer.vocab_size)
  else:
    base = preset()
  if m.hf_dir:
    from sao_jax.models import hf_import

    base = model_config.with_architecture(base, hf_import.config_from_hf(m.hf_dir))
  return dataclasses.replace(base, **m.overrides) if m.overrides else base


def _check_model(m: sections.Model):
  """The ModelConfig of the preset (or model.hf_dir) with `model.overrides`,
  built as the run builds it: a field's own check (ModelConfig.__post_init__,
  a ValueError or TypeError) becomes one line naming the override."""
  try:
    return model_architecture(m)
  except (TypeError, ValueError) as e:
    message = " ".join(str(e).split())
    if any(message.startswith(f"{k} = ") for k in m.overrides):  # "num_layers = -1: ..."
      raise ConfigError(f"model.overrides.{message}") from None
    raise ConfigError(f"model.overrides = {m.overrides!r}: {message}") from None


def _check_sizes(typed: sections.Sections) -> None:
  """The sizes whose upper bound another field sets (memory is `check_memory`'s)."""
  r = typed.rollout
  # A decode call samples at most one turn's tokens; its outputs are
  # [slots, decode_steps] whatever the budget.
  for field, steps in (
    ("rollout.decode_steps", r.decode_steps),
    ("eval.decode_steps", typed.eval.decode_steps),
  ):
    if steps > r.max_turn_tokens:
      _fail(field, steps, f"an integer in [1, {r.max_turn_tokens}] (rollout.max_turn_tokens)")
  # Every built-in's turn limit (its default if unset) and a user factory's
  # if given: every turn takes at least one of rollout.max_len's tokens.
  turns = {**registry.kwargs_defaults(typed.env.name), **typed.env.kwargs}.get("max_turns")
  if turns is not None and not (sections.is_int(turns) and 1 <= turns <= r.max_len):
    _fail(
      "env.kwargs.max_turns",
      turns,
      f"an integer in [1, {r.max_len}] (rollout.max_len: a turn takes at least one token)",
    )


def _check_eval_sets(typed: sections.Sections) -> None:
  """Each of eval.sets names a registered environment (or a file, or the
  held-out split), and a set of chat prompts meets a chat format."""
  for name, spec in sections.parse_eval_sets(typed.eval.sets):
    if not spec.endswith(sections.EVAL_SET_FILES) and spec != "heldout":
      try:
        registry.check_env_name(spec)
      except ValueError as e:
        _fail("eval.sets", typed.eval.sets, f"set {name!r}: {e}")
    env_name = (
      ("math_tool" if typed.env.name not in ("dataset", "math_tool") else typed.env.name)
      if spec.endswith(sections.EVAL_SET_FILES)
      else spec
    )
    builtin = registry.ENVIRONMENTS.get(env_name)
    if builtin is not None and builtin.chat_prompts and typed.env.chat_format == "raw":
      _fail(
        "eval.sets",
        typed.eval.sets,
        f"sets whose prompts are chat messages (set "
        f"{name!r}: {env_name}) need env.chat_format 'qwen3', 'qwen3_5' or 'plain', not 'raw'",
      )


def _check_routing_replay(typed: sections.Sections, arch) -> None:
  """rl.routing_replay needs MoE layers to replay (`arch`: `_check_model`'s)."""
  if not typed.rl.routing_replay:
    return
  m = typed.model
  if arch.num_moe_layers < 1:
    _fail(
      "rl.routing_replay",
      True,
      f"False for a model without MoE layers ("
      f"{m.hf_dir or m.preset!r}: {arch.num_layers} layers, none of them MoE)",
    )


def _check_update_precision(typed: sections.Sections, arch) -> None:
  """Every stage that trains can move its params: its learning rate, down to
  its schedule's floor, survives rounding in the params' dtype (precision.py;
  `arch`: `_check_model`'s ModelConfig)."""
  param_dtype = arch.param_dtype
  rl, stages = typed.rl, {}
  if typed.sft.steps:
    stages["sft.lr"] = (typed.sft.lr, precision.schedule_floor(typed.sft.lr, decays=True))
  if rl.steps:
    stages["rl.actor_lr"] = (rl.actor_lr, precision.schedule_floor(rl.actor_lr, decays=True))
  if rl.steps or typed.value_pretrain.steps:
    stages["rl.critic_lr"] = (rl.critic_lr, precision.schedule_floor(rl.critic_lr, decays=False))
  message = precision.check_updates_kept(param_dtype, stages)
  if message:
    raise ConfigError(message)


def _process_count() -> int:
  import jax

  return jax.process_count()


def _mesh_fits(axes: dict, devices: int, *, first_of: bool = False) -> bool:
  """A mesh of `axes` (one size may be -1: the rest) spans `devices`, or with
  `first_of` the first of them (factories.engine_mesh)."""
  sizes = list(axes.values())
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    return devices % known == 0
  return known <= devices if first_of else known == devices


def _check_mesh(mesh: dict, num_devices: int) -> None:
  """The mesh (well formed: sections.Sharding) spans the devices present."""
  if not _mesh_fits(mesh, num_devices):
    _fail("sharding.mesh", mesh, f"a mesh over the {num_devices} devices present")


def _check_engine_mesh(text: str, host_devices: int) -> None:
  """rollout.mesh fits one host's devices (factories.engine_mesh takes the
  first of them; a -1 size takes the rest)."""
  axes = sections.parse_mesh(text)
  if not _mesh_fits(axes, host_devices, first_of=True):
    _fail(
      "rollout.mesh",
      text,
      f"a mesh over at most the {host_devices} devices of one "
      "host" + (" (a -1 size must leave a whole number)" if -1 in axes.values() else ""),
    )


# Host bytes a queued or stored trajectory holds per token (trajectory.canonicalize):
# tokens and policy_version int32, rollout_logprobs and rewards float32, action_mask bool.
TRAJECTORY_BYTES_PER_TOKEN = 17


def check_memory(typed: sections.Sections, model_cfg, abstract_state) -> None:
  """Refuses a model or a size that the memory present cannot hold, from
  shapes alone: `run.build` calls it between the programs' shapes and the
  first allocation, so nothing has been allocated or written.

  Each check is a floor of what the run holds at once, so a run that fits
  is never refused: the train state (`abstract_state`, the params and Adam
  moments of policy and critic, as each device holds its shards), and
  beside it in turn the rollout engine's KV cache (rollout.slots x
  rollout.max_len, or rollout.kv_pages), the evaluation engine's (eval.slots),
  one residual stream [batch, largest data.buckets entry, d_model] of a train
  step (rl.batch_size, sft.batch_size), and on the host a full ingestion
  queue or value pretraining's store of rollout.max_len trajectories. On CPU
  every device is the host's memory (its cgroup limit in a container); on
  an accelerator each device has its `bytes_limit`, and a cache or batch
  counts as if spread evenly over the devices. Unknown memory refuses nothing.
  """
  import collections

  import jax
  import numpy as np

  from sao_jax.models import sharding as shd
  from sao_jax.rollout import layout

  nbytes = lambda tree: sum(
    math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
  )
  state = collections.Counter()  # device -> bytes of the train state's shards on it
  for x in jax.tree.leaves(abstract_state):
    for device in x.sharding.addressable_devices:
      state[device] += shd.shard_bytes(x)
  device_pool, host_pool = memory_pools(state)
  m, r, c = typed.model, typed.rollout, typed.rl
  capacity, used, _, where = device_pool
  if capacity is not None and used > capacity:
    field, value = (
      ("model.overrides", m.overrides)
      if m.overrides
      else ("model.hf_dir", m.hf_dir)
      if m.hf_dir
      else ("model.preset", m.preset)
    )
    _fail(
      field,
      value,
      f"a model whose train state fits: the params and Adam moments of "
      f"policy and critic take {_bytes(used)}, {where} is {_bytes(capacity)}",
    )

  def at_most(pool, field: str, value: int, unit: int, what: str) -> None:
    capacity, used, spread, where = pool
    if capacity is None or not value:
      return
    most = max(capacity - used, 0) * spread // unit
    if value > most:
      _fail(
        field,
        value,
        f"<= {most} here: {what} takes {_bytes(unit)} each, and {where} "
        f"({_bytes(capacity)}) holds {most} beside the train state ({_bytes(used)})",
      )

  per_slot = layout.cache_bytes_per_device(model_cfg, 1, r.max_len)
  in_process = bool(c.steps) and _source_spec(c.mode).in_process
  paged_pool = r.kv_cache == "paged" and r.kv_pages
  if in_process or typed.value_pretrain.steps:
    if paged_pool:
      at_most(
        device_pool,
        "rollout.kv_pages",
        r.kv_pages,
        nbytes(layout.abstract_pool(model_cfg, 1, r.page_size)),
        "a KV-cache page",
      )
    else:
      at_most(
        device_pool,
        "rollout.slots",
        r.slots,
        per_slot,
        f"a slot's KV cache (rollout.max_len {r.max_len} positions)",
      )
  if not paged_pool:
    at_most(
      device_pool,
      "eval.slots",
      typed.eval.slots,
      per_slot,
      f"a slot's KV cache (rollout.max_len {r.max_len} positions)",
    )
  row = max(typed.data.buckets) * model_cfg.d_model * np.dtype(model_cfg.dtype).itemsize
  what = f"a row's residual stream ({max(typed.data.buckets)} tokens x d_model)"
  if c.steps or typed.value_pretrain.steps:
    at_most(device_pool, "rl.batch_size", c.batch_size, row, what)
  if typed.sft.steps and not typed.sft.init_from_hf:
    at_most(device_pool, "sft.batch_size", typed.sft.batch_size, row, what)
  trajectory = r.max_len * TRAJECTORY_BYTES_PER_TOKEN
  what = f"a trajectory of up to rollout.max_len ({r.max_len}) tokens"
  if in_process:
    at_most(host_pool, "rollout.queue_size", r.queue_size, trajectory, what)
  if typed.value_pretrain.steps:
    at_most(
      host_pool,
      "value_pretrain.num_trajectories",
      typed.value_pretrain.num_trajectories,
      trajectory,
      what,
    )


def memory_pools(state: dict) -> tuple[tuple, tuple]:
  """(device pool, host pool), each (capacity or None, bytes the train state
  takes of it, devices a cache or batch spreads over, its name), for
  `state`: device -> bytes of the train state on it. CPU devices share the
  host's memory; an accelerator's is its `bytes_limit`, the tightest device's."""
  host = host_memory_bytes()
  if all(d.platform == "cpu" for d in state):
    pool = (host, sum(state.values()), 1, "this host's memory")
    return pool, pool

  def limit(device):
    try:
      return (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001  # a backend without the statistics
      return None

  limits = [limit(d) for d in state]
  free = None if None in limits else min(lim - state[d] for d, lim in zip(state, limits))
  device_pool = (
    None if free is None else free + max(state.values()),
    max(state.values()),
    len(state),
    f"each of the {len(state)} devices' memory",
  )
  return device_pool, (host, 0, 1, "this host's memory")


def host_memory_bytes() -> int | None:
  """This host's physical memory, or its cgroup's limit where lower (a
  container); None where neither can be read."""
  sizes = []
  try:
    sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
  except (ValueError, OSError, AttributeError):
    pass
  for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      with open(path, encoding="ascii") as f:
        text = f.read().strip()
    except OSError:
      continue
    if text.isdigit():  # "max": no limit
      sizes.append(int(text))
  return min(sizes, default=None)


def _bytes(n: float) -> str:
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.3g} {unit}"
  return f"{int(n)} B"


def check_workdir(workdir: str, min_free_gb: float) -> None:
  """Creates `workdir` and fails clearly if it is unwritable or nearly full.

  Run before training, so a run never dies at its first checkpoint hours
  in. A probe file is written (flushed to disk) and removed: a POSIX path,
  or an object-store URL such as gs://bucket/run (`files.check_writable`:
  a missing bucket, missing credentials and an unreachable store are each
  one line). Free space is checked on POSIX only.
  """
  try:
    free_gb = files.check_writable(workdir)
  except files.StorageError as e:
    raise ConfigError(f"workdir {workdir!r}: {e}") from None
  if free_gb is not None and free_gb < min_free_gb:
    raise ConfigError(
      f"workdir {workdir!r} has {free_gb:.3f} GiB free, less than "
      f"checkpoint.min_free_gb = {min_free_gb}"
    )


def run(main: Callable) -> None:
  """`absl.app.run(main)` with one-line errors for bad configs and clean stops.

  Flag parsing of `--config.rl.stepz=3` or a config file that sets an
  unknown field would otherwise end in a long traceback.
  """
  try:
    app.run(main)
  except (ConfigError, StopTraining) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2 if isinstance(e, ConfigError) else 1)
  except (AttributeError, KeyError, TypeError) as e:
    # Raised by ml_collections while parsing --config(.field) flags.
    if not _from_config_parsing(e):
      raise
    message = str(e).strip("'\"").replace("\\n", " ").replace("\n", " ").replace("\\'", "'")
    print(f"error: bad config: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _from_config_parsing(e: BaseException) -> bool:
  tb = e.__traceback__
  while tb is not None:
    if "ml_collections" in tb.tb_frame.f_code.co_filename and "config_flags" in (
      tb.tb_frame.f_code.co_filename
    ):
      return True
    tb = tb.tb_next
  return False
