"""Gated DeltaNet's kernels on this machine, side by side in one run.

    python benchmarks/deltanet.py [--rows=4] [--length=1024] [--heads=4] [--dim=16]
                                  [--repeats=5] [--torch]

What a training step and a prefill pay for the delta rule
(sao_jax/models/deltanet.py), forward and backward, at one shape:

  chunked, substitution   the library's chunked form: each chunk's
                          (I + A)^-1 by forward substitution with its
                          closed-form gradient (`unit_lower_inverse`)
  chunked, solve          the same algebra with
                          `jax.scipy.linalg.solve_triangular` in the chunk
                          (what the library used first)
  recurrent               the token-by-token scan (the decode step's form)

for chunks of 32 and 64 tokens; with --torch also transformers' own torch
functions (`torch_chunk_gated_delta_rule`, the reference the parity tests
compare to), forward only. Medians of --repeats runs after a warm-up,
and each time divided by the library form's at chunk 64: ratios, since
the machine is shared. The decode step (one token, the recurrent form
from a state) is timed beside it.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from sao_jax.models import deltanet as dn

_ROWS = flags.DEFINE_integer("rows", 4, "Rows (sequences).")
_LENGTH = flags.DEFINE_integer("length", 1024, "Tokens a row.")
_HEADS = flags.DEFINE_integer("heads", 4, "Value heads (key heads: half).")
_DIM = flags.DEFINE_integer("dim", 16, "Key and value head dim.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs a form (median).")
_TORCH = flags.DEFINE_bool("torch", False, "Also transformers' torch reference (forward).")


def _inputs(rows, length, heads, dim):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(rows, length, heads // 2, dim)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(rows, length, heads // 2, dim)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(rows, length, heads, dim)), jnp.float32)
  g = -jnp.abs(jnp.asarray(rng.normal(size=(rows, length, heads)), jnp.float32))
  beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(rows, length, heads)), jnp.float32))
  return q, k, v, g, beta


def _solve_inverse(a):
  """(I + A)^-1 by XLA's triangular solve (the library's first version)."""
  eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
  return jax.scipy.linalg.solve_triangular(eye + a, eye, lower=True, unit_diagonal=True)


def _median_seconds(fn, *args) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _grad_fn(rule, g, beta):
  loss = lambda q, k, v: rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].sum()
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _jax_rows(q, k, v, g, beta) -> list[tuple[str, float]]:
  rows = []
  for chunk in (32, 64):
    for name, inverse in (("substitution", dn.unit_lower_inverse), ("solve", _solve_inverse)):
      original = dn.unit_lower_inverse
      dn.unit_lower_inverse = inverse  # the chunk's solve, swapped for this form only
      try:
        fn = _grad_fn(functools.partial(dn.chunked_gated_delta_rule, chunk=chunk), g, beta)
        rows.append((f"chunked {chunk}, {name}: fwd+bwd", _median_seconds(fn, q, k, v)))
      finally:
        dn.unit_lower_inverse = original
  rows.append(
    (
      "recurrent: fwd+bwd",
      _median_seconds(_grad_fn(dn.recurrent_gated_delta_rule, g, beta), q, k, v),
    )
  )
  state = jnp.zeros((q.shape[0], v.shape[2], q.shape[3], v.shape[3]), jnp.float32)
  step = jax.jit(
    lambda q, k, v, g, beta, s: dn.recurrent_gated_delta_rule(
      q, k, v, g, beta, initial_state=s, use_qk_l2norm_in_kernel=True
    )
  )
  one = lambda x: x[:, :1]
  rows.append(
    (
      "decode step (1 token, from a state)",
      _median_seconds(step, *(one(x) for x in (q, k, v, g, beta)), state),
    )
  )
  return rows


def _torch_row(q, k, v, g, beta) -> tuple[str, float]:
  import torch
  from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

  args = [torch.tensor(np.asarray(x)) for x in (q, k, v, g, beta)]
  heads = v.shape[2]
  args[0] = args[0].repeat_interleave(heads // q.shape[2], dim=2)
  args[1] = args[1].repeat_interleave(heads // q.shape[2], dim=2)
  run = lambda: ref.torch_chunk_gated_delta_rule(
    *args[:3], g=args[3], beta=args[4], use_qk_l2norm_in_kernel=True
  )
  with torch.no_grad():
    run()
    times = []
    for _ in range(_REPEATS.value):
      start = time.perf_counter()
      run()
      times.append(time.perf_counter() - start)
  return "transformers torch_chunk_gated_delta_rule (64): fwd only", float(np.median(times))


def main(_):
  shape = (_ROWS.value, _LENGTH.value, _HEADS.value, _DIM.value)
  inputs = _inputs(*shape)
  rows = _jax_rows(*inputs)
  if _TORCH.value:
    rows.append(_torch_row(*inputs))
  base = dict(rows)["chunked 64, substitution: fwd+bwd"]
  print(
    f"rows {shape[0]} x {shape[1]} tokens, {shape[2]} value heads of {shape[3]} "
    f"({jax.default_backend()}), medians of {_REPEATS.value}"
  )
  print("| form | ms | / chunked 64 substitution |\n|---|---|---|")
  for name, seconds in rows:
    print(f"| {name} | {seconds * 1e3:.1f} | {seconds / base:.2f} |")


if __name__ == "__main__":
  app.run(main)
