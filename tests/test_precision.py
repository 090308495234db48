"""Mixed precision: bf16 compute with fp32 master weights (ModelConfig.dtype).

The switch is `dtype="bfloat16"` with `param_dtype="float32"` (in a run's
config: `config.model.overrides = {"dtype": "bfloat16"}`). It must actually
compute in bf16, keep every parameter and optimizer moment in fp32, and
still train.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sao_jax import train_step as ts
from sao_jax.models import config as mcfg
from sao_jax.models import policy

FP32 = mcfg.tiny()
BF16 = dataclasses.replace(FP32, dtype="bfloat16")


def fixed_batch(cfg, rows=4, length=64, prompt=8):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (rows, length)).astype(np.int32)
  action = np.zeros((rows, length), bool)
  action[:, prompt:] = True
  return {
      "tokens": tokens, "positions": np.broadcast_to(np.arange(length), tokens.shape),
      "segment_ids": np.ones_like(tokens), "action_mask": action,
      "rollout_logprobs": np.where(action, -np.log(cfg.vocab_size), 0.0).astype(np.float32),
      "rewards": np.zeros((rows, length), np.float32),
      "baseline_advantages": np.where(action, 1.0, 0.0).astype(np.float32),
      "policy_version": np.zeros_like(tokens),
  }


def float_dtypes(tree):
  return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_dtype_field_takes_names_and_refuses_non_floats():
  assert BF16.dtype == jnp.bfloat16 and BF16.param_dtype == jnp.float32
  # Names and jnp types give equal configs that hash alike (jit static args).
  by_type = dataclasses.replace(FP32, dtype=jnp.bfloat16)
  assert by_type == BF16 and hash(by_type) == hash(BF16)
  assert mcfg.ModelConfig.from_dict(dict(dataclasses.asdict(FP32), dtype="bfloat16")) == BF16
  with pytest.raises(ValueError, match="^dtype must be one of"):
    dataclasses.replace(FP32, dtype="int8")
  with pytest.raises(ValueError, match="^param_dtype must be one of"):
    dataclasses.replace(FP32, param_dtype="float64x")


def test_bf16_compute_runs_the_matmuls_in_bf16():
  params = policy.init_params(BF16, jax.random.key(0))
  b = fixed_batch(BF16)
  fn = lambda p: policy.token_logprobs(BF16, p, b["tokens"], b["positions"], b["segment_ids"])
  hlo = jax.jit(fn).lower(params).as_text()
  assert "bf16" in hlo and float_dtypes(params) == {jnp.dtype(jnp.float32)}
  logp_bf16, _ = jax.jit(fn)(params)
  logp_fp32, _ = policy.token_logprobs(FP32, params, b["tokens"], b["positions"],
                                       b["segment_ids"])
  assert logp_bf16.dtype == jnp.float32  # log-probs (and the losses) stay fp32
  np.testing.assert_allclose(logp_bf16, logp_fp32, atol=0.1)
  assert float(jnp.abs(logp_bf16 - logp_fp32).max()) > 0  # not silently fp32


def test_bf16_compute_trains_and_keeps_fp32_master_weights():
  params = policy.init_params(BF16, jax.random.key(0))
  tx = optax.adam(1e-2)
  step = jax.jit(ts.make_sft_step(BF16, tx), donate_argnums=(0, 1))
  opt = tx.init(params)
  batch = jax.tree.map(jnp.asarray, fixed_batch(BF16))
  nll = []
  for _ in range(15):
    params, opt, metrics = step(params, opt, batch)
    nll.append(float(metrics["sft/nll"]))
  assert all(np.isfinite(nll)) and int(metrics["sft/update_skipped"]) == 0
  assert nll[-1] < 0.7 * nll[0], nll  # memorises the fixed batch
  assert float_dtypes(params) == {jnp.dtype(jnp.float32)}
  assert float_dtypes(opt) == {jnp.dtype(jnp.float32)}


def test_bf16_rl_step_updates_fp32_params():
  params = policy.init_params(BF16, jax.random.key(0))
  tx = optax.adam(1e-3)
  state = ts.TrainState(jnp.zeros((), jnp.int32), params, {}, tx.init(params), ())
  step = jax.jit(ts.make_train_step(BF16, ts.StepConfig(advantage="group", critic_updates=0),
                                    tx, optax.identity()))
  new, metrics = step(state, jax.tree.map(jnp.asarray, fixed_batch(BF16)))
  assert int(new.step) == 1 and np.isfinite(float(metrics["policy/loss"]))
  assert float_dtypes(new.policy) == float_dtypes(new.policy_opt) == {jnp.dtype(jnp.float32)}
  assert any(np.any(np.asarray(a) != np.asarray(b))
             for a, b in zip(jax.tree.leaves(new.policy), jax.tree.leaves(params)))
