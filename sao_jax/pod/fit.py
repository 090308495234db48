"""What a pod's chips hold: the memory accounting and the fit report of its compiled programs.

The trainer's resident state (`resident_report`, with LoRA its frozen base),
the params' precision and one version's bytes (`precision_report`), the
direct weight path's plan (`transfer_report`), and rows computed from the
compiled ones (`lowering.compile_one`), not compiled together: a train step
beside a colocated engine's params and cache (`colocated_rows`), an engine
program beside the standby copy of the next version and the RL step beside
the trainer's served snapshots (`double_buffer_rows`). `step_time_model`
models the RL step's and a version's seconds (sao_jax/train/steptime.py);
`format_*` write each in the lines and table the compile prints.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from sao_jax.algo import advantages
from sao_jax.config import sections
from sao_jax.models import lora, precision
from sao_jax.models import sharding as shd
from sao_jax.pod import chips
from sao_jax.train import factories, steptime
from sao_jax.transport import weight_transfer

GIB = chips.GIB


def resident_report(progs: factories.Programs) -> dict:
  """What the trainer holds a chip from the start (`Programs.abstract_resident`):
  the state (its optimizer's part apart), with LoRA and the frozen policy base
  (the critic's trunk is the same arrays)."""
  state = progs.abstract_state
  base = shd.shard_bytes(progs.lora.abstract_base) if progs.lora is not None else 0
  return {
    "state_bytes_per_chip": shd.shard_bytes(state),
    "optimizer_bytes_per_chip": shd.shard_bytes((state.policy_opt, state.critic_opt)),
    "base_bytes_per_chip": base,
    "resident_bytes_per_chip": shd.shard_bytes(progs.abstract_resident),
  }


def lora_settings(config, progs: factories.Programs) -> dict | None:
  """LoRA's settings (None without it): rank, targets, the base's dtype, adapters' size."""
  if progs.lora is None:
    return None
  c, state = sections.Lora.of(config.lora), progs.abstract_state
  return {
    "rank": c.rank,
    "alpha": c.alpha,
    "actor_targets": list(c.actor_targets),
    "critic_targets": list(c.critic_targets),
    "critic_whole": list(c.critic_whole),
    "base_dtype": jnp.dtype(jax.tree.leaves(progs.lora.abstract_base)[0].dtype).name,
    "adapter_params": lora.count((state.policy, state.critic)),
  }


def format_resident(res: dict, lora_s: dict | None, hbm: float) -> str:
  """The trainer's resident state a chip (`resident_report`) and its LoRA settings, in one line."""
  head = (
    "full fine-tuning"
    if lora_s is None
    else (
      f"LoRA rank {lora_s['rank']} (alpha {lora_s['alpha']:g}) on actor "
      f"{','.join(lora_s['actor_targets'])}, critic {','.join(lora_s['critic_targets'])}; "
      f"{lora_s['adapter_params'] / 1e6:.2f}M adapter params over a {lora_s['base_dtype']} "
      "base"
    )
  )
  return (
    f"{head}; resident a chip {size(res['resident_bytes_per_chip'])} "
    f"({res['resident_bytes_per_chip'] / hbm:.0%} of HBM) = state "
    f"{size(res['state_bytes_per_chip'])} (optimizer "
    f"{size(res['optimizer_bytes_per_chip'])}) + base {size(res['base_bytes_per_chip'])}"
  )


def size(n: float) -> str:
  """`n` bytes in the largest binary unit it reaches (2.00 GiB, 512 B)."""
  for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n:.0f} B"


def format_capacity(cap: dict) -> str:
  """An engine's KV capacity (`EnginePrograms.capacity`) in one line."""
  groups = (
    f", {cap['groups']} slot groups of {cap['slots_per_group']} slots: "
    f"{cap['live_tokens_per_group']:,} a group"
    if cap["groups"] > 1
    else ""
  )
  head = (
    f"paged: {cap['pages']:,} pages of {cap['page_size']} = "
    if cap["kind"] == "paged"
    else "dense: "
  )
  return (
    f"{head}{cap['live_tokens']:,} live tokens, {cap['fraction_of_dense']:.3f} of "
    f"slots x max_len ({cap['slots']} x {cap['max_len']:,}){groups}; "
    f"{cap['max_len_trajectories_per_group']:.2f} max_len trajectories a group; "
    f"{size(cap['bytes_per_device'])} a chip"
  )


def precision_report(model_cfg, abstract_policy) -> dict:
  """The trained params' dtype and bytes, and the engines' copy (precision.py):
  its dtype and bytes are what one policy version moves to each engine."""
  master = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract_policy))
  dtypes = {jnp.dtype(x.dtype).name for x in jax.tree.leaves(abstract_policy)}
  return {
    "param_dtype": (
      dtypes.pop()
      if len(dtypes) == 1  # a LoRA base's own dtype
      else jnp.dtype(model_cfg.param_dtype).name
    ),
    "compute_dtype": jnp.dtype(model_cfg.dtype).name,
    "master_bytes": master,
    "serving_dtype": jnp.dtype(precision.serving_config(model_cfg).param_dtype).name,
    "version_bytes": precision.serving_bytes(model_cfg, abstract_policy),
  }


def transfer_report(model_cfg, abstract_policy, engine_params, cast: bool = True) -> dict:
  """The direct weight path's plan (weight_transfer.plan) from the trainer's
  layout of the engines' copy into one rollout engine's: bytes per rollout
  engine and per trainer host for one version, and the double buffers.
  `cast=False`: a version crosses in its own dtypes (a LoRA run's adapters,
  `abstract_policy` the trainer's and `engine_params` the rollout's layout)."""
  serving = (
    jax.eval_shape(functools.partial(precision.cast_for_serving, model_cfg), abstract_policy)
    if cast
    else abstract_policy
  )
  src = [
    (x.shape, s.dtype, x.sharding)
    for x, s in zip(jax.tree.leaves(abstract_policy), jax.tree.leaves(serving))
  ]
  return weight_transfer.report(
    src, [(x.shape, x.sharding) for x in jax.tree.leaves(engine_params)]
  )


def format_transfer(t: dict) -> str:
  """The direct weight path's plan (`transfer_report`) in one line."""
  return (
    f"one version {size(t['version_bytes'])} in {t['pieces']} pieces, each pulled "
    f"once per rollout engine over {t['destination_devices']} devices (max "
    f"{size(t['max_bytes_per_rollout_device'])} per device, then "
    f"{size(t['local_copy_bytes_per_engine'])} of local copies); per trainer host "
    f"{size(t['min_bytes_per_trainer_host'])}-{size(t['max_bytes_per_trainer_host'])} "
    f"per engine ({t['trainer_hosts']} hosts); double buffers +"
    f"{size(t['snapshot_bytes_per_trainer_device'])} per trainer device, +"
    f"{size(t['standby_bytes_per_rollout_device'])} per rollout device"
  )


def format_precision(p: dict) -> str:
  """The params' precision (`precision_report`) in one line."""
  return (
    f"{p['param_dtype']} master weights ({p['master_bytes'] / GIB:.2f} GiB), "
    f"{p['compute_dtype']} compute; engines hold {p['serving_dtype']} "
    f"({p['version_bytes'] / GIB:.2f} GiB a version)"
  )


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
  engine = [
    by_name[n]
    for n in ("prefill", "decode", "decode_loop")
    if by_name.get(n, {}).get("argument_bytes") is not None
  ]
  out = []
  if not engine:
    return out
  resident = max(r["argument_bytes"] for r in engine)
  for name in ("sft", "value", "rl"):
    r = by_name.get(name)
    if r is not None and r.get("total_bytes") is not None:
      out.append(_added_row(r, f"{name}+eng", "engine params and cache", resident, min_headroom))
  return out


def _added_row(r: dict, name: str, what: str, added: float, min_headroom: float) -> dict:
  """Row `r`'s program with `added` bytes a chip resident beside it (computed, not compiled);
  `argument_bytes` holds the bytes added."""
  total = r["total_bytes"] + added
  headroom = 1.0 - total / r["hbm_bytes"]
  fits = headroom >= min_headroom
  row = {
    "program": name,
    "shape": f"{r['shape']} + {what}",
    "topology": r["topology"],
    "hbm_bytes": r["hbm_bytes"],
    "compile_s": 0.0,
    "argument_bytes": added,
    "total_bytes": total,
    "headroom": headroom,
    "fits": fits,
    "status": "FITS" if fits else "DOES NOT FIT",
    "computed": True,
  }
  if not fits:
    row["message"] = (
      f"{total / GIB:.2f} GiB of {r['hbm_bytes'] / GIB:.2f} GiB leaves "
      f"{headroom:.1%} headroom, less than --min_headroom={min_headroom:.0%}"
    )
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
      out.append(
        _added_row(
          r,
          f"{name}+next",
          "next version",
          transfer["standby_bytes_per_rollout_device"],
          min_headroom,
        )
      )
  r = by_name.get("rl")
  if r is not None and r.get("total_bytes") is not None:
    keep = weight_transfer.KEEP_SNAPSHOTS
    out.append(
      _added_row(
        r,
        "rl+snapshot",
        f"{keep} snapshots",
        keep * transfer["snapshot_bytes_per_trainer_device"],
        min_headroom,
      )
    )
  return out


def step_time_model(
  rows: list[dict],
  transfer: dict | None,
  devices,
  rdevices,
  model_cfg,
  config,
  mfu: float,
  batch_rows: int | None = None,
  length: int | None = None,
) -> tuple[dict, dict | None] | None:
  """(the RL step's modeled time, a version's) from the rl row's cost and the plan, or None
  without an rl row: at `mfu` of the chip's peak bf16 FLOP/s. A scanned layer
  stack's loop runs num_layers times: the layer-scaled estimate. Beside them,
  the step counted from the model's shape (`steptime.rl_step_flops` at the rl
  program's rows x length: `batch_rows` and `length`, default the config's)."""
  rl = next((r for r in rows if r["program"] == "rl"), None)
  if rl is None:
    return None
  if not rl.get("fits") and rl.get("total_bytes") is None:
    step = {"available": False, "reason": "the RL step did not compile"}
  else:
    scale = model_cfg.num_layers if getattr(model_cfg, "scan_layers", False) else 1
    step = steptime.step_model(
      rl.get("cost"), devices[0].device_kind, mfu, loops=rl.get("while_loops", 0), loop_scale=scale
    )
    if step.get("available"):
      counted = steptime.rl_step_flops(
        model_cfg,
        batch_rows or config.rl.batch_size,
        length or max(config.data.buckets),
        critic_updates=(
          config.rl.critic_updates if advantages.ESTIMATORS[config.rl.advantage].uses_critic else 0
        ),
        remat=model_cfg.remat != "none",
        causal_skip=model_cfg.attention_impl == "splash",
      )
      step["analytic"] = {
        **steptime.analytic_step(counted["total"], len(devices), devices[0].device_kind, mfu),
        "flops": counted,
      }
  version = None
  if transfer is not None:
    version = steptime.version_model(
      transfer["bytes_per_rollout_engine"], len(rdevices), rdevices[0].device_kind, step
    )
  return step, version


def format_table(rows: list[dict]) -> str:
  """The rows as the table the compile prints: bytes a chip in GiB, headroom, verdict."""
  head = (
    f"{'program':<11} {'shape':<46} {'compile s':>9} {'cpu s':>7} {'args GiB':>9} "
    f"{'out GiB':>8} {'temp GiB':>9} {'alias GiB':>9} {'total GiB':>9} {'HBM GiB':>8} "
    f"{'headroom':>8}  verdict"
  )
  lines = [head, "-" * len(head)]
  g = lambda r, k: f"{r[k] / GIB:.3f}" if r.get(k) is not None else "-"
  for r in rows:
    total = g(r, "total_bytes")
    if r.get("total_bytes") is None and r.get("required_bytes"):
      total = f">{r['required_bytes'] / GIB:.1f}"  # what the refusing compiler needed
    headroom = f"{r['headroom']:.1%}" if "headroom" in r else "-"
    cpu = f"{r['cpu_s']:.0f}" if r.get("cpu_s") is not None else "-"
    lines.append(
      f"{r['program']:<11} {r['shape']:<46} {r.get('compile_s', 0):>9.1f} {cpu:>7} "
      f"{g(r, 'argument_bytes'):>9} {g(r, 'output_bytes'):>8} {g(r, 'temp_bytes'):>9} "
      f"{g(r, 'alias_bytes'):>9} {total:>9} {r['hbm_bytes'] / GIB:>8.2f} "
      f"{headroom:>8}  {r['status']}"
    )
  for r in rows:
    if r.get("message"):
      lines.append(f"  {r['program']}: {r['message']}")
  return "\n".join(lines)
