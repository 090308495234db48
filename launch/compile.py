"""Compiles the trainer's and the rollout engine's programs for a TPU topology, on a CPU host.

    python launch/compile.py --config=configs/sao_moe.py --topology=v5p-256 \
        [--rollout_topology=v5p-8 --rollout_mesh=expert:2,tensor:2] [--out=compile.json] \
        [--programs=sft,value,rl,prefill,decode,decode_loop] [--min_headroom=0.10] \
        [--config.model.overrides.num_layers=2]

No TPU is reachable from the project's machines, but the TPU compiler is:
libtpu (`pip install -e '.[aot]'`) compiles for a topology it only knows by
name (docs/DESIGN.md section 8). This script lowers the very programs the
trainer runs -- `factories.build_programs` builds them for the trainer too --
with the config's own mesh, sharding rules and batch shapes, on the
topology's devices. Inputs are `jax.ShapeDtypeStruct`s carrying shardings,
from `jax.eval_shape` of the initialisers: nothing is allocated, so a 30B
model compiles on a laptop.

The TPU compiler refuses a program that does not fit a chip's HBM ("Ran
out of memory on HBM"), and reports per-chip argument / output / temporary
/ aliased bytes of one that does. Each program gets a row: compile time,
those figures, their total against the chip's HBM, the headroom left and
FITS / DOES NOT FIT; a refused compile is a DOES NOT FIT row with the
compiler's message, not a crash. The exit status is 0 only when every
program fits with at least --min_headroom of HBM to spare, so the same
command is a gate in CI and the first thing to run on a real pod.

Programs and the shapes they are compiled at:

  sft      SFT step: sft.batch_size packed rows of max(data.buckets) tokens
  value    value-pretraining step (one critic update): rl.batch_size rows
  rl       RL step (K critic updates + the actor update): rl.batch_size rows
  prefill  the rollout engine's step appending [rollout.slots, W] tokens to
           a [slots, rollout.max_len] cache; W = the engine's largest prefill
           bucket, max_len: the widest step the driver sends (a "recompute"
           weight swap re-feeds whole records, and an append wider than the
           engine's 256-token bucket is padded to max_len); the model runs
           it model.prefill_chunk tokens at a time, so W changes the token
           arrays' size, not the per-chunk activations
  decode   the same step with one token per slot (`PolicyEngine.generate`)
  decode_loop  the driver's decode (`PolicyEngine.decode`): the jitted while
           loop of rollout.decode_steps one-token steps with per-slot stops

--rows, --length and --prefill_len override those shapes.

The engine's KV capacity is reported with its programs (a "rollout KV"
line, the engine rows' shapes, and "rollout_pool" in the JSON): the live
tokens its cache holds -- a paged pool's pages x page_size, a dense cache's
slots x max_len -- in all and per slot group (a sharded engine's pool
splits over the batch axes, each group serving its own slots), as a
fraction of slots x max_len, in max_len trajectories a group, and in bytes
a chip.

The rollout on a slice of its own (rl.mode "fleet": each launch/rollout.py
process runs an engine over its host's chips): --rollout_topology names
what one engine spans (v5p-8: one v5p host, 4 chips) and the config's
rollout.mesh (or --rollout_mesh) its mesh, the one launch/rollout.py lays
its engine on (`factories.engine_mesh`); the trainer's programs are
compiled on --topology in the same run, the whole chain in one command
(configs/sao_moe_128k.py gives it).

With `rollout.sharded_engine` on the trainer's own topology (colocated),
rows "rl+eng" (and "sft+eng", "value+eng") add the engine's resident
params and KV cache (its step's argument bytes) to each train step's total:
computed from the compiled figures, not compiled together, and part of
the exit status.

With --rollout_topology and `fleet.weights_path` "direct" (the default),
rows "prefill+next", "decode+next" and "decode_loop+next" add the standby
copy a rollout engine holds while the next version arrives (the transfer
plan's `standby_bytes_per_rollout_device`) to each engine program, and
"rl+snapshot" the trainer's `weight_transfer.KEEP_SNAPSHOTS` served
snapshots (`snapshot_bytes_per_trainer_device` each) to the RL step:
computed the same way, part of the exit status.

The RL step's time is modeled (sao_jax/train/steptime.py; a "[compile] step
time:" line, "step_time" and "version_time" in the JSON): the compiled
rl program's `cost_analysis()` FLOPs and HBM bytes per chip at the chip's
published bf16 peak, --mfu of it (default 0.4, an assumption), or its HBM
bandwidth, whichever binds; XLA counts each while-loop body once, so with
the scanned layer stack the figure is a lower bound and the layer-scaled
one (x num_layers) is given beside it. A version's seconds into one
rollout host follow from the plan's bytes per host at the published v5p
DCN rate (25 GB/s a 4-chip host) and at the TCP rate peers measured
(3.59 GB/s); their ratio to the step is the policy lag in steps.

With `lora.enabled` the train steps take the frozen bases as their last
argument (`factories.abstract_bases`; the critic's trunk is passed once, as
the trainer's one set of arrays), the engines the merged params; a
"[compile] trainer:" line and "lora" / "resident" in the JSON give the rank,
targets and base dtype, and the state and base a chip holds from the start.

Topologies: Cloud TPU names (v5p-256, v5e-4, v6e-8, v4-16) or libtpu's own
(v5p:4x4x8, v5e:2x2). Mind that v5p and v4 names count TensorCores, two per
chip: v5p-128 is 64 chips (4x4x4) and the 128-chip slice is v5p-256.

`--config.model.overrides.FIELD=VALUE` sets a ModelConfig field (e.g.
num_layers=2) even though the configs' override dicts are empty and locked.
"""

import contextlib
import dataclasses
import math
import datetime
import functools
import os
import re
import subprocess
import sys
import threading
import time

# The host's own devices only run eval_shape; the programs are compiled for
# the topology's devices. Without this JAX would try to claim a local TPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes an exclusive lock (/tmp/libtpu_lockfile) to own the local
# chips; compiling for a topology owns none, and two compiles (parallel
# tests, a background record run) must not refuse each other.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.experimental import topologies
from ml_collections import config_flags

from sao_jax.algo import advantages
from sao_jax.train import configuration
from sao_jax.train import factories
from sao_jax.data import files
from sao_jax.models import lora
from sao_jax.models import policy
from sao_jax.models import precision
from sao_jax.config import sections
from sao_jax.models import sharding
from sao_jax.train import steptime
from sao_jax.transport import weight_transfer
from sao_jax.data import packing
from sao_jax.rollout import programs as programs_lib

PROGRAMS = ("sft", "value", "rl", "prefill", "decode", "decode_loop")
GIB = 2**30

# --config files import the repository's `configs` package, which is not
# installed: this checkout's root joins sys.path, whatever the working directory.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "TPU topology of the trainer: v5p-256, v5e-4, or libtpu's v5p:4x4x8.")
_ROLLOUT_TOPOLOGY = flags.DEFINE_string(
    "rollout_topology", None, "Topology of the rollout slice (default: --topology).")
_OUT = flags.DEFINE_string("out", None, "Write the results here as JSON.")
_PROGRAMS = flags.DEFINE_list("programs", list(PROGRAMS), f"Which of {PROGRAMS} to compile.")
_MIN_HEADROOM = flags.DEFINE_float(
    "min_headroom", 0.10, "Fraction of HBM each program must leave free to count as fitting.")
_ROWS = flags.DEFINE_integer("rows", None, "Packed rows of the train steps (default: the "
                             "config's sft.batch_size / rl.batch_size).")
_LENGTH = flags.DEFINE_integer("length", None, "Tokens per packed row (default: "
                               "max(data.buckets), the largest bucket).")
_ROLLOUT_MESH = flags.DEFINE_string(
    "rollout_mesh", None, "The rollout engine's mesh over the rollout topology, e.g. "
    "expert:2,tensor:2: sets rollout.mesh (default: the config's rollout.mesh; empty, the "
    "trainer's mesh with rollout.sharded_engine, else one chip, as the run's engine).")
_PREFILL_LEN = flags.DEFINE_integer("prefill_len", None, "Width of the prefill step "
                                    "(default: the engine's largest bucket, rollout.max_len).")
_DUMP_HLO = flags.DEFINE_string("dump_hlo", None, "Write each compiled program's HLO text "
                                "here (<program>.hlo.txt).")
_MFU = flags.DEFINE_float("mfu", 0.4, "Fraction of the chip's peak bf16 FLOP/s the modeled "
                          "RL step reaches (an assumption: the step-time model's one knob).")
_HEARTBEAT_S = flags.DEFINE_integer("heartbeat_s", 60, "Seconds between progress lines.")
flags.mark_flags_as_required(["config", "topology"])

# HBM per device that the TPU compiler holds programs to (its own "available
# HBM" figure), by device kind. libtpu's compile-only devices do not report
# memory (memory_stats() needs an addressable device), so these were read off
# the compiler's out-of-memory message on each kind with libtpu 0.0.42:
# v5p 95 GiB per chip, v5e 16 GiB, v6e 32 GiB, less what the runtime keeps;
# a v4 topology has one device per TensorCore, each with half of the chip's
# 32 GiB.
HBM_BYTES = {
    "TPU v5": 95.74 * GIB, "TPU v5p": 95.74 * GIB,
    "TPU v5 lite": 15.75 * GIB, "TPU v5e": 15.75 * GIB,
    "TPU v6 lite": 31.25 * GIB, "TPU v6e": 31.25 * GIB,
    "TPU v4": 15.25 * GIB,
}

# Cloud TPU generation names -> (libtpu's name, TensorCores per chip, 3-D torus).
_GENERATIONS = {"v5p": ("v5p", 2, True), "v4": ("v4", 2, True), "v5e": ("v5e", 1, False),
                "v5litepod": ("v5e", 1, False), "v6e": ("v6e", 1, False)}


def topology_name(name: str) -> str:
  """libtpu's topology name ("v5p:4x4x8") for a Cloud TPU name ("v5p-256") or itself.

  Cloud names count TensorCores for v4 and v5p (two per chip) and chips for
  v5e and v6e. The torus shapes are the standard slice shapes: starting at
  2x2x1 (3-D) or 1x1 (2-D), each doubling doubles the smallest dimension
  (the last one among equals), which gives v5p-128 = 4x4x4, v5p-256 =
  4x4x8, v5e-16 = 4x4, v5e-32 = 4x8.
  """
  if ":" in name:
    return name
  m = re.fullmatch(r"(v5p|v4|v5e|v5litepod|v6e)-(\d+)", name)
  if not m:
    raise configuration.ConfigError(
        f"--topology={name!r}: expected a Cloud TPU name like v5p-256 / v5e-4 / v6e-8, or "
        "libtpu's like v5p:4x4x8 / v5e:2x2")
  gen, cores_per_chip, torus3d = _GENERATIONS[m.group(1)]
  count = int(m.group(2))
  chips = count // cores_per_chip
  smallest = 4 if torus3d else 1
  if count % cores_per_chip or chips < smallest or chips & (chips - 1):
    raise configuration.ConfigError(
        f"--topology={name!r}: {m.group(1)} slices here are {smallest} chips or a power of "
        f"two above ({cores_per_chip} per chip in the name); give libtpu's name (e.g. "
        f"{gen}:4x4x12) for other shapes")
  dims = [2, 2, 1] if torus3d else [1, 1]
  while int(np.prod(dims)) < chips:
    low = min(dims)
    i = max(j for j, d in enumerate(dims) if d == low)
    dims[i] *= 2
  return f"{gen}:{'x'.join(map(str, dims))}"


def topology_devices(name: str):
  """(libtpu's name, the topology's devices) for compiling without the hardware."""
  tname = topology_name(name)
  # libtpu's default host is 2x2x1 chips; a slice smaller than that (a v5e-1
  # or v6e-1, Colab's TPUs) is one host of its own size.
  dims = [int(d) for d in tname.split(":")[1].split("x")]
  kw = ({"chips_per_host_bounds": tuple(dims + [1] * (3 - len(dims)))}
        if int(np.prod(dims)) < 4 else {})
  try:
    topo = topologies.get_topology_desc(platform="tpu", topology_name=tname, **kw)
  except Exception as e:  # pylint: disable=broad-except
    raise configuration.ConfigError(f"--topology={name!r} ({tname}): libtpu refused it: "
                                    f"{_first_line(str(e))}") from None
  return tname, list(topo.devices)


def hbm_bytes(device) -> float:
  kind = device.device_kind
  if kind not in HBM_BYTES:
    raise configuration.ConfigError(f"no HBM size known for device kind {kind!r}; add it to "
                                    "HBM_BYTES in launch/compile.py")
  return HBM_BYTES[kind]


# --------------------------------------------------------------- config


def pop_model_overrides(argv: list[str]) -> dict:
  """Removes `--config.model.overrides.FIELD=VALUE` from argv; returns {FIELD: VALUE}.

  The configs' `model.overrides` is an empty, locked dict, so ml_collections'
  flag parser refuses new keys in it; ModelConfig fields (num_layers, and
  scan / remat / attention switches as they land) are exactly what one
  wants to vary when sizing a pod. Values are Python literals where they
  parse (2, True, 0.5) and strings otherwise ("splash").
  """
  out, prefix = {}, "--config.model.overrides."
  for arg in list(argv):
    if arg.startswith(prefix):
      key, sep, value = arg[len(prefix):].partition("=")
      if not sep or not key:
        raise SystemExit(f"error: {arg!r}: write {prefix}FIELD=VALUE")
      out[key] = configuration.parse_literal(value)
      argv.remove(arg)
  return out


_MODEL_OVERRIDES: dict = {}


def _git_commit() -> str | None:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True, timeout=30).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True, check=True, timeout=30).stdout
    return head + ("+uncommitted" if dirty.strip() else "")
  except (OSError, subprocess.SubprocessError):
    return None


# --------------------------------------------------------------- programs


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


def abstract_batch(rows: int, length: int, batch_sharding, action_index: bool = False,
                   routing: tuple[int, int] | None = None) -> dict:
  """A packed batch `[rows, length]` of ShapeDtypeStructs, dtypes from `packing.pack`.

  With `action_index` (`data.logits_at_actions`) the batch carries it at its
  widest, `[rows, length]` (a row of action tokens only): the head's worst case.
  With `routing` (M, k) (`rl.routing_replay`) it carries the recorded expert
  choices `[rows, length, M, k]`.
  """
  example = packing.pack([], 1, (8,), action_index=action_index, routing=routing)
  return {k: jax.ShapeDtypeStruct((rows, length) + v.shape[2:], v.dtype,
                                  sharding=batch_sharding)
          for k, v in example.items()}


def train_programs(config, progs: factories.Programs, mesh, topo: str, hbm: float,
                   model_cfg, bases=None) -> dict:
  """The trainer's sft / value / rl steps at the largest bucket, as it calls them:
  with LoRA, the bases (`factories.abstract_bases`) as each step's last
  argument, the critic's trunk passed once (`shared_trunk`)."""
  length = _LENGTH.value or max(config.data.buckets)
  rl_rows = _ROWS.value or config.rl.batch_size
  sft_rows = _ROWS.value or config.sft.batch_size
  state = progs.abstract_state
  # The trainer calls its sft, value and rl steps inside its mesh and
  # logical-axis rules, which turn the model's activation annotations into
  # sharding constraints; all three are lowered the same way here.
  ctx = lambda: _in_mesh(mesh, progs.rules)
  at_actions = config.data.get("logits_at_actions", False)
  replay = ((model_cfg.num_moe_layers, model_cfg.experts_per_token)
            if config.rl.get("routing_replay") else None)
  rl_batch = abstract_batch(rl_rows, length, progs.batch_sharding, at_actions, replay)
  sft_batch = abstract_batch(sft_rows, length, progs.batch_sharding, at_actions)
  step, tail = (lambda fn, donate: fn), ()
  if bases is not None:
    step = shared_trunk
    tail = (bases[0], {k: v for k, v in bases[1].items() if k not in bases[0]})
  return {
      "sft": Program("sft", step(progs.sft_step, (0, 1)),
                     (state.policy, state.policy_opt, sft_batch) + tail,
                     f"{sft_rows}x{length}", topo, hbm, ctx),
      "value": Program("value", step(progs.value_step, (0,)),  # packed without action_index
                       (state, abstract_batch(rl_rows, length, progs.batch_sharding)) + tail,
                       f"{rl_rows}x{length}", topo, hbm, ctx),
      "rl": Program("rl", step(progs.rl_step, (0,)), (state, rl_batch) + tail,
                    f"{rl_rows}x{length} K={config.rl.critic_updates}", topo, hbm, ctx),
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


def chip_bytes(tree) -> int:
  """Bytes a chip holds of a tree of sharded ShapeDtypeStructs (each leaf's shard)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def resident_report(progs: factories.Programs) -> dict:
  """What the trainer holds a chip from the start (`Programs.abstract_resident`):
  the state (its optimizer's part apart), with LoRA and the frozen policy base
  (the critic's trunk is the same arrays)."""
  state = progs.abstract_state
  base = chip_bytes(progs.lora.abstract_base) if progs.lora is not None else 0
  return {"state_bytes_per_chip": chip_bytes(state),
          "optimizer_bytes_per_chip": chip_bytes((state.policy_opt, state.critic_opt)),
          "base_bytes_per_chip": base, "resident_bytes_per_chip": chip_bytes(
              progs.abstract_resident)}


def lora_settings(config, progs: factories.Programs) -> dict | None:
  """LoRA's settings (None without it): rank, targets, the base's dtype, adapters' size."""
  if progs.lora is None:
    return None
  c, state = sections.Lora.of(config.lora), progs.abstract_state
  return {"rank": c.rank, "alpha": c.alpha, "actor_targets": list(c.actor_targets),
          "critic_targets": list(c.critic_targets), "critic_whole": list(c.critic_whole),
          "base_dtype": jnp.dtype(jax.tree.leaves(progs.lora.abstract_base)[0].dtype).name,
          "adapter_params": lora.count((state.policy, state.critic))}


def format_resident(res: dict, lora_s: dict | None, hbm: float) -> str:
  head = "full fine-tuning" if lora_s is None else (
      f"LoRA rank {lora_s['rank']} (alpha {lora_s['alpha']:g}) on actor "
      f"{','.join(lora_s['actor_targets'])}, critic {','.join(lora_s['critic_targets'])}; "
      f"{lora_s['adapter_params'] / 1e6:.2f}M adapter params over a {lora_s['base_dtype']} "
      "base")
  return (f"{head}; resident a chip {_size(res['resident_bytes_per_chip'])} "
          f"({res['resident_bytes_per_chip'] / hbm:.0%} of HBM) = state "
          f"{_size(res['state_bytes_per_chip'])} (optimizer "
          f"{_size(res['optimizer_bytes_per_chip'])}) + base {_size(res['base_bytes_per_chip'])}")


@contextlib.contextmanager
def _in_mesh(mesh, rules):
  """A mesh and logical-axis rules for tracing, as the trainer and the engine set them.

  `jax.set_mesh`, not `with mesh:`: flax resolves the model's activation
  constraints against the abstract mesh, which the old context manager no
  longer sets, so under it every constraint would be silently dropped.
  """
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def _size(n: float) -> str:
  for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n:.0f} B"


def format_capacity(cap: dict) -> str:
  """An engine's KV capacity (`EnginePrograms.capacity`) in one line."""
  groups = (f", {cap['groups']} slot groups of {cap['slots_per_group']} slots: "
            f"{cap['live_tokens_per_group']:,} a group" if cap["groups"] > 1 else "")
  head = (f"paged: {cap['pages']:,} pages of {cap['page_size']} = "
          if cap["kind"] == "paged" else "dense: ")
  return (f"{head}{cap['live_tokens']:,} live tokens, {cap['fraction_of_dense']:.3f} of "
          f"slots x max_len ({cap['slots']} x {cap['max_len']:,}){groups}; "
          f"{cap['max_len_trajectories_per_group']:.2f} max_len trajectories a group; "
          f"{_size(cap['bytes_per_device'])} a chip")


def precision_report(model_cfg, abstract_policy) -> dict:
  """The trained params' dtype and bytes, and the engines' copy (precision.py):
  its dtype and bytes are what one policy version moves to each engine."""
  master = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract_policy))
  dtypes = {jnp.dtype(x.dtype).name for x in jax.tree.leaves(abstract_policy)}
  return {"param_dtype": (dtypes.pop() if len(dtypes) == 1  # a LoRA base's own dtype
                          else jnp.dtype(model_cfg.param_dtype).name),
          "compute_dtype": jnp.dtype(model_cfg.dtype).name, "master_bytes": master,
          "serving_dtype": jnp.dtype(precision.serving_config(model_cfg).param_dtype).name,
          "version_bytes": precision.serving_bytes(model_cfg, abstract_policy)}


def transfer_report(model_cfg, abstract_policy, engine_params) -> dict:
  """The direct weight path's plan (weight_transfer.plan) from the trainer's
  layout of the engines' copy into one rollout engine's: bytes per rollout
  engine and per trainer host for one version, and the double buffers."""
  serving = jax.eval_shape(functools.partial(precision.cast_for_serving, model_cfg),
                           abstract_policy)
  src = [(x.shape, s.dtype, x.sharding) for x, s in
         zip(jax.tree.leaves(abstract_policy), jax.tree.leaves(serving))]
  return weight_transfer.report(src, [(x.shape, x.sharding)
                                      for x in jax.tree.leaves(engine_params)])


def format_transfer(t: dict) -> str:
  return (f"one version {_size(t['version_bytes'])} in {t['pieces']} pieces, each pulled "
          f"once per rollout engine over {t['destination_devices']} devices (max "
          f"{_size(t['max_bytes_per_rollout_device'])} per device, then "
          f"{_size(t['local_copy_bytes_per_engine'])} of local copies); per trainer host "
          f"{_size(t['min_bytes_per_trainer_host'])}-{_size(t['max_bytes_per_trainer_host'])} "
          f"per engine ({t['trainer_hosts']} hosts); double buffers +"
          f"{_size(t['snapshot_bytes_per_trainer_device'])} per trainer device, +"
          f"{_size(t['standby_bytes_per_rollout_device'])} per rollout device")


def format_precision(p: dict) -> str:
  return (f"{p['param_dtype']} master weights ({p['master_bytes'] / GIB:.2f} GiB), "
          f"{p['compute_dtype']} compute; engines hold {p['serving_dtype']} "
          f"({p['version_bytes'] / GIB:.2f} GiB a version)")


def rollout_section(config) -> sections.Rollout:
  """The config's rollout section, with --rollout_mesh as its mesh when given."""
  r = sections.rollout(config)
  if _ROLLOUT_MESH.value:
    try:
      r = r.replace(mesh=_ROLLOUT_MESH.value)
    except configuration.ConfigError as e:
      raise configuration.ConfigError(f"--rollout_mesh={_ROLLOUT_MESH.value}: {e}") from None
  return r


def engine_programs(config, model_cfg, abstract_policy, devices, topo: str, hbm: float,
                    train_mesh=None) -> tuple[dict, str, dict]:
  """The rollout engine's programs: prefill, decode (one token) and decode_loop.

  Returns ({name: Program}, the engine's layout in words, its KV capacity:
  `EnginePrograms.capacity`, the live tokens its cache or page pool holds).

  The layout is the one the run would use (`factories.engine_mesh`):
  `rollout.mesh` (or --rollout_mesh, which sets it) over the rollout
  topology's devices; else with `rollout.sharded_engine` the trainer's
  colocated engine on the trainer's mesh (`train_mesh`), or, on a rollout
  topology of its own, {"data": -1} over its devices (a fleet rollout
  process's engine over its host's chips); else one device holding params
  and the dense [slots, max_len] cache (or, with `rollout.kv_cache`
  "paged", the pool of pages), on the rollout topology's first chip.

  The programs are the engine's own (`EnginePrograms.for_rollout`: the
  same jitted functions, static args, shardings and donation
  `PolicyEngine` runs), built without an engine, which would copy real
  params onto devices. prefill and decode are `PolicyEngine.step` at
  [slots, W] and [slots, 1]; decode_loop is `PolicyEngine.decode`, the
  driver's decode, at `rollout.decode_steps` iterations, with no stop
  token (the driver's turn-end id is a constant of the loop, not a shape).
  All attend over the whole cache (kv bucket max_len).
  """
  r = rollout_section(config)
  width = _PREFILL_LEN.value or r.max_len
  where = (f"rollout.mesh={r.mesh}" if r.mesh else "one chip" if not r.sharded_engine
           else "the trainer's mesh (colocated)" if train_mesh is not None
           else "data:-1 over the rollout topology")
  try:
    mesh = factories.engine_mesh(r, devices, trainer_mesh=train_mesh)
    if mesh is not None:
      progs = programs_lib.EnginePrograms.for_rollout(
          model_cfg, r, mesh=mesh, record_routing=bool(config.rl.get("routing_replay")))
      layout = f"mesh {dict(mesh.shape)}"
    else:
      # A one-device mesh on the target's first chip (EnginePrograms(device=)),
      # so that the model traces the TPU paths (attention.compile_platform),
      # not the host's.
      progs = programs_lib.EnginePrograms.for_rollout(
          model_cfg, r, device=devices[0], record_routing=bool(config.rl.get("routing_replay")))
      layout = "1 chip"
  except ValueError as e:  # a mesh, slots or pages that do not split over the devices
    raise configuration.ConfigError(
        f"the rollout engine on {where}: {e}; give the rollout slice its own layout "
        "(--rollout_topology, rollout.mesh or --rollout_mesh) or compile "
        "--programs=sft,value,rl") from None

  steps = r.decode_steps
  cap = progs.capacity()
  cache_shape = f"cache {r.slots}x{r.max_len}, {layout}"
  if progs.paged:
    cache_shape = (f"cache {r.slots}x{r.max_len} paged: {progs.num_pages} pages of "
                   f"{progs.page_size} = {cap['live_tokens']:,} live tokens "
                   f"({cap['fraction_of_dense']:.3f} of slots x max_len), {layout}")
  step = progs.step(None)
  return {
      "prefill": Program("prefill", step, progs.step_args(abstract_policy, width),
                         f"{r.slots}x{width}, {cache_shape}", topo, hbm, progs.context),
      "decode": Program("decode", step, progs.step_args(abstract_policy, 1),
                        f"{r.slots}x1, {cache_shape}", topo, hbm, progs.context),
      "decode_loop": Program("decode_loop", progs.decode(None, steps, -1),
                             progs.decode_args(abstract_policy),
                             f"{r.slots}x1 x {steps} steps, {cache_shape}", topo, hbm,
                             progs.context),
  }, layout, cap


# --------------------------------------------------------------- compiling


def _first_line(msg: str, limit: int = 400) -> str:
  lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
  pick = next((ln for ln in lines if "memory" in ln.lower()), lines[0] if lines else "")
  return pick[:limit]


def _gib_in(pattern: str, msg: str) -> float | None:
  m = re.search(pattern + r"\s*\(([\d.]+)([KMGT])\)", msg)
  if not m:
    return None
  return float(m.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]


@contextlib.contextmanager
def _heartbeat(name: str, start: float, every: int):
  """Prints a progress line every `every` seconds while a compile runs (they take minutes)."""
  done = threading.Event()

  def beat():
    while not done.wait(every):
      print(f"[compile] {name}: still compiling, {time.time() - start:.0f} s", flush=True)

  t = threading.Thread(target=beat, daemon=True)
  t.start()
  try:
    yield
  finally:
    done.set()
    t.join()


def compile_one(p: Program, min_headroom: float) -> dict:
  """Lowers and compiles `p`; its row: timings, per-chip bytes and the verdict."""
  row = {"program": p.name, "shape": p.shape, "topology": p.topology, "hbm_bytes": p.hbm}
  start, cpu_start = time.time(), time.process_time()
  print(f"[compile] {p.name} ({p.shape}) on {p.topology}: lowering", flush=True)
  try:
    with _heartbeat(p.name, start, _HEARTBEAT_S.value):
      with p.context():
        lowered = p.fn.lower(*p.args)
      row["lower_s"] = round(time.time() - start, 2)
      print(f"[compile] {p.name}: lowered in {row['lower_s']:.1f} s; compiling", flush=True)
      compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    msg = str(e)
    row["compile_s"] = round(time.time() - start, 2)
    row["cpu_s"] = round(time.process_time() - cpu_start, 2)
    if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower():
      row.update(status="DOES NOT FIT", fits=False, message=_first_line(msg),
                 required_bytes=_gib_in(r"HLO temporaries", msg),
                 compiler_hbm_bytes=_gib_in(r"available HBM", msg))
    else:
      row.update(status="ERROR", fits=False, message=f"{type(e).__name__}: {_first_line(msg)}")
    print(f"[compile] {p.name}: {row['status']} after {row['compile_s']:.0f} s: "
          f"{row['message']}", flush=True)
    return row
  row["compile_s"] = round(time.time() - start, 2)
  # CPU seconds of this process (all its threads): on a shared host the wall
  # time says more about the neighbours than about the program.
  row["cpu_s"] = round(time.process_time() - cpu_start, 2)
  hlo = compiled.as_text()
  row["collectives"] = collectives(hlo)
  # Per-chip FLOPs and HBM bytes as XLA's cost model counts them (each
  # while-loop body once): the RL step's time model (sao_jax/train/steptime.py).
  row["cost"] = steptime.cost(compiled)
  row["while_loops"] = steptime.while_loops(hlo)
  if _DUMP_HLO.value:
    os.makedirs(_DUMP_HLO.value, exist_ok=True)
    with open(os.path.join(_DUMP_HLO.value, f"{p.name}.hlo.txt"), "w", encoding="utf-8") as f:
      f.write(hlo)
  m = compiled.memory_analysis()
  arg, out = m.argument_size_in_bytes, m.output_size_in_bytes
  temp, alias = m.temp_size_in_bytes, m.alias_size_in_bytes
  code = m.generated_code_size_in_bytes
  # Donated arguments (alias) are counted in both argument and output bytes
  # but live once.
  total = arg + out - alias + temp + code
  headroom = 1.0 - total / p.hbm
  fits = headroom >= min_headroom
  row.update(argument_bytes=arg, output_bytes=out, temp_bytes=temp, alias_bytes=alias,
             code_bytes=code, total_bytes=total,
             peak_bytes=getattr(m, "peak_memory_in_bytes", None), headroom=headroom,
             fits=fits, status="FITS" if fits else "DOES NOT FIT")
  if not fits:
    row["message"] = (f"{total / GIB:.2f} GiB of {p.hbm / GIB:.2f} GiB leaves "
                      f"{headroom:.1%} headroom, less than --min_headroom={min_headroom:.0%}")
  print(f"[compile] {p.name}: compiled in {row['compile_s']:.0f} s ({row['cpu_s']:.0f} CPU s), "
        f"{total / GIB:.2f} GiB per chip: {row['status']}", flush=True)
  return row


_COLLECTIVE = re.compile(
    r"= (.+?) (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)"
    r"(?:-start)?\(")
_TYPED = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64)"
                    r"\[([0-9,]*)\]")


def collectives(hlo_text: str) -> dict:
  """{op: {dtype: {"count", "bytes"}}} over the compiled program's cross-chip collectives.

  What each collective carries decides the precision of the sums crossing
  chips (a gradient reduce-scattered in bf16 is summed in bf16) and the
  bytes on the interconnect: the element types and sizes of each
  collective's result, per chip (an async "-start" op's result tuple holds
  its operand too, so its bytes count both).
  """
  out: dict = {}
  for m in _COLLECTIVE.finditer(hlo_text):
    for dtype, dims in _TYPED.findall(m.group(1)):
      size = math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
      entry = out.setdefault(m.group(2), {}).setdefault(dtype, {"count": 0, "bytes": 0})
      entry["count"] += 1
      entry["bytes"] += size
  return out


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def colocated_rows(rows: list[dict], min_headroom: float) -> list[dict]:
  """Train step + the colocated engine's resident state, per chip (computed, not compiled).

  A colocated engine (rollout.sharded_engine on the trainer's mesh) keeps
  its params and KV cache on the same chips while each train step runs, so
  what must fit is a train step's total plus the engine step's arguments
  (params + cache + slot state). Each program's own temporaries are not
  live at the same time (the trainer and the engine run one after the
  other), so the engine's temporaries are not added; the largest of the
  engine programs' arguments is. One row per train step compiled.
  """
  by_name = {r["program"]: r for r in rows}
  engine = [by_name[n] for n in ("prefill", "decode", "decode_loop")
            if by_name.get(n, {}).get("argument_bytes") is not None]
  out = []
  if not engine:
    return out
  resident = max(r["argument_bytes"] for r in engine)
  for name in ("sft", "value", "rl"):
    r = by_name.get(name)
    if r is not None and r.get("total_bytes") is not None:
      out.append(_added_row(r, f"{name}+eng", "engine params and cache", resident,
                            min_headroom))
  return out


def _added_row(r: dict, name: str, what: str, added: float, min_headroom: float) -> dict:
  """Row `r`'s program with `added` bytes a chip resident beside it (computed, not compiled);
  `argument_bytes` holds the bytes added."""
  total = r["total_bytes"] + added
  headroom = 1.0 - total / r["hbm_bytes"]
  fits = headroom >= min_headroom
  row = {"program": name, "shape": f"{r['shape']} + {what}", "topology": r["topology"],
         "hbm_bytes": r["hbm_bytes"], "compile_s": 0.0, "argument_bytes": added,
         "total_bytes": total, "headroom": headroom, "fits": fits,
         "status": "FITS" if fits else "DOES NOT FIT", "computed": True}
  if not fits:
    row["message"] = (f"{total / GIB:.2f} GiB of {r['hbm_bytes'] / GIB:.2f} GiB leaves "
                      f"{headroom:.1%} headroom, less than --min_headroom={min_headroom:.0%}")
  return row


def double_buffer_rows(rows: list[dict], transfer: dict, min_headroom: float) -> list[dict]:
  """The direct weight path's second copies, per chip (computed, not compiled).

  While a version arrives the rollout engine keeps generating with the one
  it holds, so each engine program runs beside the standby copy
  (`standby_bytes_per_rollout_device`): rows "prefill+next", "decode+next",
  "decode_loop+next". The trainer serves the newest `KEEP_SNAPSHOTS`
  versions from snapshots on its chips while it trains: row
  "rl+snapshot" adds that many `snapshot_bytes_per_trainer_device`.
  """
  by_name = {r["program"]: r for r in rows}
  out = []
  for name in ("prefill", "decode", "decode_loop"):
    r = by_name.get(name)
    if r is not None and r.get("total_bytes") is not None:
      out.append(_added_row(r, f"{name}+next", "next version",
                            transfer["standby_bytes_per_rollout_device"], min_headroom))
  r = by_name.get("rl")
  if r is not None and r.get("total_bytes") is not None:
    keep = weight_transfer.KEEP_SNAPSHOTS
    out.append(_added_row(r, "rl+snapshot", f"{keep} snapshots",
                          keep * transfer["snapshot_bytes_per_trainer_device"], min_headroom))
  return out


def step_time_model(rows: list[dict], transfer: dict | None, devices, rdevices,
                    model_cfg, config) -> tuple[dict, dict | None] | None:
  """(the RL step's modeled time, a version's) from the rl row's cost and the plan, or None
  without an rl row. A scanned layer stack's loop runs num_layers times: the
  layer-scaled estimate. Beside them, the step counted from the model's shape
  (`steptime.rl_step_flops` at the rl program's rows x length)."""
  rl = next((r for r in rows if r["program"] == "rl"), None)
  if rl is None:
    return None
  if not rl.get("fits") and rl.get("total_bytes") is None:
    step = {"available": False, "reason": "the RL step did not compile"}
  else:
    scale = model_cfg.num_layers if getattr(model_cfg, "scan_layers", False) else 1
    step = steptime.step_model(rl.get("cost"), devices[0].device_kind, _MFU.value,
                               loops=rl.get("while_loops", 0), loop_scale=scale)
    if step.get("available"):
      counted = steptime.rl_step_flops(
          model_cfg, _ROWS.value or config.rl.batch_size,
          _LENGTH.value or max(config.data.buckets),
          critic_updates=(config.rl.critic_updates
                          if advantages.ESTIMATORS[config.rl.advantage].uses_critic else 0),
          remat=model_cfg.remat != "none", causal_skip=model_cfg.attention_impl == "splash")
      step["analytic"] = {**steptime.analytic_step(counted["total"], len(devices),
                                                   devices[0].device_kind, _MFU.value),
                          "flops": counted}
  version = None
  if transfer is not None:
    version = steptime.version_model(transfer["bytes_per_rollout_engine"], len(rdevices),
                                     rdevices[0].device_kind, step)
  return step, version


def format_table(rows: list[dict]) -> str:
  head = (f"{'program':<11} {'shape':<46} {'compile s':>9} {'cpu s':>7} {'args GiB':>9} "
          f"{'out GiB':>8} {'temp GiB':>9} {'alias GiB':>9} {'total GiB':>9} {'HBM GiB':>8} "
          f"{'headroom':>8}  verdict")
  lines = [head, "-" * len(head)]
  g = lambda r, k: f"{r[k] / GIB:.3f}" if r.get(k) is not None else "-"
  for r in rows:
    total = g(r, "total_bytes")
    if r.get("total_bytes") is None and r.get("required_bytes"):
      total = f">{r['required_bytes'] / GIB:.1f}"  # what the refusing compiler needed
    headroom = f"{r['headroom']:.1%}" if "headroom" in r else "-"
    cpu = f"{r['cpu_s']:.0f}" if r.get("cpu_s") is not None else "-"
    lines.append(f"{r['program']:<11} {r['shape']:<46} {r.get('compile_s', 0):>9.1f} {cpu:>7} "
                 f"{g(r, 'argument_bytes'):>9} {g(r, 'output_bytes'):>8} {g(r, 'temp_bytes'):>9} "
                 f"{g(r, 'alias_bytes'):>9} {total:>9} {r['hbm_bytes'] / GIB:>8.2f} "
                 f"{headroom:>8}  {r['status']}")
  for r in rows:
    if r.get("message"):
      lines.append(f"  {r['program']}: {r['message']}")
  return "\n".join(lines)


# --------------------------------------------------------------- main


def main(argv):
  del argv
  jax.config.update("jax_enable_compilation_cache", False)  # AOT TPU programs: nothing to reuse
  config = _CONFIG.value
  if _MODEL_OVERRIDES:
    with config.unlocked():
      for key, value in _MODEL_OVERRIDES.items():
        config.model.overrides[key] = value
  unknown = [p for p in _PROGRAMS.value if p not in PROGRAMS]
  if unknown or not _PROGRAMS.value:
    raise configuration.ConfigError(f"--programs={','.join(_PROGRAMS.value)}: each must be "
                                    f"one of {','.join(PROGRAMS)}")
  if not 0 < _MFU.value <= 1:
    raise configuration.ConfigError(f"--mfu={_MFU.value}: must be in (0, 1]")
  if not 0 <= _MIN_HEADROOM.value <= 1:
    raise configuration.ConfigError(f"--min_headroom={_MIN_HEADROOM.value}: must be in [0, 1]")
  for flag in (_ROWS, _LENGTH, _PREFILL_LEN):
    if flag.value is not None and flag.value < 1:
      raise configuration.ConfigError(f"--{flag.name}={flag.value}: must be >= 1")

  tname, devices = topology_devices(_TOPOLOGY.value)
  rname, rdevices = (topology_devices(_ROLLOUT_TOPOLOGY.value) if _ROLLOUT_TOPOLOGY.value
                     else (tname, devices))
  try:
    # rollout.mesh must fit the engine's own slice (--rollout_topology).
    configuration.validate(config, num_devices=len(devices), host_devices=len(rdevices))
  except configuration.ConfigError as e:
    hint = ""
    if "sharding.mesh" in str(e) and re.fullmatch(r"(v5p|v4)-\d+", _TOPOLOGY.value):
      hint = (f" ({_TOPOLOGY.value} is {len(devices)} chips: v5p / v4 names count "
              "TensorCores, two per chip)")
    raise configuration.ConfigError(f"{e} of {_TOPOLOGY.value} ({tname}){hint}") from None
  model_cfg = factories.build_model_config(config)
  step_cfg = factories.step_config(config)
  mesh = sharding.make_mesh(dict(config.sharding.mesh), devices=devices)
  hbm, rhbm = hbm_bytes(devices[0]), hbm_bytes(rdevices[0])

  print(f"[compile] trainer: {_TOPOLOGY.value} = {tname}, {len(devices)} x "
        f"{devices[0].device_kind} ({hbm / GIB:.2f} GiB HBM each), mesh "
        f"{dict(mesh.shape)}", flush=True)
  if rname != tname or rdevices is not devices:
    print(f"[compile] rollout: {_ROLLOUT_TOPOLOGY.value} = {rname}, {len(rdevices)} x "
          f"{rdevices[0].device_kind} ({rhbm / GIB:.2f} GiB HBM each)", flush=True)
  t0 = time.time()
  progs = factories.build_programs(config, model_cfg, step_cfg, mesh)
  # With LoRA the state's policy is adapters; the engines serve them merged.
  bases = factories.abstract_bases(progs)
  served = factories.abstract_served_policy(progs, bases)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(served))
  print(f"[compile] model: {config.model.preset} {dict(config.model.overrides)}, "
        f"{model_cfg.num_layers} layers, {n_params / 1e9:.3f}B policy params; programs built "
        f"in {time.time() - t0:.1f} s", flush=True)
  precision_line = precision_report(model_cfg, served)
  print(f"[compile] precision: {format_precision(precision_line)}", flush=True)
  resident, lora_line = resident_report(progs), lora_settings(config, progs)
  print(f"[compile] trainer: {format_resident(resident, lora_line, hbm)}", flush=True)

  wanted, engine_layout, pool, transfer = {}, None, None, None
  if {"sft", "value", "rl"} & set(_PROGRAMS.value):
    wanted.update(train_programs(config, progs, mesh, tname, hbm, model_cfg, bases))
  if {"prefill", "decode", "decode_loop"} & set(_PROGRAMS.value):
    engine_progs, engine_layout, pool = engine_programs(
        config, model_cfg, served, rdevices, rname, rhbm,
        train_mesh=None if _ROLLOUT_TOPOLOGY.value else mesh)
    print(f"[compile] rollout engine: {engine_layout}", flush=True)
    print(f"[compile] rollout KV {format_capacity(pool)}", flush=True)
    wanted.update(engine_progs)
    transfer = transfer_report(model_cfg, served,
                               engine_progs["decode"].args[0])
    print(f"[compile] transfer: {format_transfer(transfer)}", flush=True)
  command = " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:] + [
      f"--config.model.overrides.{k}={v}" for k, v in _MODEL_OVERRIDES.items()])
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

  def write(rows, complete):
    """The results so far as JSON (after every program: a pod-sized run takes
    hours, and a killed one still leaves what it measured)."""
    if not _OUT.value:
      return
    result = {
        "command": command, "date": started, "git_commit": _git_commit(),
        "jax": jax.__version__,
        "topology": {"name": _TOPOLOGY.value, "libtpu_name": tname, "devices": len(devices),
                     "device_kind": devices[0].device_kind, "hbm_bytes": hbm},
        "rollout_topology": {"name": _ROLLOUT_TOPOLOGY.value or _TOPOLOGY.value,
                             "libtpu_name": rname, "devices": len(rdevices),
                             "device_kind": rdevices[0].device_kind, "hbm_bytes": rhbm},
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "rollout_engine": engine_layout,
        # The live tokens the engine's cache holds (EnginePrograms.capacity).
        "rollout_pool": pool,
        "model": {"preset": config.model.preset, "overrides": dict(config.model.overrides),
                  "num_layers": model_cfg.num_layers, "policy_params": n_params},
        # Master weights vs the engines' copy: the bytes one version moves.
        "precision": precision_line,
        # LoRA's rank, targets and base dtype (None: the whole model trains), and
        # what the trainer holds a chip: the state, with LoRA the frozen base.
        "lora": lora_line, "resident": resident,
        # The direct weight path into one rollout engine (weight_transfer.report).
        "transfer": transfer,
        # The RL step and a version's transfer modeled at the chips' peaks
        # (sao_jax/train/steptime.py): a model, not a measurement.
        "step_time": model[0] if model else None,
        "version_time": model[1] if model else None,
        "min_headroom": _MIN_HEADROOM.value,
        "programs": {r["program"]: r for r in rows},
        "table": format_table(rows) + (f"\nrollout KV {format_capacity(pool)}" if pool else ""),
        "complete": complete,
        "ok": complete and all(r["fits"] for r in rows),
    }
    files.write_json(_OUT.value, result, indent=2)

  rows, model = [], None
  for name in PROGRAMS:
    if name in _PROGRAMS.value:
      rows.append(compile_one(wanted[name], _MIN_HEADROOM.value))
      write(rows, complete=len(rows) == len(_PROGRAMS.value))
  colocated = (colocated_rows(rows, _MIN_HEADROOM.value)
               if engine_layout is not None and rdevices is devices
               and not rollout_section(config).mesh and config.rollout.sharded_engine else [])
  rows += colocated
  # The direct weight path's double buffers, on the engine's and the trainer's chips
  # (on the rollout slice of its own, as a fleet has it, with fleet.weights_path "direct".)
  direct = (transfer is not None and rdevices is not devices
            and config.fleet.weights_path == "direct")
  buffered = double_buffer_rows(rows, transfer, _MIN_HEADROOM.value) if direct else []
  rows += buffered
  model = step_time_model(rows, transfer, devices, rdevices, model_cfg, config)
  if model is not None:
    print(f"[compile] step time: {steptime.format_model(*model)}", flush=True)
  if colocated or buffered or model is not None:
    write(rows, complete=True)

  print("\n" + format_table(rows), flush=True)
  if pool is not None:
    print(f"rollout KV {format_capacity(pool)}", flush=True)
  if _OUT.value:
    print(f"[compile] wrote {_OUT.value}", flush=True)
  if not all(r["fits"] for r in rows):
    bad = [f"{r['program']} ({r['status']})" for r in rows if not r["fits"]]
    where = sorted({r["topology"] for r in rows if not r["fits"]})
    print(f"error: does not fit {' / '.join(where)} with {_MIN_HEADROOM.value:.0%} headroom: "
          f"{', '.join(bad)}", file=sys.stderr, flush=True)
    sys.exit(1)
  print(f"[compile] all {len(rows)} programs fit with >= {_MIN_HEADROOM.value:.0%} headroom",
        flush=True)

if __name__ == "__main__":
  _MODEL_OVERRIDES.update(pop_model_overrides(sys.argv))
  configuration.run(main)
