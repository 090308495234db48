"""MoE routing capture and replay (sao_jax/models/routing.py, transformer.MoE)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from sao_jax.models import config as mcfg
from sao_jax.models import policy, routing
from sao_jax.models.transformer import MoE, Transformer, init_cache

B, L = 2, 10


def _cfg(**kw):
  # A dense layer 0 (as Qwen's mlp_only layers), then two MoE layers; 8 experts, top-2.
  return dataclasses.replace(
    mcfg.tiny(64), num_layers=3, dense_layers=(0,), dense_d_ff=64, num_experts=8, **kw
  )


def _inputs(cfg, seed=1):
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (B, L), 0, cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(L), (B, L))
  return tokens, positions, jnp.ones((B, L), jnp.int32)


def _forward(cfg, params, tokens, positions, segments, replay=None):
  @jax.jit
  def run(params, replay):
    (logits, _), state = Transformer(cfg, "lm").apply(
      {"params": params}, tokens, positions, segments, routing=replay, mutable=["intermediates"]
    )
    return logits, routing.collect(cfg, state["intermediates"], B, L)

  return run(params, replay)


@pytest.mark.parametrize("scan", [False, True])
def test_collect_is_the_router_top_k_and_self_replay_is_exact(scan):
  cfg = _cfg(scan_layers=scan)
  params = policy.init_params(cfg, jax.random.PRNGKey(0))
  tokens, positions, segments = _inputs(cfg)
  logits, own = _forward(cfg, params, tokens, positions, segments)
  assert own.shape == (cfg.num_moe_layers, B, L, cfg.experts_per_token)
  assert own.min() >= 0 and own.max() < cfg.num_experts
  replayed, _ = _forward(cfg, params, tokens, positions, segments, own)
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(logits))
  # NONE rows keep the router's own choice: the same result again.
  none = jnp.full_like(own, routing.NONE)
  kept, _ = _forward(cfg, params, tokens, positions, segments, none)
  np.testing.assert_array_equal(np.asarray(kept), np.asarray(logits))


@pytest.mark.parametrize("impl", ["dense", "ragged", "blocked"])
def test_replayed_experts_are_the_ones_used(impl):
  """One MoE layer with forced experts equals the SwiGLU mixture computed by hand,
  gates from the router's probabilities at those experts, renormalised."""
  cfg = dataclasses.replace(_cfg(), moe_impl=impl, moe_block=4)
  x = jax.random.normal(jax.random.PRNGKey(3), (B, L, cfg.d_model))
  mask = jnp.ones((B, L), bool)
  params = nn.meta.unbox(MoE(cfg).init(jax.random.PRNGKey(4), x, mask)["params"])
  own_top = jax.lax.top_k(
    jax.nn.softmax(x.reshape(-1, cfg.d_model) @ params["router"]), cfg.experts_per_token
  )[1]
  forced = (own_top + 3) % cfg.num_experts  # none of the router's choices survive... mostly
  out, _ = MoE(cfg).apply({"params": params}, x, mask, forced.reshape(B, L, -1))

  xf = np.asarray(x.reshape(-1, cfg.d_model), np.float64)
  probs = np.asarray(
    jax.nn.softmax(jnp.asarray(xf @ np.asarray(params["router"]), jnp.float32)), np.float64
  )
  want = np.zeros_like(xf)
  silu = lambda v: v / (1 + np.exp(-v))
  for n in range(xf.shape[0]):
    chosen = np.asarray(forced[n])
    gates = probs[n, chosen] / probs[n, chosen].sum()
    for g, e in zip(gates, chosen):
      h = silu(xf[n] @ np.asarray(params["wi_gate"][e])) * (xf[n] @ np.asarray(params["wi_up"][e]))
      want[n] += g * (h @ np.asarray(params["wo"][e]))
  np.testing.assert_allclose(np.asarray(out).reshape(-1, cfg.d_model), want, rtol=2e-4, atol=2e-5)
  plain, _ = MoE(cfg).apply({"params": params}, x, mask)
  assert not np.allclose(np.asarray(plain), np.asarray(out), atol=1e-4)


def _decode_logprobs(cfg, params, tokens, replay):
  """The engine's way: the first token as a prefill, then one token a step against
  the KV cache, each step replaying its own column of `replay`; log-probs of
  tokens[:, 1:] under the logits that preceded them."""

  @jax.jit
  def step(cache, tok, t, replay_t):
    logits, aux = Transformer(cfg, "lm").apply(
      {"params": params},
      tok,
      jnp.full((B, 1), t),
      jnp.ones_like(tok),
      cache=cache,
      routing=replay_t,
    )
    return logits, aux["cache"]

  cache = init_cache(cfg, B, L)
  out = []
  for t in range(L - 1):
    logits, cache = step(cache, tokens[:, t : t + 1], t, replay[:, :, t : t + 1])
    logp = jax.nn.log_softmax(logits[:, 0])
    out.append(jnp.take_along_axis(logp, tokens[:, t + 1 : t + 2], -1)[:, 0])
  return jnp.stack(out, 1)


@pytest.mark.parametrize("scan", [False, True])
def test_trainer_with_the_engine_routing_matches_the_engine(scan):
  """The engine decodes under some routing (here forced: a stand-in for its own
  choices where they flip); the trainer's teacher-forced log-probs with that
  routing replayed equal the engine's, and without it they do not."""
  cfg = _cfg(scan_layers=scan)
  params = policy.init_params(cfg, jax.random.PRNGKey(0))
  tokens, positions, segments = _inputs(cfg)
  _, own = _forward(cfg, params, tokens, positions, segments)
  engine_routing = (own + 1) % cfg.num_experts
  engine = _decode_logprobs(cfg, params, tokens, engine_routing)
  logprobs = jax.jit(
    lambda r: policy.token_logprobs(cfg, params, tokens, positions, segments, routing=r)[0]
  )
  replayed, plain = logprobs(engine_routing), logprobs(None)
  np.testing.assert_allclose(np.asarray(replayed[:, 1:]), np.asarray(engine), atol=2e-5)
  assert np.abs(np.asarray(plain[:, 1:]) - np.asarray(engine)).max() > 1e-3


def test_differ_ignores_order_within_the_top_k():
  a = jnp.array([[0, 1], [2, 3], [4, 5]])
  b = jnp.array([[1, 0], [2, 4], [4, 5]])
  np.testing.assert_array_equal(np.asarray(routing.differ(a, b)), [False, True, False])


def test_collect_without_intermediates_is_one_clear_error():
  with pytest.raises(ValueError, match="mutable"):
    routing.collect(_cfg(), {}, B, L)
