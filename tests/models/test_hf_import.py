"""Import of Qwen3-MoE safetensors checkpoints, and parity with transformers."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from sao_jax.models import hf_import, policy
from sao_jax.models.transformer import Transformer

torch = pytest.importorskip("torch", reason="the 'parity' extra (make test installs it)")
transformers = pytest.importorskip("transformers")

HF_CONFIG = dict(
  vocab_size=96,
  hidden_size=48,
  intermediate_size=80,
  moe_intermediate_size=24,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  num_experts=6,
  num_experts_per_tok=2,
  norm_topk_prob=True,
  decoder_sparse_step=1,
  mlp_only_layers=[1],
  rms_norm_eps=1e-6,
  rope_theta=10000.0,
  max_position_embeddings=128,
  tie_word_embeddings=False,
  attention_bias=False,
  architectures=["Qwen3MoeForCausalLM"],
  model_type="qwen3_moe",
)


def hub_layout_state_dict(model, num_experts, moe_ff):
  """The model's tensors under the Hub's per-expert names, as numpy."""
  out = {}
  for name, t in model.state_dict().items():
    a = t.detach().numpy().copy()
    if name.endswith("mlp.experts.gate_up_proj"):
      pre = name[: -len("gate_up_proj")]
      for j in range(num_experts):
        out[f"{pre}{j}.gate_proj.weight"] = a[j, :moe_ff].copy()
        out[f"{pre}{j}.up_proj.weight"] = a[j, moe_ff:].copy()
    elif name.endswith("mlp.experts.down_proj"):
      pre = name[: -len("down_proj")]
      for j in range(num_experts):
        out[f"{pre}{j}.down_proj.weight"] = a[j].copy()
    else:
      out[name] = a
  return out


@pytest.fixture(scope="module")
def hf_model():
  torch.manual_seed(0)
  cfg = transformers.Qwen3MoeConfig(
    **{k: v for k, v in HF_CONFIG.items() if k not in ("architectures", "model_type")}
  )
  model = transformers.Qwen3MoeForCausalLM(cfg).eval().float()
  with torch.no_grad():  # make norms non-trivial so their mapping is tested
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.1 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module")
def checkpoint_dir(hf_model, tmp_path_factory):
  path = tmp_path_factory.mktemp("qwen3moe")
  tensors = hub_layout_state_dict(
    hf_model, HF_CONFIG["num_experts"], HF_CONFIG["moe_intermediate_size"]
  )
  names = sorted(tensors)
  shards = {
    "model-00001-of-00002.safetensors": names[: len(names) // 2],
    "model-00002-of-00002.safetensors": names[len(names) // 2 :],
  }
  for file, keys in shards.items():
    save_file({k: tensors[k] for k in keys}, str(path / file))
  (path / "model.safetensors.index.json").write_text(
    json.dumps({"weight_map": {k: f for f, keys in shards.items() for k in keys}})
  )
  (path / "config.json").write_text(json.dumps(HF_CONFIG))
  return path, tensors


def test_import_maps_every_tensor(checkpoint_dir):
  path, tensors = checkpoint_dir
  cfg = hf_import.config_from_hf(str(path))
  assert cfg.dense_layers == (1,) and cfg.num_experts == 6
  params = hf_import.load_hf_checkpoint(str(path), cfg)
  d, h, hd = cfg.d_model, cfg.num_heads, cfg.head_dim
  np.testing.assert_array_equal(params["embed"], tensors["model.embed_tokens.weight"])
  np.testing.assert_array_equal(params["lm_head"], tensors["lm_head.weight"].T)
  for i in range(cfg.num_layers):
    pre, lay = f"model.layers.{i}.", params[f"layer_{i}"]
    np.testing.assert_array_equal(
      lay["attn"]["q"].reshape(d, h * hd), tensors[pre + "self_attn.q_proj.weight"].T
    )
    np.testing.assert_array_equal(
      lay["attn"]["o"].reshape(h * hd, d), tensors[pre + "self_attn.o_proj.weight"].T
    )
    np.testing.assert_array_equal(
      lay["attn"]["k_norm"]["scale"], tensors[pre + "self_attn.k_norm.weight"]
    )
    if i == 1:
      np.testing.assert_array_equal(lay["mlp"]["wo"], tensors[pre + "mlp.down_proj.weight"].T)
    else:
      np.testing.assert_array_equal(lay["moe"]["router"], tensors[pre + "mlp.gate.weight"].T)
      for j in range(cfg.num_experts):
        np.testing.assert_array_equal(
          lay["moe"]["wi_up"][j], tensors[pre + f"mlp.experts.{j}.up_proj.weight"].T
        )
        np.testing.assert_array_equal(
          lay["moe"]["wo"][j], tensors[pre + f"mlp.experts.{j}.down_proj.weight"].T
        )
  n_ours = sum(x.size for x in jax.tree.leaves(params))
  assert n_ours == sum(t.size for t in tensors.values())


def test_import_rejects_wrong_shapes_and_extra_tensors(checkpoint_dir, tmp_path):
  path, tensors = checkpoint_dir
  cfg = hf_import.config_from_hf(str(path))
  bad = dict(tensors)
  bad["model.norm.weight"] = np.ones(7, np.float32)
  save_file(bad, str(tmp_path / "m.safetensors"))
  with pytest.raises(ValueError, match="final_norm/scale: checkpoint shape"):
    hf_import.load_hf_checkpoint(str(tmp_path / "m.safetensors"), cfg)
  extra = dict(tensors, **{"model.layers.0.extra.weight": np.ones(2, np.float32)})
  save_file(extra, str(tmp_path / "e.safetensors"))
  with pytest.raises(ValueError, match="not used by the model"):
    hf_import.load_hf_checkpoint(str(tmp_path / "e.safetensors"), cfg)


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params, tokens):
  """Our logits [B, L, V] (one compile for the tests that share a config)."""
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return Transformer(cfg).apply({"params": params}, tokens, pos, jnp.ones_like(tokens))[0]


def test_logits_match_transformers(hf_model, checkpoint_dir):
  path, _ = checkpoint_dir
  cfg = hf_import.config_from_hf(str(path))
  params = hf_import.load_hf_checkpoint(str(path), cfg)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20))
  with torch.no_grad():
    ref = hf_model(torch.tensor(tokens)).logits.numpy()
  ours = _logits(cfg, params, jnp.asarray(tokens, jnp.int32))
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
  # And the log-probs view agrees with log_softmax of the reference logits.
  pos = np.broadcast_to(np.arange(20, dtype=np.int32), (2, 20))
  lp, _ = policy.token_logprobs(
    cfg, params, tokens.astype(np.int32), pos, np.ones((2, 20), np.int32)
  )
  ref_lp = torch.log_softmax(torch.tensor(ref), -1).numpy()
  np.testing.assert_allclose(
    lp[:, 1:], np.take_along_axis(ref_lp[:, :-1], tokens[:, 1:, None], -1)[..., 0], atol=1e-4
  )


def test_a_bf16_checkpoint_imports_into_fp32_master_weights_exactly(checkpoint_dir, tmp_path):
  """Qwen3 releases store bf16: the import reads them (safetensors' numpy
  reader cannot) and the fp32 master weights hold the checkpoint's values
  exactly; the pod preset's param_dtype is float32."""
  from safetensors.torch import save_file as save_torch

  path, tensors = checkpoint_dir
  bf16 = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in tensors.items()}
  save_torch(bf16, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
  cfg = hf_import.config_from_hf(str(tmp_path))
  assert cfg.param_dtype == jnp.float32
  params = hf_import.load_hf_checkpoint(str(tmp_path), cfg)
  want = {k: v.float().numpy() for k, v in bf16.items()}
  np.testing.assert_array_equal(params["embed"], want["model.embed_tokens.weight"])
  np.testing.assert_array_equal(
    params["layer_0"]["moe"]["wo"][3], want["model.layers.0.mlp.experts.3.down_proj.weight"].T
  )
  np.testing.assert_array_equal(params["final_norm"]["scale"], want["model.norm.weight"])
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))


def test_transformers_loads_an_export_and_its_logits_match(checkpoint_dir, tmp_path):
  """Export (bf16, the default) of a sao-jax model that was never an HF one:
  transformers' Qwen3MoE reads the directory, and its logits equal ours on
  the same (bf16-rounded) weights."""
  from sao_jax.models import hf_export

  path, _ = checkpoint_dir
  cfg = hf_import.config_from_hf(str(path))  # a dense layer among MoE ones
  rng = np.random.default_rng(3)  # random weights from shapes alone (no init compile)
  params = jax.tree.map(
    lambda s: (0.1 * rng.standard_normal(s.shape)).astype(np.float32),
    jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0))),
  )
  hf_export.export_params(params, cfg, str(tmp_path / "out"))
  model = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path / "out"), dtype=torch.float32
  ).eval()
  rounded = hf_import.load_hf_checkpoint(str(tmp_path / "out"), cfg)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 20))
  with torch.no_grad():
    ref = model(torch.tensor(tokens)).logits.numpy()
  ours = _logits(cfg, rounded, jnp.asarray(tokens, jnp.int32))
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
