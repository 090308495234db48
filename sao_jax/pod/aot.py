"""Compiling a config's programs for a TPU topology on a CPU host, and whether they fit.

`run(config, settings)` is what `launch/compile.py` does: it lays the
config's mesh on the topology's devices (`chips.topology_devices`), builds
the trainer's and the rollout engine's programs as the run builds them
(`aot_programs`), compiles each (`lowering.compile_one`), adds the rows a
colocated engine or the direct weight path's double buffers imply and the
step-time model (`fit`), prints the table and writes the JSON record to
`settings.out` after every program (a killed run keeps what it measured).
It returns True only when every row fits with `settings.min_headroom` of
HBM to spare. A config that does not fit the topology is a `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import sys
import time
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np

from sao_jax.data import files
from sao_jax.models import sharding
from sao_jax.pod import aot_programs, chips, fit, lowering
from sao_jax.train import configuration, factories, steptime
from sao_jax.transport import weight_channel

PROGRAMS = ("sft", "value", "rl", "prefill", "decode", "decode_loop")
TRAIN_PROGRAMS = ("sft", "value", "rl")
ENGINE_PROGRAMS = ("prefill", "decode", "decode_loop")
# With LoRA, compiled beside the engine's (or alone, named in --programs): a
# fleet rollout's merge at a swap.
MERGE = "merge"
GIB = chips.GIB


@dataclasses.dataclass(frozen=True)
class Settings:
  """What to compile, where, and at which shapes (launch/compile.py's flags, same names)."""

  topology: str
  rollout_topology: str | None = None
  programs: Sequence[str] = PROGRAMS
  min_headroom: float = 0.10
  rows: int | None = None
  length: int | None = None
  rollout_mesh: str | None = None
  prefill_len: int | None = None
  dump_hlo: str | None = None
  mfu: float = 0.4
  heartbeat_s: int = 60
  out: str | None = None
  command: str = ""  # the command line, for the record
  git_commit: Callable[[], str | None] = lambda: None


def check(s: Settings) -> None:
  """Refuses settings out of range, in one line naming the flag."""
  unknown = [p for p in s.programs if p not in (*PROGRAMS, MERGE)]
  if unknown or not s.programs:
    raise configuration.ConfigError(
      f"--programs={','.join(s.programs)}: each must be one of {','.join((*PROGRAMS, MERGE))}"
    )
  if not 0 < s.mfu <= 1:
    raise configuration.ConfigError(f"--mfu={s.mfu}: must be in (0, 1]")
  if not 0 <= s.min_headroom <= 1:
    raise configuration.ConfigError(f"--min_headroom={s.min_headroom}: must be in [0, 1]")
  for name in ("rows", "length", "prefill_len"):
    value = getattr(s, name)
    if value is not None and value < 1:
      raise configuration.ConfigError(f"--{name}={value}: must be >= 1")


class _Slices(NamedTuple):
  """The trainer's topology and the rollout engine's (the same one unless given)."""

  tname: str
  devices: list
  rname: str
  rdevices: list
  hbm: float
  rhbm: float
  mesh: object  # the trainer's mesh over `devices`


def _slices(config, s: Settings) -> _Slices:
  """The topologies' devices, the config validated on them, the trainer's mesh."""
  tname, devices = chips.topology_devices(s.topology)
  rname, rdevices = (
    chips.topology_devices(s.rollout_topology) if s.rollout_topology else (tname, devices)
  )
  try:
    # rollout.mesh must fit the engine's own slice (--rollout_topology).
    configuration.validate(config, num_devices=len(devices), host_devices=len(rdevices))
  except configuration.ConfigError as e:
    hint = ""
    if "sharding.mesh" in str(e) and re.fullmatch(r"(v5p|v4)-\d+", s.topology):
      hint = (
        f" ({s.topology} is {len(devices)} chips: v5p / v4 names count TensorCores, two per chip)"
      )
    raise configuration.ConfigError(f"{e} of {s.topology} ({tname}){hint}") from None
  mesh = sharding.make_mesh(dict(config.sharding.mesh), devices=devices)
  return _Slices(
    tname, devices, rname, rdevices, chips.hbm_bytes(devices[0]), chips.hbm_bytes(rdevices[0]), mesh
  )


@dataclasses.dataclass
class _Plan:
  """The programs to compile and the reports printed before compiling them."""

  model_cfg: object
  programs: dict
  n_params: int
  precision: dict
  resident: dict
  lora: dict | None
  engine_layout: str | None = None
  pool: dict | None = None
  transfer: dict | None = None


def _print_slices(sl: _Slices, s: Settings) -> None:
  print(
    f"[compile] trainer: {s.topology} = {sl.tname}, {len(sl.devices)} x "
    f"{sl.devices[0].device_kind} ({sl.hbm / GIB:.2f} GiB HBM each), mesh "
    f"{dict(sl.mesh.shape)}",
    flush=True,
  )
  if sl.rname != sl.tname or sl.rdevices is not sl.devices:
    print(
      f"[compile] rollout: {s.rollout_topology} = {sl.rname}, {len(sl.rdevices)} x "
      f"{sl.rdevices[0].device_kind} ({sl.rhbm / GIB:.2f} GiB HBM each)",
      flush=True,
    )


def _plan(config, s: Settings, sl: _Slices) -> _Plan:
  """Builds the programs as the run does and prints the model, precision and memory lines."""
  model_cfg = factories.build_model_config(config)
  step_cfg = factories.step_config(config)
  _print_slices(sl, s)
  t0 = time.time()
  progs = factories.build_programs(config, model_cfg, step_cfg, sl.mesh)
  # With LoRA the state's policy is adapters; the engines serve them merged.
  bases = factories.abstract_bases(progs)
  served = factories.abstract_served_policy(progs, bases)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(served))
  print(
    f"[compile] model: {config.model.preset} {dict(config.model.overrides)}, "
    f"{model_cfg.num_layers} layers, {n_params / 1e9:.3f}B policy params; programs built "
    f"in {time.time() - t0:.1f} s",
    flush=True,
  )
  plan = _Plan(
    model_cfg,
    {},
    n_params,
    fit.precision_report(model_cfg, served),
    fit.resident_report(progs),
    fit.lora_settings(config, progs),
  )
  print(f"[compile] precision: {fit.format_precision(plan.precision)}", flush=True)
  print(f"[compile] trainer: {fit.format_resident(plan.resident, plan.lora, sl.hbm)}", flush=True)
  if set(TRAIN_PROGRAMS) & set(s.programs):
    plan.programs.update(
      aot_programs.train_programs(
        config, progs, sl.mesh, sl.tname, sl.hbm, model_cfg, bases, s.rows, s.length
      )
    )
  if {*ENGINE_PROGRAMS, MERGE} & set(s.programs):
    r = aot_programs.rollout_section(config, s.rollout_mesh)
    engine_progs, plan.engine_layout, plan.pool = aot_programs.engine_programs(
      config,
      r,
      model_cfg,
      served,
      sl.rdevices,
      sl.rname,
      sl.rhbm,
      s.prefill_len,
      train_mesh=None if s.rollout_topology else sl.mesh,
    )
    print(f"[compile] rollout engine: {plan.engine_layout}", flush=True)
    print(f"[compile] rollout KV {fit.format_capacity(plan.pool)}", flush=True)
    plan.programs.update(engine_progs)
    plan.transfer = fit.transfer_report(model_cfg, served, engine_progs["decode"].args[0])
    # With LoRA a version crosses the fleet as the adapters (float32), which
    # the rollout merges onto its own base at each swap.
    merge = aot_programs.merge_program(config, r, model_cfg, sl.rdevices, sl.rname, sl.rhbm)
    if merge is None and MERGE in s.programs:
      raise configuration.ConfigError("--programs=merge: a LoRA config's only (lora.enabled)")
    if merge is not None:
      plan.programs[MERGE] = merge
      plan.transfer = fit.transfer_report(
        model_cfg, progs.abstract_state.policy, merge.args[0], cast=False
      )
    print(f"[compile] transfer: {fit.format_transfer(plan.transfer)}", flush=True)
  return plan


def record(
  config,
  s: Settings,
  sl: _Slices,
  plan: _Plan,
  rows: list[dict],
  model,
  started: str,
  complete: bool,
) -> dict:
  """The JSON record of a compile: where, what, the reports, each program's row, the verdict."""
  return {
    "command": s.command,
    "date": started,
    "git_commit": s.git_commit(),
    "jax": jax.__version__,
    "topology": {
      "name": s.topology,
      "libtpu_name": sl.tname,
      "devices": len(sl.devices),
      "device_kind": sl.devices[0].device_kind,
      "hbm_bytes": sl.hbm,
    },
    "rollout_topology": {
      "name": s.rollout_topology or s.topology,
      "libtpu_name": sl.rname,
      "devices": len(sl.rdevices),
      "device_kind": sl.rdevices[0].device_kind,
      "hbm_bytes": sl.rhbm,
    },
    "mesh": {k: int(v) for k, v in sl.mesh.shape.items()},
    "rollout_engine": plan.engine_layout,
    # The live tokens the engine's cache holds (EnginePrograms.capacity).
    "rollout_pool": plan.pool,
    "model": {
      "preset": config.model.preset,
      "overrides": dict(config.model.overrides),
      "num_layers": plan.model_cfg.num_layers,
      "policy_params": plan.n_params,
    },
    # Master weights vs the engines' copy: the bytes one version moves.
    "precision": plan.precision,
    # LoRA's rank, targets and base dtype (None: the whole model trains), and
    # what the trainer holds a chip: the state, with LoRA the frozen base.
    "lora": plan.lora,
    "resident": plan.resident,
    # The direct weight path into one rollout engine (weight_transfer.report).
    "transfer": plan.transfer,
    # The RL step and a version's transfer modeled at the chips' peaks
    # (sao_jax/train/steptime.py): a model, not a measurement.
    "step_time": model[0] if model else None,
    "version_time": model[1] if model else None,
    "min_headroom": s.min_headroom,
    "programs": {r["program"]: r for r in rows},
    "table": fit.format_table(rows)
    + (f"\nrollout KV {fit.format_capacity(plan.pool)}" if plan.pool else ""),
    "complete": complete,
    "ok": complete and all(r["fits"] for r in rows),
  }


def _computed_rows(config, s: Settings, sl: _Slices, plan: _Plan, rows: list[dict]):
  """The rows computed from the compiled ones: a colocated engine's, the double buffers'."""
  colocated = (
    fit.colocated_rows(rows, s.min_headroom)
    if plan.engine_layout is not None
    and sl.rdevices is sl.devices
    and not aot_programs.rollout_section(config, s.rollout_mesh).mesh
    and config.rollout.sharded_engine
    else []
  )
  # A weight channel's double buffers, on the engine's and the trainer's chips
  # (on a rollout slice of its own, as a fleet has it, where the channel stages
  # versions in device memory: weight_channel.WeightChannel.device_buffers).
  channel = weight_channel.CHANNELS[config.fleet.weights_path]
  direct = plan.transfer is not None and sl.rdevices is not sl.devices and channel.device_buffers
  buffered = (
    fit.double_buffer_rows(rows + colocated, plan.transfer, s.min_headroom) if direct else []
  )
  return colocated + buffered


def _verdict(rows: list[dict], pool, s: Settings) -> bool:
  """Prints the table and whether every row fits; returns that."""
  print("\n" + fit.format_table(rows), flush=True)
  if pool is not None:
    print(f"rollout KV {fit.format_capacity(pool)}", flush=True)
  if s.out:
    print(f"[compile] wrote {s.out}", flush=True)
  if not all(r["fits"] for r in rows):
    bad = [f"{r['program']} ({r['status']})" for r in rows if not r["fits"]]
    where = sorted({r["topology"] for r in rows if not r["fits"]})
    print(
      f"error: does not fit {' / '.join(where)} with {s.min_headroom:.0%} headroom: "
      f"{', '.join(bad)}",
      file=sys.stderr,
      flush=True,
    )
    return False
  print(f"[compile] all {len(rows)} programs fit with >= {s.min_headroom:.0%} headroom", flush=True)
  return True


def run(config, s: Settings) -> bool:
  """Compiles `s.programs` of `config` for `s.topology`; True when every row fits."""
  check(s)
  sl = _slices(config, s)
  plan = _plan(config, s, sl)
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

  def write(rows, model, complete):
    if s.out:
      files.write_json(s.out, record(config, s, sl, plan, rows, model, started, complete), indent=2)

  rows = []
  names = [n for n in PROGRAMS if n in s.programs] + [n for n in (MERGE,) if n in plan.programs]
  for name in names:
    rows.append(
      lowering.compile_one(plan.programs[name], s.min_headroom, s.heartbeat_s, s.dump_hlo)
    )
    write(rows, None, complete=len(rows) == len(names))
  computed = _computed_rows(config, s, sl, plan, rows)
  rows += computed
  model = fit.step_time_model(
    rows, plan.transfer, sl.devices, sl.rdevices, plan.model_cfg, config, s.mfu, s.rows, s.length
  )
  if model is not None:
    print(f"[compile] step time: {steptime.format_model(*model)}", flush=True)
  if computed or model is not None:
    write(rows, model, complete=True)
  return _verdict(rows, plan.pool, s)
