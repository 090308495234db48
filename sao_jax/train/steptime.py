"""A modeled RL step and a modeled weight version on a TPU pod, from compiled figures.

launch/compile.py compiles the trainer's RL step for a topology it has no
chips of; the compiled program's `cost_analysis()` still says how many
FLOPs and HBM bytes one chip's share of the step takes. At a chip's
published peak that is a step time -- a model, not a measurement: the
MFU (the fraction of peak FLOP/s a step reaches) is an assumption, given
as a number. Beside it, the transfer plan's bytes per rollout host at a
host's published DCN bandwidth give the seconds one policy version takes
to reach a rollout host, and their ratio the policy lag in steps.

XLA's cost analysis counts a while loop's body once (checked on this jax
and libtpu: a 10-step `lax.scan` reports about one step's FLOPs), so a
program with loops -- the scanned layer stack, the K critic updates --
is under-counted; `step_model` says so and gives, beside the figure as
counted (a lower bound), the figure scaled by the scanned layer count: an
estimate that over-counts what runs outside the layer loop and under-counts
loops nested in it. Beside both, `rl_step_flops` counts the step's matmul
FLOPs from the model's shape and the step's passes (the usual "6ND" count
made specific: K critic updates, the actor update, full remat, causal
attention): no loop is missed, though nothing slower than a matmul at the
assumed MFU is seen either. It is the figure to plan a pod with.
"""

import math
import re

# Per-chip peaks by libtpu device kind, from the Cloud TPU docs' spec tables
# (cloud.google.com/tpu/docs/v5p, /v5e, /v6e; read 2026-12): bf16 FLOP/s,
# HBM bytes/s, DCN bytes/s per chip (v5p: 50 Gbps a chip, 200 Gbps = 25
# GB/s for a 4-chip host; v5e: 200 Gbps per 8-chip host; v6e: none taken),
# chips per host.
# The one place these figures live (/work/shared/research/weight-sync.md
# section 4 surveys the DCN figures).
TPU_PEAKS = {
  "TPU v5": {
    "name": "v5p",
    "bf16_flops": 459e12,
    "hbm_bytes_per_s": 2765e9,
    "dcn_bytes_per_s_per_chip": 50e9 / 8,
    "chips_per_host": 4,
    "source": "cloud.google.com/tpu/docs/v5p",
  },
  "TPU v5 lite": {
    "name": "v5e",
    "bf16_flops": 197e12,
    "hbm_bytes_per_s": 819e9,
    "dcn_bytes_per_s_per_chip": 200e9 / 8 / 8,
    "chips_per_host": 8,
    "source": "cloud.google.com/tpu/docs/v5e",
  },
  "TPU v6 lite": {
    "name": "v6e",
    "bf16_flops": 918e12,
    "hbm_bytes_per_s": 1640e9,
    "dcn_bytes_per_s_per_chip": None,
    "chips_per_host": 8,
    "source": "cloud.google.com/tpu/docs/v6e",
  },
}
TPU_PEAKS["TPU v5p"] = TPU_PEAKS["TPU v5"]
TPU_PEAKS["TPU v5e"] = TPU_PEAKS["TPU v5 lite"]
TPU_PEAKS["TPU v6e"] = TPU_PEAKS["TPU v6 lite"]

# Trainer -> sampler host over TCP as peers measured it (verl PR #7905 on
# v6e: 3.59 GB/s; marin: "4GBps is the best we get on v4"), the survey's
# (weight-sync.md section 4) realistic rate beside the line rate.
TCP_BYTES_PER_S = 3.59e9

_WHILE = re.compile(r"\swhile\(")


def cost(compiled) -> dict | None:
  """{"flops", "bytes_accessed"} per chip from `compiled.cost_analysis()`, or None.

  jax returns a dict (0.4.3x onward) or, earlier, a list of one dict per
  program; a backend without a cost model returns None or raises.
  """
  try:
    ca = compiled.cost_analysis()
  except Exception:  # noqa: BLE001
    return None
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else None
  if not isinstance(ca, dict) or "flops" not in ca:
    return None
  out = {"flops": float(ca["flops"]), "bytes_accessed": float(ca.get("bytes accessed", 0.0))}
  if not (math.isfinite(out["flops"]) and out["flops"] >= 0):
    return None
  return out


def while_loops(hlo_text: str) -> int:
  """The number of while ops in a compiled program's HLO text."""
  return len(_WHILE.findall(hlo_text))


def roofline_seconds(
  flops: float, bytes_accessed: float, peak_flops: float, hbm_bytes_per_s: float, mfu: float
) -> float:
  """One chip's time: FLOPs at `mfu` of peak or HBM bytes at full bandwidth, the larger."""
  if not 0 < mfu <= 1:
    raise ValueError(f"mfu={mfu}: must be in (0, 1]")
  return max(flops / (peak_flops * mfu), bytes_accessed / hbm_bytes_per_s)


def step_model(
  step_cost: dict | None, device_kind: str, mfu: float, *, loops: int = 0, loop_scale: int = 1
) -> dict:
  """The RL step's modeled seconds from its per-chip cost at `device_kind`'s peak.

  `loops`: while ops in the program; with any, the counted figure is a
  lower bound, and `layer_scaled_seconds` is it times `loop_scale` (the
  scanned layer count): the parts outside the layer loop are scaled too,
  loops nested inside it are not, so an estimate, not a bound.
  """
  peaks = TPU_PEAKS.get(device_kind)
  if step_cost is None:
    return {"available": False, "reason": "cost_analysis() not available for this program"}
  if peaks is None:
    return {
      "available": False,
      "reason": f"no peak figures for device kind {device_kind!r} "
      "(TPU_PEAKS in sao_jax/train/steptime.py)",
    }
  s = roofline_seconds(
    step_cost["flops"],
    step_cost["bytes_accessed"],
    peaks["bf16_flops"],
    peaks["hbm_bytes_per_s"],
    mfu,
  )
  out = {
    "available": True,
    "device": peaks["name"],
    "source": peaks["source"],
    "mfu": mfu,
    "peak_bf16_flops": peaks["bf16_flops"],
    "hbm_bytes_per_s": peaks["hbm_bytes_per_s"],
    "flops_per_chip": step_cost["flops"],
    "bytes_accessed_per_chip": step_cost["bytes_accessed"],
    "bound": (
      "compute"
      if step_cost["flops"] / (peaks["bf16_flops"] * mfu)
      >= step_cost["bytes_accessed"] / peaks["hbm_bytes_per_s"]
      else "memory"
    ),
    "seconds": s,
    "while_loops": loops,
    "lower_bound": loops > 0,
  }
  out["layer_scaled_seconds"] = s * max(1, loop_scale) if loops else s
  return out


def forward_flops_per_token(cfg, attended: float, head: bool = True) -> float:
  """Matmul FLOPs of one token's forward pass through `cfg` (a ModelConfig).

  A multiply-add is 2 FLOPs. Per layer, by its kind (`cfg.layer_specs`):
  softmax attention's q / k / v / o projections (a "gated_full" layer's
  output gate one more of q's size) and its scores and weighted values
  against `attended` keys (`L` for an implementation that computes every
  query-key pair of a row, `(L+1)/2` on average for one that skips the
  masked half of a causal row, as splash's block mask does); a Gated
  DeltaNet layer's projections and, per value head, its chunked delta rule
  (chunk C: k k^T and q k^T, 2C dk each; the unit-lower solve, C (dk +
  dv); the intra-chunk product, 2C dv; three [dk, dv] state products),
  whatever `attended`; a MoE layer's router and its top-k experts' SwiGLU
  (dropless: every token's k experts, no padding), with a shared expert's
  SwiGLU and gate where it has one, or a dense layer's SwiGLU; and, with
  `head`, the vocabulary-wide LM head. Norms, softmax, the conv and the
  other elementwise work are left out (a few percent at these shapes:
  tests/train/test_steptime.py compares with XLA's count).
  """
  d, h, kvh, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  full = 2 * d * (h + 2 * kvh) * hd + 2 * h * hd * d + 4 * h * hd * attended
  kh, vh = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv, c = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.deltanet_chunk
  linear = (
    2 * d * (2 * kh * dk + 2 * vh * dv + 2 * vh)
    + 2 * vh * dv * d
    + vh * (c * (5 * dk + 3 * dv) + 6 * dk * dv)
  )
  attention = {"full": full, "gated_full": full + 2 * d * h * hd, "linear": linear}
  moe = 2 * d * cfg.num_experts + cfg.experts_per_token * 6 * d * cfg.moe_d_ff
  mlp = {
    "dense": 6 * d * (cfg.dense_d_ff or 0),
    "moe": moe,
    "moe_shared": moe + 6 * d * cfg.shared_expert_d_ff + 2 * d,
  }
  flops = sum(attention[s.attention] + mlp[s.mlp] for s in cfg.layer_specs)
  return float(flops + (2 * d * cfg.vocab_size if head else 0))


def rl_step_flops(
  cfg,
  rows: int,
  length: int,
  *,
  critic_updates: int,
  remat: bool,
  head_fraction: float = 1.0,
  causal_skip: bool = True,
) -> dict:
  """Matmul FLOPs of one RL step (`train_step.make_train_step`) over `rows x length`
  tokens, by what the step runs: `critic_updates` value-model updates and one
  actor update, each a forward and a backward (the backward is twice the
  forward's matmuls: gradients of inputs and of weights), plus a second
  forward under full rematerialisation (`remat`). The actor's head runs at
  `head_fraction` of the tokens (1: every token; `data.logits_at_actions`:
  the action tokens'); the critic's value head is a dot product.

  An upper-side count for a frozen-attention critic (its attention weights
  get no gradient, which saves a sixth or less of its backward) and for
  packed rows (shorter segments attend over fewer keys).
  """
  attended = (length + 1) / 2 if causal_skip else float(length)
  passes = 3 + (1 if remat else 0)  # forward + backward (2x) [+ the recomputed forward]
  trunk = forward_flops_per_token(cfg, attended, head=False)
  head = 2 * cfg.d_model * cfg.vocab_size
  tokens = rows * length
  actor = passes * (trunk + head * head_fraction) * tokens
  critic = critic_updates * passes * trunk * tokens
  return {
    "actor": actor,
    "critic": critic,
    "total": actor + critic,
    "per_token_forward": trunk + head,
    "tokens": tokens,
    "attended": attended,
  }


def analytic_step(flops_total: float, chips: int, device_kind: str, mfu: float) -> dict:
  """The RL step's seconds from `rl_step_flops`' total, spread evenly over `chips`."""
  peaks = TPU_PEAKS.get(device_kind)
  if peaks is None:
    return {"available": False, "reason": f"no peak figures for device kind {device_kind!r}"}
  per_chip = flops_total / chips
  return {
    "available": True,
    "flops_per_chip": per_chip,
    "seconds": per_chip / (peaks["bf16_flops"] * mfu),
    "mfu": mfu,
  }


def version_model(
  bytes_per_rollout_engine: int, rollout_devices: int, device_kind: str, step: dict
) -> dict:
  """Seconds a version takes into one rollout host, at line rate and at TCP rate, and the
  policy lag in RL steps (version seconds / step seconds) for both step bounds."""
  peaks = TPU_PEAKS.get(device_kind)
  if peaks is None or peaks["dcn_bytes_per_s_per_chip"] is None:
    return {"available": False, "reason": f"no DCN figure for device kind {device_kind!r}"}
  chips_per_host = min(rollout_devices, peaks["chips_per_host"])
  hosts = max(1, rollout_devices // chips_per_host)
  per_host = bytes_per_rollout_engine / hosts
  line_rate = peaks["dcn_bytes_per_s_per_chip"] * chips_per_host
  out = {
    "available": True,
    "rollout_hosts_per_engine": hosts,
    "bytes_per_rollout_host": per_host,
    "dcn_bytes_per_s_per_host": line_rate,
    "tcp_bytes_per_s_per_host": TCP_BYTES_PER_S,
    "seconds_line_rate": per_host / line_rate,
    "seconds_tcp": per_host / TCP_BYTES_PER_S,
  }
  if step.get("available"):
    for rate in ("line_rate", "tcp"):
      v = out[f"seconds_{rate}"]
      out[f"lag_steps_{rate}"] = v / step["seconds"]
      out[f"lag_steps_{rate}_layer_scaled"] = v / step["layer_scaled_seconds"]
      if step.get("analytic", {}).get("available"):
        out[f"lag_steps_{rate}_analytic"] = v / step["analytic"]["seconds"]
  return out


def format_model(step: dict, version: dict | None) -> str:
  """The "[compile] step time:" line."""
  if not step.get("available"):
    head = f"RL step: {step['reason']}"
  else:
    head = (
      f"RL step {step['flops_per_chip'] / 1e12:.1f} TFLOP and "
      f"{step['bytes_accessed_per_chip'] / 1e9:.1f} GB of HBM per chip at {step['mfu']:.0%} "
      f"of {step['device']}'s {step['peak_bf16_flops'] / 1e12:.0f} TFLOP/s bf16 peak: "
      f"{step['seconds']:.2f} s ({step['bound']}-bound)"
    )
    if step["lower_bound"]:
      head += (
        f", a lower bound ({step['while_loops']} while loops, each body counted once; "
        f"x layers: {step['layer_scaled_seconds']:.1f} s)"
      )
    if step.get("analytic", {}).get("available"):
      a = step["analytic"]
      head += (
        f"; counted from the model's shape: {a['flops_per_chip'] / 1e12:.0f} TFLOP a "
        f"chip, {a['seconds']:.1f} s"
      )
  if not version or not version.get("available"):
    return head
  tail = (
    f"; a version {version['bytes_per_rollout_host'] / 1e9:.1f} GB per rollout host: "
    f"{version['seconds_line_rate']:.1f} s at {version['dcn_bytes_per_s_per_host'] / 1e9:.0f}"
    f" GB/s DCN, {version['seconds_tcp']:.1f} s at TCP's "
    f"{version['tcp_bytes_per_s_per_host'] / 1e9:.2f} GB/s"
  )
  if "lag_steps_line_rate" in version:
    tail += (
      f"; policy lag {version['lag_steps_line_rate']:.2f}-{version['lag_steps_tcp']:.2f} steps"
    )
    if step["lower_bound"]:
      tail += (
        f" ({version['lag_steps_line_rate_layer_scaled']:.2f}-"
        f"{version['lag_steps_tcp_layer_scaled']:.2f} at the layer-scaled step)"
      )
    if "lag_steps_line_rate_analytic" in version:
      tail += (
        f", {version['lag_steps_line_rate_analytic']:.2f}-"
        f"{version['lag_steps_tcp_analytic']:.2f} at the shape-counted step"
      )
  return head + tail
