"""Pod-scale model paths against the plain reference path (docs/DESIGN.md section 8).

Each scale setting of ModelConfig (scanned layers, remat, chunked / splash
attention, chunked log-probs) must compute what the reference computes: the
same parameters (restacked) give the same logits, values, log-probs, KV-cache
decoding and gradients, to 1e-5 in fp32. Shapes are tiny so that the CPU
path stays the oracle for the TPU one.

Compiles dominate the time of this file on a CPU, so the jitted views are
shared across tests (one compile per config) and compiled with LLVM's
cheap settings: same HLO, same numerics, about half the compile time.
"""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fakes import random_params
from safetensors.numpy import save_file

from sao_jax.algo import optim
from sao_jax.models import attention, decoding, hf_import, policy, sharding
from sao_jax.models import config as mcfg
from sao_jax.models.transformer import Transformer, lm_head_weight

# One dense layer first (like `small`), then two MoE layers: the scanned run.
REF = dataclasses.replace(
  mcfg.tiny(),
  d_model=32,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  moe_d_ff=32,
  num_layers=3,
  dense_layers=(0,),
  dense_d_ff=48,
)
SCAN = dataclasses.replace(REF, scan_layers=True, remat="full")
# Everything the pod runs, off TPU: scan, remat, chunked attention and
# log-probs. Odd lengths on purpose: blocks and chunks do not divide the row.
POD = dataclasses.replace(SCAN, attention_impl="chunked", attention_block=4, logits_chunk=5)
TOL = dict(atol=1e-5, rtol=1e-5)


def packed_batch(b=2, length=13, seed=1):
  """Rows holding several segments each, with padding at the end of row 0."""
  tokens = jax.random.randint(jax.random.key(seed), (b, length), 0, REF.vocab_size)
  seg = np.ones((b, length), np.int32)
  seg[0, 6:10], seg[0, 10:] = 2, 0  # two segments, then 3 padding tokens
  seg[1, 4:9], seg[1, 9:] = 2, 3  # three segments
  pos = np.zeros((b, length), np.int32)
  for r in range(b):
    for s in np.unique(seg[r]):
      idx = np.flatnonzero(seg[r] == s)
      pos[r, idx] = np.arange(len(idx))
  return tokens, jnp.asarray(pos), jnp.asarray(seg)


TOKENS, POS, SEG = packed_batch()
REAL = np.asarray(SEG) != 0
WEIGHTS = jax.random.normal(jax.random.key(9), TOKENS.shape) * REAL  # a loss over real tokens


def _logprob_loss(cfg, params, temperature=0.7):
  logp, aux = policy.token_logprobs(cfg, params, TOKENS, POS, SEG, temperature)
  return jnp.sum(WEIGHTS * logp) + aux["load_balance_loss"], (logp, aux["load_balance_loss"])


def _value_loss(cfg, params):
  values, aux = policy.token_values(cfg, params, TOKENS, POS, SEG)
  return jnp.sum(WEIGHTS * values) + aux["load_balance_loss"], values


FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
jit = lambda f, **kw: jax.jit(f, compiler_options=FAST_COMPILE, **kw)
# (loss, outputs), grads: one compile per config, shared by the tests.
logprob_grad = jit(jax.value_and_grad(_logprob_loss, argnums=1, has_aux=True), static_argnums=0)
value_grad = jit(jax.value_and_grad(_value_loss, argnums=1, has_aux=True), static_argnums=0)
extend = jit(decoding.extend, static_argnums=0)


@pytest.fixture(scope="module")
def params():
  return random_params(REF, 0.1)


@pytest.fixture(scope="module")
def value_params(params):
  # A non-zero head, so values depend on the trunk.
  head = {
    "value_head": jax.random.normal(jax.random.key(2), (REF.d_model, 1)),
    "value_bias": jnp.full((1,), 0.5),
  }
  return policy.value_params_from_policy(params, head)


@pytest.fixture(scope="module")
def reference(params, value_params):
  return logprob_grad(REF, params), value_grad(REF, value_params)


def assert_trees_close(a, b, **tol):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path), **(tol or TOL)
    )


# ----------------------------------------------------------------------------
# Scanned layers
# ----------------------------------------------------------------------------


def test_scanned_params_are_the_unscanned_ones_stacked(params):
  abstract = jax.eval_shape(lambda: policy.init_params(SCAN, jax.random.key(0), boxed=True))
  stacked = policy.scan_params(SCAN, params)
  assert set(stacked) == {"embed", "lm_head", "final_norm", "layer_0", "layers"}
  assert jax.tree.structure(nn.unbox(abstract)) == jax.tree.structure(stacked)
  for x, y in zip(jax.tree.leaves(nn.unbox(abstract)), jax.tree.leaves(stacked)):
    assert x.shape == y.shape
  assert stacked["layers"]["moe"]["wi_gate"].shape == (2, REF.num_experts, 32, 32)
  # The stacked axis carries the logical name "layers" (sharding rules map it).
  assert abstract["layers"]["attn"]["q"].names == ("layers", "embed", "heads", "head_dim")
  assert abstract["layer_0"]["attn"]["q"].names == ("embed", "heads", "head_dim")
  assert_trees_close(policy.unscan_params(SCAN, stacked), params, atol=0, rtol=0)


def test_scanned_layers_equal_unscanned(params, value_params, reference):
  (_, (logp, lb)), grads = reference[0]
  (_, (logp_s, lb_s)), grads_s = logprob_grad(SCAN, policy.scan_params(SCAN, params))
  np.testing.assert_allclose(logp_s, logp, **TOL)
  np.testing.assert_allclose(lb_s, lb, **TOL)
  assert_trees_close(policy.unscan_params(SCAN, grads_s), grads)

  (_, values), vgrads = reference[1]
  (_, values_s), vgrads_s = value_grad(SCAN, policy.scan_params(SCAN, value_params))
  np.testing.assert_allclose(values_s, values, **TOL)
  assert_trees_close(policy.unscan_params(SCAN, vgrads_s), vgrads)
  # Full logits are compared by the KV-cache test below.


def test_scanned_kv_cache_decoding_equals_unscanned(params):
  cache = decoding.init_cache(SCAN, 3, 16)
  assert jax.tree.map(jnp.shape, cache) == {
    "layer_0": {"k": (3, 16, 2, 8), "v": (3, 16, 2, 8)},
    "layers": {"k": (2, 3, 16, 2, 8), "v": (2, 3, 16, 2, 8)},
  }
  scanned = policy.scan_params(SCAN, params)
  tokens = np.asarray(jax.random.randint(jax.random.key(3), (3, 12), 0, REF.vocab_size))
  caches = {"ref": decoding.init_cache(REF, 3, 16), "scan": cache}
  lengths = jnp.zeros((3,), jnp.int32)
  fed = np.zeros(3, int)
  # Ragged chunks per slot (prefill, then decode-sized and append-sized
  # steps), all at one width so each config compiles once.
  for chunk in ([4, 2, 3], [1, 1, 0], [3, 1, 4], [1, 0, 1]):
    toks = np.zeros((3, 4), np.int32)
    valid = np.zeros((3, 4), bool)
    for i, n in enumerate(chunk):
      toks[i, :n], valid[i, :n] = tokens[i, fed[i] : fed[i] + n], True
    ref_logits, caches["ref"], ref_len = extend(REF, params, caches["ref"], toks, lengths, valid)
    logits, caches["scan"], new_len = extend(SCAN, scanned, caches["scan"], toks, lengths, valid)
    np.testing.assert_array_equal(new_len, ref_len)
    np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(ref_logits)[valid], **TOL)
    lengths, fed = new_len, fed + np.asarray(chunk)
  for layer in (1, 2):  # the stacked cache holds what the per-layer caches hold
    for kv in ("k", "v"):
      np.testing.assert_allclose(
        caches["scan"]["layers"][kv][layer - 1], caches["ref"][layer][kv], **TOL
      )
  np.testing.assert_allclose(caches["scan"]["layer_0"]["k"], caches["ref"][0]["k"], **TOL)


@pytest.mark.parametrize("remat", ["dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_remat_policies_give_the_same_gradients(params, reference, remat):
  """ "full" is SCAN's policy. Each config remats the scanned MoE layers and
  the unrolled dense layer 0 (the two `nn.remat` variants, with and without
  prevent_cse)."""
  (_, (logp, _)), grads = reference[0]
  scanned_cfg = dataclasses.replace(SCAN, remat=remat)
  (_, (logp_s, _)), grads_s = logprob_grad(scanned_cfg, policy.scan_params(SCAN, params))
  np.testing.assert_allclose(logp_s, logp, **TOL)
  assert_trees_close(policy.unscan_params(SCAN, grads_s), grads)


def test_scan_refuses_a_stack_that_would_stay_mostly_unrolled():
  # Layers 0 moe, 1 dense, 2 moe: the run of identical layers that ends the
  # stack is one layer long, so two of three would stay unrolled.
  with pytest.raises(ValueError, match="would stay unrolled"):
    dataclasses.replace(REF, dense_layers=(1,), scan_layers=True)
  # An all-dense stack scans whole (a dense model).
  all_dense = dataclasses.replace(REF, num_layers=1, dense_layers=(0,), scan_layers=True)
  assert (all_dense.scan_prefix, all_dense.num_scanned_layers) == (0, 1)
  with pytest.raises(ValueError, match="remat must be one of"):
    dataclasses.replace(REF, remat="some")
  with pytest.raises(ValueError, match="attention_impl must be one of"):
    dataclasses.replace(REF, attention_impl="flash")
  with pytest.raises(ValueError, match="multiple of 128"):
    dataclasses.replace(REF, attention_impl="splash", attention_block=100)


def test_freezing_rules_and_value_params_on_scanned_params(params, value_params):
  policy_s = policy.scan_params(SCAN, params)
  fresh = jax.eval_shape(lambda: policy.init_params(SCAN, jax.random.key(4), "value"))
  head = {k: value_params[k] for k in ("value_head", "value_bias")}
  vparams = policy.value_params_from_policy(policy_s, head)
  assert jax.tree.structure(vparams) == jax.tree.structure(fresh)  # the value model's tree
  assert "lm_head" not in vparams
  np.testing.assert_array_equal(vparams["layers"]["moe"]["wo"], policy_s["layers"]["moe"]["wo"])
  labels = {
    optim.param_path(k): v
    for k, v in jax.tree_util.tree_leaves_with_path(
      optim.partition_labels(vparams, optim.CRITIC_FREEZE_RULES)
    )
  }
  frozen = {n for n, label in labels.items() if label == optim.FREEZE}
  assert frozen == {n for n in labels if n == "embed" or "/attn/" in n or "/attn_norm/" in n}
  assert {"layers/attn/q", "layers/attn_norm/scale", "layer_0/attn/k_norm/scale"} <= frozen
  assert "layers/moe/wi_gate" not in frozen and "layers/mlp_norm/scale" not in frozen
  # One update: frozen stacked leaves stay bit-identical, the rest move.
  tx = optim.make_optimizer(vparams, 1e-2, rules=optim.CRITIC_FREEZE_RULES)
  _, grads = value_grad(SCAN, vparams)  # compiled by the test above
  new = jit(lambda g, p: optax.apply_updates(p, tx.update(g, tx.init(p), p)[0]))(grads, vparams)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(vparams), jax.tree.leaves(new)):
    moved = bool(np.any(np.asarray(a) != np.asarray(b)))
    assert moved == (labels[optim.param_path(path)] == optim.TRAIN), optim.param_path(path)


# ----------------------------------------------------------------------------
# Attention without L x L
# ----------------------------------------------------------------------------


def test_chunked_attention_equals_reference_with_packing_and_padding():
  """Blocks of 4 over 13 tokens: 4 query x 4 key blocks, the last one padded,
  the causal skip of later key blocks, segments that straddle blocks."""
  block = 4
  rng = np.random.default_rng(0)
  b, length, h, kvh, hd = 2, 13, 4, 2, 8
  q = jnp.asarray(rng.normal(size=(b, length, h, hd)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, length, kvh, hd)), jnp.float32) for _ in range(2))
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * REAL[:, :, None, None]

  def ref(q, k, v):
    return attention.reference_attention(q, k, v, attention.packed_causal_mask(SEG))

  def chunked(q, k, v):
    return attention.chunked_attention(q, k, v, SEG, block)

  def out_and_grads(f):  # one compile per implementation
    grads = jax.grad(lambda *a: jnp.sum(w * f(*a)), argnums=(0, 1, 2))
    return jit(lambda *a: (f(*a), grads(*a)))

  (out_ref, g_ref), (out, g) = out_and_grads(ref)(q, k, v), out_and_grads(chunked)(q, k, v)
  np.testing.assert_allclose(np.asarray(out)[REAL], np.asarray(out_ref)[REAL], **TOL)
  assert np.isfinite(np.asarray(out)).all()  # padding rows: garbage, but finite
  for x, y in zip(g, g_ref):
    np.testing.assert_allclose(x, y, **TOL)
  # A token's output ignores other segments: perturbing segment 2 of row 0
  # (tokens 6..9) leaves segment 1's outputs unchanged.
  out2, _ = out_and_grads(chunked)(q, k.at[0, 6:10].add(1.0), v.at[0, 6:10].add(1.0))
  np.testing.assert_array_equal(out2[0, :6], out[0, :6])


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 3), (4, 4), (8, 1)])
def test_decode_attention_equals_reference(heads, kv_heads):
  """One query a row over a cache with per-row visible prefixes, every GQA grouping."""
  rng = np.random.default_rng(heads * 10 + kv_heads)
  b, s, hd = 3, 11, 8
  q = jnp.asarray(rng.normal(size=(b, 1, heads, hd)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, s, kv_heads, hd)), jnp.float32) for _ in range(2))
  visible = jnp.arange(s)[None] <= jnp.asarray([0, 4, s - 1])[:, None]  # [B, S]
  want = attention.reference_attention(q, k, v, visible[:, None])
  got = jit(attention.decode_attention)(q, k, v, visible)
  np.testing.assert_allclose(got, want, **TOL)
  # Keys past a row's visible prefix do not matter.
  got2 = attention.decode_attention(q, k.at[0, 1:].add(5.0), v.at[0, 1:].add(5.0), visible)
  np.testing.assert_array_equal(got2[0], got[0])


def test_decode_steps_take_decode_attention_on_cpu_only(params, monkeypatch):
  """The gate: a CPU decode step calls `decode_attention`; a step traced for
  TPU (`compiling_for`, as launch/compile.py's one-chip engine does) and a
  prefill do not."""
  called = []
  real = attention.decode_attention
  monkeypatch.setattr(attention, "decode_attention", lambda *a: called.append(1) or real(*a))

  def trace(width):
    cache = decoding.init_cache(REF, 2, 16)
    tokens = jnp.ones((2, width), jnp.int32)
    jax.make_jaxpr(
      lambda p: decoding.extend(
        REF, p, cache, tokens, jnp.zeros((2,), jnp.int32), jnp.ones((2, width), bool)
      )
    )(params)
    return len(called)

  layers = trace(1)
  assert layers == REF.num_layers  # once a layer
  assert trace(3) == layers  # a prefill: not called
  with attention.compiling_for("tpu"):
    assert attention.compile_platform() == "tpu"
    assert trace(1) == layers  # traced for TPU: not called
  assert attention.compile_platform() == "cpu"


def test_pod_path_equals_reference_in_the_model(params, reference):
  """POD: scan + remat + chunked attention (block 4) + log-probs over 5-token
  chunks, on packed rows with padding, against REF (each piece alone is
  tested above and below)."""
  (_, (logp, lb)), grads = reference[0]
  (_, (logp_c, lb_c)), grads_c = logprob_grad(POD, policy.scan_params(POD, params))
  np.testing.assert_allclose(logp_c, logp, **TOL)
  np.testing.assert_allclose(lb_c, lb, **TOL)
  assert_trees_close(policy.unscan_params(POD, grads_c), grads)


def test_chunked_logprobs_equal_full_logits(params):
  """The chunked log-softmax alone, L = 13 not a multiple of the 5-token chunk."""
  cfg = dataclasses.replace(REF, logits_chunk=5)
  hidden = jax.random.normal(jax.random.key(5), TOKENS.shape + (REF.d_model,))
  w = params["lm_head"]

  def full(hidden, w):
    return policy.logprobs_from_logits(hidden @ w, TOKENS, 0.7)

  def chunked(hidden, w):
    return policy.chunked_logprobs(cfg, hidden, w, TOKENS, 0.7)

  def out_and_grads(f):  # one compile per implementation
    grads = jax.grad(lambda *a: jnp.sum(WEIGHTS * f(*a)), argnums=(0, 1))
    return jit(lambda *a: (f(*a), grads(*a)))

  (out, g), (out_ref, g_ref) = out_and_grads(chunked)(hidden, w), out_and_grads(full)(hidden, w)
  np.testing.assert_allclose(out, out_ref, **TOL)
  for x, y in zip(g, g_ref):
    np.testing.assert_allclose(x, y, **TOL)
  # Tied embeddings: the head is the embedding's transpose.
  tied = dataclasses.replace(cfg, tie_embeddings=True)
  np.testing.assert_array_equal(lm_head_weight(tied, params), params["embed"].T)
  np.testing.assert_array_equal(lm_head_weight(cfg, params), params["lm_head"])


def test_splash_falls_back_to_chunked_off_tpu(params):
  """Off TPU, "splash" traces to exactly the program "chunked" does."""
  assert attention.compile_platform() == "cpu"
  assert not attention.splash_usable(256, 128)
  programs = []
  for impl in ("splash", "chunked"):
    cfg = dataclasses.replace(REF, attention_impl=impl, attention_block=128)
    programs.append(
      str(
        jax.make_jaxpr(lambda p, cfg=cfg: Transformer(cfg).apply({"params": p}, TOKENS, POS, SEG))(
          params
        )
      )
    )
  assert programs[0] == programs[1]
  assert "custom_vjp_call" in programs[0]  # the chunked kernel, not the L x L reference


def test_splash_wrapper_equals_reference_in_the_pallas_interpreter():
  """The splash kernel, interpreted on CPU: layouts, scaling, GQA and masks of
  the wrapper against the reference, forward and gradients."""
  rng = np.random.default_rng(1)
  b, length, h, kvh, hd = 1, 256, 4, 2, 128
  q = jnp.asarray(rng.normal(size=(b, length, h, hd)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, length, kvh, hd)), jnp.float32) for _ in range(2))
  seg = np.ones((b, length), np.int32)
  seg[0, 100:200], seg[0, 200:] = 2, 0  # segments straddle the 128-token blocks; padding
  real = seg != 0
  seg = jnp.asarray(seg)
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * real[:, :, None, None]

  def out_and_grads(f):
    grads = jax.grad(lambda *a: jnp.sum(w * f(*a)), argnums=(0, 1, 2))
    return jit(lambda *a: (f(*a), grads(*a)))

  ref = lambda q, k, v: attention.reference_attention(q, k, v, attention.packed_causal_mask(seg))
  splash = lambda q, k, v: attention.splash_attention(q, k, v, seg, 128, interpret=True)
  (out_ref, g_ref), (out, g) = out_and_grads(ref)(q, k, v), out_and_grads(splash)(q, k, v)
  np.testing.assert_allclose(np.asarray(out)[real], np.asarray(out_ref)[real], **TOL)
  for x, y in zip(g, g_ref):
    np.testing.assert_allclose(x, y, **TOL)


@pytest.mark.parametrize(
  "mesh_axes,context", [({"data": 2, "context": 4}, 4), ({"data": 4, "context": 2}, 2)]
)
def test_splash_with_queries_split_over_a_context_axis_equals_the_reference(
  mesh_axes, context, monkeypatch
):
  """Context parallelism in the splash wrapper (interpreted on CPU, 8 devices):
  each device's L / c queries against the row's gathered keys give the
  reference's outputs and gradients, segments straddling the shards."""
  calls = []
  split = attention._context_split_splash
  monkeypatch.setattr(
    attention, "_context_split_splash", lambda *a, **kw: calls.append(a[7]) or split(*a, **kw)
  )
  rng = np.random.default_rng(2)
  b, length, h, kvh, hd = 4, 512, 4, 2, 128
  q = jnp.asarray(rng.normal(size=(b, length, h, hd)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, length, kvh, hd)), jnp.float32) for _ in range(2))
  seg = np.ones((b, length), np.int32)
  seg[:, 100:300], seg[:, 300:460], seg[:, 460:] = 2, 3, 0
  seg[1, :] = 1  # one whole-row sequence
  real = seg != 0
  seg = jnp.asarray(seg)
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * real[:, :, None, None]
  mesh = sharding.make_mesh(mesh_axes)
  rules = (("batch", "data"), ("length", "context"), ("heads", None), ("kv_heads", None))

  def out_and_grads(f):
    grads = jax.grad(lambda *a: jnp.sum(w * f(*a)), argnums=(0, 1, 2))
    return jax.jit(lambda *a: (f(*a), grads(*a)))

  ref = lambda q, k, v: attention.reference_attention(q, k, v, attention.packed_causal_mask(seg))
  splash = lambda q, k, v: attention.splash_attention(q, k, v, seg, 128, interpret=True)
  out_ref, g_ref = out_and_grads(ref)(q, k, v)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    text = out_and_grads(splash).lower(q, k, v).as_text()
    out, g = out_and_grads(splash)(q, k, v)
  assert calls and set(calls) == {context}  # the split path, c shards
  assert "all-gather" in text or "all_gather" in text  # keys gathered, queries not
  np.testing.assert_allclose(np.asarray(out)[real], np.asarray(out_ref)[real], **TOL)
  for x, y in zip(g, g_ref):
    np.testing.assert_allclose(x, y, **TOL)


def _tpu_topology():
  """A v5e 2x2 TPU topology (libtpu's compiler on this CPU host), else skip."""
  pytest.importorskip("libtpu", reason="jax[tpu] not installed: no TPU compiler here")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other tests may hold it
  from jax.experimental import topologies

  try:
    return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
  except Exception as e:  # noqa: BLE001
    pytest.skip(f"no TPU topology: {e}")


# The CPU host's persistent compile cache cannot load a TPU executable (no TPU
# client); the compile then runs uncached, which is all this test needs.
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache")
def test_splash_lowers_for_tpu_inside_scan_remat_and_shard_map():
  """The scanned, rematerialised model's gradient lowers with the splash kernel.

  Lowering runs the Pallas -> Mosaic TPU lowering of the kernel (forward and
  both backward kernels); compiling the whole model for TPU takes a minute
  on a loaded CPU, so the attention alone is compiled.
  """
  topo = _tpu_topology()
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2}, devices=topo.devices)
  rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("vocab", None),
    ("heads", None),
    ("kv_heads", None),
    ("head_dim", None),
    ("mlp", None),
    ("expert", None),
    ("layers", None),
  )
  cfg = dataclasses.replace(
    SCAN,
    attention_impl="splash",
    attention_block=128,
    logits_chunk=128,
    moe_impl="ragged",
    dtype=jnp.bfloat16,
    param_dtype=jnp.bfloat16,
  )
  init = lambda: policy.init_params(cfg, jax.random.key(0), boxed=True)
  shardings = sharding.logical_shardings(jax.eval_shape(init), mesh, rules)
  abstract = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
    jax.eval_shape(lambda: nn.unbox(init())),
    shardings,
  )
  batch = jax.ShapeDtypeStruct((8, 256), jnp.int32, sharding=sharding.batch_sharding(mesh, rules))

  def loss(p, t):
    return policy.token_logprobs(cfg, p, t, t, jnp.ones_like(t))[0].sum()

  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    assert attention.compile_platform() == "tpu"
    hlo = jax.jit(jax.grad(loss)).lower(abstract, batch).as_text()
    q = jax.ShapeDtypeStruct(
      (8, 256, 4, 128), jnp.bfloat16, sharding=sharding.batch_sharding(mesh, rules, 4)
    )
    seg = jax.ShapeDtypeStruct((8, 256), jnp.int32, sharding=batch.sharding)
    attn_grad = jax.jit(
      jax.grad(
        lambda q, s: (
          attention.splash_attention(q, q[:, :, :2], q[:, :, :2], s, 128).astype(jnp.float32).sum()
        )
      )
    )
    compiled = attn_grad.lower(q, seg).compile()
  assert hlo.count("tpu_custom_call") >= 3  # forward, dq and dkv kernels
  assert compiled.memory_analysis().temp_size_in_bytes > 0


# ----------------------------------------------------------------------------
# Sharding under jax.set_mesh
# ----------------------------------------------------------------------------


RULES = (
  ("batch", "data"),
  ("length", None),
  ("embed", "fsdp"),
  ("vocab", "tensor"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("mlp", "tensor"),
  ("expert", None),
  ("layers", None),
)


def test_logical_constraints_resolve_under_set_mesh(params, reference):
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  f = jax.jit(lambda x: nn.with_logical_constraint(x * 2, ("batch", "mlp")))
  x = jnp.ones((8, 4))
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    assert f(x).sharding.spec == jax.sharding.PartitionSpec("data", "tensor")
  # The scanned model, sharded by rules with "layers", equals the reference.
  shardings = sharding.logical_shardings(
    jax.eval_shape(lambda: policy.init_params(SCAN, jax.random.key(0), boxed=True)), mesh, RULES
  )
  assert tuple(shardings["layers"]["moe"]["wi_gate"].spec) == (None, None, "fsdp", "tensor")
  restacked = jax.device_put(policy.scan_params(SCAN, params), shardings)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    got = jit(lambda p, t: policy.token_logprobs(SCAN, p, t, POS, SEG, 0.7)[0])(restacked, TOKENS)
  (_, (want, _)), _ = reference[0]
  np.testing.assert_allclose(got, want, **TOL)


# ----------------------------------------------------------------------------
# Hugging Face import into scanned params
# ----------------------------------------------------------------------------


def to_hf_tensors(cfg, params):
  """Our unscanned params under the Hub's Qwen3-MoE names (the inverse mapping)."""
  d = cfg.d_model
  out = {
    "model.embed_tokens.weight": params["embed"],
    "model.norm.weight": params["final_norm"]["scale"],
    "lm_head.weight": params["lm_head"].T,
  }
  for i in range(cfg.num_layers):
    lay, pre = params[f"layer_{i}"], f"model.layers.{i}."
    a = lay["attn"]
    out[pre + "input_layernorm.weight"] = lay["attn_norm"]["scale"]
    out[pre + "post_attention_layernorm.weight"] = lay["mlp_norm"]["scale"]
    for name in ("q", "k", "v"):
      out[pre + f"self_attn.{name}_proj.weight"] = a[name].reshape(d, -1).T
    out[pre + "self_attn.o_proj.weight"] = a["o"].reshape(-1, d).T
    out[pre + "self_attn.q_norm.weight"] = a["q_norm"]["scale"]
    out[pre + "self_attn.k_norm.weight"] = a["k_norm"]["scale"]
    if i in cfg.dense_layers:
      for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
        out[pre + f"mlp.{theirs}.weight"] = lay["mlp"][ours].T
    else:
      out[pre + "mlp.gate.weight"] = lay["moe"]["router"].T
      for j in range(cfg.num_experts):
        for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
          out[pre + f"mlp.experts.{j}.{theirs}.weight"] = lay["moe"][ours][j].T
  return {k: np.ascontiguousarray(np.asarray(v)) for k, v in out.items()}


def test_hf_import_writes_each_layer_into_the_stacked_params(params, tmp_path):
  save_file(to_hf_tensors(REF, params), str(tmp_path / "model.safetensors"))
  loaded = hf_import.load_hf_checkpoint(str(tmp_path), SCAN)
  assert_trees_close(loaded, policy.scan_params(SCAN, params), atol=0, rtol=0)
  # Into shardings on 8 devices, one layer at a time.
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  shardings = sharding.logical_shardings(
    jax.eval_shape(lambda: policy.init_params(SCAN, jax.random.key(0), boxed=True)), mesh, RULES
  )
  placed = hf_import.load_hf_checkpoint(str(tmp_path), SCAN, shardings)
  assert placed["layers"]["moe"]["wi_up"].sharding == shardings["layers"]["moe"]["wi_up"]
  assert_trees_close(placed, loaded, atol=0, rtol=0)
  # A wrong shape in one scanned layer names that layer.
  bad = to_hf_tensors(REF, params)
  bad["model.layers.2.self_attn.q_norm.weight"] = np.ones(3, np.float32)
  save_file(bad, str(tmp_path / "bad.safetensors"))
  with pytest.raises(ValueError, match=r"layers/attn/q_norm/scale \(model.layers.2\)"):
    hf_import.load_hf_checkpoint(str(tmp_path / "bad.safetensors"), SCAN)


def test_config_from_hf_reads_num_local_experts(tmp_path):
  """transformers 5.x writes `num_local_experts`; the Hub's files `num_experts`."""
  base = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[0],
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    model_type="qwen3_moe",
  )
  cfgs = []
  for key in ("num_experts", "num_local_experts"):
    (tmp_path / key).mkdir()
    (tmp_path / key / "config.json").write_text(json.dumps(dict(base, **{key: 6})))
    cfgs.append(hf_import.config_from_hf(str(tmp_path / key)))
  assert cfgs[0] == cfgs[1]
  assert cfgs[1].num_experts == 6 and cfgs[1].dense_layers == (0,)
  assert cfgs[1].rope_theta == 10000.0
  scanned = hf_import.config_from_hf(str(tmp_path / "num_local_experts"), scan_layers=True)
  assert scanned.num_scanned_layers == 2
  (tmp_path / "none").mkdir()
  (tmp_path / "none" / "config.json").write_text(json.dumps(base))
  with pytest.raises(ValueError, match="num_local_experts"):
    hf_import.config_from_hf(str(tmp_path / "none"))
