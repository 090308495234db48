"""Delta weight versions (sao_jax/transport/weight_delta.py): encode / apply against
a numpy oracle, bit for bit, and the checksum."""

import contextlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sao_jax.transport import weight_delta as wd


def _bits(x):
  x = np.asarray(x)
  return x.view(f"uint{8 * x.dtype.itemsize}")


def _oracle(old, new, block):
  """(changed block numbers, their new words) by a plain loop."""
  o, n = _bits(old).reshape(-1), _bits(new).reshape(-1)
  pad = -o.size % block
  o, n = np.pad(o, (0, pad)), np.pad(n, (0, pad))
  changed, values = [], []
  for b in range(o.size // block):
    if (o[b * block : (b + 1) * block] != n[b * block : (b + 1) * block]).any():
      changed.append(b)
      values.append(n[b * block : (b + 1) * block])
  return changed, values


def _bf16(bits):
  return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16)


def _cases():
  rng = np.random.default_rng(0)
  base = rng.standard_normal((13, 7)).astype(ml_dtypes.bfloat16)  # 91: no whole blocks of 4
  some = base.copy()
  some.view(np.uint16)[2, 3] ^= 1  # one ulp
  some.view(np.uint16)[12, 6] ^= 0x8000  # a sign
  zeros = np.zeros((5, 3), ml_dtypes.bfloat16)
  signed = zeros.copy()
  signed.view(np.uint16)[1, 1] = 0x8000  # -0.0 == 0.0 as floats
  nans = _bf16([[0x7FC1, 0x7FC0, 0x3F80]])
  other_nans = _bf16([[0x7FC2, 0x7FC0, 0x3F80]])  # another payload: NaN != NaN as floats
  f32 = rng.standard_normal(40).astype(np.float32)
  return {
    "some": (base, some),
    "none": (base, base.copy()),
    "all": (base, base + 1),
    "-0.0": (zeros, signed),
    "nan payload": (nans, other_nans),
    "float32": (f32, f32 * np.float32(1.0000001)),
    "int32 scalar": (np.int32(3), np.int32(4)),
    "int32 same": (np.int32(3), np.int32(3)),
  }


# Every case jitted, in blocks of 1 and 4 (91 elements: a partial last
# block); two also op by op (slow: nonzero and the scatter eagerly).
@pytest.mark.parametrize(
  "case,block,jit",
  [(c, b, True) for c in sorted(_cases()) for b in (1, 4)]
  + [("nan payload", 4, False), ("some", 1, False)],
)
def test_encode_apply_is_bit_exact_against_a_loop(case, block, jit):
  with contextlib.nullcontext() if jit else jax.disable_jit():
    _round_trip(*_cases()[case], block)


def _round_trip(old, new, block):
  want_changed, want_values = _oracle(old, new, block)
  count = int(wd.changed_blocks(jnp.asarray(old), jnp.asarray(new), block=block))
  assert count == len(want_changed)
  size = wd.bucket(count)
  indices, values, n = wd.encode(jnp.asarray(old), jnp.asarray(new), block=block, size=size)
  assert int(n) == count
  n_blocks = -(-max(np.size(old), 1) // block)
  assert indices.dtype == jnp.int32 and indices.shape == (size,)
  assert values.shape == (size, block) and values.dtype == wd.word_dtype(np.asarray(old).dtype)
  np.testing.assert_array_equal(indices[:count], want_changed)
  np.testing.assert_array_equal(indices[count:], n_blocks)  # padding: dropped on apply
  np.testing.assert_array_equal(values[:count], np.reshape(want_values, (count, block)))
  got = wd.apply(jnp.asarray(old), indices, values, block=block)
  assert got.dtype == np.asarray(new).dtype and got.shape == np.shape(new)
  assert _bits(got).tobytes() == _bits(new).tobytes()
  assert (wd.checksum(got) == wd.checksum(jnp.asarray(new))) and (
    count == 0 or wd.checksum(jnp.asarray(old)) != wd.checksum(jnp.asarray(new))
  )


def test_bucket_pads_by_at_most_a_quarter_and_repeats():
  sizes = [wd.bucket(n) for n in range(0, 5000)]
  assert sizes[:9] == [1, 1, 2, 3, 4, 5, 6, 7, 8]
  assert all(n <= s <= max(n * 1.25, 1) for n, s in enumerate(sizes))
  assert len(set(sizes[1000:2000])) == 5  # a handful of programs an octave
  # Two versions whose changes fall in one bucket: one program each way.
  old = jnp.zeros((64,), jnp.bfloat16)
  before = wd.encode._cache_size(), wd.apply._cache_size()
  for changed in (9, 10):
    new = old.at[jnp.arange(0, 4 * changed, 4)].set(1.0)
    size = wd.bucket(int(wd.changed_blocks(old, new, block=1)))
    assert size == 10
    indices, values, _ = wd.encode(old, new, block=1, size=size)
    assert _bits(wd.apply(old, indices, values, block=1)).tobytes() == _bits(new).tobytes()
  assert (
    wd.encode._cache_size() - before[0],
    wd.apply._cache_size() - before[1],
  ) == (1, 1)


def test_the_checksum_sees_every_single_bit_and_moved_words():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((6, 5)).astype(ml_dtypes.bfloat16)
  ref = int(wd.checksum(jnp.asarray(x)))
  for i in range(x.size):
    for bit in range(16):
      y = x.copy()
      y.view(np.uint16).reshape(-1)[i] ^= 1 << bit
      assert int(wd.checksum(jnp.asarray(y))) != ref, (i, bit)
  swapped = x.copy().reshape(-1)
  swapped[[0, 1]] = swapped[[1, 0]]
  assert int(wd.checksum(jnp.asarray(swapped.reshape(x.shape)))) != ref
  assert wd.checksums([jnp.asarray(x)]) == [ref]


def test_encode_pieces_sends_a_piece_whole_when_its_delta_is_no_smaller():
  """At most 33 changed elements of 100 bf16 (33 x 6 bytes < 200): a delta
  of each size in one program; 34 (bucket 40) or more, or an int32 scalar
  (8 bytes > 4), whole."""
  zeros = jnp.zeros((100,), jnp.bfloat16)
  assert wd.capacity((100,), jnp.bfloat16, 1) == 33
  before = wd.encode._cache_size()
  for changed, size in ((0, 1), (1, 1), (13, 14), (33, 40)):
    new = zeros.at[jnp.arange(changed) * 3].set(2.0)
    (delta,) = wd.encode_pieces([zeros], [new], block=1)
    if size > 33:
      assert delta is None
      continue
    assert (delta.changed, delta.size, delta.nbytes) == (changed, size, 6 * size)
    got = wd.apply(zeros, delta.indices, delta.values, block=1)
    assert _bits(got).tobytes() == _bits(new).tobytes()
  assert wd.encode._cache_size() - before == 1
  assert wd.encode_pieces([jnp.int32(0)], [jnp.int32(1)]) == [None]
