"""Routing replay end to end (rl.routing_replay): the engine records the experts it
chose for every token it fed, trajectories carry them through the store and the
batch, and the actor's forward uses them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import runs
from fakes import EchoEnv

from sao_jax.config import sections
from sao_jax.data import packing, store
from sao_jax.data.trajectory import checked
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy, routing
from sao_jax.models.transformer import Transformer
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine
from sao_jax.train import configuration

TOK = CharTokenizer()
MAX_LEN = 96


def _cfg(**kw):
  # A dense layer, then two MoE layers of 8 experts, top-2.
  return dataclasses.replace(
    mcfg.tiny(TOK.vocab_size),
    num_layers=3,
    dense_layers=(0,),
    dense_d_ff=64,
    **{"num_experts": 8, **kw},
  )


def _own_routing(cfg, params, tokens):
  """The trainer-side forward's own choices on one sequence, [T, M, k] (one
  compile: the row padded to MAX_LEN at the end, which causal attention
  keeps from the real tokens)."""
  n = len(tokens)
  row = np.zeros((1, MAX_LEN), np.int32)
  row[0, :n] = tokens
  return np.moveaxis(np.asarray(_forward_routing(cfg, params, row))[:, 0, :n], 0, 1)


def _forward_routing(cfg, params, row):
  if cfg not in _JITS:

    def run(params, row):
      positions = jnp.arange(MAX_LEN)[None]
      _, state = Transformer(cfg, "hidden").apply(
        {"params": params}, row, positions, jnp.ones_like(row), mutable=["intermediates"]
      )
      return routing.collect(cfg, state["intermediates"], 1, MAX_LEN)

    _JITS[cfg] = jax.jit(run)
  return _JITS[cfg](params, row)


_JITS = {}


def _trajectories(cfg, params, kv_cache="dense", n=6):
  kw = dict(kv_cache="paged", page_size=8) if kv_cache == "paged" else {}
  rollout = sections.Rollout(slots=3, max_len=MAX_LEN, max_turn_tokens=6, decode_steps=4, **kw)
  engine = PolicyEngine(cfg, params, rollout, seed=3, record_routing=True)
  out = []
  RolloutDriver(engine, EchoEnv(), TOK, iter(range(100)), out.append).run(max_trajectories=n)
  return out


@pytest.mark.parametrize(
  "kv_cache,scan,chunk,hybrid",
  [("dense", False, 8, False), ("paged", True, 0, False), ("dense", True, 16, True)],
)
def test_the_engine_records_what_the_trainer_chooses_in_f32(kv_cache, scan, chunk, hybrid):
  """In float32 the engine and the trainer route alike: every fed token's
  recorded experts are the trainer's own, the never-fed last token's row is
  NONE, and each trajectory's rows line up with its tokens (multi-turn, with
  observations fed as prefill). `hybrid`: the Qwen3.5-style toy, its MoE
  layers inside the periodic scan's blocks."""
  if hybrid:
    cfg = dataclasses.replace(
      mcfg.tiny_hybrid(TOK.vocab_size), scan_layers=scan, prefill_chunk=chunk
    )
  else:
    cfg = _cfg(scan_layers=scan, prefill_chunk=chunk)
  params = policy.init_params(cfg, jax.random.key(0))
  trajs = _trajectories(cfg, params, kv_cache)
  assert any(t.num_turns >= 2 for t in trajs)
  for t in trajs:
    m, k = cfg.num_moe_layers, cfg.experts_per_token
    assert t.routing.shape == (len(t), m, k) and t.routing.dtype == np.int16
    assert (t.routing[-1] == routing.NONE).all()
    own = _own_routing(cfg, params, t.tokens)[:-1]
    np.testing.assert_array_equal(np.sort(t.routing[:-1], -1), np.sort(own, -1))
    assert checked(t, TOK.vocab_size, MAX_LEN, routing_shape=(m, k, cfg.num_experts))[1] is None


def test_replayed_routing_gives_the_engine_log_probs_where_bf16_routing_differs():
  """bf16 compute, 128 experts top-8: the engine's and the trainer's own choices
  differ at some tokens (a fixed seed, so the case is there every run). With
  the recorded routing replayed, the trainer's teacher-forced log-probs come
  within bf16 noise of what the engine sampled with, and closer than without."""
  cfg = _cfg(num_experts=128, experts_per_token=8, param_dtype=jnp.float32, dtype=jnp.bfloat16)
  params = policy.init_params(cfg, jax.random.key(0))
  trajs = _trajectories(cfg, params, n=6)
  packed = packing.pack(trajs, rows=len(trajs), buckets=(MAX_LEN,), routing=(2, 8))
  tokens, mask = jnp.asarray(packed["tokens"]), packed["action_mask"]
  replay = jnp.moveaxis(jnp.asarray(packed["routing"], jnp.int32), 2, 0)
  lp = jax.jit(
    lambda r: policy.token_logprobs(
      cfg,
      params,
      tokens,
      jnp.asarray(packed["positions"]),
      jnp.asarray(packed["segment_ids"]),
      routing=r,
    )[0]
  )
  engine_lp = packed["rollout_logprobs"][mask]
  plain = np.abs(np.asarray(lp(None))[mask] - engine_lp)
  replayed = np.abs(np.asarray(lp(replay))[mask] - engine_lp)
  flips = sum(
    int(routing.differ(t.routing[:-1], _own_routing(cfg, params, t.tokens)[:-1]).any(-1).sum())
    for t in trajs
  )
  assert flips > 0
  assert replayed.max() < plain.max() and replayed.max() < 0.02


def test_routing_survives_the_store_and_is_refused_by_reason():
  cfg = _cfg()
  params = policy.init_params(cfg, jax.random.key(0))
  t = _trajectories(cfg, params, n=1)[0]
  back = store.deserialize(store.serialize(t))
  np.testing.assert_array_equal(back.routing, t.routing)
  shape = (cfg.num_moe_layers, cfg.experts_per_token, cfg.num_experts)
  assert checked(back, TOK.vocab_size, MAX_LEN, routing_shape=shape)[1] is None
  no_routing = dataclasses.replace(t, routing=None)
  assert store.deserialize(store.serialize(no_routing)).routing is None
  assert checked(no_routing, TOK.vocab_size, MAX_LEN)[1] is None  # no replay: not needed
  cases = {
    "missing_routing": None,
    "bad_routing": t.routing[:, :1],  # one MoE layer of two
    "routing_out_of_range": np.where(t.routing == 0, cfg.num_experts, t.routing),
  }
  for reason, r in cases.items():
    assert (
      checked(dataclasses.replace(t, routing=r), TOK.vocab_size, MAX_LEN, routing_shape=shape)[1]
      == reason
    )
  assert (
    checked(dataclasses.replace(t, routing=t.routing[:-1]), TOK.vocab_size, MAX_LEN)[1]
    == "bad_routing"
  )  # not a row per token
  assert (
    checked(dataclasses.replace(t, routing=t.routing.astype(np.float32)), TOK.vocab_size, MAX_LEN)[
      1
    ]
    == "bad_routing"
  )
  # The routing member is capped like the others, by choices a token.
  wide = dataclasses.replace(t, routing=np.zeros((len(t), 1000, 8), np.int16))
  with pytest.raises(store.CorruptRecordError, match="too_large"):
    store.deserialize(store.serialize(wide), MAX_LEN, routing_choices=384)
  assert store.deserialize(store.serialize(wide), MAX_LEN, routing_choices=8000).routing.shape[
    1:
  ] == (1000, 8)
  with pytest.raises(ValueError, match="routing record"):
    packing.pack([no_routing], rows=1, buckets=(MAX_LEN,), routing=shape[:2])


def test_routing_replay_needs_moe_layers():
  config = runs.load_config_module("sao_tiny.py").get_config()
  config.rl.routing_replay = True
  configuration.validate(config, num_devices=1)
  config.model.overrides = {"num_layers": 1, "dense_layers": (0,), "dense_d_ff": 32}
  with pytest.raises(configuration.ConfigError, match="rl.routing_replay"):
    configuration.validate(config, num_devices=1)


# The engine records and the trainer replays in the default run (the tests above),
# and test_compile.py compiles the replayed step with its batch.
@pytest.mark.slow
def test_a_run_with_routing_replay_trains(tmp_path):
  """The real trainer, async rollout, replay on: RL steps run on recorded routing."""
  workdir = str(tmp_path / "replay")
  runs.launch(workdir, "--config.rl.routing_replay=True", "--config.rl.steps=2")
  rl = runs.read_metrics(workdir, "rl")
  assert [r["step"] for r in rl] == [1, 2]
  assert all(np.isfinite(r["policy/loss"]) for r in rl)
  assert all(r.get("queue/rejected_missing_routing", 0) == 0 for r in rl)
