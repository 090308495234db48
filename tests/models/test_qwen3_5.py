"""The Qwen3.5 / 3.6 hybrids (Gated DeltaNet + gated full attention, dense or
MoE with a shared expert) against transformers' own classes: config and
weights from `save_pretrained`, logits, export; packed rows that leak no
state; the engine's recurrent state (decode log-probs equal teacher-forced
ones, dense and paged cache, a weight swap mid-run); routing in the
periodic scan.

(The kernels' own oracle tests: tests/models/test_deltanet.py.)
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import EchoEnv, random_params

from sao_jax.algo.optim import param_path
from sao_jax.config import sections
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import hf_export, hf_import, policy, routing
from sao_jax.models.transformer import Transformer
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine

torch = pytest.importorskip("torch", reason="the 'parity' extra (make test installs it)")
transformers = pytest.importorskip("transformers")

# Tiny text configs as transformers writes them: 8 layers, the releases'
# [linear x3, full] pattern (full_attention_interval 4), a quarter of each
# head rotary, value heads twice the key heads.
TEXT = dict(
  vocab_size=96,
  hidden_size=48,
  num_hidden_layers=8,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  rms_norm_eps=1e-6,
  max_position_embeddings=256,
  linear_conv_kernel_dim=4,
  linear_key_head_dim=8,
  linear_value_head_dim=12,
  linear_num_key_heads=2,
  linear_num_value_heads=4,
  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
KINDS = {
  "dense": lambda: transformers.Qwen3_5ForCausalLM(
    transformers.Qwen3_5TextConfig(**TEXT, intermediate_size=80)
  ),
  "moe": lambda: transformers.Qwen3_5MoeForCausalLM(
    transformers.Qwen3_5MoeTextConfig(
      **TEXT,
      moe_intermediate_size=24,
      shared_expert_intermediate_size=40,
      num_experts=4,
      num_experts_per_tok=2,
    )
  ),
}
# The chunked delta rule and transformers' torch reference sum in other orders.
TOL = dict(atol=3e-4, rtol=1e-4)


def _randomise(model, seed):
  """Weights no init would give: zero-centred norms off zero, the DeltaNet
  output norm off one, decays spread over (0, 1)."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("A_log"):
        p.copy_(torch.log(0.5 + 4 * torch.rand_like(p)))
      elif "linear_attn.norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif "norm" in name or "dt_bias" in name:
        p.copy_(0.2 * torch.randn_like(p))
      else:
        p.copy_(0.1 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module", params=sorted(KINDS))
def saved(request, tmp_path_factory):
  """(transformers model, the directory its save_pretrained wrote) per kind."""
  model = _randomise(KINDS[request.param]().eval().float(), seed=0)
  path = tmp_path_factory.mktemp(f"qwen3_5_{request.param}")
  model.save_pretrained(str(path))
  return model, path


def _params(cfg, scale, seed):
  """Random params (fakes.random_params) with the zero-centred norms' offsets
  near 0, as trained ones are (y = x_hat * (1 + w))."""
  params = random_params(cfg, scale, seed)
  return jax.tree_util.tree_map_with_path(
    lambda path, x: x - 1.0 if param_path(path).endswith("norm/scale") else x, params
  )


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params, tokens, segment_ids=None, positions=None):
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  if segment_ids is None:
    segment_ids = jnp.ones_like(tokens)
  return Transformer(cfg).apply({"params": params}, tokens, positions, segment_ids)[0]


def _reference(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def test_config_and_logits_match_transformers_unscanned_and_scanned(saved):
  model, path = saved
  cfg = hf_import.config_from_hf(str(path))
  moe = model.config.model_type == "qwen3_5_moe_text"
  assert cfg.family == ("qwen3_5_moe" if moe else "qwen3_5")
  assert cfg.attention_kinds == ("linear", "linear", "linear", "gated_full") * 2
  assert (cfg.rotary_dims, cfg.zero_centered_norm, cfg.scan_prefix, cfg.scan_period) == (
    4,
    True,
    0,
    4,
  )
  assert {s.mlp for s in cfg.layer_specs} == {"moe_shared" if moe else "dense"}
  params = hf_import.load_hf_checkpoint(str(path), cfg)
  # 70 tokens: two chunks of the delta rule and a partial third.
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 70))
  ref = _reference(model, tokens)
  np.testing.assert_allclose(_logits(cfg, params, jnp.asarray(tokens)), ref, **TOL)
  # Scanned over the repeating block: two steps of four layers ("layers/sub_r").
  scanned = dataclasses.replace(cfg, scan_layers=True)
  direct = hf_import.load_hf_checkpoint(str(path), scanned)
  assert direct["layers"]["sub_0"]["attn"]["conv_q"].shape[0] == scanned.scan_steps == 2
  jax.tree.map(np.testing.assert_array_equal, direct, policy.scan_params(scanned, params))
  jax.tree.map(np.testing.assert_array_equal, policy.unscan_params(scanned, direct), params)
  np.testing.assert_allclose(_logits(scanned, direct, jnp.asarray(tokens)), ref, **TOL)


def test_export_loads_in_transformers_with_equal_logits(saved, tmp_path):
  """Trained weights (random, of the imported shape) export to a directory
  AutoModelForCausalLM reads as the family's causal LM, with our logits."""
  model, path = saved
  cfg = dataclasses.replace(hf_import.config_from_hf(str(path)), scan_layers=True)
  params = _params(cfg, 0.1, seed=3)
  hf_export.export_params(params, cfg, str(tmp_path / "out"), dtype="float32")
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["model_type"] == model.config.model_type
  back = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path / "out"), dtype=torch.float32
  ).eval()
  assert type(back).__name__ == type(model).__name__
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 40))
  np.testing.assert_allclose(
    _logits(cfg, params, jnp.asarray(tokens)), _reference(back, tokens), **TOL
  )


def test_a_multimodal_release_imports_its_text_model(saved, tmp_path):
  """The releases are image-text checkpoints: model_type qwen3_5[_moe], the
  text fields under text_config, tensors under model.language_model, a
  vision tower and an MTP head beside them. The text model imports alone."""
  model, path = saved
  cfg = hf_import.config_from_hf(str(path))
  hf = json.loads((path / "config.json").read_text())
  moe = hf["model_type"] == "qwen3_5_moe_text"
  nested = {
    "model_type": "qwen3_5_moe" if moe else "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": hf,
    "vision_config": {"depth": 1},
  }
  (tmp_path / "config.json").write_text(json.dumps(nested))
  tensors = {}
  for k, v in model.state_dict().items():
    name = k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
    tensors[name] = v.contiguous()
  tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
  tensors["mtp.fc.weight"] = torch.ones(4, 4)
  from safetensors.torch import save_file

  save_file(tensors, str(tmp_path / "model.safetensors"))
  assert hf_import.config_from_hf(str(tmp_path)) == cfg
  params = hf_import.load_hf_checkpoint(str(tmp_path), cfg)
  jax.tree.map(np.testing.assert_array_equal, params, hf_import.load_hf_checkpoint(str(path), cfg))
  assert hf_import.mtp_tensors(str(tmp_path)) == ["mtp.fc.weight"]
  # An export carries the MTP head over unchanged (bytes and dtype as
  # stored), and transformers still loads the text model from it.
  out = tmp_path / "export"
  stats = hf_export.export_params(
    params, cfg, str(out), dtype="float32", carry=(str(tmp_path), ["mtp.fc.weight"])
  )
  assert hf_export.CARRIED in stats["files"]
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert index["weight_map"]["mtp.fc.weight"] == hf_export.CARRIED
  np.testing.assert_array_equal(
    hf_import._Reader(str(out)).get("mtp.fc.weight"),
    np.ones((4, 4), np.float32),
  )
  back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  assert type(back).__name__ == type(model).__name__


def test_packed_rows_leak_no_state_across_segments():
  """Two sequences packed in one row give each one's logits alone: the conv
  window and the delta-rule state restart at the segment boundary."""
  cfg = mcfg.tiny_hybrid(vocab_size=40)
  params = _params(cfg, 0.1, seed=0)
  rng = np.random.default_rng(0)
  a, b = rng.integers(0, 40, 37), rng.integers(0, 40, 21)
  tokens = np.concatenate([a, b, np.zeros(6, int)])[None]
  seg = np.concatenate([np.ones(37), 2 * np.ones(21), np.zeros(6)]).astype(np.int32)[None]
  pos = np.concatenate([np.arange(37), np.arange(21), np.zeros(6)]).astype(np.int32)[None]
  packed = np.asarray(_logits(cfg, params, jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos)))
  for x, sl in ((a, slice(0, 37)), (b, slice(37, 58))):
    # Alone in a row of the same width (one compile), padding after it.
    row = np.zeros((1, 64), int)
    row[0, : len(x)] = x
    alone_seg = (np.arange(64) < len(x)).astype(np.int32)[None]
    alone = np.asarray(
      _logits(
        cfg,
        params,
        jnp.asarray(row),
        jnp.asarray(alone_seg),
        jnp.asarray(np.arange(64)[None] * alone_seg),
      )
    )
    np.testing.assert_allclose(packed[0, sl], alone[0, : len(x)], atol=1e-5, rtol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def _routed(cfg, params, tokens, replay):
  """(the routing collected [M, B, L, k], logits, logits replaying `replay`)."""
  pos, seg = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape), jnp.ones_like(tokens)
  model = Transformer(cfg)
  (logits, _), state = model.apply({"params": params}, tokens, pos, seg, mutable=["intermediates"])
  chosen = routing.collect(cfg, state["intermediates"], *tokens.shape)
  return chosen, logits, model.apply({"params": params}, tokens, pos, seg, routing=replay)[0]


def test_routing_is_collected_in_layer_order_from_the_periodic_scan():
  """Both layouts collect the same [M, B, L, k]; replaying it reproduces the
  logits (the scanned replay is split per period)."""
  cfg = mcfg.tiny_hybrid(vocab_size=40)
  scanned = dataclasses.replace(cfg, scan_layers=True)
  assert (scanned.scan_period, scanned.scan_steps) == (2, 2)
  params = _params(cfg, 0.3, seed=1)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 40, (2, 9)))
  none = jnp.full((4, 2, 9, 2), routing.NONE, jnp.int32)
  chosen, logits, _ = _routed(cfg, params, tokens, none)
  assert chosen.shape == (4, 2, 9, 2)
  for c, p in ((cfg, params), (scanned, policy.scan_params(scanned, params))):
    again, _, replayed = _routed(c, p, tokens, chosen)
    np.testing.assert_array_equal(again, chosen)
    np.testing.assert_allclose(replayed, logits, atol=1e-5)


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_engine_logprobs_equal_teacher_forced_for_the_hybrid(kv_cache):
  """The engine serves the scanned hybrid toy, its DeltaNet layers' conv and
  delta-rule state carried per slot beside the KV cache: every sampled
  token's recorded log-prob is the teacher-forced one, across prefill
  chunks, multi-turn appends, slot reuse and a weight swap mid-run. Dense:
  the swap re-feeds every in-flight record ("recompute"); paged: a pool of
  one max_len trajectory, so slots wait, are preempted and re-fed, and the
  swap keeps the states ("keep")."""
  tok = CharTokenizer()
  cfg = dataclasses.replace(mcfg.tiny_hybrid(tok.vocab_size), scan_layers=True, prefill_chunk=16)
  params = {0: _params(cfg, 0.1, seed=0), 1: _params(cfg, 0.1, seed=1)}
  kw = dict(max_turn_tokens=6)
  if kv_cache == "paged":
    kw = dict(kv_cache="paged", page_size=8, kv_pages=12, max_turn_tokens=16, swap_policy="keep")
  rollout = sections.Rollout(slots=3, max_len=96, decode_steps=4, **kw)
  engine = PolicyEngine(cfg, params[0], rollout, seed=3)
  out = []
  driver = RolloutDriver(engine, EchoEnv(), tok, iter(range(100)), None)

  def emit(t):
    out.append(t)
    if len(out) == 2:
      driver.update_params(params[1], 1)

  driver._emit = emit
  driver.run(max_trajectories=6)
  logprobs = jax.jit(policy.token_logprobs, static_argnums=0)
  checked = 0
  for t in out:
    n = len(t)  # padded to max_len: one compiled program for every record
    tokens = np.zeros((1, rollout.max_len), np.int32)
    tokens[0, :n] = t.tokens
    segments = (np.arange(rollout.max_len) < n).astype(np.int32)[None]
    for version in set(t.policy_version[t.action_mask].tolist()):
      lp, _ = logprobs(cfg, params[version], tokens, np.arange(rollout.max_len)[None], segments)
      sel = t.action_mask & (t.policy_version == version)
      np.testing.assert_allclose(np.asarray(lp)[0, :n][sel], t.rollout_logprobs[sel], atol=2e-4)
      checked += int(sel.sum())
  assert checked > 30 and driver.stats.param_swaps == 1
  if kv_cache == "paged":
    assert driver.stats.preemptions > 0 and any(t.num_turns >= 3 for t in out)


def test_the_critic_of_the_hybrid_freezes_every_token_mixer():
  """The paper's frozen critic attention covers the Gated DeltaNet layers too
  (their projections, conv, decay and output norm), in the periodic scan's
  "layers/sub_r" layout; the MoE, its shared expert and the norms train."""
  from sao_jax.algo import optim

  cfg = dataclasses.replace(mcfg.tiny_hybrid(), scan_layers=True)
  value = jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0), "value"))
  labels = {
    optim.param_path(p): l
    for p, l in jax.tree_util.tree_flatten_with_path(
      optim.partition_labels(value, optim.CRITIC_FREEZE_RULES)
    )[0]
  }
  frozen = {n for n, l in labels.items() if l == optim.FREEZE}
  assert {
    "layers/sub_0/attn/conv_q",
    "layers/sub_0/attn/a_log",
    "layers/sub_0/attn/norm",
    "layers/sub_1/attn/q",
    "layers/sub_1/attn_norm/scale",
    "embed",
  } <= frozen
  trained = {n for n, l in labels.items() if l == optim.TRAIN}
  assert {
    "layers/sub_0/moe/shared/wi_gate",
    "layers/sub_1/moe/shared_gate",
    "layers/sub_0/mlp_norm/scale",
    "value_head",
  } <= trained
  assert not [n for n in trained if "/attn" in n]
