"""The MoE transformer: decoding, packing, MoE paths, sharding, freezing, scale."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sao_jax.algo import optim
from sao_jax.models import config as mcfg
from sao_jax.models import decoding, moe, policy, sharding
from sao_jax.models.transformer import Transformer

CFG = mcfg.tiny()
# Jitted views: op-by-op execution of the model is slow on CPU.
logprobs = jax.jit(policy.token_logprobs, static_argnums=0)
token_values = jax.jit(policy.token_values, static_argnums=0)
extend = jax.jit(decoding.extend, static_argnums=0)


@pytest.fixture(scope="module")
def params():
  return policy.init_params(CFG, jax.random.key(0))


def test_incremental_decoding_matches_teacher_forcing_multi_turn(params):
  rng = np.random.default_rng(0)
  b, total = 3, 40
  seqs = rng.integers(0, CFG.vocab_size, (b, total)).astype(np.int32)
  # Per slot: prompt length, then chunks alternating decode steps and
  # observation appends of different lengths (ragged across slots).
  prompt_len = np.array([5, 9, 3])
  cache = decoding.init_cache(CFG, b, 64)
  lengths = jnp.zeros((b,), jnp.int32)
  got = np.zeros((b, total), np.float32)

  def run(chunk_lens, lengths, cache):
    width = int(max(chunk_lens.max(), 1))
    start = np.asarray(lengths)
    toks = np.zeros((b, width), np.int32)
    valid = np.zeros((b, width), bool)
    for i in range(b):
      toks[i, : chunk_lens[i]] = seqs[i, start[i] : start[i] + chunk_lens[i]]
      valid[i, : chunk_lens[i]] = True
    logits, cache, new_len = extend(CFG, params, cache, toks, lengths, valid)
    # The logits of token j of the chunk predict the slot's next token.
    logp = np.asarray(jax.nn.log_softmax(logits))
    for i in range(b):
      for j in range(chunk_lens[i]):
        t = start[i] + j + 1
        if t < total:
          got[i, t] = logp[i, j, seqs[i, t]]
    return new_len, cache

  lengths, cache = run(prompt_len, lengths, cache)
  schedule = [
    np.array(x)
    for x in ([1, 1, 1], [1, 0, 1], [4, 2, 0], [1, 1, 1], [0, 6, 3], [1, 1, 1], [1, 1, 1])
  ]
  for chunk in schedule:
    lengths, cache = run(chunk, lengths, cache)
  np.testing.assert_array_equal(lengths, prompt_len + sum(schedule))

  pos = np.broadcast_to(np.arange(total), (b, total))
  ref, _ = logprobs(CFG, params, seqs, pos, np.ones((b, total), np.int32))
  for i in range(b):
    # Every token after the prompt whose predecessor was fed in some chunk.
    n = int(lengths[i])
    idx = np.arange(1, n)
    np.testing.assert_allclose(got[i, idx], np.asarray(ref)[i, idx], atol=2e-5)


def test_packed_segments_equal_separate_rows(params):
  rng = np.random.default_rng(1)
  a = rng.integers(0, CFG.vocab_size, 7)
  c = rng.integers(0, CFG.vocab_size, 5)
  packed = np.concatenate([a, c, [0, 0]])[None].astype(np.int32)
  seg = np.array([[1] * 7 + [2] * 5 + [0, 0]], np.int32)
  pos = np.array([list(range(7)) + list(range(5)) + [0, 0]], np.int32)
  lp, _ = logprobs(CFG, params, packed, pos, seg)
  lpa, _ = logprobs(CFG, params, a[None], np.arange(7)[None], np.ones((1, 7), np.int32))
  lpc, _ = logprobs(CFG, params, c[None], np.arange(5)[None], np.ones((1, 5), np.int32))
  np.testing.assert_allclose(lp[0, :7], lpa[0], atol=1e-5)
  np.testing.assert_allclose(lp[0, 7:12], lpc[0], atol=1e-5)
  assert float(lp[0, 7]) == 0.0  # a segment's first token has no prefix


def test_ragged_moe_equals_dense(params):
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, CFG.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
  seg = jnp.ones((2, 16), jnp.int32)
  dense, aux_d = Transformer(CFG).apply({"params": params}, tokens, pos, seg)
  ragged_cfg = dataclasses.replace(CFG, moe_impl="ragged")
  ragged, aux_r = Transformer(ragged_cfg).apply({"params": params}, tokens, pos, seg)
  np.testing.assert_allclose(dense, ragged, atol=1e-5)
  np.testing.assert_allclose(aux_d["load_balance_loss"], aux_r["load_balance_loss"])
  assert float(aux_d["load_balance_loss"]) >= 1.0 - 1e-5  # minimum is 1 (balanced)


@pytest.mark.parametrize("route", ["random", "one_expert", "unused_expert"])
def test_blocked_moe_kernel_equals_per_token_oracle(route):
  """Every pair lands in a block of its own expert, whatever the routing skew."""
  n, d, f, e, k, block = 37, 8, 12, 4, 2, 8
  ks = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(ks[0], (n, d))
  wg, wu = (jax.random.normal(kk, (e, d, f)) for kk in ks[1:3])
  wo = jax.random.normal(ks[3], (e, f, d))
  top_i = jax.random.randint(ks[4], (n, k), 0, e)
  if route == "one_expert":  # one expert takes every first choice: its run spans blocks
    top_i = top_i.at[:, 0].set(2)
  elif route == "unused_expert":
    top_i = top_i % 3
  top_p = jax.nn.softmax(jax.random.normal(ks[5], (n, k)))
  got = moe.blocked_moe(x, top_i, top_p, wg, wu, wo, block=block)
  np.testing.assert_allclose(got, _moe_oracle(x, top_i, top_p, wg, wu, wo), rtol=1e-4, atol=1e-4)


def _moe_oracle(x, top_i, top_p, wg, wu, wo):
  """Top-k SwiGLU experts token by token, in float64."""
  xn, ti, tp = (np.asarray(a, np.float64) for a in (x, top_i, top_p))
  want = np.zeros(xn.shape)
  for t in range(xn.shape[0]):
    for j in range(ti.shape[1]):
      ex = int(ti[t, j])
      g, u = xn[t] @ np.asarray(wg[ex]), xn[t] @ np.asarray(wu[ex])
      want[t] += tp[t, j] * ((g / (1 + np.exp(-g)) * u) @ np.asarray(wo[ex]))
  return want


def _decode_sized_moe(seed, n=32, d=8, f=12, e=4, k=2):
  """A 32-token MoE call, 4 experts top-2: inputs, weights and two routings.

  balanced: token t picks experts t % 4 and (t + 1) % 4 (16 pairs each,
  under the capacity of 24); skewed: every first choice on expert 0 (32).
  """
  ks = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(ks[0], (n, d))
  wg, wu = (jax.random.normal(kk, (e, d, f)) for kk in ks[1:3])
  wo = jax.random.normal(ks[3], (e, f, d))
  top_p = jax.nn.softmax(jax.random.normal(ks[5], (n, k)))
  balanced = jnp.stack([jnp.arange(n) % e, (jnp.arange(n) + 1) % e], 1)
  skewed = balanced.at[:, 0].set(0).at[:, 1].set(1 + jnp.arange(n) % 3)
  return x, top_p, (wg, wu, wo), balanced, skewed


def test_capacity_moe_kernel_equals_oracle_within_capacity_and_drops_past_it():
  x, top_p, w, balanced, skewed = _decode_sized_moe(1)
  cap = moe.small_capacity(32, 2, 4)
  assert cap == 24
  assert moe.small_capacity(16, 2, 4) == 12  # below 16 tokens: capacity, not dense
  assert moe.small_capacity(8, 2, 4) == 8  # 6 rounds up to 8 = n: dense
  got = moe.capacity_moe(x, balanced, top_p, *w, capacity=cap)
  np.testing.assert_allclose(got, _moe_oracle(x, balanced, top_p, *w), rtol=1e-4, atol=1e-4)
  # 32 > 24 pairs on expert 0: the kernel alone would drop 8 of them, which
  # is why the MoE module checks the load first.
  dropped = moe.capacity_moe(x, skewed, top_p, *w, capacity=cap)
  assert not np.allclose(dropped, _moe_oracle(x, skewed, top_p, *w), rtol=1e-3, atol=1e-3)


def test_capacity_or_dense_is_exact_whatever_the_load():
  x, top_p, (wg, wu, wo), balanced, skewed = _decode_sized_moe(2)
  n, e = 32, 4
  taken = []

  def dense(x, top_i, top_p):
    taken.append("dense")  # traced once: the cond's other branch
    gates = jnp.zeros((n, e)).at[jnp.arange(n)[:, None], top_i].set(top_p)
    h = jax.nn.silu(jnp.einsum("nd,edf->enf", x, wg)) * jnp.einsum("nd,edf->enf", x, wu)
    return jnp.einsum("enf,efd,ne->nd", h, wo, gates)

  run = jax.jit(lambda ti: moe.capacity_or_dense(x, ti, top_p, wg, wu, wo, dense))
  for top_i in (balanced, skewed):
    np.testing.assert_allclose(
      run(top_i), _moe_oracle(x, top_i, top_p, wg, wu, wo), rtol=1e-4, atol=1e-4
    )
  assert taken == ["dense"]


def test_small_blocked_calls_take_the_capacity_path_and_equal_dense(params):
  # A decode step of 32 slots: too small for blocks, so "blocked" runs
  # capacity_or_dense (its cond), and the result is dense's.
  tokens = jax.random.randint(jax.random.key(4), (32, 1), 0, CFG.vocab_size)
  pos = jnp.full((32, 1), 3)
  seg = jnp.ones((32, 1), jnp.int32)
  small_cfg = dataclasses.replace(CFG, moe_impl="blocked")
  run = lambda cfg: Transformer(cfg).apply({"params": params}, tokens, pos, seg)[0]
  assert " cond[" in str(jax.make_jaxpr(lambda: run(small_cfg))())
  assert " cond[" not in str(jax.make_jaxpr(lambda: run(CFG))())
  np.testing.assert_allclose(run(small_cfg), run(CFG), rtol=1e-5, atol=1e-5)


def test_blocked_moe_equals_dense_with_gradients(params):
  # 2 x 200 tokens, blocks of 64: the blocked path (N * (E - k) > E * moe_block).
  tokens = jax.random.randint(jax.random.key(2), (2, 200), 0, CFG.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(200), (2, 200))
  seg = jnp.ones((2, 200), jnp.int32)
  blocked_cfg = dataclasses.replace(CFG, moe_impl="blocked", moe_block=64)

  def loss(cfg, p):
    logp, aux = logprobs(cfg, p, tokens, pos, seg)
    return logp.mean() + aux["load_balance_loss"]

  # The blocked path is taken (its sort), not the dense fallback.
  def jaxpr(cfg):
    return str(jax.make_jaxpr(functools.partial(loss, cfg))(params))

  blocked_jaxpr = jaxpr(blocked_cfg)
  assert " sort[" in blocked_jaxpr and " sort[" not in jaxpr(CFG)
  # Blocks of moe_block rows: 2 * 400 pairs // 64 + 4 experts = 16 blocks of 64.
  assert f"f32[16,64,{CFG.d_model}]" in blocked_jaxpr

  dense, g_dense = jax.value_and_grad(functools.partial(loss, CFG))(params)
  blocked, g_blocked = jax.value_and_grad(functools.partial(loss, blocked_cfg))(params)
  np.testing.assert_allclose(blocked, dense, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_blocked), jax.tree.leaves(g_dense)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_value_model_from_policy(params):
  fresh = policy.init_params(CFG, jax.random.key(3), head="value")
  vparams = policy.value_params_from_policy(params, fresh)
  assert "lm_head" not in vparams
  np.testing.assert_array_equal(vparams["layer_1"]["moe"]["wo"], params["layer_1"]["moe"]["wo"])
  tokens = jnp.arange(10)[None] % CFG.vocab_size
  pos = jnp.arange(10)[None]
  seg = jnp.ones((1, 10), jnp.int32)
  vparams["value_bias"] = jnp.array([0.5])
  values, _ = token_values(CFG, vparams, tokens, pos, seg)
  assert values.shape == (1, 10)
  assert float(values[0, 0]) == 0.0
  np.testing.assert_allclose(values[0, 1:], 0.5, atol=1e-6)  # zero-init head + bias
  # Causality: V at t depends on x_<t only.
  changed = tokens.at[0, 5].set((tokens[0, 5] + 1) % CFG.vocab_size)
  vparams["value_head"] = jax.random.normal(jax.random.key(4), (CFG.d_model, 1))
  v1, _ = token_values(CFG, vparams, tokens, pos, seg)
  v2, _ = token_values(CFG, vparams, changed, pos, seg)
  np.testing.assert_array_equal(v1[0, :6], v2[0, :6])
  assert np.abs(np.asarray(v1[0, 6:] - v2[0, 6:])).max() > 0


def test_qwen3_30b_a3b_shape_builds_abstractly():
  cfg = mcfg.qwen3_30b_a3b()
  shapes = jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0)))
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  per_expert = 3 * cfg.d_model * cfg.moe_d_ff
  inactive = cfg.num_layers * (cfg.num_experts - cfg.experts_per_token) * per_expert
  active = total - inactive
  print(f"Qwen3-30B-A3B: {total / 1e9:.2f}B total, {active / 1e9:.2f}B active")
  assert 30.3e9 < total < 30.7e9
  assert 3.2e9 < active < 3.45e9


RULES_FSDP = (
  ("batch", ("data", "fsdp")),
  ("length", None),
  ("embed", "fsdp"),
  ("vocab", "tensor"),
  ("heads", "tensor"),
  ("kv_heads", None),
  ("head_dim", None),
  ("mlp", "tensor"),
  ("layers", None),
  ("expert", None),
)
RULES_EXPERT = (
  ("batch", "data"),
  ("length", None),
  ("embed", None),
  ("vocab", None),
  ("heads", None),
  ("kv_heads", None),
  ("head_dim", "tensor"),
  ("mlp", None),
  ("layers", None),
  ("expert", ("fsdp", "tensor")),
)


def test_two_rule_sets_give_identical_outputs_on_8_devices():
  assert jax.device_count() == 8, "conftest should give 8 fake CPU devices"
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  init = lambda: policy.init_params(CFG, jax.random.key(5), boxed=True)
  tokens = jax.random.randint(jax.random.key(6), (4, 12), 0, CFG.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(12), (4, 12))
  seg = jnp.ones((4, 12), jnp.int32)
  outs = []
  for rules in (RULES_FSDP, RULES_EXPERT):
    p, shard = sharding.sharded_init(init, mesh, rules)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      fwd = jax.jit(
        lambda p, t: policy.token_logprobs(CFG, p, t, pos, seg)[0],
        in_shardings=(shard, sharding.batch_sharding(mesh, rules)),
      )
      outs.append(np.asarray(fwd(p, tokens)))
  np.testing.assert_allclose(outs[0], outs[1], atol=1e-5)
  p, shard = sharding.sharded_init(init, mesh, RULES_EXPERT)
  assert p["layer_0"]["moe"]["wi_gate"].sharding.spec[0] == ("fsdp", "tensor")
  with pytest.raises(ValueError, match="lack logical axes"):
    sharding.sharded_init(init, mesh, RULES_FSDP[:-1])
  with pytest.raises(ValueError, match="mesh has axes"):
    sharding.sharded_init(init, mesh, RULES_FSDP[:-1] + (("expert", "pipeline"),))


def test_critic_optimizer_freezes_attention_and_trains_the_rest(params):
  vparams = policy.value_params_from_policy(
    params, policy.init_params(CFG, jax.random.key(7), head="value")
  )
  tx = optim.make_optimizer(vparams, 1e-2, rules=optim.CRITIC_FREEZE_RULES)
  state = tx.init(vparams)
  tokens = jax.random.randint(jax.random.key(8), (2, 10), 0, CFG.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
  seg = jnp.ones((2, 10), jnp.int32)

  def loss(p):
    v, _ = token_values(CFG, p, tokens, pos, seg)
    return jnp.mean((v - 1.0) ** 2)

  @jax.jit
  def step(p, state):
    updates, state = tx.update(jax.grad(loss)(p), state, p)
    return optax.apply_updates(p, updates), state

  new = vparams
  for _ in range(3):
    new, state = step(new, state)
  labels = optim.partition_labels(vparams, optim.CRITIC_FREEZE_RULES)
  flat_labels = {optim.param_path(k): v for k, v in jax.tree_util.tree_leaves_with_path(labels)}
  moved = {
    optim.param_path(k): bool(np.any(np.asarray(a) != np.asarray(b)))
    for (k, a), b in zip(jax.tree_util.tree_leaves_with_path(vparams), jax.tree.leaves(new))
  }
  frozen = [n for n, l in flat_labels.items() if l == optim.FREEZE]
  assert "layer_0/attn/q" in frozen and "embed" in frozen
  assert "layer_0/moe/wi_gate" not in frozen
  for name in frozen:
    assert not moved[name], name  # bit-identical
  for name in ("layer_0/moe/wi_gate", "layer_1/moe/router", "value_head", "final_norm/scale"):
    assert moved[name], name
  # No Adam moments for frozen leaves: only trainable leaves are arrays.
  adam_state = state.inner_states[optim.TRAIN].inner_state
  mu = [
    s
    for s in jax.tree.leaves(adam_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    if isinstance(s, optax.ScaleByAdamState)
  ][0].mu
  mu_paths = {
    optim.param_path(k) for k, v in jax.tree_util.tree_leaves_with_path(mu) if hasattr(v, "shape")
  }
  assert mu_paths == {n for n, l in flat_labels.items() if l == optim.TRAIN}


def test_optax_masked_alone_does_not_freeze(params):
  # The trap docs/DESIGN.md section 2 warns about, kept as a regression check of the docs.
  grads = jax.tree.map(jnp.ones_like, params)
  tx = optax.masked(optax.adam(1e-2), jax.tree.map(lambda _: False, params))
  updates, _ = tx.update(grads, tx.init(params), params)
  assert float(jax.tree.leaves(updates)[0].sum()) != 0.0


def test_freezing_rules_must_cover_every_parameter(params):
  with pytest.raises(ValueError, match="matches no freezing rule"):
    optim.partition_labels(params, ((r"attn", optim.FREEZE),))


def test_config_validation():
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    dataclasses.replace(CFG, num_kv_heads=3)
  with pytest.raises(ValueError, match="experts_per_token"):
    dataclasses.replace(CFG, experts_per_token=9)
  with pytest.raises(ValueError, match="moe_block must be positive"):
    dataclasses.replace(CFG, moe_block=0)
  with pytest.raises(ValueError, match="Unknown model config"):
    mcfg.ModelConfig.from_dict({**dataclasses.asdict(CFG), "n_layer": 2})
