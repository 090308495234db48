"""Mixed precision: bf16 compute with fp32 master weights (ModelConfig.dtype).

The switch is `dtype="bfloat16"` with `param_dtype="float32"` (in a run's
config: `config.model.overrides = {"dtype": "bfloat16"}`). It must actually
compute in bf16, keep every parameter and optimizer moment in fp32, and
still train.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from runs import load_config_module, shipped_configs

from sao_jax.algo import optim
from sao_jax.models import config as mcfg
from sao_jax.models import policy, precision
from sao_jax.train import configuration, factories
from sao_jax.train import train_step as ts

FP32 = mcfg.tiny()
BF16 = dataclasses.replace(FP32, dtype="bfloat16")


def fixed_batch(cfg, rows=4, length=64, prompt=8):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (rows, length)).astype(np.int32)
  action = np.zeros((rows, length), bool)
  action[:, prompt:] = True
  return {
    "tokens": tokens,
    "positions": np.broadcast_to(np.arange(length), tokens.shape),
    "segment_ids": np.ones_like(tokens),
    "action_mask": action,
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
  logp_fp32, _ = policy.token_logprobs(FP32, params, b["tokens"], b["positions"], b["segment_ids"])
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
  step = jax.jit(
    ts.make_train_step(
      BF16, ts.StepConfig.of(advantage="group", critic_updates=0), tx, optax.identity()
    )
  )
  new, metrics = step(state, jax.tree.map(jnp.asarray, fixed_batch(BF16)))
  assert int(new.step) == 1 and np.isfinite(float(metrics["policy/loss"]))
  assert float_dtypes(new.policy) == float_dtypes(new.policy_opt) == {jnp.dtype(jnp.float32)}
  assert any(
    np.any(np.asarray(a) != np.asarray(b))
    for a, b in zip(jax.tree.leaves(new.policy), jax.tree.leaves(params))
  )


# --- every shipped config's steps move its weights (sao_jax/models/precision.py) ----

SHIPPED = [n[:-3] for n in shipped_configs()]


def load_config(name):
  return load_config_module(name + ".py").get_config()


def stage_steps(config):
  """(field, learning rate, head) of each training stage the config runs, at
  the peak and at the schedule's floor: SFT and the actor train the policy,
  value pretraining and RL's critic updates the value model."""
  out = []
  if config.sft.steps:
    lr = config.sft.lr
    out += [("sft.lr", lr, "lm"), ("sft.lr floor", precision.schedule_floor(lr, True), "lm")]
  if config.rl.steps:
    lr = config.rl.actor_lr
    out += [
      ("rl.actor_lr", lr, "lm"),
      ("rl.actor_lr floor", precision.schedule_floor(lr, True), "lm"),
    ]
  if config.rl.steps or config.value_pretrain.steps:
    out.append(("rl.critic_lr", config.rl.critic_lr, "value"))
  return out


@functools.lru_cache(maxsize=None)
def changed_fraction(cfg, head, lr, clip_norm):
  """The fraction of weights one step of the run's optimizer (AdamW with the
  run's clip) changes, from the fp32 init cast to cfg.param_dtype. The value
  head starts at zero (its body would get no gradient): here it is drawn
  like the other weights."""
  init = policy.init_params(
    dataclasses.replace(cfg, param_dtype=jnp.float32), jax.random.key(0), head
  )
  init = jax.tree.map(
    lambda x: x if np.any(np.asarray(x)) else 0.02 * jax.random.normal(jax.random.key(1), x.shape),
    init,
  )
  params = jax.tree.map(lambda x: x.astype(cfg.param_dtype), init)
  b = jax.tree.map(jnp.asarray, fixed_batch(cfg))
  m = b["action_mask"]

  def loss(p):
    if head == "lm":
      logp, _ = policy.token_logprobs(cfg, p, b["tokens"], b["positions"], b["segment_ids"])
      return -jnp.where(m, logp, 0.0).sum() / m.sum()
    v = policy.token_values(cfg, p, b["tokens"], b["positions"], b["segment_ids"])
    v = v[0] if isinstance(v, tuple) else v
    return 0.5 * jnp.where(m, (v - 1.0) ** 2, 0.0).sum() / m.sum()

  @jax.jit
  def step(p):
    tx = optim.make_optimizer(p, lr, clip_norm=clip_norm)
    updates, _ = tx.update(jax.grad(loss)(p), tx.init(p), p)
    new = optax.apply_updates(p, updates)
    return sum(jnp.sum(a != b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(p)))

  return int(step(params)) / sum(x.size for x in jax.tree.leaves(params))


def small_model_with_dtypes_of(config):
  """The tiny shape with the dtypes the config trains in (its preset's,
  overrides and compute dtype)."""
  big = factories.build_model_config(config)
  return dataclasses.replace(FP32, param_dtype=big.param_dtype, dtype=big.dtype)


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_config_moves_its_weights_like_fp32_master_weights(name):
  config = load_config(name)
  cfg = small_model_with_dtypes_of(config)
  reference = dataclasses.replace(cfg, param_dtype=jnp.float32)
  for field, lr, head in stage_steps(config):
    got = changed_fraction(cfg, head, lr, config.rl.clip_norm)
    want = changed_fraction(reference, head, lr, config.rl.clip_norm)
    assert want > 0.9, (field, want)  # the fp32 reference moves (nearly) every weight
    assert got >= want, (
      f"{name}: {field} = {lr:g} changed {got:.3f} of the weights, fp32 master weights {want:.3f}"
    )


def test_bf16_params_at_the_pod_lr_fail_the_same_check_and_the_guard():
  """The old qwen3_30b_a3b preset (bf16 params) at sao_moe's lr: one step
  changes a few percent of the weights, and validate refuses the config."""
  bf16 = dataclasses.replace(FP32, param_dtype="bfloat16", dtype="bfloat16")
  got = changed_fraction(bf16, "lm", 1e-6, 1.0)
  want = changed_fraction(FP32, "lm", 1e-6, 1.0)
  assert want > 0.9 and got < 0.1, (got, want)
  config = load_config("sao_moe")
  config.model.overrides = {"param_dtype": "bfloat16"}
  with pytest.raises(
    configuration.ConfigError, match=r"^rl.actor_lr = 1e-06 \(down to 1e-07 .*bfloat16 params"
  ):
    configuration.validate(config, num_devices=128, num_processes=32, host_devices=4)


def test_half_ulp_and_the_guard_threshold():
  assert precision.half_ulp(jnp.bfloat16, 1.0) == 2.0**-8
  assert precision.half_ulp(jnp.bfloat16, 0.02) == 2.0**-14
  assert precision.half_ulp(jnp.float32, 1.0) == 2.0**-24
  # The oracle: adding the threshold to 1.0 in the dtype keeps it only just
  # above it (a tie rounds to even), and just below it rounds away.
  one = jnp.ones((), jnp.bfloat16)
  assert one + jnp.bfloat16(0.9 * 2.0**-8) == one
  assert one + jnp.bfloat16(1.1 * 2.0**-8) != one
  assert precision.updates_lost(jnp.bfloat16, 3e-3) and not precision.updates_lost(
    jnp.bfloat16, 4e-3
  )
  assert precision.check_updates_kept(jnp.float32, {"rl.actor_lr": (1e-6, 1e-7)}) is None
  assert precision.check_updates_kept(jnp.float32, {"rl.actor_lr": (1e-7, 1e-8)})


def test_the_pod_preset_keeps_fp32_master_weights_and_serves_bf16():
  cfg = mcfg.qwen3_30b_a3b()
  assert cfg.param_dtype == jnp.float32 and cfg.dtype == jnp.bfloat16
  serving = precision.serving_config(cfg)
  assert serving.param_dtype == serving.dtype == jnp.bfloat16
  assert precision.serving_config(FP32) is FP32


@pytest.mark.parametrize("hybrid", [False, True])
def test_the_engine_serves_a_bf16_copy_with_the_trainers_forward(hybrid):
  """The engine's copy is the compute-dtype cast, and its forward (every
  weight cast to bf16 where used) equals the trainer's from fp32 weights bit
  for bit, once XLA may not skip the casts: by default
  (xla_allow_excess_precision) XLA:CPU drops a weight's f32 -> bf16 -> f32
  round trip into its f32 matmul, so the trainer's forward is a little more
  precise than the engine's (the gap is asserted too, so this records it).
  `hybrid`: the Qwen3.5-style toy, whose DeltaNet decay, conv and
  zero-centred norms cast too."""
  cfg = dataclasses.replace(mcfg.tiny_hybrid(), dtype="bfloat16") if hybrid else BF16
  params = policy.init_params(cfg, jax.random.key(1))
  served = precision.cast_for_serving(cfg, params)
  assert float_dtypes(served) == {jnp.dtype(jnp.bfloat16)}
  b = fixed_batch(cfg)
  args = (b["tokens"], b["positions"], b["segment_ids"])
  engine_cfg = precision.serving_config(cfg)
  trainer_fn = jax.jit(lambda p: policy.token_logprobs(cfg, p, *args)[0])
  engine_fn = jax.jit(lambda p: policy.token_logprobs(engine_cfg, p, *args)[0])
  strict = {"xla_allow_excess_precision": False}
  trainer = trainer_fn.lower(params).compile(compiler_options=strict)(params)
  engine = engine_fn.lower(served).compile(compiler_options=strict)(served)
  np.testing.assert_array_equal(np.asarray(engine), np.asarray(trainer))
  gap = np.abs(np.asarray(trainer_fn(params)) - np.asarray(engine_fn(served))).max()
  assert 0 < gap < 0.05, gap
  assert precision.serving_bytes(cfg, params) * 2 == sum(x.nbytes for x in jax.tree.leaves(params))


def test_an_engine_holds_and_restores_into_the_compute_dtype():
  from sao_jax.config import sections
  from sao_jax.rollout.engine import PolicyEngine

  params = policy.init_params(BF16, jax.random.key(2))
  engine = PolicyEngine(BF16, params, sections.Rollout(slots=2, max_len=64))
  assert float_dtypes(engine.params) == {jnp.dtype(jnp.bfloat16)}
  assert float_dtypes(engine.abstract_params()) == {jnp.dtype(jnp.bfloat16)}
  want = precision.cast_for_serving(BF16, params)
  for a, b in zip(jax.tree.leaves(engine.params), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  engine.update_params(jax.tree.map(lambda x: x + 1, params), 1)  # a new version: cast again
  assert float_dtypes(engine.params) == {jnp.dtype(jnp.bfloat16)} and engine.version == 1
