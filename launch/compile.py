"""Compiles the trainer's and the rollout engine's programs for a TPU topology, on a CPU host.

    python launch/compile.py --config=configs/sao_moe.py --topology=v5p-256 \
        [--rollout_topology=v5p-8 --rollout_mesh=expert:2,tensor:2] [--out=compile.json] \
        [--programs=sft,value,rl,prefill,decode,decode_loop] [--min_headroom=0.10] \
        [--config.model.overrides.num_layers=2]

No TPU is reachable from the project's machines, but the TPU compiler is:
libtpu (`pip install -e '.[aot]'`) compiles for a topology it only knows by
name (docs/DESIGN.md section 8). This script lowers the very programs the
trainer runs -- `factories.build_programs` builds them for the trainer too,
sao_jax/pod/aot.py does the work --
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
With the engine's programs it also compiles "merge", a fleet rollout's merge
of a version's adapters onto its base (the trainer's jitted merge, on the
rollout's mesh; `--programs=merge` compiles it alone), and the transfer plan
is the actor's adapters in float32: what a LoRA version crosses
(docs/design/weight_sync.md, "LoRA versions").

Topologies: Cloud TPU names (v5p-256, v5e-4, v6e-8, v4-16) or libtpu's own
(v5p:4x4x8, v5e:2x2). Mind that v5p and v4 names count TensorCores, two per
chip: v5p-128 is 64 chips (4x4x4) and the 128-chip slice is v5p-256.

`--config.model.overrides.FIELD=VALUE` sets a ModelConfig field (e.g.
num_layers=2) even though the configs' override dicts are empty and locked.
"""

import os
import subprocess
import sys

# The host's own devices only run eval_shape; the programs are compiled for
# the topology's devices. Without this JAX would try to claim a local TPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes an exclusive lock (/tmp/libtpu_lockfile) to own the local
# chips; compiling for a topology owns none, and two compiles (parallel
# tests, a background record run) must not refuse each other.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
from absl import flags
from ml_collections import config_flags

from sao_jax.pod import aot
from sao_jax.train import configuration

PROGRAMS = aot.PROGRAMS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --config files import the repository's `configs` package, which is not
# installed: this checkout's root joins sys.path, whatever the working directory.
sys.path.append(ROOT)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_TOPOLOGY = flags.DEFINE_string(
  "topology", None, "TPU topology of the trainer: v5p-256, v5e-4, or libtpu's v5p:4x4x8."
)
_ROLLOUT_TOPOLOGY = flags.DEFINE_string(
  "rollout_topology", None, "Topology of the rollout slice (default: --topology)."
)
_OUT = flags.DEFINE_string("out", None, "Write the results here as JSON.")
_PROGRAMS = flags.DEFINE_list(
  "programs",
  list(PROGRAMS),
  f"Which of {PROGRAMS} to compile; with lora.enabled the engine's come with "
  "'merge', which may also be named alone.",
)
_MIN_HEADROOM = flags.DEFINE_float(
  "min_headroom", 0.10, "Fraction of HBM each program must leave free to count as fitting."
)
_ROWS = flags.DEFINE_integer(
  "rows",
  None,
  "Packed rows of the train steps (default: the config's sft.batch_size / rl.batch_size).",
)
_LENGTH = flags.DEFINE_integer(
  "length", None, "Tokens per packed row (default: max(data.buckets), the largest bucket)."
)
_ROLLOUT_MESH = flags.DEFINE_string(
  "rollout_mesh",
  None,
  "The rollout engine's mesh over the rollout topology, e.g. "
  "expert:2,tensor:2: sets rollout.mesh (default: the config's rollout.mesh; empty, the "
  "trainer's mesh with rollout.sharded_engine, else one chip, as the run's engine).",
)
_PREFILL_LEN = flags.DEFINE_integer(
  "prefill_len",
  None,
  "Width of the prefill step (default: the engine's largest bucket, rollout.max_len).",
)
_DUMP_HLO = flags.DEFINE_string(
  "dump_hlo", None, "Write each compiled program's HLO text here (<program>.hlo.txt)."
)
_MFU = flags.DEFINE_float(
  "mfu",
  0.4,
  "Fraction of the chip's peak bf16 FLOP/s the modeled "
  "RL step reaches (an assumption: the step-time model's one knob).",
)
_HEARTBEAT_S = flags.DEFINE_integer("heartbeat_s", 60, "Seconds between progress lines.")
flags.mark_flags_as_required(["config", "topology"])


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
      key, sep, value = arg[len(prefix) :].partition("=")
      if not sep or not key:
        raise SystemExit(f"error: {arg!r}: write {prefix}FIELD=VALUE")
      out[key] = configuration.parse_literal(value)
      argv.remove(arg)
  return out


_MODEL_OVERRIDES: dict = {}


def _git_commit() -> str | None:
  """This checkout's commit, "+uncommitted" when tracked files changed; None without git."""
  try:
    head = subprocess.run(
      ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "status", "--porcelain", "--untracked-files=no"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=True,
      timeout=30,
    ).stdout
    return head + ("+uncommitted" if dirty.strip() else "")
  except (OSError, subprocess.SubprocessError):
    return None


def main(argv):
  del argv
  jax.config.update("jax_enable_compilation_cache", False)  # AOT TPU programs: nothing to reuse
  config = _CONFIG.value
  if _MODEL_OVERRIDES:
    with config.unlocked():
      for key, value in _MODEL_OVERRIDES.items():
        config.model.overrides[key] = value
  command = " ".join(
    [os.path.relpath(sys.argv[0])]
    + sys.argv[1:]
    + [f"--config.model.overrides.{k}={v}" for k, v in _MODEL_OVERRIDES.items()]
  )
  settings = aot.Settings(
    topology=_TOPOLOGY.value,
    rollout_topology=_ROLLOUT_TOPOLOGY.value,
    programs=tuple(_PROGRAMS.value),
    min_headroom=_MIN_HEADROOM.value,
    rows=_ROWS.value,
    length=_LENGTH.value,
    rollout_mesh=_ROLLOUT_MESH.value,
    prefill_len=_PREFILL_LEN.value,
    dump_hlo=_DUMP_HLO.value,
    mfu=_MFU.value,
    heartbeat_s=_HEARTBEAT_S.value,
    out=_OUT.value,
    command=command,
    git_commit=_git_commit,
  )
  if not aot.run(config, settings):
    sys.exit(1)


if __name__ == "__main__":
  _MODEL_OVERRIDES.update(pop_model_overrides(sys.argv))
  configuration.run(main)
