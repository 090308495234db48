"""sao_jax/train/steptime.py: the RL step and a weight version modeled at a chip's peak."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from sao_jax.train import steptime

V5P = "TPU v5"


def _scan_program(steps: int):
  def f(w, x):
    return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]

  return jax.jit(f).lower(jnp.zeros((steps, 64, 64)), jnp.zeros((8, 64))).compile()


def test_cost_reads_what_this_jax_returns_and_counts_a_loop_body_once():
  one, ten = _scan_program(1), _scan_program(10)
  c1, c10 = steptime.cost(one), steptime.cost(ten)
  assert c1["flops"] >= 2 * 8 * 64 * 64 and c1["bytes_accessed"] > 0
  # The caveat the model states: XLA counts the scan's body once, not ten times.
  assert c10["flops"] < 2 * c1["flops"]
  assert steptime.while_loops(ten.as_text()) >= 1
  assert steptime.while_loops("ROOT %add = f32[] add(%a, %b)") == 0


class _Reports:
  """An executable's cost_analysis() in the shapes jax versions return."""

  def __init__(self, value):
    self.value = value

  def cost_analysis(self):
    if isinstance(self.value, Exception):
      raise self.value
    return self.value


def test_cost_takes_a_list_and_says_none_when_absent():
  got = steptime.cost(_Reports([{"flops": 10.0, "bytes accessed": 4.0}]))
  assert got == {"flops": 10.0, "bytes_accessed": 4.0}
  for absent in (
    None,
    [],
    {},
    {"bytes accessed": 1.0},
    {"flops": float("nan")},
    NotImplementedError("no cost model"),
  ):
    assert steptime.cost(_Reports(absent)) is None, absent
  step = steptime.step_model(None, V5P, 0.4)
  assert step == {"available": False, "reason": "cost_analysis() not available for this program"}
  assert "not available" in steptime.format_model(step, None)
  assert not steptime.step_model({"flops": 1.0, "bytes_accessed": 1.0}, "TPU v9", 0.4)["available"]


def test_the_step_and_the_version_at_v5p_peaks():
  peak, hbm = 459e12, 2765e9
  # Compute-bound: 1.836e15 FLOPs at 40% of 459 TFLOP/s is 10 s; the bytes take 1 s.
  step = steptime.step_model(
    {"flops": 0.4 * peak * 10, "bytes_accessed": hbm}, V5P, 0.4, loops=2, loop_scale=48
  )
  assert step["seconds"] == pytest.approx(10.0) and step["bound"] == "compute"
  assert step["lower_bound"] and step["layer_scaled_seconds"] == pytest.approx(480.0)
  # Memory-bound at full HBM bandwidth.
  mem = steptime.step_model({"flops": 1.0, "bytes_accessed": 3 * hbm}, V5P, 0.4)
  assert mem["seconds"] == pytest.approx(3.0) and mem["bound"] == "memory"
  assert not mem["lower_bound"] and mem["layer_scaled_seconds"] == mem["seconds"]
  with pytest.raises(ValueError):
    steptime.roofline_seconds(1.0, 1.0, peak, hbm, 0.0)
  # 50 GB a version into a 2-host (8-chip) engine: 25 GB a host, 1 s at 25 GB/s.
  v = steptime.version_model(50e9, 8, V5P, step)
  assert v["rollout_hosts_per_engine"] == 2 and v["bytes_per_rollout_host"] == 25e9
  assert v["dcn_bytes_per_s_per_host"] == pytest.approx(25e9)
  assert v["seconds_line_rate"] == pytest.approx(1.0)
  assert v["seconds_tcp"] == pytest.approx(25e9 / 3.59e9)
  assert v["lag_steps_line_rate"] == pytest.approx(0.1)
  assert v["lag_steps_tcp_layer_scaled"] == pytest.approx(25e9 / 3.59e9 / 480)
  line = steptime.format_model(step, v)
  assert "10.00 s (compute-bound), a lower bound" in line and "policy lag 0.10-0.70" in line
  # A one-host engine takes the whole version; no lag without a step time.
  v1 = steptime.version_model(50e9, 4, V5P, {"available": False})
  assert v1["rollout_hosts_per_engine"] == 1 and v1["seconds_line_rate"] == pytest.approx(2.0)
  assert "lag_steps_line_rate" not in v1


def test_the_shape_count_matches_xla_on_a_loop_free_model():
  """Forward and forward + backward of an unrolled model whose every expert is
  chosen (so the dense MoE does exactly top-k's work) and whose attention
  computes every query-key pair: XLA's count and the formula agree within 10%."""
  import dataclasses

  from sao_jax.models import config as mcfg
  from sao_jax.models import policy

  cfg = dataclasses.replace(mcfg.tiny(1024), moe_impl="dense", experts_per_token=4)
  params = policy.init_params(cfg, jax.random.PRNGKey(0))
  b, length = 4, 128
  tokens = jnp.zeros((b, length), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length), (b, length))
  loss = lambda p: policy.token_logprobs(cfg, p, tokens, positions, jnp.ones_like(tokens))[0].sum()
  fwd = steptime.cost(jax.jit(loss).lower(params).compile())["flops"]
  both = steptime.cost(jax.jit(jax.grad(loss)).lower(params).compile())["flops"]
  per_token = steptime.forward_flops_per_token(cfg, attended=length)
  assert fwd / (b * length) == pytest.approx(per_token, rel=0.1)
  counted = steptime.rl_step_flops(cfg, b, length, critic_updates=0, remat=False, causal_skip=False)
  assert counted["total"] == pytest.approx(3 * per_token * b * length)
  assert both == pytest.approx(counted["total"], rel=0.1)


def test_the_rl_step_count_adds_critic_updates_remat_and_the_head_fraction():
  from sao_jax.models import config as mcfg

  cfg = mcfg.qwen3_30b_a3b()
  base = steptime.rl_step_flops(cfg, 1, 1024, critic_updates=0, remat=False)
  trunk = steptime.forward_flops_per_token(cfg, (1024 + 1) / 2, head=False)
  head = 2 * cfg.d_model * cfg.vocab_size
  assert base["total"] == pytest.approx(3 * (trunk + head) * 1024)
  k2 = steptime.rl_step_flops(cfg, 1, 1024, critic_updates=2, remat=True, head_fraction=0.25)
  assert k2["critic"] == pytest.approx(2 * 4 * trunk * 1024)
  assert k2["actor"] == pytest.approx(4 * (trunk + 0.25 * head) * 1024)
  # Qwen3-30B-A3B's ~3.3B active weights a token, less the embedding lookup:
  # 2 FLOPs each in the forward, attention at a short context aside.
  short = steptime.forward_flops_per_token(cfg, attended=1)
  assert 5.0e9 < short < 7.0e9
  step = steptime.analytic_step(k2["total"], 4, V5P, 0.5)
  assert step["seconds"] == pytest.approx(k2["total"] / 4 / (0.5 * 459e12))
  assert not steptime.analytic_step(1.0, 1, "TPU v9", 0.5)["available"]


def test_the_shape_count_goes_by_layer_kind():
  """Qwen3.5-35B-A3B: only its 10 gated full layers attend over the context
  (a DeltaNet layer's chunked rule costs the same at any length), and the
  shared expert is counted."""
  from sao_jax.models import config as mcfg

  cfg = mcfg.qwen3_5_35b_a3b()
  per_key = steptime.forward_flops_per_token(cfg, 1.0) - steptime.forward_flops_per_token(cfg, 0.0)
  assert per_key == 10 * 4 * cfg.num_heads * cfg.head_dim
  # The shared expert's SwiGLU is counted in each of the 40 MoE layers.
  wider = dataclasses.replace(cfg, shared_expert_d_ff=2 * cfg.shared_expert_d_ff)
  gap = steptime.forward_flops_per_token(wider, 0.0) - steptime.forward_flops_per_token(cfg, 0.0)
  assert gap == 40 * 6 * cfg.d_model * cfg.shared_expert_d_ff
