"""Gated DeltaNet kernels against a float64 numpy loop and transformers' torch code.

Two oracles: `numpy_delta_rule` / `numpy_conv` below (plain loops over
tokens, float64), and transformers' own `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_fn`,
`causal_conv1d_update` and the whole `Qwen3_5GatedDeltaNet` layer.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from sao_jax.models import deltanet as dn

# fp32 kernels against float64 loops: a few ulps times the accumulation depth.
ATOL = RTOL = 2e-5


def numpy_l2norm(x):
  return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def numpy_delta_rule(q, k, v, g, beta, s0=None, segment_ids=None, l2norm=False):
  """The recurrence token by token in float64, one row and one head at a time.

  A token whose segment differs from the one the state holds starts from 0;
  the state held at the start is position 0's segment; padding is skipped.
  """
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  batch, length, key_heads, dk = q.shape
  heads, dv = v.shape[2:]
  if l2norm:
    q, k = numpy_l2norm(q), numpy_l2norm(k)
  q = q / np.sqrt(dk)
  if segment_ids is None:
    segment_ids = np.ones((batch, length), int)
  out = np.zeros((batch, length, heads, dv))
  final = np.zeros((batch, heads, dk, dv))
  for b in range(batch):
    for h in range(heads):
      kh = h // (heads // key_heads)
      s = np.zeros((dk, dv)) if s0 is None else np.asarray(s0, np.float64)[b, h].copy()
      held = segment_ids[b, 0]
      for t in range(length):
        if segment_ids[b, t] == 0:
          continue
        if segment_ids[b, t] != held:
          s, held = np.zeros((dk, dv)), segment_ids[b, t]
        s = np.exp(g[b, t, h]) * s
        delta = beta[b, t, h] * (v[b, t, h] - s.T @ k[b, t, kh])
        s = s + np.outer(k[b, t, kh], delta)
        out[b, t, h] = s.T @ q[b, t, kh]
      final[b, h] = s
  return out, final


def numpy_conv(x, weight, state=None):
  """Causal depthwise conv + SiLU by a loop over taps: y_t = silu(sum_d w[K-1-d] x_{t-d})."""
  x = np.asarray(x, np.float64)
  taps = weight.shape[0]
  if state is None:
    state = np.zeros((x.shape[0], taps - 1, x.shape[2]))
  xs = np.concatenate([state, x], axis=1)
  pre = np.zeros_like(x)
  for t in range(x.shape[1]):
    for d in range(taps):
      pre[:, t] += weight[taps - 1 - d] * xs[:, t + taps - 1 - d]
  return pre / (1 + np.exp(-pre)), xs[:, -(taps - 1) :]


# One shape for (almost) every call, so that each jitted program below
# compiles once for the whole file: L = 37 is a multiple of no chunk size used.
B, L, HK, H, DK, DV, TAPS = 2, 37, 2, 4, 8, 6, 4
C = 2 * HK * DK + H * DV  # conv channels: q, k, v

recurrent = jax.jit(
  dn.recurrent_gated_delta_rule, static_argnames=("use_qk_l2norm_in_kernel", "scale")
)
chunked = jax.jit(
  dn.chunked_gated_delta_rule, static_argnames=("chunk", "use_qk_l2norm_in_kernel", "scale")
)
causal_conv = jax.jit(dn.causal_conv)

# Row 0: a 17-token segment, a 13-token one, 7 padding; row 1: 13, 17, 7.
PACKED_IDS = np.array([[1] * 17 + [2] * 13 + [0] * 7, [1] * 13 + [2] * 17 + [0] * 7])


def segments(ids_row):
  """(start, end) of each segment of a row, in order."""
  bounds = np.flatnonzero(np.diff(np.concatenate([[0], ids_row, [0]])))
  return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if ids_row[a] != 0]


def random_inputs(seed):
  rng = np.random.default_rng(seed)
  f32 = lambda x: x.astype(np.float32)
  q = f32(rng.normal(size=(B, L, HK, DK)))
  k = f32(rng.normal(size=(B, L, HK, DK)))
  v = f32(rng.normal(size=(B, L, H, DV)))
  g = f32(-rng.uniform(0.01, 2.0, size=(B, L, H)))
  beta = f32(rng.uniform(size=(B, L, H)))
  s0 = f32(0.5 * rng.normal(size=(B, H, DK, DV)))
  return q, k, v, g, beta, s0


def unit_keys(q, k):
  """Without the in-kernel l2norm, keep |k| = 1 so the delta rule stays contractive."""
  return np.asarray(numpy_l2norm(q), np.float32), np.asarray(numpy_l2norm(k), np.float32)


def split_qkv(qkv):
  """The conv's channels -> q, k [B, n, HK, DK], v [B, n, H, DV], as the layer splits them."""
  q, k, v = np.split(np.asarray(qkv), [HK * DK, 2 * HK * DK], axis=-1)
  n = qkv.shape[1]
  return q.reshape(B, n, HK, DK), k.reshape(B, n, HK, DK), v.reshape(B, n, H, DV)


FORMS = (("recurrent", recurrent), ("chunked", functools.partial(chunked, chunk=8)))


class DeltaRuleOracleTest(parameterized.TestCase):
  def test_hardcoded(self):
    # Dk = Dv = 1, q = k = 1, scale 1, exp(g) = 1/2, beta = 1/2, v = (2, 4):
    # t0: u = 0.5 (2 - 0) = 1, S = 1;  t1: S' = 0.5, u = 0.5 (4 - 0.5) = 1.75, S = 2.25.
    ones = jnp.ones((1, 2, 1, 1))
    v = jnp.array([2.0, 4.0]).reshape(1, 2, 1, 1)
    g, beta = jnp.full((1, 2, 1), jnp.log(0.5)), jnp.full((1, 2, 1), 0.5)
    out, state = recurrent(ones, ones, v, g, beta, scale=1.0)
    np.testing.assert_allclose(out.ravel(), [1.0, 2.25], rtol=1e-6)
    np.testing.assert_allclose(state.ravel(), [2.25], rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(True, False)
  def test_recurrent_matches_numpy(self, l2norm):
    q, k, v, g, beta, s0 = random_inputs(0)
    if not l2norm:
      q, k = unit_keys(q, k)
    fn = self.variant(
      functools.partial(dn.recurrent_gated_delta_rule, use_qk_l2norm_in_kernel=l2norm)
    )
    out, state = fn(q, k, v, g, beta, initial_state=s0)
    out_ref, state_ref = numpy_delta_rule(q, k, v, g, beta, s0, l2norm=l2norm)
    np.testing.assert_allclose(out, out_ref, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(state, state_ref, atol=ATOL, rtol=RTOL)

  @chex.variants(with_jit=True, without_jit=True)
  def test_chunked_matches_numpy(self):
    q, k, v, g, beta, s0 = random_inputs(1)
    fn = self.variant(
      functools.partial(dn.chunked_gated_delta_rule, chunk=5, use_qk_l2norm_in_kernel=True)
    )
    out, state = fn(q, k, v, g, beta, initial_state=s0)
    out_ref, state_ref = numpy_delta_rule(q, k, v, g, beta, s0, l2norm=True)
    np.testing.assert_allclose(out, out_ref, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(state, state_ref, atol=ATOL, rtol=RTOL)

  @parameterized.parameters(16, 64)  # 64: one chunk, mostly internal padding
  def test_chunked_matches_numpy_other_chunks(self, chunk):
    q, k, v, g, beta, s0 = random_inputs(1)
    out, state = chunked(
      q, k, v, g, beta, chunk=chunk, initial_state=s0, use_qk_l2norm_in_kernel=True
    )
    out_ref, state_ref = numpy_delta_rule(q, k, v, g, beta, s0, l2norm=True)
    np.testing.assert_allclose(out, out_ref, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(state, state_ref, atol=ATOL, rtol=RTOL)

  def test_bf16_inputs_keep_an_fp32_state(self):
    q, k, v, g, beta, s0 = random_inputs(2)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    out, state = chunked(
      bf(q), bf(k), bf(v), g, beta, chunk=16, initial_state=s0, use_qk_l2norm_in_kernel=True
    )
    self.assertEqual(out.dtype, jnp.bfloat16)
    self.assertEqual(state.dtype, jnp.float32)
    upcast = [np.asarray(bf(x), np.float32) for x in (q, k, v)]
    out_ref, state_ref = numpy_delta_rule(*upcast, g, beta, s0, l2norm=True)
    # The output is rounded to bf16 once (8 bits); the state never was.
    np.testing.assert_allclose(np.asarray(out, np.float32), out_ref, atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(state, state_ref, atol=ATOL, rtol=RTOL)


class UnitLowerInverseTest(parameterized.TestCase):
  """The chunk's triangular solve: (I + A)^-1 by forward substitution, its
  closed-form gradient against autodiff through a general inverse."""

  @parameterized.parameters(1, 16, 64)
  def test_inverse_and_gradient(self, c):
    rng = np.random.default_rng(c)
    a = np.tril(rng.normal(size=(3, c, c)) * 0.3, -1).astype(np.float32)
    t = jax.jit(dn.unit_lower_inverse)(jnp.asarray(a))
    np.testing.assert_allclose(
      t, np.linalg.inv(np.eye(c, dtype=np.float32) + a), rtol=1e-4, atol=1e-4
    )
    w = jnp.asarray(rng.normal(size=(3, c, c)), jnp.float32)
    ours = jax.grad(lambda x: jnp.sum(dn.unit_lower_inverse(x) * w))(jnp.asarray(a))
    ref = jax.grad(lambda x: jnp.sum(jnp.linalg.inv(jnp.eye(c) + jnp.tril(x, -1)) * w))(
      jnp.asarray(a)
    )
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)

  def test_the_worst_case_is_exact(self):
    # Strictly lower ones (every key equal, beta 1, no decay): the inverse
    # is bidiagonal, where a power series would sum binomial coefficients.
    c = 64
    t = dn.unit_lower_inverse(jnp.tril(jnp.ones((c, c)), -1))
    np.testing.assert_array_equal(t, np.eye(c) - np.eye(c, k=-1))


class GradientTest(parameterized.TestCase):
  def test_chunked_grads_equal_recurrent(self):
    q, k, v, g, beta, s0 = random_inputs(3)
    rng = np.random.default_rng(4)
    w_out = rng.normal(size=v.shape).astype(np.float32)
    w_state = rng.normal(size=s0.shape).astype(np.float32)

    def grads(fn):
      def loss(*args):
        out, state = fn(
          *args[:5], initial_state=args[5], segment_ids=PACKED_IDS, use_qk_l2norm_in_kernel=True
        )
        return jnp.sum(out * w_out) + jnp.sum(state * w_state)

      return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, g, beta, s0)

    grad_chunked = grads(functools.partial(dn.chunked_gated_delta_rule, chunk=5))
    grad_recurrent = grads(dn.recurrent_gated_delta_rule)
    for name, a, b in zip("q k v g beta s0".split(), grad_chunked, grad_recurrent):
      self.assertGreater(np.abs(b).max(), 1e-2, name)  # a gradient that is there to compare
      np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4, err_msg=name)
    # Padding reads nothing and writes nothing: no gradient reaches it.
    for name, grad in zip("q k v g beta".split(), grad_chunked[:5]):
      np.testing.assert_array_equal(grad[:, 30:], 0, err_msg=name)


class PackedRowTest(parameterized.TestCase):
  """Rows of two segments plus padding equal each segment run alone."""

  @parameterized.named_parameters(*FORMS)
  def test_delta_rule(self, fn):
    # The first segment of a row continues the initial state, the second starts from zero.
    q, k, v, g, beta, s0 = random_inputs(10)
    out, state = fn(
      q, k, v, g, beta, initial_state=s0, segment_ids=PACKED_IDS, use_qk_l2norm_in_kernel=True
    )
    for b in range(B):
      (a0, e0), (a1, e1) = segments(PACKED_IDS[b])
      alone = [
        numpy_delta_rule(*(x[b : b + 1, a:e] for x in (q, k, v, g, beta)), s, l2norm=True)
        for (a, e), s in (((a0, e0), s0[b : b + 1]), ((a1, e1), None))
      ]
      np.testing.assert_allclose(out[b : b + 1, a0:e0], alone[0][0], atol=ATOL, rtol=RTOL)
      np.testing.assert_allclose(out[b : b + 1, a1:e1], alone[1][0], atol=ATOL, rtol=RTOL)
      np.testing.assert_array_equal(out[b, e1:], 0)
      np.testing.assert_allclose(state[b : b + 1], alone[1][1], atol=ATOL, rtol=RTOL)

  @parameterized.named_parameters(*FORMS)
  def test_all_padding_passes_the_state_through(self, fn):
    q, k, v, g, beta, s0 = random_inputs(12)
    out, state = fn(
      q,
      k,
      v,
      g,
      beta,
      initial_state=s0,
      segment_ids=np.zeros_like(PACKED_IDS),
      use_qk_l2norm_in_kernel=True,
    )
    np.testing.assert_array_equal(out, 0)
    np.testing.assert_array_equal(state, s0)

  def test_conv(self):
    rng = np.random.default_rng(13)
    x = rng.normal(size=(B, L, C)).astype(np.float32)
    weight = rng.normal(size=(TAPS, C)).astype(np.float32)
    state0 = rng.normal(size=(B, TAPS - 1, C)).astype(np.float32)
    y, state = causal_conv(x, weight, state0, PACKED_IDS)
    for b in range(B):
      (a0, e0), (a1, e1) = segments(PACKED_IDS[b])
      alone = [
        numpy_conv(x[b : b + 1, a0:e0], weight, state0[b : b + 1]),
        numpy_conv(x[b : b + 1, a1:e1], weight),
      ]
      np.testing.assert_allclose(y[b : b + 1, a0:e0], alone[0][0], atol=1e-5, rtol=1e-5)
      np.testing.assert_allclose(y[b : b + 1, a1:e1], alone[1][0], atol=1e-5, rtol=1e-5)
      np.testing.assert_array_equal(y[b, e1:], 0)
      np.testing.assert_allclose(state[b : b + 1], alone[1][1], atol=0)

  def test_conv_state_of_a_short_last_segment(self):
    # The last segment has 2 < K-1 tokens: its state is them, after one zero.
    rng = np.random.default_rng(14)
    x = rng.normal(size=(1, 7, 3)).astype(np.float32)
    weight = rng.normal(size=(TAPS, 3)).astype(np.float32)
    _, state = causal_conv(x, weight, None, np.array([[1, 1, 1, 2, 2, 0, 0]]))
    np.testing.assert_array_equal(state[0, 0], 0)
    np.testing.assert_array_equal(state[0, 1:], x[0, 3:5])


class DecodeContinuityTest(parameterized.TestCase):
  def test_prefill_then_decode_equals_one_pass(self):
    """Conv + delta rule: a right-padded prefill, then one token a step from the carried states."""
    rng = np.random.default_rng(20)
    x = rng.normal(size=(B, L, C)).astype(np.float32)
    weight = (0.5 * rng.normal(size=(TAPS, C))).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, size=(B, L, H)).astype(np.float32)
    beta = rng.uniform(size=(B, L, H)).astype(np.float32)
    zero_conv, zero_state = (
      np.zeros((B, TAPS - 1, C), np.float32),
      np.zeros((B, H, DK, DV), np.float32),
    )

    def prefill(ids):
      qkv, conv_state = causal_conv(x, weight, zero_conv, ids)
      out, state = chunked(
        *split_qkv(qkv),
        g,
        beta,
        chunk=8,
        initial_state=zero_state,
        segment_ids=ids,
        use_qk_l2norm_in_kernel=True,
      )
      return out, conv_state, state

    full, _, _ = prefill(np.ones((B, L), np.int32))
    # Row 0 prefills 19 tokens, row 1 14; the rest of each row is padding.
    prompt = np.array([19, 14])
    out, conv_state, state = prefill((np.arange(L)[None] < prompt[:, None]).astype(np.int32))
    for b in range(B):
      np.testing.assert_allclose(out[b, : prompt[b]], full[b, : prompt[b]], atol=1e-5, rtol=1e-5)
    rows = np.arange(B)
    for i in range(L - prompt.max()):
      t = prompt + i
      qkv, conv_state = causal_conv(x[rows, t][:, None], weight, conv_state)
      out, state = recurrent(
        *split_qkv(qkv),
        g[rows, t][:, None],
        beta[rows, t][:, None],
        initial_state=state,
        use_qk_l2norm_in_kernel=True,
      )
      np.testing.assert_allclose(out[:, 0], full[rows, t], atol=1e-5, rtol=1e-5, err_msg=str(i))


class ConvOracleTest(parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_numpy(self):
    rng = np.random.default_rng(30)
    x = rng.normal(size=(B, L, C)).astype(np.float32)
    weight = rng.normal(size=(TAPS, C)).astype(np.float32)
    state = rng.normal(size=(B, TAPS - 1, C)).astype(np.float32)
    for s in (None, state):
      y, new_state = self.variant(dn.causal_conv)(x, weight, s)
      y_ref, state_ref = numpy_conv(x, weight, s)
      np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
      np.testing.assert_allclose(new_state, state_ref, atol=0)


class TransformersOracleTest(parameterized.TestCase):
  """transformers' Qwen3.5 torch code on the same random inputs, the second oracle."""

  def setUp(self):
    super().setUp()
    self.torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5 import modeling_qwen3_5

    self.hf = modeling_qwen3_5

  def t(self, x):
    return self.torch.from_numpy(np.array(x, np.float32))

  def reference(self, q, k, v, g, beta, s0, l2norm, chunk):
    # Same [B, L, H, D] layout and GQA (repeat_interleave) as ours; l2norm inside when asked.
    args = [self.t(x) for x in (q, k, v, g, beta)]
    kw = dict(initial_state=self.t(s0), output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    return (
      self.hf.torch_chunk_gated_delta_rule(*args, chunk_size=chunk, **kw),
      self.hf.torch_recurrent_gated_delta_rule(*args, **kw),
    )

  def assert_close(self, ours, ref):
    np.testing.assert_allclose(ours[0], ref[0].numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ours[1], ref[1].numpy(), atol=1e-5, rtol=1e-5)

  @parameterized.parameters(16, 64)
  def test_delta_rule(self, chunk):
    q, k, v, g, beta, s0 = random_inputs(1)
    ref_chunk, ref_recurrent = self.reference(q, k, v, g, beta, s0, True, chunk)
    ours_chunk = chunked(
      q, k, v, g, beta, chunk=chunk, initial_state=s0, use_qk_l2norm_in_kernel=True
    )
    ours_recurrent = recurrent(q, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=True)
    self.assert_close(ours_chunk, ref_chunk)
    self.assert_close(ours_recurrent, ref_recurrent)

  def test_delta_rule_without_l2norm(self):
    q, k, v, g, beta, s0 = random_inputs(0)
    q, k = unit_keys(q, k)
    ref_chunk, ref_recurrent = self.reference(q, k, v, g, beta, s0, False, 16)
    ours = recurrent(q, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=False)
    self.assert_close(ours, ref_chunk)
    self.assert_close(ours, ref_recurrent)

  def test_conv(self):
    # transformers' layout: x [B, C, L], weight [C, K], conv_state [B, C, K-1].
    rng = np.random.default_rng(41)
    x = rng.normal(size=(B, L, C)).astype(np.float32)
    weight = rng.normal(size=(TAPS, C)).astype(np.float32)
    tw = self.t(weight.T)
    y, state = causal_conv(x, weight)
    y_ref = self.hf.causal_conv1d_fn(self.t(x.transpose(0, 2, 1)), tw, activation="silu")
    np.testing.assert_allclose(y, y_ref.numpy().transpose(0, 2, 1), atol=1e-5, rtol=1e-5)
    # Decode: causal_conv1d_update carries its state in place, one token a call.
    t_state = self.t(np.asarray(state).transpose(0, 2, 1))
    nxt = rng.normal(size=(B, 3, C)).astype(np.float32)
    for i in range(3):
      y, state = causal_conv(nxt[:, i : i + 1], weight, state)
      y_ref = self.hf.causal_conv1d_update(
        self.t(nxt[:, i : i + 1].transpose(0, 2, 1)), t_state, tw, activation="silu"
      )
      np.testing.assert_allclose(y, y_ref.numpy().transpose(0, 2, 1), atol=1e-5, rtol=1e-5)
      np.testing.assert_allclose(state, t_state.numpy().transpose(0, 2, 1), atol=0)

  def test_layer(self):
    """The whole Qwen3_5GatedDeltaNet forward, composed from this module's pieces."""
    torch = self.torch
    hidden = 24
    cfg = self.hf.Qwen3_5TextConfig(
      hidden_size=hidden,
      linear_conv_kernel_dim=TAPS,
      linear_key_head_dim=DK,
      linear_value_head_dim=DV,
      linear_num_key_heads=HK,
      linear_num_value_heads=H,
      num_hidden_layers=1,
      layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    layer = self.hf.Qwen3_5GatedDeltaNet(cfg, layer_idx=0).eval()
    with torch.no_grad():
      for p in layer.parameters():  # move the weights off the init's ones and zeros
        p.add_(0.3 * torch.randn_like(p))
    x = np.random.default_rng(42).normal(size=(B, L, hidden)).astype(np.float32)
    with torch.no_grad():
      ref = layer(self.t(x)).numpy()

    w = {n: p.detach().numpy() for n, p in layer.named_parameters()}
    qkv, _ = causal_conv(x @ w["in_proj_qkv.weight"].T, w["conv1d.weight"][:, 0, :].T)
    g, beta = dn.decay_and_beta(
      x @ w["in_proj_a.weight"].T, x @ w["in_proj_b.weight"].T, w["A_log"], w["dt_bias"]
    )
    out, _ = chunked(
      *split_qkv(qkv),
      g,
      beta,
      chunk=16,
      initial_state=np.zeros((B, H, DK, DV), np.float32),
      use_qk_l2norm_in_kernel=True,
    )
    z = (x @ w["in_proj_z.weight"].T).reshape(B, L, H, DV)
    y = dn.gated_rms_norm(out, z, w["norm.weight"], eps=cfg.rms_norm_eps)
    ours = np.asarray(y).reshape(B, L, H * DV) @ w["out_proj.weight"].T
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=1e-4)
