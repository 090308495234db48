"""Model families as data: dense Qwen3 against transformers' own class, from a
checkpoint `save_pretrained` wrote to an export it loads back; the layer
description and the one-line refusals.

(Qwen3-MoE's parity: tests/models/test_hf_import.py.)
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import EchoEnv, random_params

from sao_jax.config import sections
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import families, hf_export, hf_import, policy
from sao_jax.models.transformer import Transformer
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine

torch = pytest.importorskip("torch", reason="the 'parity' extra (make test installs it)")
transformers = pytest.importorskip("transformers")

# A tiny dense Qwen3 as transformers writes it. Tied embeddings, as the
# 0.6B-4B releases have them.
QWEN3 = dict(
  vocab_size=96,
  hidden_size=48,
  intermediate_size=80,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  rms_norm_eps=1e-6,
  rope_theta=10000.0,
  max_position_embeddings=128,
  tie_word_embeddings=True,
)
TOL = dict(atol=1e-4, rtol=1e-4)


def _randomise(model, seed):
  """Non-trivial norms and weights (init's ones and small normals would hide a
  mapping error)."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def saved(request, tmp_path_factory):
  """(transformers model, the directory its save_pretrained wrote) per tying."""
  cfg = transformers.Qwen3Config(**dict(QWEN3, tie_word_embeddings=request.param))
  model = _randomise(transformers.Qwen3ForCausalLM(cfg).eval().float(), seed=0)
  path = tmp_path_factory.mktemp("qwen3")
  model.save_pretrained(str(path))
  return model, path


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params, tokens):
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return Transformer(cfg).apply({"params": params}, tokens, pos, jnp.ones_like(tokens))[0]


def _reference(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def test_config_from_a_dense_qwen3_save_pretrained(saved):
  model, path = saved
  cfg = hf_import.config_from_hf(str(path))
  tied = model.config.tie_word_embeddings
  assert (cfg.family, cfg.num_experts, cfg.dense_d_ff, cfg.num_layers) == ("qwen3", 0, 80, 3)
  assert cfg.tie_embeddings == tied and cfg.num_moe_layers == 0
  assert all(s == mcfg.LayerSpec("full", "dense") for s in cfg.layer_specs)


def test_imported_logits_match_transformers(saved):
  model, path = saved
  cfg = hf_import.config_from_hf(str(path))
  params = hf_import.load_hf_checkpoint(str(path), cfg)
  assert ("lm_head" in params) != cfg.tie_embeddings
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20))
  ref = _reference(model, tokens)
  np.testing.assert_allclose(_logits(cfg, params, jnp.asarray(tokens, jnp.int32)), ref, **TOL)
  # The whole stack as one scan computes the same logits.
  scanned = dataclasses.replace(cfg, scan_layers=True)
  assert (scanned.scan_prefix, scanned.num_scanned_layers) == (0, 3)
  np.testing.assert_allclose(
    _logits(scanned, policy.scan_params(scanned, params), jnp.asarray(tokens, jnp.int32)),
    ref,
    **TOL,
  )
  # ... and an import straight into the scanned layout is the same params.
  direct = hf_import.load_hf_checkpoint(str(path), scanned)
  jax.tree.map(np.testing.assert_array_equal, direct, policy.scan_params(scanned, params))


def test_a_bf16_save_pretrained_imports_into_fp32_masters_exactly(saved, tmp_path):
  model, _ = saved
  model.to(torch.bfloat16).save_pretrained(str(tmp_path))
  model.float()
  cfg = hf_import.config_from_hf(str(tmp_path))
  params = hf_import.load_hf_checkpoint(str(tmp_path), cfg)
  sd = {k: v.to(torch.bfloat16).float().numpy() for k, v in model.state_dict().items()}
  np.testing.assert_array_equal(params["embed"], sd["model.embed_tokens.weight"])
  np.testing.assert_array_equal(
    params["layer_2"]["mlp"]["wo"], sd["model.layers.2.mlp.down_proj.weight"].T
  )
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))


def test_export_loads_in_transformers_with_equal_logits(saved, tmp_path):
  """A model sao-jax trained (random weights of the imported shape) exports to a
  directory `AutoModelForCausalLM` reads as Qwen3ForCausalLM, tied or not,
  with our logits on the exported (bf16-rounded) weights."""
  _, path = saved
  cfg = hf_import.config_from_hf(str(path))
  params = random_params(cfg, 0.1, seed=3)
  hf_export.export_params(params, cfg, str(tmp_path / "out"))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["architectures"] == ["Qwen3ForCausalLM"] and written["model_type"] == "qwen3"
  model = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path / "out"), dtype=torch.float32
  ).eval()
  assert type(model).__name__ == "Qwen3ForCausalLM"
  assert model.config.tie_word_embeddings == cfg.tie_embeddings
  rounded = hf_import.load_hf_checkpoint(str(tmp_path / "out"), cfg)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 20))
  np.testing.assert_allclose(
    _logits(cfg, rounded, jnp.asarray(tokens, jnp.int32)), _reference(model, tokens), **TOL
  )


def test_value_model_exports_as_a_token_classifier(tmp_path):
  cfg = mcfg.tiny_dense(vocab_size=96)
  value = jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0), "value"))
  value = jax.tree.map(lambda s: np.full(s.shape, 0.01, np.float32), value)
  hf_export.export_params(value, cfg, str(tmp_path / "v"), head="value", dtype="float32")
  model = transformers.AutoModelForTokenClassification.from_pretrained(str(tmp_path / "v"))
  assert type(model).__name__ == "Qwen3ForTokenClassification"
  back = hf_import.load_hf_checkpoint(str(tmp_path / "v"), cfg, head="value")
  jax.tree.map(np.testing.assert_array_equal, back, value)


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_engine_logprobs_equal_teacher_forced_for_a_tied_dense_model(kv_cache):
  """The engine serves a dense, tied, scanned Qwen3: every sampled token's
  recorded log-prob is the teacher-forced one (a swap mid-run included)."""
  tok = CharTokenizer()
  cfg = dataclasses.replace(mcfg.tiny_dense(tok.vocab_size), scan_layers=True)
  params = {0: random_params(cfg, 0.05, seed=0), 1: random_params(cfg, 0.05, seed=1)}
  kw = dict(kv_cache="paged", page_size=8) if kv_cache == "paged" else {}
  rollout = sections.Rollout(slots=3, max_len=96, max_turn_tokens=6, decode_steps=4, **kw)
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
    n = len(t)
    for version in set(t.policy_version[t.action_mask].tolist()):
      lp, _ = logprobs(
        cfg, params[version], t.tokens[None], np.arange(n)[None], np.ones((1, n), np.int32)
      )
      sel = t.action_mask & (t.policy_version == version)
      np.testing.assert_allclose(np.asarray(lp)[0, sel], t.rollout_logprobs[sel], atol=2e-4)
      checked += int(sel.sum())
  assert checked > 30 and driver.stats.param_swaps == 1


def test_unsupported_model_types_are_one_line(tmp_path):
  bert = transformers.BertConfig(
    vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
  )
  bert.save_pretrained(str(tmp_path))
  with pytest.raises(ValueError) as e:
    hf_import.config_from_hf(str(tmp_path))
  msg = str(e.value)
  assert "\n" not in msg and "model_type 'bert' is not supported" in msg
  assert "qwen3, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe" in msg
  (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
  with pytest.raises(ValueError, match="model_type '' is not supported"):
    hf_import.config_from_hf(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
  with pytest.raises(ValueError, match=r"lacks \['vocab_size', 'num_hidden_layers'"):
    hf_import.config_from_hf(str(tmp_path))


def test_layer_kinds_a_family_cannot_hold_are_refused():
  with pytest.raises(ValueError, match="family 'qwen3' has no full-attention / moe-MLP"):
    dataclasses.replace(mcfg.tiny(), family="qwen3")
  with pytest.raises(ValueError, match="family 'qwen3_moe' has no linear-attention"):
    dataclasses.replace(
      mcfg.tiny(),
      attention_kinds=("full", "linear"),
      linear_num_key_heads=1,
      linear_num_value_heads=2,
      linear_key_head_dim=8,
      linear_value_head_dim=8,
    )
  with pytest.raises(ValueError, match="linear .Gated DeltaNet. layers need"):
    dataclasses.replace(mcfg.tiny(), attention_kinds=("full", "linear"))
  with pytest.raises(ValueError, match="attention_kinds has 1 entries for 2 layers"):
    dataclasses.replace(mcfg.tiny(), attention_kinds=("full",))
  with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
    dataclasses.replace(mcfg.tiny(), family="llama")
  with pytest.raises(ValueError, match="num_layers = -1: must be an integer >= 1"):
    dataclasses.replace(mcfg.tiny_dense(), num_layers=-1)
  with pytest.raises(ValueError, match="num_experts = 0 .a dense model. needs"):
    dataclasses.replace(mcfg.tiny_dense(), experts_per_token=2)


def test_presets_have_the_published_parameter_counts():
  """The dense presets' sizes against the releases' model cards (0.6B, 1.7B,
  8.2B parameters; 0.44B, 1.4B, 6.95B outside the embeddings)."""
  for preset, total, non_embedding in (
    (mcfg.qwen3_0_6b, 0.60e9, 0.44e9),
    (mcfg.qwen3_1_7b, 1.72e9, 1.41e9),
    (mcfg.qwen3_8b, 8.19e9, 6.95e9),
  ):
    cfg = preset()
    shapes = jax.eval_shape(lambda cfg=cfg: policy.init_params(cfg, jax.random.key(0)))
    n = sum(x.size for x in jax.tree.leaves(shapes))
    embed = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    assert abs(n - total) / total < 0.01, (preset.__name__, n)
    assert abs(n - embed - non_embedding) / non_embedding < 0.01, (preset.__name__, n - embed)
    assert families.hf_config(cfg)["model_type"] == "qwen3"


@pytest.mark.parametrize("scan", [False, True])
def test_the_critic_of_a_dense_model_trains_its_mlps_with_attention_frozen(scan):
  """The paper freezes the critic's attention and trains its MoE projections;
  in a dense model the dense MLPs are what trains (and the value head, the
  norms of the MLPs and the final norm), stacked or not."""
  from sao_jax.algo import optim

  cfg = dataclasses.replace(mcfg.tiny_dense(), scan_layers=scan)
  value = jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0), "value"))
  labels = {
    optim.param_path(p): l
    for p, l in jax.tree_util.tree_flatten_with_path(
      optim.partition_labels(value, optim.CRITIC_FREEZE_RULES)
    )[0]
  }
  trained = sorted(n for n, l in labels.items() if l == optim.TRAIN)
  frozen = sorted(n for n, l in labels.items() if l == optim.FREEZE)
  layer = "layers" if scan else "layer_1"
  assert f"{layer}/mlp/wi_gate" in trained and f"{layer}/mlp_norm/scale" in trained
  assert {"value_head", "value_bias", "final_norm/scale"} <= set(trained)
  assert f"{layer}/attn/q" in frozen and "embed" in frozen
  assert not [n for n in trained if "/attn" in n]


def test_model_hf_dir_is_checked_before_the_run(saved, tmp_path):
  """model.hf_dir: a directory of an unsupported family, a head subset, or a
  dense checkpoint with routing replay are one-line config errors; a good one
  gives the run its architecture under the preset's way of running."""
  from configs import qwen3_colab
  from sao_jax.train import factories

  _, path = saved
  config = qwen3_colab.get_config(str(path))
  cfg = factories.build_model_config(config)
  assert (cfg.family, cfg.num_layers, cfg.d_model, cfg.vocab_size) == ("qwen3", 3, 48, 96)
  assert cfg.scan_layers and cfg.param_dtype == jnp.float32 and cfg.dtype == jnp.bfloat16
  transformers.BertConfig(
    vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
  ).save_pretrained(str(tmp_path))
  cases = (
    (dict(hf_dir=str(tmp_path)), "model_type 'bert' is not supported"),
    (dict(vocab_subset="env"), "model.vocab_subset = 'env'"),
    (dict(hf_dir=str(tmp_path / "missing")), "No such file"),
  )
  for change, message in cases:
    bad = qwen3_colab.get_config(str(path))
    for k, v in change.items():
      bad.model[k] = v
    with pytest.raises(sections.ConfigError, match=message) as e:
      factories.validate_config(bad, num_devices=8)
    assert "\n" not in str(e.value)
  replay = qwen3_colab.get_config(str(path))
  replay.rl.routing_replay = True
  with pytest.raises(sections.ConfigError, match="without MoE layers"):
    factories.validate_config(replay, num_devices=8)
