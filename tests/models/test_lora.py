"""LoRA adapters (sao_jax/models/lora.py): merge, gradients, layouts, fingerprints."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.algo import optim
from sao_jax.models import config as model_config
from sao_jax.models import lora, policy
from sao_jax.train.train_step import Adapters, forward_args, full_critic, full_policy

ACTOR = lora.LoraConfig(
  rank=4, alpha=8.0, targets=(r"/attn/(q|k|v|o)$", r"/(mlp|moe)/(wi_gate|wi_up|wo)$")
)


def _params(preset="tiny", **changes):
  cfg = dataclasses.replace(model_config.PRESETS[preset](), **changes)
  return cfg, jax.jit(lambda: policy.init_params(cfg, jax.random.key(0)))()


def _flat(tree):
  return {optim.param_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _init(params, cfg, seed=1):
  return jax.jit(lambda p: lora.init_adapters(p, cfg, jax.random.key(seed)))(params)


def _randomise_b(adapters, rng):
  """Adapters with B drawn too (a trained state: both factors non-zero)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(adapters)
  out = [
    jax.random.normal(jax.random.fold_in(rng, i), x.shape) * 0.1
    if optim.param_path(p).endswith(lora.B)
    else x
    for i, (p, x) in enumerate(leaves)
  ]
  return jax.tree_util.tree_unflatten(treedef, out)


@pytest.mark.parametrize("base_dtype", [jnp.float32, jnp.bfloat16])
def test_zero_b_merge_is_the_base_bit_for_bit(base_dtype):
  _, params = _params()
  base = jax.tree.map(lambda x: x.astype(base_dtype), params)
  adapters = _init(base, ACTOR)
  merged = jax.jit(lora.merge, static_argnums=2)(base, adapters, ACTOR)
  for name, x in _flat(base).items():
    y = _flat(merged)[name]
    assert y.dtype == x.dtype, name
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32))
  # Every projection got an adapter, fp32, A [.., in, r], B [.., r, out]; norms did not.
  flat = _flat(adapters)
  assert flat["layer_0/attn/o/lora_a"].shape == (4 * 16, 4)
  assert flat["layer_0/attn/o/lora_b"].shape == (4, 64)
  assert flat["layer_0/attn/q/lora_b"].shape == (4, 4 * 16)
  assert flat["layer_1/moe/wi_up/lora_a"].shape == (4, 64, 4)  # one per expert
  assert not any("norm" in n or "router" in n or "embed" in n for n in flat)
  assert all(x.dtype == jnp.float32 for x in flat.values())


def test_merge_adds_the_scaled_product_per_layout():
  """An oracle in numpy: each matrix, flattened [batch, in, out], gets s A @ B."""
  cfg, params = _params("tiny", scan_layers=True)
  adapters = _randomise_b(_init(params, ACTOR), jax.random.key(2))
  merged = _flat(jax.jit(lora.merge, static_argnums=2)(params, adapters, ACTOR))
  flat_ad = _flat(adapters)
  checked = 0
  for name, w in _flat(params).items():
    if f"{name}/lora_a" not in flat_ad:
      np.testing.assert_array_equal(merged[name], w)
      continue
    a, b = (np.asarray(flat_ad[f"{name}/{k}"], np.float64) for k in (lora.A, lora.B))
    batch = a.shape[:-2]  # the stacked layer axis (and experts)
    assert batch[0] == cfg.num_layers
    want = np.asarray(w, np.float64) + (ACTOR.scale * a @ b).reshape(w.shape)
    np.testing.assert_allclose(merged[name], want, rtol=1e-5, atol=1e-6)
    checked += 1
  assert checked == 7  # q k v o, wi_gate wi_up wo


def test_adapter_gradient_is_the_projection_of_the_full_gradient():
  """d/dA L(W + s A B) = s G B^T and d/dB = s A^T G, with G = dL/dW' (the full
  gradient at the merged weights), per layer and per expert."""
  cfg, params = _params("tiny")
  adapters = _randomise_b(_init(params, ACTOR), jax.random.key(2))
  tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  segments = jnp.ones((2, 12), jnp.int32)

  def loss(p):
    logp, _ = policy.token_logprobs(cfg, p, tokens, positions, segments)
    return -logp.mean()

  merged = jax.jit(lora.merge, static_argnums=2)(params, adapters, ACTOR)
  full = _flat(jax.jit(jax.grad(loss))(merged))
  got = _flat(jax.jit(jax.grad(lambda ad: loss(lora.merge(params, ad, ACTOR))))(adapters))
  flat_ad = _flat(adapters)
  for name in ("layer_0/attn/q", "layer_1/attn/o", "layer_0/moe/wo"):
    batch, n_in, n_out = lora.matrix_shape(name, params_shape(params, name))
    g = np.asarray(full[name], np.float64).reshape(batch + (n_in, n_out))
    a, b = (np.asarray(flat_ad[f"{name}/{k}"], np.float64) for k in (lora.A, lora.B))
    np.testing.assert_allclose(
      got[f"{name}/lora_a"], ACTOR.scale * g @ np.swapaxes(b, -1, -2), rtol=2e-4, atol=1e-7
    )
    np.testing.assert_allclose(
      got[f"{name}/lora_b"], ACTOR.scale * np.swapaxes(a, -1, -2) @ g, rtol=2e-4, atol=1e-7
    )


def params_shape(params, name):
  return _flat(params)[name].shape


def test_rules_frozen_whole_and_bad_targets():
  _, params = _params()
  critic = lora.LoraConfig(
    4, 8.0, (r"/moe/(wi_gate|wi_up|wo)$",), whole=(r"^lm_head$",), frozen=(r"^layer_1/",)
  )
  kinds = lora.plan(params, critic)
  assert kinds["lm_head"] == "whole" and kinds["layer_0/moe/wo"] == "adapter"
  assert not any(n.startswith("layer_1/") for n in kinds)  # frozen wins
  with pytest.raises(ValueError, match="match no parameter"):
    lora.plan(params, dataclasses.replace(critic, targets=(r"/mlp/wq$",)))
  with pytest.raises(ValueError, match="not a matrix"):
    lora.plan(params, dataclasses.replace(critic, targets=(r"attn_norm/scale$",)))
  with pytest.raises(ValueError, match="embedding"):
    lora.plan(params, dataclasses.replace(critic, targets=(r"^embed$",)))


def test_carry_over_and_optimizer_rules():
  _, params = _params()
  policy_ad = _randomise_b(_init(params, ACTOR), jax.random.key(2))
  critic_cfg = dataclasses.replace(ACTOR, whole=(r"^lm_head$",))
  critic_ad = lora.carry_over(policy_ad, _init(params, critic_cfg, 5))
  flat_p, flat_c = _flat(policy_ad), _flat(critic_ad)
  np.testing.assert_array_equal(flat_c["layer_0/attn/q/lora_b"], flat_p["layer_0/attn/q/lora_b"])
  labels = _flat(optim.partition_labels(critic_ad, lora.optimizer_rules(critic_ad, (r"/moe/",))))
  assert labels["layer_0/attn/q/lora_a"] == optim.FREEZE
  assert labels["layer_0/moe/wo/lora_b"] == optim.TRAIN
  assert labels["lm_head"] == optim.TRAIN


def test_fingerprint_sees_one_bit():
  params = {
    "embed": jax.random.normal(jax.random.key(0), (16, 8)),
    "layers": {"w": jax.random.normal(jax.random.key(1), (2, 8, 4))},
  }
  fp = lora.fingerprint(params)
  assert fp == lora.fingerprint(jax.tree.map(jnp.copy, params))
  flipped = dict(
    params, embed=params["embed"].at[3, 5].set(jnp.nextafter(params["embed"][3, 5], jnp.inf))
  )
  assert lora.fingerprint(flipped) != fp
  swapped = {"embed": params["embed"], "layers": {"w": params["layers"]["w"][::-1]}}
  assert lora.fingerprint(swapped) != fp  # the same values elsewhere: another base
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  assert lora.fingerprint(bf16) != fp


def test_peft_export_names_and_refusals(tmp_path):
  """The adapter file's names are transformers' modules, A^T [r, in] and
  B^T [out, r]; experts become fused 3-D parameters of rank 2r (the rest
  zero-padded); fused-tensor parts and whole-trained leaves are refused."""
  from sao_jax.models import peft_export

  cfg, params = _params("tiny_dense", vocab_size=96, scan_layers=True)
  adapters = _init(params, ACTOR)
  tensors, modules, fused, rank = peft_export.peft_adapter(cfg, adapters, 4)
  name = "base_model.model.model.layers.1.self_attn.o_proj"
  assert tensors[f"{name}.lora_A.weight"].shape == (4, 4 * 16)
  assert tensors[f"{name}.lora_B.weight"].shape == (64, 4)
  np.testing.assert_array_equal(
    tensors[f"{name}.lora_A.weight"], np.asarray(adapters["layers"]["attn"]["o"][lora.A][1]).T
  )
  assert len(tensors) == 2 * 2 * 7 and len(modules) == 14  # layers x 7 matrices x (A, B)
  assert not fused and rank == 4
  assert peft_export.export_adapters(adapters, cfg, ACTOR, str(tmp_path / "a"))["modules"] == 14
  moe_cfg, moe = _params("tiny")
  tensors, modules, fused, rank = peft_export.peft_adapter(moe_cfg, _init(moe, ACTOR), 4)
  assert rank == 8 and fused[:2] == [
    "model.layers.0.mlp.experts.gate_up_proj",
    "model.layers.0.mlp.experts.down_proj",
  ]
  inner = "base_model.model.model.layers.0.mlp.experts.base_layer"  # gate_up_proj
  assert tensors[f"{inner}.lora_A.weight"].shape == (4 * 8, 64)  # [E * 2r, d]
  assert tensors[f"{inner}.lora_B.weight"].shape == (2 * 64, 8 * 4)  # [2F, 2r * E]
  assert not tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"][4:].any()
  hybrid_cfg, hybrid = _params("tiny_hybrid")
  with pytest.raises(ValueError, match="part of a fused tensor"):
    peft_export.peft_adapter(hybrid_cfg, _init(hybrid, ACTOR), 4)
  with pytest.raises(ValueError, match="trained whole"):
    peft_export.peft_adapter(cfg, {"lm_head": params["embed"]}, 4)


@pytest.mark.slow  # torch, transformers and peft imports: ~15 s
@pytest.mark.parametrize("preset", ["tiny_dense", "tiny"])
def test_peft_loads_the_adapters_onto_transformers_with_equal_logits(tmp_path, preset):
  """The base exported as HF float32 weights (dense Qwen3, Qwen3-MoE), the
  adapters as a PEFT directory: transformers + peft's logits equal ours on
  lora.merge(base, adapters), and peft's merge_and_unload equals our merge."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  from sao_jax.models import hf_export, peft_export
  from sao_jax.models.transformer import Transformer

  cfg, params = _params(preset, vocab_size=96)
  adapters = _randomise_b(_init(params, ACTOR), jax.random.key(2))
  hf_export.export_params(params, cfg, str(tmp_path / "base"), dtype="float32")
  peft_export.export_adapters(
    adapters, cfg, ACTOR, str(tmp_path / "adapter"), base_model=str(tmp_path / "base")
  )
  model = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path / "base"), dtype=torch.float32
  ).eval()
  model = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 20))
  with torch.no_grad():
    ref = model(torch.tensor(tokens)).logits.numpy()
  merged = lora.merge(params, adapters, ACTOR)
  pos = jnp.broadcast_to(jnp.arange(20), (2, 20))
  ours = Transformer(cfg).apply(
    {"params": merged}, jnp.asarray(tokens, jnp.int32), pos, jnp.ones((2, 20), jnp.int32)
  )[0]
  base = Transformer(cfg).apply(
    {"params": params}, jnp.asarray(tokens, jnp.int32), pos, jnp.ones((2, 20), jnp.int32)
  )[0]
  assert float(np.abs(np.asarray(ours) - np.asarray(base)).max()) > 1e-2  # the adapters act
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
  if preset == "tiny":  # the experts' adapters count: without them the logits differ
    no_experts = {
      k: ({**v, "moe": {}} if k.startswith("layer_") else v) for k, v in adapters.items()
    }
    partial = Transformer(cfg).apply(
      {"params": lora.merge(params, no_experts, ACTOR)},
      jnp.asarray(tokens, jnp.int32),
      pos,
      jnp.ones((2, 20), jnp.int32),
    )[0]
    assert float(np.abs(np.asarray(partial) - ref).max()) > 1e-2
  theirs = model.merge_and_unload().state_dict()
  np.testing.assert_allclose(
    theirs["model.layers.0.self_attn.q_proj.weight"].numpy(),
    np.asarray(merged["layer_0"]["attn"]["q"]).reshape(64, -1).T,
    atol=1e-6,
  )


# The scanned toys, each layer rematerialised: a dense prefix before a scanned
# MoE run, a dense stack, and the hybrid's [linear, full] blocks of MoE layers.
SCANNED = {
  "moe": dict(preset="tiny", num_layers=3, dense_layers=(0,), dense_d_ff=96),
  "dense": dict(preset="tiny_dense"),
  "hybrid": dict(preset="tiny_hybrid"),
}
CRITIC = lora.LoraConfig(4, 8.0, (r"/(mlp|moe)/(wi_gate|wi_up|wo)$",), whole=(r"^value_",))


@pytest.mark.parametrize(
  "name, which",
  [
    ("moe", "policy"),
    pytest.param("moe", "critic", marks=pytest.mark.slow),
    pytest.param("dense", "policy", marks=pytest.mark.slow),
    pytest.param("hybrid", "policy", marks=pytest.mark.slow),
  ],
)
def test_the_per_layer_merge_gives_the_whole_tree_merge_loss_and_gradients(name, which):
  """The train steps' forward (`forward_args`: each layer merges its own
  adapters inside its rematerialised block) against the forward of the
  whole-tree `lora.merge`: the same loss and adapter gradients in fp32, for
  the actor, and for the critic with its value head trained whole."""
  changes = dict(SCANNED[name])
  cfg, base = _params(changes.pop("preset"), scan_layers=True, remat="full", **changes)
  forward, view, lora_cfg = policy.token_logprobs, full_policy, ACTOR
  if which == "critic":
    base = jax.jit(lambda: policy.init_params(cfg, jax.random.key(5), "value"))()
    forward, view, lora_cfg = policy.token_values, full_critic, CRITIC
  views, bases = Adapters(ACTOR, CRITIC), (base, base)
  adapters = _randomise_b(_init(base, lora_cfg), jax.random.key(2))
  tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, cfg.vocab_size)
  inputs = (tokens, jnp.broadcast_to(jnp.arange(16), (2, 16)), jnp.ones((2, 16), jnp.int32))
  weights = jax.random.normal(jax.random.key(4), (2, 16))

  def per_layer(ad):
    full, adapted = forward_args(views, ad, bases, which)
    return jnp.sum(weights * forward(cfg, full, *inputs, adapters=adapted)[0])

  def whole_tree(ad):
    return jnp.sum(weights * forward(cfg, view(views, ad, bases), *inputs)[0])

  got, want = (jax.jit(jax.value_and_grad(f))(adapters) for f in (per_layer, whole_tree))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  got_g, want_g = _flat(got[1]), _flat(want[1])
  assert got_g.keys() == want_g.keys() and any(k.startswith("layers/") for k in got_g)
  for key, g in got_g.items():
    np.testing.assert_allclose(g, want_g[key], rtol=1e-5, atol=1e-7, err_msg=key)
