"""Typed config sections: each field's default, meaning and check, in one place.

A run's config is an `ml_collections.ConfigDict` (so that launch flags such
as `--config.rl.steps=3` reach it), built by configs/common.py from the
section records here: every field is declared once, as

    slots: int = knob(16, "Concurrent decode slots of the engine.", integer(1))

with its default, its documentation and its check. A record is frozen and
checks itself on construction (each field, then the rules between fields
of the same section), so `Rollout(slots=0)` fails with

    ConfigError: rollout.slots = 0: must be an integer >= 1

and the objects that use a section take it whole: `PolicyEngine(cfg,
params, rollout)`, `RolloutDriver(..., rollout=rollout)`. `load(config)`
turns a ConfigDict into its records (configuration.validate does this
first); rules that join fields of different sections stay in
`configuration.validate`.

Fields whose allowed values are a registry that users extend look the
registry up when checked, so a registered extension is accepted without
touching this file: here for the registries of the layers below this one
(rl.advantage, rl.policy_loss); a registry above it (env.name,
env.chat_format, env.tokenizer, rl.mode, fleet.weights_path) is checked by
its own layer, which `configuration.validate` calls (docs/DESIGN.md section
6: a lower layer never imports a higher one).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Callable, ClassVar

import ml_collections

from sao_jax.config import import_strings

# The engine's KV caches (sao_jax/rollout/engine.py) and the driver's
# weight-swap policies (sao_jax/rollout/driver.py): fixed enumerations,
# defined here because they are the allowed values of config fields.
KV_CACHES = ("dense", "paged")
SWAP_POLICIES = ("recompute", "keep", "drain")


class ConfigError(ValueError):
  """A setting that cannot work; the message is one line naming the field."""


def fail(field: str, value, allowed: str):
  raise ConfigError(f"{field} = {value!r}: must be {allowed}")


# ------------------------------------------------------------------ checks
@dataclasses.dataclass(frozen=True)
class Check:
  """A predicate on a field's value and, for the error, what is allowed."""

  ok: Callable[[Any], bool]
  allowed: str | Callable[[], str]

  def describe(self) -> str:
    return self.allowed() if callable(self.allowed) else self.allowed


def is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def is_real(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def integer(lo: int | None = None, hi: int | None = None, note: str = "") -> Check:
  """An integer in [lo, hi] (either end open when None)."""
  if lo is not None and hi is not None:
    allowed = f"an integer in [{lo}, {hi}]"
  elif lo is not None:
    allowed = f"an integer >= {lo}"
  else:
    allowed = "an integer"
  return Check(
    lambda v: is_int(v) and (lo is None or v >= lo) and (hi is None or v <= hi), allowed + note
  )


def real(
  lo: float | None = None, *, above: bool = False, unit: str = "a finite number", note: str = ""
) -> Check:
  """A finite number >= lo (> lo with `above`)."""
  if lo is None:
    return Check(is_real, unit + note)
  return Check(
    lambda v: is_real(v) and (v > lo if above else v >= lo),
    f"{unit} {'>' if above else '>='} {lo:g}{note}",
  )


def unit_interval(open_low: bool = False, open_high: bool = False) -> Check:
  """A number in [0, 1], either end open."""
  return Check(
    lambda v: is_real(v) and (v > 0 if open_low else v >= 0) and (v < 1 if open_high else v <= 1),
    f"in {'(' if open_low else '['}0, 1{')' if open_high else ']'}",
  )


def one_of(values: tuple | Callable[[], Any]) -> Check:
  """One of `values`, or of the keys of a registry that `values()` returns
  (looked up when checked, so registered extensions count)."""
  get = values if callable(values) else (lambda: values)
  show = lambda: f"one of {sorted(get())}" if isinstance(get(), dict) else f"one of {tuple(get())}"
  return Check(lambda v: v in get(), show)


def optional(check: Check, none_means: str = "") -> Check:
  return Check(
    lambda v: v is None or check.ok(v), lambda: f"None{none_means} or {check.describe()}"
  )


BOOL = Check(lambda v: isinstance(v, bool), "True or False")
STRING = Check(lambda v: isinstance(v, str), "a string")
# A name in a registry of a layer above this one (an environment, a chat
# format, an rl.mode): checked here as a name, looked up by that layer's own
# check (train/configuration.validate calls them all).
REGISTERED_NAME = Check(lambda v: isinstance(v, str) and bool(v), "a non-empty string")


# The mesh axes the project's rules name (sao_jax/models/sharding.py, rollout/layout.py).
MESH_AXES = ("data", "fsdp", "expert", "tensor", "context")


def _is_regex_tuple(v) -> bool:
  if not isinstance(v, tuple) or not all(isinstance(x, str) and x for x in v):
    return False
  try:
    for x in v:
      re.compile(x)
  except re.error:
    return False
  return True


def parse_mesh(text: str) -> dict[str, int]:
  """A mesh written on one line: "expert:2,tensor:2" -> {"expert": 2, "tensor": 2}.

  Axis names are unique and among MESH_AXES (a misspelt "tensr" would
  silently become a batch axis of the engine); sizes are integers >= 1, or
  -1 for one axis (the devices left over). Raises ConfigError saying what
  is wrong (callers prefix the field).
  """
  axes: dict[str, int] = {}
  for part in text.split(","):
    name, sep, size = (x.strip() for x in part.partition(":"))
    if not sep or not name:
      raise ConfigError("write AXIS:SIZE,... (e.g. expert:2,tensor:2)")
    if name not in MESH_AXES:
      raise ConfigError(f"axis {name!r} is not one of {MESH_AXES}")
    if name in axes:
      raise ConfigError(f"axis {name!r} appears twice")
    try:
      axes[name] = int(size)
    except ValueError:
      raise ConfigError(f"{size!r} is not an integer") from None
    if axes[name] < 1 and axes[name] != -1:
      raise ConfigError(
        f"axis {name!r} has size {axes[name]} (>= 1, or -1 for the devices left over)"
      )
  if list(axes.values()).count(-1) > 1:
    raise ConfigError("at most one axis may be -1")
  return axes


def increasing(lo: int) -> Check:
  """A non-empty increasing tuple of integers >= lo."""
  return Check(
    lambda b: (
      isinstance(b, tuple)
      and bool(b)
      and all(is_int(x) and x >= lo for x in b)
      and list(b) == sorted(set(b))
    ),
    f"a non-empty increasing tuple of integers >= {lo}",
  )


def knob(default, doc: str, check: Check | None = None, *, placeholder: type | None = None):
  """A section field: its default, what it means, and its check.

  `placeholder`: the type a None default takes in the ConfigDict (so that
  `--config.rl.critic_lam=1.0` parses as that type).
  """
  metadata = {"doc": doc, "check": check, "placeholder": placeholder}
  if isinstance(default, dict):  # a fresh copy for each record; not part of its hash
    return dataclasses.field(default_factory=lambda: dict(default), hash=False, metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


# ----------------------------------------------------------------- sections
@dataclasses.dataclass(frozen=True)
class Section:
  """A frozen record of one config section that checks itself on construction."""

  NAME: ClassVar[str] = ""

  def __post_init__(self):
    for f in dataclasses.fields(self):
      check = f.metadata.get("check")
      value = getattr(self, f.name)
      if check is not None and not check.ok(value):
        fail(self.field_name(f.name), value, check.describe())
    self.check_together()

  def check_together(self) -> None:
    """Rules between fields of this section (override); cross-section rules
    live in configuration.validate."""

  @classmethod
  def field_name(cls, field: str) -> str:
    """The dotted name of `field` in a config ("rl.steps"; "seed" at the top)."""
    return f"{cls.NAME}.{field}" if cls.NAME else field

  def replace(self, **changes) -> "Section":
    """A copy with `changes`, checked again."""
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_config(cls, node) -> "Section":
    """The record of a ConfigDict section (every field must be present)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
      try:
        value = node[f.name]
      except (KeyError, AttributeError):
        raise ConfigError(
          f"{cls.field_name(f.name)}: missing; configs derive from "
          "configs/common.py, which defines it"
        ) from None
      kwargs[f.name] = _plain(value)
    return cls(**kwargs)

  @classmethod
  def of(cls, node) -> "Section":
    """This section's record from a record (returned as is), a ConfigDict or a
    dict that may leave fields out (they take the record's defaults): for
    callers that hold one section, not a whole config (tools, tests)."""
    if isinstance(node, cls):
      return node
    items = node.items() if hasattr(node, "items") else dict(node).items()
    return cls(**{k: _plain(v) for k, v in items})

  @classmethod
  def defaults(cls) -> ml_collections.ConfigDict:
    """The section's defaults as a ConfigDict (what configs/common.py holds)."""
    c = ml_collections.ConfigDict()
    for f in dataclasses.fields(cls):
      placeholder = f.metadata.get("placeholder")
      default = f.default_factory() if f.default is dataclasses.MISSING else f.default
      if default is None and placeholder is not None:
        c[f.name] = ml_collections.config_dict.placeholder(placeholder)
      else:
        c[f.name] = default
    return c


def _plain(value):
  if isinstance(value, ml_collections.ConfigDict):
    return value.to_dict()
  if isinstance(value, list):
    return tuple(value)
  return value


def _model_presets():
  from sao_jax.models import config as model_config

  return model_config.PRESETS


def _compute_dtypes():
  from sao_jax.models import config as model_config

  return ("",) + tuple(d.name for d in model_config.FLOAT_DTYPES)


DICT = Check(
  lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v), "a dict with string keys"
)

# Logical axis -> mesh axis rules (sao_jax/models/sharding.py): data parallel on a
# single host, the default; the pod configs shard further.
DATA_PARALLEL_RULES = (
  ("batch", "data"),
  ("length", None),
  ("embed", None),
  ("vocab", None),
  ("heads", None),
  ("kv_heads", None),
  ("head_dim", None),
  ("mlp", None),
  ("expert", None),
  ("layers", None),
)


def _is_mesh_dict(mesh) -> bool:
  sizes = list(mesh.values()) if isinstance(mesh, dict) else []
  return (
    bool(sizes)
    and all(isinstance(k, str) for k in mesh)
    and all(is_int(x) and (x >= 1 or x == -1) for x in sizes)
    and sizes.count(-1) <= 1
  )


def _is_rules(rules) -> bool:
  def axes_ok(axes):
    return (
      axes is None
      or isinstance(axes, str)
      or (isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes))
    )

  return (
    isinstance(rules, tuple)
    and bool(rules)
    and all(
      isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str) and axes_ok(r[1])
      for r in rules
    )
  )


@dataclasses.dataclass(frozen=True)
class Model(Section):
  """The policy and critic architecture (sao_jax/models/config.py); the
  factories build its ModelConfig (`factories.build_model_config`)."""

  NAME: ClassVar[str] = "model"
  preset: str = knob(
    "tiny",
    "A preset of sao_jax/models/config.py: the CPU toys tiny, "
    "small (Qwen3-MoE) and tiny_dense (Qwen3); the releases' shapes "
    "qwen3_0_6b, qwen3_1_7b, qwen3_8b, qwen3_30b_a3b. With model.hf_dir it "
    "only says how the model runs.",
    one_of(_model_presets),
  )
  hf_dir: str = knob(
    "",
    "A Hugging Face model directory (config.json and *.safetensors: what "
    "save_pretrained or huggingface_hub.snapshot_download writes) of a supported family "
    "(sao_jax/models/families.py: qwen3, qwen3_moe). The architecture comes from its "
    "config.json and the initial policy weights from its safetensors, which SFT then "
    "trains; model.preset only says how the model runs (dtypes, scan, remat, kernels) "
    'and model.overrides apply last. "": the preset\'s architecture, randomly '
    "initialised.",
    STRING,
  )
  overrides: dict = knob(
    {}, 'ModelConfig field overrides of the preset, e.g. {"num_layers": 3}.', DICT
  )
  vocab_from_tokenizer: bool = knob(
    True, "Size the tiny / small presets' vocabulary to the tokenizer's.", BOOL
  )
  compute_dtype: str = knob(
    "",
    'Activation / matmul dtype: "float32", or "bfloat16" for bf16 compute with '
    "fp32 master weights (params and optimizer state stay in the preset's param_dtype). "
    '"": the preset\'s own dtype.',
    one_of(_compute_dtypes),
  )
  vocab_subset: str = knob(
    "",
    '"env": the embedding and LM head cover only the token ids the environment\'s '
    "prompts and demonstrations use, plus the tokenizer's added tokens and every printable "
    "ASCII character (sao_jax/envs/head_vocab.py), for a model trained from scratch: ids "
    "stay the tokenizer's outside the model, the policy's distribution is over the subset. "
    "Needs an environment with a finite row list (dataset, math_tool); refused with "
    'sft.init_from_hf (a real checkpoint keeps its full head). "": the full head.',
    one_of(("", "env")),
  )

  def check_together(self):
    from sao_jax.models import config as model_config

    known = {f.name for f in dataclasses.fields(model_config.ModelConfig)}
    unknown = sorted(set(self.overrides) - known)
    if unknown:
      fail(
        "model.overrides",
        self.overrides,
        f"ModelConfig fields (sao_jax/models/config.py); not {unknown}",
      )
    if self.hf_dir:
      from sao_jax.models import families

      if self.vocab_subset:
        fail(
          "model.vocab_subset",
          self.vocab_subset,
          '"" with model.hf_dir (a real checkpoint keeps its full head)',
        )
      try:
        families.config_kwargs(self.hf_dir)
      except (OSError, ValueError) as e:
        fail(
          "model.hf_dir",
          self.hf_dir,
          f"a Hugging Face model directory of a supported family ({' '.join(str(e).split())})",
        )


@dataclasses.dataclass(frozen=True)
class Env(Section):
  """The task: environment, tokenizer, chat format, reward and sandbox
  (sao_jax/envs/registry.py builds each from this section)."""

  NAME: ClassVar[str] = "env"
  name: str = knob(
    "python_tool",
    "A built-in environment (python_tool, code_fix, online_style, "
    "dataset, math_tool, humaneval, repo_repair) or a user's factory as an import string, "
    '"my_pkg.my_env:make_env" or "path/to/my_env.py:make_env" '
    "(sao_jax/envs/registry.py).",
    REGISTERED_NAME,
  )
  kwargs: dict = knob(
    {}, "Keyword arguments of the built-in's config dataclass, or of the factory.", DICT
  )
  reward: str = knob(
    "",
    '"": the environment\'s own reward; "pkg.module:fn": fn(task, response, info) '
    "-> float replaces it (run in the trainer-side process, never in the sandbox).",
    STRING,
  )
  tokenizer: str = knob(
    "char",
    'Tokenizer by name: "char" (the toys\' character vocabulary), "qwen3" '
    "(Qwen3's, offline) or \"qwen3_5\" (Qwen3.5's and Qwen3.6's, offline); "
    "env.tokenizer_path, if set, takes precedence.",
    STRING,
  )
  chat_format: str = knob(
    "raw",
    "How prompts, turn ends and observations become tokens (sao_jax/envs/chat.py): "
    '"raw" (the toys\' text format), "plain", "qwen3" (Qwen3\'s chat template) or '
    '"qwen3_5" (Qwen3.5\'s).',
    REGISTERED_NAME,
  )
  thinking: bool = knob(
    True,
    "qwen3, qwen3_5: thinking on (the model may write <think>...</think>) or off "
    "(the generation prompt carries an empty think block, as Qwen3 defines it).",
    BOOL,
  )
  max_tool_output_tokens: int = knob(
    512,
    "Tool output (observation messages) is cut to this many tokens, with a visible "
    "marker; 0: no cap.",
    integer(0, note=" (0: no cap)"),
  )
  sandbox: dict = knob(
    {"cpu_seconds": 1, "wall_seconds": 3.0},
    "Sandbox limits (sao_jax/envs/sandbox.py SandboxLimits fields).",
    DICT,
  )
  tool_latency_s: float = knob(
    0.0,
    "Simulated tool latency: seconds slept in every RL environment step (an agentic "
    "tool call's wait; benchmarks/loop.py). 0: none.",
    real(0, unit="a finite number of seconds"),
  )
  tokenizer_path: str = knob(
    "",
    "A user's tokenizer.json (with its tokenizer_config.json beside it for the special "
    "tokens); empty: env.tokenizer.",
    STRING,
  )
  allow_unisolated: bool = knob(
    False,
    "Run model-written code even where the sandbox cannot isolate it (no root: no "
    "network namespace, chroot, uid drop, process cleanup). Off: such a run refuses to "
    "start and says what is missing.",
    BOOL,
  )
  tool_calls_per_turn: int = knob(
    8,
    "Tool calls one turn may make (dataset, math_tool, humaneval, repo_repair); further "
    "calls are "
    'not run but answered with an error (event "tool_budget_calls"). 0: no bound.',
    integer(0, note=" (0: no bound)"),
  )
  tool_seconds_per_turn: float = knob(
    30.0,
    "Seconds of tool time one turn may use: a call starts only with time left and "
    "its sandbox's wall clock is cut to it; later calls are answered with an error (event "
    '"tool_budget_time"). Below rollout.env_timeout. 0: no bound.',
    real(0, unit="a finite number of seconds"),
  )
  tool_seconds_per_episode: float = knob(
    0.0,
    "Seconds of tool time one episode may use, all turns together (as "
    "tool_seconds_per_turn). 0: no bound.",
    real(0, unit="a finite number of seconds"),
  )

  def check_together(self):
    """The reward's import string resolves (imported, not called). Whether
    the environment, tokenizer, chat format and sandbox limits name what
    the envs layer has is asked of that layer (registry.check_env_section,
    from configuration.validate): this layer sits below it."""
    if self.reward:
      try:
        fn = import_strings.resolve(self.reward, "env.reward")
      except ValueError as e:
        raise ConfigError(str(e)) from None
      if not callable(fn):
        fail("env.reward", self.reward, "an import string of a callable")


@dataclasses.dataclass(frozen=True)
class Sharding(Section):
  """The trainer's mesh and the logical-axis rules (sao_jax/models/sharding.py).
  Checked here: the mesh's sizes and the rules' shape; whether the mesh
  fits the devices present is checked by configuration.validate, which
  knows them, and whether the rules cover every logical axis by
  `sharding.check_rules` when the programs are built."""

  NAME: ClassVar[str] = "sharding"
  mesh: dict = knob(
    {"data": -1},
    "Mesh axis sizes; -1 takes the remaining devices.",
    Check(_is_mesh_dict, "a dict of axis name -> size >= 1 (at most one size may be -1)"),
  )
  rules: tuple = knob(
    DATA_PARALLEL_RULES,
    "Logical axis -> mesh axes rules (sao_jax/models/sharding.py); the default is data parallel.",
    Check(_is_rules, "a non-empty tuple of (logical axis, mesh axes) pairs"),
  )


@dataclasses.dataclass(frozen=True)
class Distributed(Section):
  """Multi-host training (sao_jax/train/distributed.py): one SPMD trainer over
  many processes. Per-host values go in flags, e.g.
  --config.distributed.process_id=1."""

  NAME: ClassVar[str] = "distributed"
  enabled: bool = knob(
    False, "Join the processes (jax.distributed.initialize) before anything else.", BOOL
  )
  coordinator_address: str = knob(
    "",
    'Process 0\'s "host:port"; "": JAX_COORDINATOR_ADDRESS or auto-detection (TPU, SLURM).',
    Check(lambda v: isinstance(v, str), "a string host:port ('' : from the environment)"),
  )
  num_processes: int = knob(
    0, "0: JAX_NUM_PROCESSES or auto-detection.", integer(0, note=" (0: from the environment)")
  )
  process_id: int = knob(
    -1,
    "This process's index; -1: JAX_PROCESS_ID or auto-detection.",
    integer(-1, note=" (-1: from the environment)"),
  )

  def check_together(self):
    if self.num_processes and self.process_id >= self.num_processes:
      fail(
        "distributed.process_id",
        self.process_id,
        f"< distributed.num_processes ({self.num_processes})",
      )


@dataclasses.dataclass(frozen=True)
class Data(Section):
  NAME: ClassVar[str] = "data"
  num_train_tasks: int = knob(
    100_000, "Training tasks are indices [0, num_train_tasks); evaluation is disjoint.", integer(1)
  )
  buckets: tuple = knob(
    (64, 128, 256), "Packed row lengths; the train step compiles once per bucket.", increasing(8)
  )
  logits_at_actions: bool = knob(
    False,
    "Compute the policy's vocabulary-wide head at action tokens only (SFT and RL "
    "steps; packing.pack's action_index): with a large vocabulary the head is most of a "
    "small model's step and most of an agentic row is prompt and tool output. The head's "
    "width is bucketed to a multiple of L/8, so up to 8 compiles of the SFT and RL steps "
    "per length bucket (in practice one or two); off for the toys' 64-token vocabulary, "
    "where it saves nothing.",
    BOOL,
  )


@dataclasses.dataclass(frozen=True)
class SFT(Section):
  """Supervised warm start on demonstrations (the paper's SFT baseline)."""

  NAME: ClassVar[str] = "sft"
  steps: int = knob(
    200,
    "SFT steps. The default leaves the tiny model headroom for RL on "
    "python_tool (benchmarks/RESULTS.md#learning-on-cpu).",
    integer(0),
  )
  batch_size: int = knob(32, "Packed rows per SFT step.", integer(1))
  lr: float = knob(3e-3, "Peak learning rate (warmup, then cosine decay).", real(0, above=True))
  warmup: int = knob(20, "Linear warmup steps.", integer(0))
  stop_at_nll: float = knob(
    0.0,
    "Stop SFT early, at the first step where the mean training NLL of the last "
    "`stop_window` steps is at or below this (0: off, every one of `steps` runs; the lr "
    "schedule's horizon stays `steps`). For warm starts that land alike across seeds "
    "whose speed of learning differs (benchmarks/RESULTS.md#learning-on-cpu).",
    real(0),
  )
  stop_window: int = knob(25, "The steps whose mean NLL `stop_at_nll` compares.", integer(1))
  init_from_hf: str = knob(
    "", "A Hugging Face safetensors SFT checkpoint to start from instead of SFT.", STRING
  )
  init_from_run: str = knob(
    "",
    "Another sao-jax run's directory whose newest checkpoint's policy this run starts "
    "from (DIR@N: its checkpoint N), in place of a random initialisation (e.g. a "
    "`launch/sft.py` run, then sft.steps = 0): the same model and head; with "
    "lora.enabled it is the frozen base the adapters train on, which a resume and a "
    "fleet's rollouts read again (they must see DIR; pin N while DIR still trains). "
    "Its optimizer and critic are not read.",
    STRING,
  )


@dataclasses.dataclass(frozen=True)
class ValuePretrain(Section):
  """Critic-only steps on trajectories of the initial policy (cold start fix)."""

  NAME: ClassVar[str] = "value_pretrain"
  steps: int = knob(50, "Critic-only steps.", integer(0))
  num_trajectories: int = knob(
    256, "How many such trajectories to generate into the trajectory store.", integer(1)
  )


@dataclasses.dataclass(frozen=True)
class Rollout(Section):
  """The rollout engine (sao_jax/rollout/engine.py) and its driver
  (sao_jax/rollout/driver.py); both take this section whole."""

  NAME: ClassVar[str] = "rollout"
  backend: str = knob(
    "jax",
    'The engine that serves the rollout (sao_jax/rollout/backends.py): "jax", '
    'the project\'s own, in-process (the default); "vllm", a vLLM server in its own '
    "process and virtual environment fed token ids over loopback (`make vllm-env`; "
    "sao_jax/rollout/vllm_backend.py). The trajectories are the same either way.",
    REGISTERED_NAME,
  )
  slots: int = knob(16, "Concurrent decode slots of the engine (continuous batching).", integer(1))
  sharded_engine: bool = knob(
    False,
    "Lay the trainer's engine's params and KV cache out on the trainer's mesh "
    '(slots over the batch axes, kv heads over "tensor"); a fleet rollout process, '
    'and each process of a multi-host run, on {"data": -1} over its host\'s devices; '
    "evaluation and serving stay on one device. Off (and no rollout.mesh): one device "
    "holds all.",
    BOOL,
  )
  mesh: str = knob(
    "",
    "The engine's own mesh, AXIS:SIZE,... over the devices of its host (e.g. "
    '"expert:2,tensor:2"; one size may be -1: the devices left over; without -1 the '
    'engine takes the host\'s first devices): slots over every axis but "tensor", '
    'heads, MLP and vocabulary over "tensor", experts over "expert" '
    "(sao_jax/rollout/layout.py). Set, it wins over sharded_engine, for the trainer's "
    "engine, a fleet rollout process, evaluation and serving alike, and launch/compile.py "
    'compiles the engine on it. "": see sharded_engine.',
    STRING,
  )
  max_len: int = knob(
    256, "Max tokens per trajectory (prompt + actions + observations).", integer(8)
  )
  kv_cache: str = knob(
    "dense",
    'The engine\'s KV cache: "dense" (every slot owns max_len positions) or '
    '"paged" (a pool of fixed-size pages the slots share; admission waits for free '
    'pages; sao_jax/rollout/kv_cache.py, "Paged"). Measured: '
    "benchmarks/RESULTS.md#rollout-engine.",
    one_of(KV_CACHES),
  )
  page_size: int = knob(16, "Positions a page holds (paged); must divide max_len.", integer(1))
  kv_pages: int = knob(
    0,
    "Pages in the pool (paged); 0: the dense cache's size, slots x max_len / "
    "page_size. Fewer pages, less memory: a long-tailed length mix needs pages for its "
    "live tokens only. At least max_len / page_size per slot group (one device of a "
    "sharded engine's batch axes).",
    integer(0, note=" (0: the dense cache's size)"),
  )
  max_turn_tokens: int = knob(24, "Max tokens per action turn.", integer(1))
  prefill_buckets: tuple = knob(
    (8, 16, 32, 64, 128, 256),
    "Widths an engine step's new tokens are padded to (one "
    "compiled program each); max_len is always the last, so an append wider than the "
    'largest bucket below max_len (a long prompt or tool output, a "recompute" swap\'s '
    "re-feed) runs max_len wide. Long contexts want buckets up to a few thousand tokens.",
    increasing(1),
  )
  temperature: float = knob(1.0, "Sampling temperature.", real(0, above=True))
  top_k: int = knob(
    0,
    "Top-k sampling (0: off). Training refuses anything but 0: the "
    "train step's log-probs do not apply it.",
    integer(0),
  )
  top_p: float = knob(
    1.0,
    "Nucleus sampling (1.0: off). Training refuses anything but 1.0, as for top_k.",
    Check(lambda v: is_real(v) and 0 < v <= 1, "in (0, 1]"),
  )
  samples_per_prompt: int = knob(1, "1 for SAO; G >= 2 for the GRPO arms.", integer(1))
  decode_steps: int = knob(
    1,
    "Decode steps per engine call (a jitted loop with per-slot stops; 1: one token "
    "per call). Measured: benchmarks/RESULTS.md#rollout-engine.",
    integer(1),
  )
  swap_policy: str = knob(
    "recompute",
    'In-flight slots at a weight swap: recompute, keep or drain. "keep" '
    "(the caches stay; every recorded log-prob is still the exact probability its token "
    "was sampled with) costs the least per swap, but lets the rollout run further ahead "
    "of training (more policy lag). What each policy does to the CPU main job: "
    "benchmarks/RESULTS.md#rollout-engine.",
    one_of(SWAP_POLICIES),
  )
  env_workers: int = knob(
    4, "Environment worker threads (sandbox processes run in parallel).", integer(1)
  )
  env_timeout: float | None = knob(
    60.0,
    "Seconds an environment step may take before its episode ends with reward 0 "
    '("env_timeout"); the sandbox\'s own wall clock is shorter. None: no limit.',
    optional(real(0, above=True, unit="a finite number of seconds"), " (no limit)"),
  )
  queue_size: int = knob(
    64, "Bounded ingestion queue (backpressure on the rollout thread).", integer(1)
  )
  max_staleness: int | None = knob(
    None,
    "Drop trajectories lagging the policy by more versions than this; None: off (SAO).",
    optional(integer(0)),
  )

  def check_together(self):
    if self.mesh:
      try:
        parse_mesh(self.mesh)
      except ConfigError as e:
        raise ConfigError(f"rollout.mesh = {self.mesh!r}: {e}") from None
    if self.kv_cache == "paged":
      if self.max_len % self.page_size:
        fail("rollout.page_size", self.page_size, f"a divisor of rollout.max_len ({self.max_len})")
      if 0 < self.kv_pages < self.max_len // self.page_size:
        fail(
          "rollout.kv_pages",
          self.kv_pages,
          f"0 or >= rollout.max_len / rollout.page_size ({self.max_len // self.page_size}):"
          " the pool must hold one whole trajectory",
        )


def _estimators():
  from sao_jax.algo.advantages import ESTIMATORS

  return ESTIMATORS


def _policy_losses():
  from sao_jax.algo.losses import POLICY_LOSSES

  return POLICY_LOSSES


def _rollout_kl_estimators():
  from sao_jax.algo.losses import ROLLOUT_KL_ESTIMATORS

  return ROLLOUT_KL_ESTIMATORS


def _rollout_kl_reductions():
  from sao_jax.algo.losses import ROLLOUT_KL_REDUCTIONS

  return ROLLOUT_KL_REDUCTIONS


def _corrective_sides():
  from sao_jax.algo.losses import CORRECTIVE_SIDES

  return CORRECTIVE_SIDES


@dataclasses.dataclass(frozen=True)
class RL(Section):
  NAME: ClassVar[str] = "rl"
  mode: str = knob(
    "async",
    "async (SAO) or sync (generate the whole batch, wait, train) in "
    "one process; fleet: rollout in separate processes (the fleet section). "
    "The trajectory sources registered in sao_jax/train/sources.py.",
    REGISTERED_NAME,
  )
  steps: int = knob(150, "RL steps.", integer(0))
  batch_size: int = knob(
    16, "Trajectories per train step (packed into this many rows).", integer(1)
  )
  advantage: str = knob(
    "value",
    "An estimator of sao_jax/algo/advantages.py: value "
    "(skip-observation GAE), token_gae, step_gae_mean, step_gae_last, "
    "group, running_mean.",
    one_of(_estimators),
  )
  policy_loss: str = knob(
    "dis",
    "A loss of sao_jax/algo/losses.py: dis (the paper's) or ppo_clip; DIS's variants "
    "dis_rollout_kl, dis_corrective, dis_seq_geo, cispo (MiniMax-M1's: upper clip only), "
    "cispo_two_sided. How often each collapses under lag: experiments/README.md.",
    one_of(_policy_losses),
  )
  eps_low: float = knob(
    0.2,
    "Ratio window's lower width: 1 - eps_low (0.2 / 0.28: this "
    "project's choice; the paper gives no values).",
    unit_interval(open_low=True, open_high=True),
  )
  eps_high: float = knob(0.28, "Ratio window's upper width: 1 + eps_high.", real(0, above=True))
  rollout_kl_coef: float = knob(
    0.1,
    "dis_rollout_kl: beta of its penalty on the KL divergence from the rollout policy.",
    real(0),
  )
  rollout_kl_estimator: str = knob(
    "k2",
    "dis_rollout_kl: the per-token KL estimator, k2 = 0.5 (log r)^2 (SkyRL's "
    "proposal) or k3 = r - 1 - log r (what experiments/dis_stability.py's dis_kl arms "
    "run).",
    one_of(_rollout_kl_estimators),
  )
  rollout_kl_reduction: str = knob(
    "sequence",
    "dis_rollout_kl: the penalty's mean, \"sequence\" (each sequence's token "
    "mean, then the mean over sequences: SkyRL's proposal) or \"token\" (over the batch's "
    "action tokens: what experiments/dis_stability.py's dis_kl arms run).",
    one_of(_rollout_kl_reductions),
  )
  corrective_side: str = knob(
    "low",
    'dis_corrective: which out-of-window corrective tokens it keeps, "low" (A > 0 '
    'below the window; their weight r < 1 - eps_low is bounded) or "high" (A < 0 above '
    "it; r unbounded, as under PPO clip).",
    one_of(_corrective_sides),
  )
  geo_eps_low: float = knob(
    0.05,
    "dis_seq_geo: a whole sequence is masked when its "
    "geometric mean ratio exp(mean log r) leaves (1 - geo_eps_low, "
    "1 + geo_eps_high).",
    unit_interval(open_low=True, open_high=True),
  )
  geo_eps_high: float = knob(0.05, "dis_seq_geo: see geo_eps_low.", real(0, above=True))
  gamma: float = knob(1.0, "Discount.", unit_interval())
  lam: float = knob(0.95, "GAE lambda.", unit_interval())
  critic_lam: float | None = knob(
    None,
    "Lambda of the critic's return targets (None: rl.lam). 1.0 regresses the critic "
    "on Monte Carlo returns instead of its own bootstrapped estimates.",
    optional(unit_interval()),
    placeholder=float,
  )
  critic_updates: int = knob(2, "K critic updates per actor update.", integer(0, 64))
  freeze_critic_attention: bool = knob(
    True, "Freeze the critic's attention (and embeddings); train MoE/MLP and head.", BOOL
  )
  actor_frozen: tuple = knob(
    (),
    'Regexes over the actor\'s parameter paths (e.g. r"/moe/router$", the MoE '
    "router) the actor's optimizers never move, in SFT and RL alike (one optimizer-state "
    "layout for both): their updates are exactly 0 and Adam keeps no moments for them. "
    "Each must match at least one parameter (checked when the programs are built).",
    Check(_is_regex_tuple, "a tuple of valid regexes"),
  )
  actor_lr: float = knob(3e-4, "Actor learning rate.", real(0, above=True))
  critic_lr: float = knob(1e-3, "Critic learning rate.", real(0, above=True))
  warmup: int = knob(5, "Actor warmup steps.", integer(0))
  clip_norm: float | None = knob(
    1.0, "Global gradient-norm clip (None: off).", optional(real(0, above=True, unit="a number"))
  )
  load_balance_coef: float = knob(0.01, "MoE load-balancing loss weight.", real(0))
  routing_replay: bool = knob(
    False,
    "Routing replay: the rollout engine records the MoE experts it chose for every "
    "token it fed, trajectories carry them (int16 [T, M, k]; one without is refused as "
    "missing_routing) and the actor's forward uses them instead of its own top-k, so the "
    "trainer's log-probs are those of the engine's routing "
    "(benchmarks/RESULTS.md#models-and-the-train-step). MoE models, either rollout backend "
    "(rollout.backend = 'vllm' runs its server without prefix caching then).",
    BOOL,
  )
  sync_every: int = knob(
    1, "Push params to the rollout engine every this many actor updates.", integer(1)
  )
  max_generated_tokens: int = knob(
    0,
    "Stop RL once this many tokens have been generated by the policy, counted over "
    "every stage that generates (value-pretraining rollouts included, evaluation not); "
    "0: off, rl.steps alone ends the run. Equal budgets across arms (experiments/) are "
    "equal numbers of generated tokens.",
    integer(0, note=" (0: off)"),
  )
  group_std_normalize: bool = knob(
    True,
    "GRPO arms: divide the group-centred reward by the group's std (GRPO as "
    "published); False: R - mean_G, in reward units like SAO's advantages.",
    BOOL,
  )
  running_mean_window: int = knob(64, "Window W of the running-mean baseline arm.", integer(1))
  eval_every: int = knob(
    0, "Held-out evaluation every this many RL steps (0: only at the ends).", integer(0)
  )
  max_nonfinite_updates: int = knob(
    3,
    "A non-finite loss or gradient skips that update (params unchanged); this many in "
    "a row stop the run cleanly, its last checkpoint intact.",
    integer(1),
  )
  max_rollout_restarts: int = knob(
    3,
    "Times a dead rollout thread is restarted (fresh engine, current params) before "
    "the run stops with the thread's error.",
    integer(0),
  )

  def check_together(self):
    estimator = _estimators()[self.advantage]
    if estimator.uses_critic and self.critic_updates < 1:
      fail("rl.critic_updates", self.critic_updates, f">= 1 with rl.advantage = {self.advantage!r}")
    # A loss option is set here or nowhere: one the loss takes that the train
    # step does not offer, or one offered that this section lacks, would
    # run at a default no config can change.
    from sao_jax.algo import losses

    try:
      losses.check_policy_loss(self.policy_loss)
    except ValueError as e:
      raise ConfigError(f"rl.policy_loss = {self.policy_loss!r}: {e}") from None
    missing = [k for k in losses.CONFIG_OPTIONS if not hasattr(self, k)]
    if missing:
      raise ConfigError(
        f"losses.CONFIG_OPTIONS {missing}: not fields of the rl section "
        "(sao_jax/config/sections.py RL); declare each here"
      )


@dataclasses.dataclass(frozen=True)
class Fleet(Section):
  """rl.mode = "fleet": rollout processes (launch/rollout.py) apart from the
  trainer, trajectories and weights through shared storage (sao_jax/transport/fleet.py),
  weights over the network on the direct path (sao_jax/transport/weight_transfer.py)."""

  NAME: ClassVar[str] = "fleet"
  root: str = knob(
    "",
    'The shared directory (local, NFS, a gcsfuse mount); "": <workdir>/fleet.',
    Check(lambda v: isinstance(v, str), 'a path ("": <workdir>/fleet)'),
  )
  shard_trajectories: int = knob(
    16, "A rollout closes (renames) its shard after this many trajectories...", integer(1)
  )
  shard_seconds: float = knob(
    10.0,
    "...or when its first trajectory is this many seconds old.",
    real(0, above=True, unit="a finite number of seconds"),
  )
  keep_versions: int = knob(
    3,
    "Published weight versions kept on disk (older ones are pruned).",
    Check(
      lambda v: is_int(v) and v >= 2,
      "an integer >= 2 (a rollout may be reading the one before the newest)",
    ),
  )
  poll_seconds: float = knob(
    0.5,
    "Seconds between polls for new shards (trainer) and new versions (rollouts).",
    real(0, above=True, unit="a finite number of seconds"),
  )
  max_unread_shards: int = knob(
    8,
    "A rollout with this many closed shards the trainer has "
    "not consumed waits (backpressure, like rollout.queue_size "
    "in-process).",
    integer(1),
  )
  weights_path: str = knob(
    "direct",
    'How versions reach the rollouts: "direct", each trainer process serves '
    "its shards and each rollout pulls them into its devices over the network "
    '(sao_jax/transport/weight_transfer.py), checkpoints as bootstrap and fallback; "checkpoint", '
    "every version as an orbax checkpoint under <root>/weights. Direct falls back to "
    "checkpoint (counted, logged) where jax.experimental.transfer is unavailable. The "
    "channels of sao_jax/transport/weight_channel.py.",
    REGISTERED_NAME,
  )
  checkpoint_every: int = knob(
    8,
    "On the direct path, every this many versions (and the first and last) are also "
    "written as checkpoints: what a rollout takes when a pull fails.",
    integer(1),
  )
  pull_timeout_s: float = knob(
    300.0,
    "A direct pull not complete after this many seconds is discarded (counted); "
    "the rollout keeps its version.",
    real(0, above=True, unit="a finite number of seconds"),
  )
  transfer_host: str = knob(
    "",
    "The IP address the weight servers bind and advertise (the hosts' internal "
    'interface: the transfer server has no authentication); "": this host name\'s '
    "address.",
    Check(lambda v: isinstance(v, str), 'an IP address or ""'),
  )
  transfer_sockets: int = knob(
    4, "Parallel bulk TCP sockets of each weight server.", integer(1, 64)
  )
  delta_versions: bool = knob(
    False,
    "On the direct path, each version is also offered as its delta from the one "
    "before (the bf16 elements that changed, sao_jax/transport/weight_delta.py) and a rollout "
    "holding that one pulls only the delta, checked by a checksum per piece (a mismatch: "
    "counted, the version pulled whole). Costs a rollout one more copy of a version on its "
    "devices (the held version's pieces) and the trainer an encode per version; off by "
    "default: on CPU loopback the encode outweighs the bytes saved "
    "(benchmarks/RESULTS.md#fleet-and-weight-sync). Turn it on where "
    "the link between trainer and rollout hosts is the bottleneck.",
    BOOL,
  )

  def check_together(self):
    if self.pull_timeout_s <= self.poll_seconds:
      fail(
        "fleet.pull_timeout_s",
        self.pull_timeout_s,
        f"> fleet.poll_seconds ({self.poll_seconds}): a pull is checked once per poll",
      )


def _is_str_dict(v) -> bool:
  return isinstance(v, dict) and all(isinstance(k, str) for k in v)


def _is_resources(v) -> bool:
  return _is_str_dict(v) and all(is_real(x) and x >= 0 for x in v.values())


# Kubernetes names and quantities of the emitted manifests (--emit=jobset / raycluster).
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
POD_SANDBOXES = ("sys_admin", "gvisor", "none")
POD_VOLUME_KINDS = ("pvc", "gcs")


def _is_k8s_name(v, empty_ok: bool = True) -> bool:
  return isinstance(v, str) and ((empty_ok and not v) or bool(_K8S_NAME.match(v)))


def _is_requests(v) -> bool:
  return (
    _is_str_dict(v)
    and {"cpu", "memory"} <= set(v)
    and all(isinstance(x, str) and _QUANTITY.match(x) for x in v.values())
  )


def parse_pod_volumes(volumes) -> list[tuple[str, str, str, bool]]:
  """`pod.volumes` as [(mount path, kind, claim or bucket, read_only)]; ValueError
  (one line) on a malformed entry, a relative or repeated mount path."""
  if not isinstance(volumes, tuple) or not all(isinstance(v, str) for v in volumes):
    raise ValueError('a tuple of strings "MOUNT=pvc:CLAIM" or "MOUNT=gcs:BUCKET"')
  out, mounts = [], set()
  for entry in volumes:
    mount, _, source = entry.partition("=")
    kind, _, name = source.partition(":")
    name, ro, mode = name.partition(":")
    mount = os.path.normpath(mount) if mount else ""
    if not (
      mount.startswith("/")
      and mount != "/"
      and kind in POD_VOLUME_KINDS
      and name
      and (not ro or mode == "ro")
    ):
      raise ValueError(
        f'{entry!r} is not "MOUNT=pvc:CLAIM" or "MOUNT=gcs:BUCKET" '
        '(an absolute MOUNT, ":ro" at the end for read-only)'
      )
    if kind == "pvc" and not _K8S_NAME.match(name) or kind == "gcs" and not _BUCKET.match(name):
      raise ValueError(
        f"{entry!r}: {name!r} is not a valid {'claim' if kind == 'pvc' else 'bucket'} name"
      )
    if mount in mounts:
      raise ValueError(f"{entry!r}: {mount} is mounted twice")
    mounts.add(mount)
    out.append((mount, kind, name, bool(ro)))
  return out


@dataclasses.dataclass(frozen=True)
class Pod(Section):
  """launch/pod.py: one command starts, places and supervises every host
  (sao_jax/pod/hosts.py): the trainer's processes and the rollout hosts, on Ray
  or as a Kubernetes JobSet."""

  NAME: ClassVar[str] = "pod"
  trainer_hosts: int = knob(
    1,
    "Trainer processes, one a host of the training slice (jax.distributed over them when > 1).",
    integer(1),
  )
  rollout_hosts: int = knob(
    0,
    'Rollout processes (launch/rollout.py), one a rollout host; > 0 needs rl.mode = "fleet".',
    integer(0),
  )
  trainer_resources: dict = knob(
    {},
    'Ray resources one trainer host takes (e.g. {"TPU": 4}); {}: one CPU.',
    Check(_is_resources, "a dict of Ray resource name -> amount >= 0"),
  )
  rollout_resources: dict = knob(
    {},
    "Ray resources one rollout host takes; {}: one CPU.",
    Check(_is_resources, "a dict of Ray resource name -> amount >= 0"),
  )
  host_env: dict = knob(
    {},
    "Environment variables of every host's process.",
    Check(
      lambda v: _is_str_dict(v) and all(isinstance(x, str) for x in v.values()),
      "a dict of str -> str",
    ),
  )
  max_trainer_restarts: int = knob(
    3,
    "Restarts of the trainer group (all its processes, from the last checkpoint) "
    "before the job fails.",
    integer(0),
  )
  max_rollout_restarts: int = knob(
    10,
    "Restarts of each rollout host (same rollout_id: it resumes its shard "
    "sequence) before the job fails.",
    integer(0),
  )
  coordinator_port: int = knob(
    0,
    "jax.distributed's port on trainer host 0; 0: a free port, new at each start.",
    integer(0, 65535),
  )
  finish_seconds: float = knob(
    600.0,
    "After the trainer finishes, how long rollout hosts get to see DONE and exit "
    "before they are stopped.",
    real(0, unit="a finite number of seconds"),
  )
  image: str = knob(
    "sao-jax:latest",
    "Container image of the emitted JobSet (Dockerfile).",
    Check(lambda v: isinstance(v, str) and v, "a non-empty image name"),
  )
  tpu_type: str = knob(
    "tpu-v5p-slice",
    "GKE TPU accelerator of the emitted JobSet (cloud.google.com/gke-tpu-accelerator).",
    Check(lambda v: isinstance(v, str) and v, "a GKE TPU accelerator"),
  )
  trainer_topology: str = knob(
    "4x4x8",
    "TPU topology of the training slice (cloud.google.com/gke-tpu-topology).",
    Check(lambda v: isinstance(v, str) and v, 'e.g. "4x4x8"'),
  )
  rollout_topology: str = knob(
    "2x2x1",
    "TPU topology of one rollout host's slice.",
    Check(lambda v: isinstance(v, str) and v, 'e.g. "2x2x1"'),
  )
  chips_per_host: int = knob(4, "TPU chips a host (google.com/tpu of each pod).", integer(1))
  # What the emitted Kubernetes manifests (sao_jax/pod/kube.py) need to start on GKE.
  volumes: tuple = knob(
    (),
    "Volumes every pod of an emitted JobSet / RayCluster mounts, each "
    '"MOUNT=pvc:CLAIM" (a PersistentVolumeClaim, e.g. Filestore) or "MOUNT=gcs:BUCKET" '
    '(the gcsfuse CSI driver), ":ro" at the end for read-only. The workdir, fleet.root '
    "and every absolute path the config names must lie under one (or be gs://), else "
    "--emit refuses: each pod would see its own empty disk.",
    Check(
      lambda v: isinstance(v, tuple), 'a tuple of "MOUNT=pvc:CLAIM" / "MOUNT=gcs:BUCKET" strings'
    ),
  )
  service_account: str = knob(
    "",
    "Kubernetes service account of every pod; with Workload Identity it is bound to "
    "the Google service account that reaches the buckets. Required (--emit refuses) when "
    "the workdir, a path or a volume is on GCS.",
    Check(_is_k8s_name, "\"\" or a Kubernetes name (lowercase letters, digits, '-')"),
  )
  queue: str = knob(
    "",
    'Kueue LocalQueue of an emitted job (label kueue.x-k8s.io/queue-name); "": none.',
    Check(_is_k8s_name, "\"\" or a Kubernetes name (lowercase letters, digits, '-')"),
  )
  sandbox: str = knob(
    "sys_admin",
    "How the emitted pods get the privilege the code sandbox needs "
    "(sao_jax/envs/sandbox.py makes network, IPC, PID and mount namespaces as root): "
    '"sys_admin", the capability SYS_ADMIN added to the runtime\'s defaults, AppArmor '
    "unconfined (its default profile denies mount), seccomp RuntimeDefault (GKE "
    'Standard; Autopilot refuses it); "gvisor", GKE Sandbox (runtimeClassName gvisor, '
    'SYS_ADMIN inside gVisor\'s own kernel; single-host TPU slices only); "none", no '
    "privilege (environments that run no code).",
    one_of(POD_SANDBOXES),
  )
  trainer_requests: dict = knob(
    {"cpu": "150", "memory": "350Gi"},
    "CPU and memory a trainer pod requests (Kubernetes "
    "quantities; memory is also its limit, CPU has none). The default fits a v5p host "
    "(208 vCPUs, 448 GB) beside GKE's reservations.",
    Check(_is_requests, 'a dict of Kubernetes quantities with "cpu" and "memory"'),
  )
  rollout_requests: dict = knob(
    {"cpu": "150", "memory": "350Gi"},
    "CPU and memory a rollout pod requests (as pod.trainer_requests).",
    Check(_is_requests, 'a dict of Kubernetes quantities with "cpu" and "memory"'),
  )
  head_requests: dict = knob(
    {"cpu": "8", "memory": "32Gi"},
    "CPU and memory of an emitted RayCluster's head pod "
    "(the driver, launch/pod.py: it only supervises).",
    Check(_is_requests, 'a dict of Kubernetes quantities with "cpu" and "memory"'),
  )
  checkpoint_seconds: float = knob(
    300.0,
    "How long one checkpoint save takes on this job's storage (measured, or "
    "estimated as a trainer host's checkpoint bytes / its write bandwidth); with "
    "pod.grace_margin it sizes the pods' terminationGracePeriodSeconds.",
    real(0, above=True, unit="a finite number of seconds"),
  )
  grace_margin: float = knob(
    2.0,
    "terminationGracePeriodSeconds = ceil(pod.checkpoint_seconds x this): the time a "
    "stopped pod gets to finish the save in flight.",
    real(1, unit="a finite number"),
  )

  def check_together(self):
    try:
      parse_pod_volumes(self.volumes)
    except ValueError as e:
      raise ConfigError(f"pod.volumes = {self.volumes!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Eval(Section):
  NAME: ClassVar[str] = "eval"
  num_tasks: int = knob(400, "Held-out tasks for pass@1.", integer(1))
  slots: int = knob(32, "The evaluation engine's decode slots.", integer(1))
  temperature: float = knob(1.0, "Sampling temperature of evaluation.", real(0, above=True))
  samples_per_task: int = knob(
    1,
    "Episodes sampled per held-out task; pass@1 averages them and reports its "
    "standard error over tasks (more samples cut the sampling noise).",
    integer(1),
  )
  decode_steps: int = knob(
    8,
    "Decode steps per engine call of evaluation (no weight swaps there, so a long "
    "loop only saves host round trips).",
    integer(1),
  )
  top_p: float = knob(
    1.0,
    "Nucleus sampling of evaluation (1.0: off, the paper's setting).",
    Check(lambda v: is_real(v) and 0 < v <= 1, "in (0, 1]"),
  )
  sets: tuple = knob(
    (),
    'Named evaluation sets, each "NAME=SPEC" or "SPEC": SPEC is "heldout" (the '
    "run's own held-out tasks), a built-in environment or import string (its held-out "
    'tasks, e.g. "humaneval", "math_tool"), or a file of rows (.jsonl, .jsonl.gz, '
    ".parquet) run as held-out rows of the run's dataset environment (math_tool's tools "
    "and verifier if the run's is not one). (): the run's held-out tasks, named "
    '"heldout". Every set uses the run\'s tokenizer, chat format and budgets.',
    Check(
      lambda v: isinstance(v, tuple) and all(isinstance(x, str) for x in v),
      'a tuple of strings "NAME=SPEC" or "SPEC"',
    ),
  )
  strict: bool = knob(
    True,
    "A set that lost rows at load (malformed, duplicate, conflicting) fails the "
    "evaluation, naming the counts, before anything is sampled; False evaluates the rows "
    "left and reports the counts (rows_rejected) in the table and summary.json.",
    BOOL,
  )

  def check_together(self):
    try:
      parse_eval_sets(self.sets)
    except ValueError as e:
      fail("eval.sets", self.sets, str(e))


EVAL_SET_FILES = (".jsonl", ".jsonl.gz", ".parquet")
_SET_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def parse_eval_sets(sets: tuple) -> list[tuple[str, str]]:
  """`eval.sets` as [(name, spec)], the default [("heldout", "heldout")].

  Raises ValueError saying what is wrong (a bad or repeated name, a file
  that does not exist); whether an environment's name is registered is
  the envs layer's check (registry.check_env_name, from
  configuration.validate).
  """
  out = []
  for item in sets or ("heldout",):
    name, sep, spec = item.partition("=")
    if not sep:
      spec = name
      base = os.path.basename(spec.rstrip("/"))
      for ext in EVAL_SET_FILES:
        base = base[: -len(ext)] if base.endswith(ext) else base
      name = base.split(":")[-1]
    name, spec = name.strip(), spec.strip()
    if not _SET_NAME.match(name):
      raise ValueError(f"set name {name!r} is not 1-64 letters, digits, '_', '.', '-'")
    if name in {n for n, _ in out}:
      raise ValueError(f"set name {name!r} appears twice")
    if spec.endswith(EVAL_SET_FILES):
      if not os.path.isfile(spec):
        raise ValueError(f"set {name!r}: no file {spec!r}")
    out.append((name, spec))
  return out


_NAME = optional(Check(lambda v: isinstance(v, str) and bool(v), "a non-empty string"))


@dataclasses.dataclass(frozen=True)
class Logging(Section):
  """Where metrics go besides <workdir>/metrics.jsonl (and TensorBoard, the top-level
  `tensorboard` switch): Weights & Biases (sao_jax/train/metrics.py; the `wandb` extra)."""

  NAME: ClassVar[str] = "logging"
  wandb: bool = knob(
    False,
    "Send every metric to Weights & Biases too, under the names and "
    'steps TensorBoard gets (metrics.metric_name, against "<stage>/step").',
    BOOL,
  )
  # None: W&B's environment variable (named in the doc), else the default after it.
  wandb_project: str | None = knob(
    None, 'The W&B project; None: $WANDB_PROJECT, else "sao-jax".', _NAME, placeholder=str
  )
  wandb_entity: str | None = knob(
    None,
    "The W&B entity (team or user); None: $WANDB_ENTITY, else the account's default.",
    _NAME,
    placeholder=str,
  )
  wandb_run_name: str | None = knob(
    None,
    "The run's display name; None: $WANDB_NAME, else the workdir's name.",
    _NAME,
    placeholder=str,
  )
  wandb_mode: str | None = knob(
    None,
    '"online", or "offline" (files under <workdir>/wandb, uploaded later with '
    "`wandb sync`); None: $WANDB_MODE, else online.",
    optional(one_of(("online", "offline"))),
    placeholder=str,
  )

  def check_together(self):
    import importlib.util

    if self.wandb and importlib.util.find_spec("wandb") is None:
      fail(
        "logging.wandb", self.wandb, "False without the wandb package (pip install -e '.[wandb]')"
      )


@dataclasses.dataclass(frozen=True)
class Checkpoint(Section):
  NAME: ClassVar[str] = "checkpoint"
  every: int = knob(25, "Steps between checkpoints.", integer(1))
  keep: int = knob(2, "Checkpoints kept.", integer(1))
  min_free_gb: float = knob(
    1.0, "Refuse to start with less free space than this under the workdir.", real(0)
  )


@dataclasses.dataclass(frozen=True)
class Faults(Section):
  """Fault injection for the fault suite and soak runs (sao_jax/train/faults.py):
  every n-th event fails on purpose; 0 is off, the default everywhere else."""

  NAME: ClassVar[str] = "faults"
  env_error_every: int = knob(
    0, "Every n-th environment step raises.", integer(0, note=" (0: off)")
  )
  env_garbage_every: int = knob(
    0,
    "Every n-th environment step returns garbage (not a StepResult).",
    integer(0, note=" (0: off)"),
  )
  malformed_every: int = knob(
    0,
    "Every n-th finished trajectory is corrupted before the ingestion queue.",
    integer(0, note=" (0: off)"),
  )
  nonfinite_every: int = knob(
    0,
    "Every n-th RL batch gets a NaN reward after validation (a non-finite update).",
    integer(0, note=" (0: off)"),
  )
  nonfinite_from_step: int = knob(
    0,
    "From this RL step on every batch is non-finite (0: never): the run must stop.",
    integer(0, note=" (0: off)"),
  )
  rollout_crash_every: int = knob(
    0, "The rollout thread dies after every n-th trajectory it emits.", integer(0, note=" (0: off)")
  )
  sigkill_after_rl_step: int = knob(
    0,
    "The trainer SIGKILLs itself once this RL step is done (0: never), its checkpoint "
    "save possibly still in flight: a kill at a known step.",
    integer(0, note=" (0: off)"),
  )
  sigterm_after_rl_step: int = knob(
    0,
    "The trainer sends itself SIGTERM once this RL step is done (0: never): a "
    "preemption notice at a known step (sao_jax/train/preemption.py).",
    integer(0, note=" (0: off)"),
  )
  sigterm_after_sft_step: int = knob(
    0,
    "The same once this SFT step is done (0: never): SFT's preemption notice.",
    integer(0, note=" (0: off)"),
  )


@dataclasses.dataclass(frozen=True)
class TopLevel(Section):
  """The run-wide fields at the config's top level (no section of their own)."""

  NAME: ClassVar[str] = ""
  seed: int = knob(0, "Seeds model init, prompt order, sampling.", integer())
  log_every: int = knob(10, "Steps between metrics lines / JSONL records.", integer(1))
  tensorboard: bool = knob(True, "Write TensorBoard event files beside metrics.jsonl.", BOOL)


# sao_jax/models/lora.py's default targets, regexes over parameter paths.
LORA_MLP_TARGETS = (r"/(mlp|moe|moe/shared)/(wi_gate|wi_up|wo)$",)
LORA_ACTOR_TARGETS = (r"/attn/(q|k|v|o)$",) + LORA_MLP_TARGETS


@dataclasses.dataclass(frozen=True)
class Lora(Section):
  """LoRA adapters over a frozen base for the actor and the critic
  (sao_jax/models/lora.py): SFT, value pretraining and RL train the adapters
  only; checkpoints hold them and a fingerprint of the base. The train steps
  merge W + (alpha / r) A @ B one layer at a time inside the model's layer
  scan; engines serve the whole merged model, merged at each version swap. A
  fleet's policy version is the adapters alone: each rollout builds the base
  itself, checks its fingerprint and merges (docs/design/weight_sync.md)."""

  NAME: ClassVar[str] = "lora"
  enabled: bool = knob(False, "Train LoRA adapters instead of the whole model.", BOOL)
  rank: int = knob(16, "r, the adapters' inner dimension (actor and critic).", integer(1))
  alpha: float = knob(
    32.0, "The scale's numerator: W + (alpha / r) A @ B (peft's lora_alpha).", real(0, above=True)
  )
  dropout: float = knob(
    0.0,
    "Dropout on the adapters' input: not built, must be 0.",
    Check(lambda v: v == 0, "0 (adapter dropout is not built)"),
  )
  actor_targets: tuple = knob(
    LORA_ACTOR_TARGETS,
    "Regexes over the actor's parameter paths (optim.param_path: "
    '"layer_0/attn/q", "layers/moe/wo") that get adapters: attention, MLP and '
    "experts by default. A path rl.actor_frozen names gets none.",
    Check(_is_regex_tuple, "a tuple of valid regexes"),
  )
  critic_targets: tuple = knob(
    LORA_MLP_TARGETS,
    "The critic's adapted paths: its MoE / MLP projections (its "
    "attention is frozen in SAO). It also carries the SFT policy's adapters on the "
    "actor's targets, frozen unless named here.",
    Check(_is_regex_tuple, "a tuple of valid regexes"),
  )
  critic_whole: tuple = knob(
    (r"^value_(head|bias)$",),
    "The critic's leaves trained whole (the new value head).",
    Check(_is_regex_tuple, "a tuple of valid regexes"),
  )
  base_dtype: str = knob(
    "",
    'The frozen base\'s dtype: "" the model\'s param_dtype, or "bfloat16" (half '
    "the bytes; the merge sums in float32 and rounds once).",
    one_of(("", "bfloat16", "float32")),
  )


# The typed sections of a run's config, by attribute name.
SECTIONS: dict[str, type[Section]] = {
  s.NAME: s
  for s in (
    Model,
    Env,
    Sharding,
    Distributed,
    Data,
    SFT,
    ValuePretrain,
    Rollout,
    RL,
    Fleet,
    Pod,
    Eval,
    Logging,
    Checkpoint,
    Faults,
    Lora,
  )
}
# Sections a config written before them may lack: they take their defaults.
OPTIONAL_SECTIONS = ("lora",)


@dataclasses.dataclass(frozen=True)
class Sections:
  """A run's config, typed and checked (`load`): what everything below the
  flag edge reads. The ConfigDict stays at that edge (launch/, experiments'
  `--set`, config.json); `run.build` turns it into this."""

  model: Model
  env: Env
  sharding: Sharding
  distributed: Distributed
  data: Data
  sft: SFT
  value_pretrain: ValuePretrain
  rollout: Rollout
  rl: RL
  fleet: Fleet
  pod: Pod
  eval: Eval
  logging: Logging
  checkpoint: Checkpoint
  faults: Faults
  lora: Lora = dataclasses.field(default_factory=Lora)
  top: TopLevel = dataclasses.field(default_factory=TopLevel)

  @property
  def seed(self) -> int:
    return self.top.seed

  @property
  def log_every(self) -> int:
    return self.top.log_every

  @property
  def tensorboard(self) -> bool:
    return self.top.tensorboard

  def replace(self, **changes) -> "Sections":
    """A copy with whole sections replaced (`sharding=s.sharding.replace(...)`)."""
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    """The config as plain nested data, in a ConfigDict's shape (W&B, logs)."""
    out = dataclasses.asdict(self.top)
    for name in SECTIONS:
      out[name] = dataclasses.asdict(getattr(self, name))
    return out


def load(config) -> Sections:
  """The typed, checked config of a ConfigDict (a Sections passes through);
  ConfigError on the first bad or missing field."""
  if isinstance(config, Sections):
    return config
  out = {}
  for name, cls in SECTIONS.items():
    if name not in config and name in OPTIONAL_SECTIONS:
      out[name] = cls()
      continue
    if name not in config:
      raise ConfigError(f"{name}: missing; configs derive from configs/common.py, which defines it")
    out[name] = cls.from_config(config[name])
  return Sections(**out, top=TopLevel.from_config(config))


def rollout(config) -> Rollout:
  """The rollout section of a Sections or a ConfigDict (engine and driver factories)."""
  return config.rollout if isinstance(config, Sections) else Rollout.from_config(config.rollout)
