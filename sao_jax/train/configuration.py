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
import math
import sys
from typing import Callable

from absl import app

from sao_jax.data import files
from sao_jax.models import precision
from sao_jax.config import sections
from sao_jax.envs import registry
from sao_jax.train import sources
from sao_jax.train.stopping import StopTraining  # noqa: F401  (re-exported for launch/)
from sao_jax.algo.advantages import ESTIMATORS


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


def validate(config, num_devices: int | None = None, num_processes: int | None = None,
             host_devices: int | None = None) -> None:
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
  spec = _source_spec(typed.rl.mode)
  _check_eval_sets(typed)
  _check_rollout(typed, spec)
  if num_devices is None:
    import jax  # pylint: disable=g-import-not-at-top
    num_devices = jax.device_count()
  _check_mesh(typed.sharding.mesh, num_devices)
  processes = _process_count() if num_processes is None else num_processes
  if typed.rollout.mesh:
    # An engine spans devices of its own host: fail now, not after SFT.
    _check_engine_mesh(typed.rollout.mesh,
                       host_devices or max(num_devices // max(processes, 1), 1))
  # With several processes every host must train on the same batches, and
  # an in-process rollout's completion order differs from host to host.
  c = typed.rl
  if processes > 1 and c.steps > 0 and spec.in_process:
    raise ConfigError(f"rl.mode = {c.mode!r} with {processes} processes: the in-process "
                      "rollout cannot feed a multi-host trainer; run rollout on its own "
                      "slices (rl.mode = 'fleet'), or rl.steps = 0")
  if typed.model.vocab_subset and typed.sft.init_from_hf:
    _fail("model.vocab_subset", typed.model.vocab_subset,
          "\"\" with sft.init_from_hf: an imported checkpoint keeps its full head")
  _check_update_precision(typed)
  _check_weight_path(typed.fleet)
  _check_routing_replay(typed)
  if typed.faults.sigkill_after_rl_step > c.steps:
    # It would never fire: the run would end normally, not be killed.
    _fail("faults.sigkill_after_rl_step", typed.faults.sigkill_after_rl_step,
          f"<= rl.steps ({c.steps})")


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
    _fail("rollout.samples_per_prompt", r.samples_per_prompt,
          f"1 with rl.mode = {c.mode!r} (single-rollout arms)")
  if r.samples_per_prompt < estimator.min_group:
    _fail("rollout.samples_per_prompt", r.samples_per_prompt,
          f">= {estimator.min_group} for rl.advantage = {c.advantage!r}")
  if c.batch_size % r.samples_per_prompt:
    _fail("rl.batch_size", c.batch_size,
          f"a multiple of rollout.samples_per_prompt ({r.samples_per_prompt}): "
          "batches hold whole groups")
  # The train step's log-probs apply the temperature only; truncated sampling
  # would bias every DIS / PPO ratio (an exactly on-policy step would show
  # ratios far from 1 and mask most tokens), so it is refused, not ignored.
  if r.top_k != 0:
    _fail("rollout.top_k", r.top_k, "0: the train step's log-probs do not apply top-k, "
          "so the importance ratios would be biased")
  if r.top_p != 1.0:
    _fail("rollout.top_p", r.top_p, "1.0: the train step's log-probs do not apply top-p, "
          "so the importance ratios would be biased")
  if r.env_timeout is not None and e.tool_seconds_per_turn >= r.env_timeout:
    # The tools would run into the step's timeout and the episode end as env_timeout.
    _fail("env.tool_seconds_per_turn", e.tool_seconds_per_turn,
          f"< rollout.env_timeout ({r.env_timeout:g}): a turn's tools must finish before "
          "its environment step times out")
  if r.max_turn_tokens >= r.max_len:
    _fail("rollout.max_turn_tokens", r.max_turn_tokens, f"< rollout.max_len ({r.max_len})")
  buckets = typed.data.buckets
  if max(buckets) < r.max_len:
    raise ConfigError(f"data.buckets = {buckets}: the largest data.buckets entry must be "
                      f">= rollout.max_len ({r.max_len})")


def _check_eval_sets(typed: sections.Sections) -> None:
  """Each of eval.sets names a registered environment (or a file, or the
  held-out split), and a set of chat prompts meets a chat format."""
  for name, spec in sections.parse_eval_sets(typed.eval.sets):
    if not spec.endswith(sections.EVAL_SET_FILES) and spec != "heldout":
      try:
        registry.check_env_name(spec)
      except ValueError as e:
        _fail("eval.sets", typed.eval.sets, f"set {name!r}: {e}")
    env_name = ("math_tool" if typed.env.name not in ("dataset", "math_tool") else
                typed.env.name) if spec.endswith(sections.EVAL_SET_FILES) else spec
    builtin = registry.ENVIRONMENTS.get(env_name)
    if builtin is not None and builtin.chat_prompts and typed.env.chat_format == "raw":
      _fail("eval.sets", typed.eval.sets, f"sets whose prompts are chat messages (set "
            f"{name!r}: {env_name}) need env.chat_format 'qwen3' or 'plain', not 'raw'")


def _check_routing_replay(typed: sections.Sections) -> None:
  """rl.routing_replay needs MoE layers to replay."""
  if not typed.rl.routing_replay:
    return
  from sao_jax.models import config as model_config  # pylint: disable=g-import-not-at-top
  m = typed.model
  arch = model_config.PRESETS[m.preset]()
  layers = m.overrides.get("num_layers", arch.num_layers)
  dense = m.overrides.get("dense_layers", arch.dense_layers)
  if layers - len(tuple(dense)) < 1:
    _fail("rl.routing_replay", True, f"False for a model without MoE layers (model.preset "
          f"{m.preset!r}: {layers} layers, dense_layers {tuple(dense)})")


def _check_update_precision(typed: sections.Sections) -> None:
  """Every stage that trains can move its params: its learning rate, down to
  its schedule's floor, survives rounding in the params' dtype (precision.py)."""
  from sao_jax.models import config as model_config  # pylint: disable=g-import-not-at-top
  m = typed.model
  param_dtype = m.overrides.get("param_dtype", model_config.PRESETS[m.preset]().param_dtype)
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
  import jax  # pylint: disable=g-import-not-at-top
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
    _fail("rollout.mesh", text, f"a mesh over at most the {host_devices} devices of one "
          "host" + (" (a -1 size must leave a whole number)" if -1 in axes.values() else ""))


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
    raise ConfigError(f"workdir {workdir!r} has {free_gb:.3f} GiB free, less than "
                      f"checkpoint.min_free_gb = {min_free_gb}")


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
        tb.tb_frame.f_code.co_filename):
      return True
    tb = tb.tb_next
  return False


def _check_weight_path(f: sections.Fleet) -> None:
  """The direct weight path's server address: an IP literal (the transfer
  library takes "ip:port"), so a host name fails here, not at the first publish."""
  if f.weights_path == "direct" and f.transfer_host:
    import ipaddress  # pylint: disable=g-import-not-at-top
    try:
      ipaddress.ip_address(f.transfer_host)
    except ValueError:
      _fail("fleet.transfer_host", f.transfer_host,
            "an IP address (the hosts' internal interface) or \"\" with "
            "fleet.weights_path = 'direct'")
