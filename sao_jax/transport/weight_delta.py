"""Delta weight versions: the elements of a piece that changed, and a checksum.

The direct weight path (weight_transfer.py) sends a version as its pieces
(distinct shards). At sao_moe's actor lr (1e-6) most bf16 elements of the
serving cast do not move from one version to the next: the fp32 master moves
by about lr a step and its bf16 rounding changes only when it crosses a
rounding boundary (benchmarks/delta_versions.py measures the fraction). A
delta names the blocks of `block` consecutive elements (row-major over the
piece) that differ, bitwise, and carries their new bits:

    words(x)     x's bits as unsigned ints of its width (-0.0 != 0.0, NaN
                 payloads kept: no float comparison anywhere)
    changed_b  = any(words(old)[b*block:(b+1)*block] != words(new)[...])
    indices    = the changed blocks' numbers, padded with `n_blocks` (out of
                 range: dropped on apply) to `size`            # [size] int32
    values     = words(new) of those blocks, 0 where padded    # [size, block]
    apply(old, indices, values) == new, bit for bit

`size` comes from `bucket(count)` (a few sizes per octave), so the programs
compile once per (shape, bucket), not once per version. `checksum` mixes
each word with its position (a bijection of the word for a fixed position,
summed mod 2^32): changing any one word always changes it, and moving words
between positions almost always does; the trainer puts the new piece's in
the manifest, the rollout recomputes it after applying.

Pure functions of arrays, jitted, on the device that holds the piece.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

# Elements per block. 1 (each changed element with its own int32 index): at
# sao_moe's lr few elements change, scattered, so a block of 16 or more is
# nearly always touched, and 1 gives the smallest delta of the block sizes
# benchmarks/delta_versions.py compares. A bitmask (a bit per element, then
# the changed values) is smaller only where more elements change; it is not
# built (sizes: benchmarks/RESULTS.md#fleet-and-weight-sync).
BLOCK = 1
INDEX_DTYPE = jnp.int32
_GOLDEN = 0x9E3779B9


def word_dtype(dtype) -> np.dtype:
  """The unsigned int dtype of `dtype`'s width (a delta's values)."""
  return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")


def words(x: jax.Array) -> jax.Array:
  """`x`'s bits as unsigned ints of its width, flat."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8).reshape(-1)
  return jax.lax.bitcast_convert_type(x, word_dtype(x.dtype)).reshape(-1)


def _from_words(w: jax.Array, dtype, shape) -> jax.Array:
  if np.dtype(dtype) == np.bool_:
    return w.astype(jnp.bool_).reshape(shape)
  return jax.lax.bitcast_convert_type(w, dtype).reshape(shape)


def _blocks(w: jax.Array, block: int) -> jax.Array:
  """Flat words as [n_blocks, block], the tail padded with zeros."""
  pad = -w.shape[0] % block
  return jnp.pad(w, (0, pad)).reshape(-1, block)


def _differ(old: jax.Array, new: jax.Array, block: int):
  """(whether each block differs bitwise [n_blocks], new's blocks)."""
  new_b = _blocks(words(new), block)  # [n_blocks, block]
  return jnp.any(_blocks(words(old), block) != new_b, axis=1), new_b


@functools.partial(jax.jit, static_argnames="block")
def changed_blocks(old: jax.Array, new: jax.Array, *, block: int) -> jax.Array:
  """How many blocks of `block` elements differ bitwise (an int32 scalar)."""
  return jnp.sum(_differ(old, new, block)[0], dtype=jnp.int32)


def capacity(shape, dtype, block: int) -> int:
  """The most changed blocks whose delta moves fewer bytes than the piece."""
  nbytes = math.prod(shape) * np.dtype(dtype).itemsize
  return max((nbytes - 1) // delta_nbytes(1, block, dtype), 0)


@functools.partial(jax.jit, static_argnames=("block", "size"))
def encode(old: jax.Array, new: jax.Array, *, block: int, size: int):
  """(indices [size] int32, values [size, block] unsigned, count): the
  changed blocks of `new` against `old`, in order, and how many there are;
  past the count (or `size`, which may be smaller), padding: index n_blocks,
  values 0."""
  assert old.shape == new.shape and old.dtype == new.dtype, (old.shape, new.shape)
  differ, new_b = _differ(old, new, block)
  n_blocks = new_b.shape[0]
  (indices,) = jnp.nonzero(differ, size=size, fill_value=n_blocks)
  values = new_b.at[indices].get(mode="fill", fill_value=0)
  return indices.astype(INDEX_DTYPE), values, jnp.sum(differ, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames="block")
def apply(old: jax.Array, indices: jax.Array, values: jax.Array, *, block: int) -> jax.Array:
  """`old` with the blocks `indices` set to `values` (padding dropped): the
  new piece, bit for bit, in a buffer of its own."""
  w = words(old)
  blocks = _blocks(w, block).at[indices].set(values, mode="drop")
  return _from_words(blocks.reshape(-1)[: w.shape[0]], old.dtype, old.shape)


def _fmix32(x: jax.Array) -> jax.Array:
  """murmur3's finalizer: a bijection of uint32."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


@jax.jit
def checksum(x: jax.Array) -> jax.Array:
  """A uint32 of `x`'s bits and their positions (module docstring)."""
  w = words(x)
  if w.dtype.itemsize == 8:
    w = jax.lax.bitcast_convert_type(w, jnp.uint32).reshape(-1)
  w = w.astype(jnp.uint32)
  position = jnp.arange(w.shape[0], dtype=jnp.uint32)
  return jnp.sum(_fmix32(w ^ (position * jnp.uint32(_GOLDEN))), dtype=jnp.uint32)


def bucket(n: int) -> int:
  """The padded size for `n` changed blocks: the smallest m * 2^e >= n with
  m in 4..8 (below 8: n itself; never 0), at most 25% padding."""
  if n <= 8:
    return max(n, 1)
  e = (n - 1).bit_length() - 3
  return -(-n // (1 << e)) << e


def delta_nbytes(size: int, block: int, dtype) -> int:
  """Bytes a delta of `size` blocks moves."""
  return size * (np.dtype(INDEX_DTYPE).itemsize + block * np.dtype(dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class Delta:
  """One piece's delta: `indices` and `values` (encode), `changed` blocks."""

  indices: jax.Array
  values: jax.Array
  changed: int

  @property
  def size(self) -> int:
    return int(self.indices.shape[0])

  @property
  def nbytes(self) -> int:
    return int(self.indices.nbytes + self.values.nbytes)


def encode_pieces(olds: list, news: list, block: int = BLOCK) -> list[Delta | None]:
  """Each piece's delta from `olds[i]` to `news[i]` (on their devices), or
  None where the delta would move no fewer bytes than the piece.

  Each piece is encoded at its `capacity` (one program per shape, whatever
  the count), all dispatched before one wait for the counts; the deltas
  sent are those encodings' first `bucket(count)` rows."""
  encoded = []
  for old, new in zip(olds, news):
    cap = capacity(new.shape, new.dtype, block)
    encoded.append(encode(old, new, block=block, size=cap) if cap else None)
  counts = jax.device_get([None if e is None else e[2] for e in encoded])
  out = []
  for e, count in zip(encoded, counts):
    size = None if e is None else bucket(int(count))
    if size is None or size > e[0].shape[0]:
      out.append(None)
      continue
    out.append(Delta(_head(e[0], size), _head(e[1], size), int(count)))
  return out


@functools.partial(jax.jit, static_argnames="size")
def _head(x: jax.Array, size: int) -> jax.Array:
  return x[:size]


def checksums(pieces: list) -> list[int]:
  """`checksum` of each piece, one wait for all."""
  return [int(c) for c in jax.device_get([checksum(p) for p in pieces])]
