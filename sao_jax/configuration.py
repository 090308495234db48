"""Config checks: every bad setting fails before anything is written.

`validate(config)` is called first thing by the trainer and by every launch
script. It raises `ConfigError` with one line that names the field, the
value and what is allowed, e.g.

    rl.eps_low = 2.0: must be in (0, 1)

Each field's own check, and the rules between fields of one section, live
with the field in its typed section (sao_jax/sections.py); what is here is
the model, the environment and the mesh (checked against registries and
devices), and the rules that join sections.

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
import os
import shutil
import sys
import uuid
from typing import Callable

from absl import app

from sao_jax import sections
from sao_jax.advantages import ESTIMATORS


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


def validate_distributed(dist) -> None:
  """Checks the `distributed` section; run before jax.distributed.initialize."""
  sections.Distributed.from_config(dist)


def validate(config, num_devices: int | None = None, num_processes: int | None = None) -> None:
  """Raises ConfigError on the first setting that cannot work.

  `num_devices` (default: all JAX devices of every process) checks that the
  mesh fits the devices, so a bad mesh fails before the workdir exists;
  `num_processes` (default: the processes JAX runs as) refuses what a
  multi-host run cannot do.
  """
  from sao_jax.models import config as model_config  # pylint: disable=g-import-not-at-top

  if config.model.preset not in model_config.PRESETS:
    _fail("model.preset", config.model.preset, f"one of {sorted(model_config.PRESETS)}")
  compute_dtype = config.model.get("compute_dtype", "")
  dtype_names = [d.name for d in model_config.FLOAT_DTYPES]
  if compute_dtype and compute_dtype not in dtype_names:
    _fail("model.compute_dtype", compute_dtype, f"'' or one of {dtype_names}")
  for field, check in (("seed", sections.integer()), ("log_every", sections.integer(1))):
    if field not in config:
      raise ConfigError(f"{field}: missing; configs derive from configs/common.py, "
                        "which defines it")
    if not check.ok(config[field]):
      _fail(field, config[field], check.describe())
  # Every field of every typed section, and the rules within a section.
  typed = sections.load(config)
  _check_env(config.env)
  # The rules that join sections.
  c, r = typed.rl, typed.rollout
  estimator = ESTIMATORS[c.advantage]
  if c.mode == "fleet" and r.samples_per_prompt != 1:
    # The fleet's checkpointed cursor is per trajectory; a GRPO group split
    # across a trainer restart would be half trained.
    _fail("rollout.samples_per_prompt", r.samples_per_prompt,
          "1 with rl.mode = 'fleet' (single-rollout arms)")
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
  if r.max_turn_tokens >= r.max_len:
    _fail("rollout.max_turn_tokens", r.max_turn_tokens, f"< rollout.max_len ({r.max_len})")
  buckets = typed.data.buckets
  if max(buckets) < r.max_len:
    raise ConfigError(f"data.buckets = {buckets}: the largest data.buckets entry must be "
                      f">= rollout.max_len ({r.max_len})")
  _check_mesh(dict(config.sharding.mesh), num_devices)
  # With several processes every host must train on the same batches, and
  # the in-process rollout's completion order differs from host to host.
  processes = _process_count() if num_processes is None else num_processes
  if processes > 1 and c.steps > 0 and c.mode in ("async", "sync"):
    raise ConfigError(f"rl.mode = {c.mode!r} with {processes} processes: the in-process "
                      "rollout cannot feed a multi-host trainer; run rollout on its own "
                      "slices (rl.mode = 'fleet'), or rl.steps = 0")
  if typed.faults.sigkill_after_rl_step > c.steps:
    # It would never fire: the run would end normally, not be killed.
    _fail("faults.sigkill_after_rl_step", typed.faults.sigkill_after_rl_step,
          f"<= rl.steps ({c.steps})")


def _check_env(env) -> None:
  """The environment, tokenizer, chat format and reward names resolve.

  An import string is imported here (not called), so a typo fails before
  the workdir exists; built-in environments' kwargs are checked against
  their config dataclass.
  """
  from sao_jax.envs import chat, registry, tokenizer  # pylint: disable=g-import-not-at-top
  try:
    registry.check_env_name(env.name)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if env.chat_format not in registry.CHAT_FORMATS:
    _fail("env.chat_format", env.chat_format, f"one of {registry.CHAT_FORMATS}")
  if not registry.is_import_string(env.name):
    spec = registry.ENVIRONMENTS[env.name]
    try:
      kwargs = registry.builtin_kwargs(spec, dict(env.kwargs))
    except (TypeError, ValueError) as e:
      raise ConfigError(f"env.kwargs = {dict(env.kwargs)!r}: {e}") from None
    if spec.chat_prompts and env.chat_format == "raw":  # the toys' format takes text
      _fail("env.chat_format", env.chat_format,
            f"'qwen3' or 'plain' for env.name = {env.name!r} (its prompts are chat messages)")
    if getattr(kwargs, "tools", ()) and not chat.FORMATS[env.chat_format].renders_tools:
      _fail("env.chat_format", env.chat_format,
            f"a format that renders tools ('qwen3') for env.kwargs.tools = "
            f"{tuple(kwargs.tools)}")
  if env.reward:
    try:
      fn = registry.resolve(env.reward, "env.reward")
    except ValueError as e:
      raise ConfigError(str(e)) from None
    if not callable(fn):
      _fail("env.reward", env.reward, "an import string of a callable")
  if not env.tokenizer_path and env.tokenizer not in tokenizer.TOKENIZERS:
    _fail("env.tokenizer", env.tokenizer, f"one of {sorted(tokenizer.TOKENIZERS)}")
  if not isinstance(env.thinking, bool):
    _fail("env.thinking", env.thinking, "True or False")
  if not (sections.is_real(env.tool_latency_s) and env.tool_latency_s >= 0):
    _fail("env.tool_latency_s", env.tool_latency_s, "a finite number of seconds >= 0")
  if not (sections.is_int(env.max_tool_output_tokens) and env.max_tool_output_tokens >= 0):
    _fail("env.max_tool_output_tokens", env.max_tool_output_tokens, "an integer >= 0 (0: no cap)")


def _process_count() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_count()


def _check_mesh(mesh: dict, num_devices: int | None) -> None:
  sizes = list(mesh.values())
  if not mesh or not all(sections.is_int(s) and (s >= 1 or s == -1) for s in sizes):
    _fail("sharding.mesh", mesh, "a dict of axis name -> size >= 1 (one size may be -1)")
  if sizes.count(-1) > 1:
    _fail("sharding.mesh", mesh, "a dict with at most one -1 size")
  if num_devices is None:
    import jax  # pylint: disable=g-import-not-at-top
    num_devices = jax.device_count()
  known = math.prod(s for s in sizes if s != -1)
  if (-1 in sizes and num_devices % known) or (-1 not in sizes and known != num_devices):
    _fail("sharding.mesh", mesh, f"a mesh over the {num_devices} devices present")


def check_workdir(workdir: str, min_free_gb: float) -> None:
  """Creates `workdir` and fails clearly if it is unwritable or nearly full.

  Run before training, so a run never dies at its first checkpoint hours
  in. A probe file is written, flushed to disk and removed. A URL
  (gs://...) is refused: metrics, the fleet and the markers use POSIX
  files, and os.makedirs would make a local folder named "gs:".
  """
  if "://" in workdir:
    raise ConfigError(f"workdir {workdir!r}: a URL; give a POSIX path every host mounts "
                      "(e.g. a gcsfuse mount of the bucket)")
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".write_probe_{uuid.uuid4().hex}")
    with open(probe, "wb") as f:
      f.write(b"\0" * 4096)
      f.flush()
      os.fsync(f.fileno())
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f"workdir {workdir!r} is not writable: {e.strerror or e}") from None
  free_gb = shutil.disk_usage(workdir).free / 2**30
  if free_gb < min_free_gb:
    raise ConfigError(f"workdir {workdir!r} has {free_gb:.3f} GiB free, less than "
                      f"checkpoint.min_free_gb = {min_free_gb}")


class StopTraining(RuntimeError):
  """A run that stopped itself cleanly (its checkpoints are intact)."""


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
