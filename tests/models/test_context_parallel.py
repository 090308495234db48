"""Context parallelism: rows split over a `context` mesh axis.

configs/sao_moe_128k.py maps the "length" logical axis onto a mesh axis, so
one 128K row spans two chips. These check, on 8 simulated CPU devices in
fp32, that the split changes nothing: attention, and the whole RL and SFT
steps (params, optimizer state and metrics) equal the one-device ones.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_configs import load_config_module
from test_trainer import demo_trajs

from sao_jax.data import packing
from sao_jax.models import attention, sharding
from sao_jax.train import factories

COMMON = load_config_module("common.py")
CONTEXT_RULES = tuple(
  ("length", "context") if name == "length" else (name, axes)
  for name, axes in COMMON.DATA_PARALLEL_RULES
)


def _config(rules):
  c = load_config_module("sao_tiny.py").get_config()
  with c.unlocked():
    c.sharding.rules = rules
    c.data.buckets = (256,)
  return c


def _programs(config, mesh, model_cfg):
  return factories.build_programs(config, model_cfg, factories.step_config(config), mesh)


def _step_outputs(config, mesh, model_cfg, batch, which):
  """(params, opt state, metrics) after one step, gathered to the host."""
  p = _programs(config, mesh, model_cfg)
  policy_params, _ = sharding.sharded_init(p.policy_init, mesh, p.rules)
  critic_params, _ = sharding.sharded_init(p.critic_init, mesh, p.rules)
  placed = jax.device_put(batch, p.batch_sharding)
  with jax.set_mesh(mesh), nn.logical_axis_rules(p.rules):
    if which == "rl":
      state = jax.jit(p.init_state, out_shardings=p.state_shardings)(policy_params, critic_params)
      state, metrics = p.rl_step(state, placed)
      out = (state.policy, state.critic, state.policy_opt)
    else:
      opt = jax.jit(p.sft_tx.init, out_shardings=p.state_shardings.policy_opt)(policy_params)
      params, opt, metrics = p.sft_step(policy_params, opt, placed)
      out = (params, opt)
  return jax.device_get(out), jax.device_get(metrics)


def _model_cfg(impl):
  cfg = factories.build_model_config(_config(CONTEXT_RULES))
  return dataclasses.replace(
    cfg, attention_impl=impl, attention_block=64, dtype=jnp.float32, param_dtype=jnp.float32
  )


# Each attention once in the default run (reference with the RL step, chunked
# with SFT); the other two pairs are slow.
@pytest.mark.parametrize(
  "impl,which",
  [
    ("reference", "rl"),
    ("chunked", "sft"),
    pytest.param("chunked", "rl", marks=pytest.mark.slow),
    pytest.param("reference", "sft", marks=pytest.mark.slow),
  ],
)
def test_a_step_over_a_context_axis_equals_one_device(which, impl):
  model_cfg = _model_cfg(impl)
  batch = packing.pack(demo_trajs(4), 4, (256,))
  one = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  split = sharding.make_mesh({"data": 2, "context": 4})
  ref_out, ref_m = _step_outputs(_config(COMMON.DATA_PARALLEL_RULES), one, model_cfg, batch, which)
  out, m = _step_outputs(_config(CONTEXT_RULES), split, model_cfg, batch, which)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref_out)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  for k in ref_m:
    if np.all(np.isfinite(ref_m[k])):
      np.testing.assert_allclose(m[k], ref_m[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_chunked_attention_with_the_length_sharded_equals_reference():
  rng = np.random.default_rng(0)
  b, length, h, kvh, hd = 2, 256, 4, 2, 16
  q = jnp.asarray(rng.normal(size=(b, length, h, hd)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, length, kvh, hd)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, length, kvh, hd)), jnp.float32)
  seg = np.ones((b, length), np.int32)
  seg[0, 100:] = 2  # two packed sequences in row 0
  seg[1, 200:] = 0  # padding in row 1
  seg = jnp.asarray(seg)
  expected = attention.reference_attention(q, k, v, attention.packed_causal_mask(seg))
  mesh = sharding.make_mesh({"data": 2, "context": 4})
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "context"))
  q, k, v, seg = (jax.device_put(x, spec) for x in (q, k, v, seg))
  got = jax.jit(lambda *a: attention.chunked_attention(*a, block=64))(q, k, v, seg)
  valid = np.asarray(seg) > 0  # a padding query's output is unspecified
  np.testing.assert_allclose(
    np.asarray(got)[valid], np.asarray(expected)[valid], rtol=1e-5, atol=1e-5
  )
