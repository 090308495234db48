"""Expert-parallel MoE (sao_jax/models/moe.py) against the dense oracle.

The dense path (every expert on every token, weighted by sparse gates) is
exact and obviously right; the expert-parallel path must agree with it on the
8 simulated CPU devices of conftest.py, for outputs and gradients, on every
mesh layout it supports, and must drop exactly the pairs its docstring says.
"""

import contextlib
import dataclasses
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import sao_moe
from sao_jax.models import config as mcfg
from sao_jax.models import moe, policy, sharding
from sao_jax.models.transformer import Transformer

E, K, D, F, N = 8, 2, 32, 48, 64
# configs/sao_moe.py's own rules (batch over data x fsdp x expert, D over
# fsdp, experts over expert) on an 8-device mesh shaped like its pod mesh.
POD = ({"data": 1, "fsdp": 2, "expert": 4, "tensor": 1}, sao_moe.POD_RULES)


def _rules(**over):
  """A full rule set: everything replicated unless given."""
  rules = {a: None for a in sharding.LOGICAL_AXES}
  rules.update(over)
  return tuple(rules.items())


# (mesh, rules): tokens over data / fsdp / also over expert; FSDP-sharded D;
# tensor-sharded F; experts over two mesh axes.
LAYOUTS = {
  "data2_expert4": ({"data": 2, "expert": 4}, _rules(batch="data", expert="expert")),
  "fsdp2_expert4": ({"fsdp": 2, "expert": 4}, _rules(batch="fsdp", embed="fsdp", expert="expert")),
  "batch_over_expert": (
    {"data": 2, "expert": 4},
    _rules(batch=("data", "expert"), expert="expert"),
  ),
  "expert4_tensor2": ({"expert": 4, "tensor": 2}, _rules(mlp="tensor", expert="expert")),
  "fsdp2_expert2_tensor2": (
    {"fsdp": 2, "expert": 2, "tensor": 2},
    _rules(batch="fsdp", embed="fsdp", mlp="tensor", expert="expert"),
  ),
  "expert_over_two_axes": (
    {"data": 2, "fsdp": 2, "tensor": 2},
    _rules(batch="data", expert=("fsdp", "tensor")),
  ),
  "pod_rules": POD,
}


def _problem(seed, n=N, e=E, k=K, skew=0.0):
  """Random tokens, routing as MoE.__call__ computes it, weights, a mask."""
  keys = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(keys[0], (n, D))
  logits = jax.random.normal(keys[1], (n, e)) + skew * jnp.arange(e)[::-1]
  probs = jax.nn.softmax(logits, -1)
  top_p, top_i = jax.lax.top_k(probs, k)
  top_p = top_p / top_p.sum(-1, keepdims=True)
  w = [
    jax.random.normal(keys[2], (e, D, F)) / np.sqrt(D),
    jax.random.normal(keys[3], (e, D, F)) / np.sqrt(D),
    jax.random.normal(keys[4], (e, F, D)) / np.sqrt(F),
  ]
  mask = jnp.arange(n) % 16 < 13  # padding in every token block
  return x, top_i, top_p, w, mask


def dense_moe(x, top_i, top_p, wg, wu, wo):
  """The dense path of MoE.__call__, verbatim."""
  gates = (
    jnp.zeros((x.shape[0], wg.shape[0]), x.dtype)
    .at[jnp.arange(x.shape[0])[:, None], top_i]
    .set(top_p)
  )  # [N, E]
  hidden = jax.nn.silu(jnp.einsum("nd,edf->nef", x, wg)) * jnp.einsum("nd,edf->nef", x, wu)
  return jnp.einsum("nef,efd,ne->nd", hidden, wo, gates)


dense_jit = jax.jit(dense_moe)


def _loss_fn(impl, mask, probe):
  """A loss reading only real tokens' outputs; grads w.r.t. x, gates, weights.

  One jitted program gives (loss, (out, dropped)) and the gradients, so each
  layout compiles once.
  """

  def loss(x, top_p, wg, wu, wo, top_i):
    out, dropped = impl(x, top_i, top_p, wg, wu, wo)
    return jnp.sum(out * probe * mask[:, None]), (out, dropped)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@pytest.fixture(scope="module")
def dense_reference():
  """Dense outputs and gradients of _problem(0), computed once."""
  x, top_i, top_p, (wg, wu, wo), mask = _problem(0)
  probe = jax.random.normal(jax.random.key(9), (N, D))
  (loss, (out, _)), grads = _loss_fn(lambda *a: (dense_moe(*a), 0), mask, probe)(
    x, top_p, wg, wu, wo, top_i
  )
  return probe, loss, np.asarray(out), grads


def _collectives(hlo, op):
  """Result shapes of every `op` (e.g. "all-gather") in an HLO module text."""
  return re.findall(rf"= \(?(\w+\[[\d,]*\])[^=]*? {op}(?:-start)?\(", hlo)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_and_gradients_equal_dense(layout, dense_reference):
  """Also reads the compiled program: all-to-all dispatch, and no all-gather
  that materialises the weights of all E experts on a device."""
  axes, rules = LAYOUTS[layout]
  mesh = sharding.make_mesh(axes)
  x, top_i, top_p, (wg, wu, wo), mask = _problem(0)
  probe, ref_loss, want, ref_grads = dense_reference
  ep = lambda *a: moe.expert_parallel_moe(*a, token_mask=mask)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    # Arguments placed as the model's rules place them, as in training.
    put = lambda a, *names: jax.device_put(
      a, jax.NamedSharding(mesh, nn.logical_to_mesh_axes(names, rules))
    )
    args = (
      put(x, "batch", None),
      put(top_p, "batch", None),
      put(wg, "expert", "embed", "mlp"),
      put(wu, "expert", "embed", "mlp"),
      put(wo, "expert", "mlp", "embed"),
      put(top_i, "batch", None),
    )
    compiled = _loss_fn(ep, mask, probe).lower(*args).compile()
    (loss, (out, dropped)), grads = compiled(*args)
  out, mask = np.asarray(out), np.asarray(mask)
  assert int(dropped) == 0  # the default is dropless
  np.testing.assert_allclose(out[mask], want[mask], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(out[~mask], 0.0)  # padding is never dispatched
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for name, g, r in zip(("x", "top_p", "wi_gate", "wi_up", "wo"), grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5, err_msg=name)

  hlo = compiled.as_text()
  assert _collectives(hlo, "all-to-all"), "expected an all-to-all dispatch"
  gathered = [g for g in _collectives(hlo, "all-gather") if g.count(",") == 2]  # 3-D
  if dict(rules)["embed"] is None:
    assert not gathered, gathered  # weights are used where they lie
  else:  # FSDP gathers D of this device's E/EP experts only
    ep_size = int(np.prod([mesh.shape[a] for a in moe._axes(dict(rules)["expert"])]))
    assert gathered and all(g.split("[")[1].startswith(f"{E // ep_size},") for g in gathered), (
      gathered
    )


@pytest.mark.parametrize("layout", ["data2_expert4", "pod_rules"])
def test_dispatch_in_rounds_equals_dense(layout, dense_reference):
  """dispatch_chunk: rounds of 3 of a device's 8 tokens (padded to 9)."""
  axes, rules = LAYOUTS[layout]
  mesh = sharding.make_mesh(axes)
  x, top_i, top_p, (wg, wu, wo), mask = _problem(0)
  probe, ref_loss, want, ref_grads = dense_reference
  ep = lambda *a: moe.expert_parallel_moe(*a, token_mask=mask, dispatch_chunk=3)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    (loss, (out, dropped)), grads = _loss_fn(ep, mask, probe)(x, top_p, wg, wu, wo, top_i)
  out, mask = np.asarray(out), np.asarray(mask)
  assert int(dropped) == 0
  np.testing.assert_allclose(out[mask], want[mask], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(out[~mask], 0.0)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for name, g, r in zip(("x", "top_p", "wi_gate", "wi_up", "wo"), grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5, err_msg=name)


def _expected_drops(top_i, mask, blocks, e_loc, ep, c):
  """The documented policy in numpy: per source block, pairs in rank-major
  order, the first `c` pairs for each destination device are kept."""
  top_i, mask = np.asarray(top_i), np.asarray(mask)
  keep = np.zeros(top_i.shape, bool)
  for rows in np.split(np.arange(len(mask)), blocks):
    used = np.zeros(ep, int)
    for r in range(top_i.shape[1]):
      for t in rows:
        dest = top_i[t, r] // e_loc
        if mask[t] and used[dest] < c:
          keep[t, r] = True
          used[dest] += 1
  return keep


@contextlib.contextmanager
def _legacy_mesh(mesh):
  """`with mesh:`, as the trainer still enters meshes (deprecated in jax 0.10)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with mesh:
      yield


@pytest.mark.parametrize(
  "layout,ctx", [("data2_expert4", jax.set_mesh), ("batch_over_expert", _legacy_mesh)]
)
def test_small_capacity_drops_as_documented(layout, ctx):
  axes, rules = LAYOUTS[layout]
  mesh = sharding.make_mesh(axes)
  # Skewed routing: low-numbered experts (device 0) are popular.
  x, top_i, top_p, (wg, wu, wo), mask = _problem(1, skew=1.5)
  cf = 1.0
  n_block = N // 8  # 8 source blocks of contiguous tokens in both layouts
  c = moe.capacity(n_block, K, E // 4, 4, cf)
  assert c == n_block * K // 4
  with ctx(mesh), nn.logical_axis_rules(rules):
    out, dropped = jax.jit(
      lambda *a: moe.expert_parallel_moe(*a, token_mask=mask, capacity_factor=cf)
    )(x, top_i, top_p, wg, wu, wo)
  keep = _expected_drops(top_i, mask, 8, E // 4, 4, c)
  m = np.asarray(mask)
  n_drop = int((m[:, None] & ~keep).sum())
  assert n_drop > 0, "the test routing should overflow device 0"
  assert int(dropped) == n_drop
  # A dropped pair contributes nothing; the kept ones keep their weights.
  want = dense_jit(x, top_i, jnp.where(keep, top_p, 0.0), wg, wu, wo)
  np.testing.assert_allclose(np.asarray(out)[m], np.asarray(want)[m], atol=1e-5, rtol=1e-5)
  # Capacity for the worst case (EP x balanced, here) is dropless again.
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    out, dropped = jax.jit(
      lambda *a: moe.expert_parallel_moe(*a, token_mask=mask, capacity_factor=4.0)
    )(x, top_i, top_p, wg, wu, wo)
  assert int(dropped) == 0
  want = dense_jit(x, top_i, top_p, wg, wu, wo)
  np.testing.assert_allclose(np.asarray(out)[m], np.asarray(want)[m], atol=1e-5, rtol=1e-5)


def test_without_expert_parallelism_falls_back_to_ragged():
  x, top_i, top_p, (wg, wu, wo), mask = _problem(2)
  m = np.asarray(mask)
  want = np.asarray(dense_jit(x, top_i, top_p, wg, wu, wo))[m]
  ep = jax.jit(lambda *a: moe.expert_parallel_moe(*a, token_mask=mask))
  out, dropped = ep(x, top_i, top_p, wg, wu, wo)  # no mesh at all
  assert int(dropped) == 0
  np.testing.assert_allclose(np.asarray(out)[m], want, atol=1e-5, rtol=1e-5)
  mesh = sharding.make_mesh({"data": 8})
  with jax.set_mesh(mesh), nn.logical_axis_rules(_rules(batch="data")):
    out, dropped = ep(x, top_i, top_p, wg, wu, wo)
  np.testing.assert_allclose(np.asarray(out)[m], want, atol=1e-5, rtol=1e-5)


def test_uneven_batch_is_padded_to_the_token_shards():
  axes, rules = LAYOUTS["data2_expert4"]
  x, top_i, top_p, (wg, wu, wo), mask = _problem(3, n=37)  # 37 = neither 2 nor 8 blocks
  with jax.set_mesh(sharding.make_mesh(axes)), nn.logical_axis_rules(rules):
    out, _ = jax.jit(lambda *a: moe.expert_parallel_moe(*a, token_mask=mask))(
      x, top_i, top_p, wg, wu, wo
    )
  m = np.asarray(mask)
  want = np.asarray(dense_jit(x, top_i, top_p, wg, wu, wo))[m]
  np.testing.assert_allclose(np.asarray(out)[m], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
  "axes,rules",
  [({"data": 2, "expert": 4}, _rules(batch="data", expert="expert")), POD],
  ids=["batch_over_data", "pod_rules"],
)
def test_transformer_expert_parallel_logits_equal_dense(axes, rules):
  cfg = dataclasses.replace(mcfg.tiny(), num_experts=8, experts_per_token=2)
  ep_cfg = dataclasses.replace(cfg, moe_impl="expert_parallel")
  mesh = sharding.make_mesh(axes)
  init = lambda: policy.init_params(cfg, jax.random.key(4), boxed=True)
  params, _ = sharding.sharded_init(init, mesh, rules)
  tokens = jax.random.randint(jax.random.key(5), (8, 16), 0, cfg.vocab_size)  # a row a device
  pos = jnp.broadcast_to(jnp.arange(16), (8, 16))
  seg = jnp.ones((8, 16), jnp.int32).at[1, 11:].set(0).at[3, 5:].set(0)  # padding
  real = np.asarray(seg) != 0

  def fwd(c):
    return jax.jit(
      lambda p: Transformer(c).apply({"params": p}, tokens, pos, seg, mutable=["intermediates"])
    )

  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    (dense, aux_d), _ = fwd(cfg)(params)
    (got, aux_e), inter = fwd(ep_cfg)(params)
    assert "all_to_all" in fwd(ep_cfg).lower(params).as_text()  # not the fallback
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(dense)[real], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(aux_e["load_balance_loss"], aux_d["load_balance_loss"])
  dropped = [
    leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(inter)
    if "moe_dropped" in jax.tree_util.keystr(path)
  ]
  assert len(dropped) == cfg.num_layers and all(int(d) == 0 for d in dropped)
