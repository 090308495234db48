"""Mixture-of-experts dispatch: one-device paths and the expert-parallel all-to-all.

One-device (or GSPMD) paths, each exact: `ragged_moe` (sort the token-expert
pairs, `ragged_dot`), `blocked_moe` (block-sparse batched matmuls: the FLOPs
of top-k), `capacity_moe` / `capacity_or_dense` (decode-sized calls, falling
back to dense whenever an expert's load exceeds `small_capacity`).

`expert_parallel_moe` dispatches by hand with `jax.shard_map` over the
"expert" mesh axes (`EP` devices, `E / EP` experts each):

  1. Tokens are split over the batch axes and any expert axis the batch is
     not sharded over, so each token is dispatched exactly once.
  2. Every (token, chosen expert) pair is written into a send buffer
     `[EP * C, D]`, one block of `C` rows per destination device.
  3. `all_to_all` over the expert axes delivers each block, with its local
     expert ids, to the device that owns the expert.
  4. There the received rows are sorted by local expert and fed to
     `ragged_dot` over that device's experts only.
  5. The reverse `all_to_all` returns each result to its row; the source
     combines a token's `k` results with its routing weights.

Capacity (`C`, rows per source -> destination device pair, static at trace
time; `capacity`): `capacity_factor <= 0` (the default) is dropless, `C = n *
min(k, E / EP)`, and the result equals the dense path exactly. `c > 0` gives
`C = ceil(c * n * k / EP)` (at most the dropless size); pairs past it are
dropped (zero contribution), every token's first choice placed before any
second choice, and the count is returned. Dispatch in rounds
(`dispatch_chunk = m > 0`): each device dispatches its tokens m at a time,
each round rematerialised, with buffers sized for m tokens and the same
result when dropless; capacity and priority then apply per round.

Invariants: padding tokens (`token_mask` False) are never dispatched, use no
capacity, are not counted as dropped and get a zero output; the "embed"
dimension may be FSDP-sharded and the "mlp" dimension sharded over axes that
do not shard tokens; no collective ever gathers another device's experts.

Why it is built this way, the cost of each collective, and dropless versus
capacity for RL: docs/design/moe.md.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

Array = jax.Array


def ambient_mesh():
  """The mesh set by `jax.set_mesh` (or the legacy `with mesh:`), else None.

  `jax.set_mesh` sets the abstract mesh, which is what flax 0.12 reads too.
  The deprecated `with mesh:` sets only the thread resources' physical mesh;
  code still entering meshes that way gets expert parallelism as well.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    return mesh
  try:
    from jax._src import mesh as mesh_lib

    mesh = mesh_lib.thread_resources.env.physical_mesh
  except (ImportError, AttributeError):
    return None
  return None if mesh.empty else mesh


def _axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry (None, a name or a tuple of names) as a tuple."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _size(mesh, axes: Sequence[str]) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _name(axes: tuple[str, ...]):
  """Axis names as collectives take them: one name, or a tuple of several."""
  return axes[0] if len(axes) == 1 else axes


def ragged_moe(x, top_i, top_p, wi_gate, wi_up, wo, token_mask=None):
  """Dropless top-k MoE on one device (or under GSPMD): sort pairs, ragged_dot.

  The same computation as `MoE(moe_impl="ragged")`; used when the mesh has no
  expert parallelism. Padding rows get a zero output, as in the parallel path.
  """
  n, d = x.shape
  k = top_i.shape[1]
  e = wi_gate.shape[0]
  if token_mask is not None:
    top_p = top_p * token_mask[:, None].astype(top_p.dtype)
  flat_e = top_i.reshape(-1)  # [N*k]
  order = jnp.argsort(flat_e)
  xs = x[order // k]  # [N*k, D], grouped by expert
  sizes = jnp.bincount(flat_e, length=e).astype(jnp.int32)  # [E]
  hidden = jax.nn.silu(jax.lax.ragged_dot(xs, wi_gate, sizes)) * jax.lax.ragged_dot(
    xs, wi_up, sizes
  )  # [N*k, F]
  ys = jax.lax.ragged_dot(hidden, wo, sizes)  # [N*k, D]
  ys = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, d)
  return jnp.einsum("nkd,nk->nd", ys, top_p)


def blocked_moe(x, top_i, top_p, wi_gate, wi_up, wo, block: int):
  """Dropless top-k MoE as block-sparse batched matmuls: the FLOPs of top-k.

  `MoE(moe_impl="blocked")`. The N*k (token, expert) pairs are sorted by
  expert and each expert's run is padded to a multiple of `block` rows, so
  every block of rows belongs to one expert. The row buffer has a static
  size, N*k rows plus at most one partial block per expert (`N*k // block +
  E` blocks), so nothing is ever dropped and no shape depends on the routing.
  Each block is multiplied by its expert's weights, gathered per block
  (`[blocks, D, F]`), in one batched matmul per projection. Compared with
  "dense" (every token through every expert) the expert FLOPs drop from E to
  about k per token; unlike `ragged_dot`, which XLA:CPU runs slowly, it is
  plain gathers and batched dots on any backend.

  Exact: the same products and sums as the dense path, only in another
  order. Worth it when N*k is many blocks; decode steps of a few slots take
  `capacity_moe` (the MoE module chooses).

  Args:
    x: `[N, D]` tokens.
    top_i: int `[N, k]` chosen experts, top_p `[N, k]` their weights.
    wi_gate, wi_up: `[E, D, F]`; wo: `[E, F, D]`.
    block: rows per block (`ModelConfig.moe_block`).

  Returns:
    `[N, D]`.
  """
  n, d = x.shape
  k = top_i.shape[1]
  e = wi_gate.shape[0]
  pairs = n * k
  flat_e = top_i.reshape(-1)  # [P]
  order = jnp.argsort(flat_e, stable=True)  # pairs grouped by expert
  sorted_e = flat_e[order]
  sizes = jnp.bincount(flat_e, length=e)  # [E]
  padded = (sizes + block - 1) // block * block
  padded_end = jnp.cumsum(padded)
  run_start = jnp.cumsum(sizes) - sizes
  # Buffer row of the j-th sorted pair: its expert's padded start + rank in run.
  row = (padded_end - padded)[sorted_e] + jnp.arange(pairs) - run_start[sorted_e]
  row = row.astype(jnp.int32)
  blocks = pairs // block + e
  # Source token of every buffer row; padding rows read an appended zero row.
  source = jnp.full((blocks * block,), n, jnp.int32).at[row].set((order // k).astype(jnp.int32))
  rows = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[source]
  rows = rows.reshape(blocks, block, d)
  # Expert of each block; trailing unused blocks (all padding) take the last.
  block_e = jnp.minimum(
    jnp.searchsorted(padded_end, jnp.arange(blocks) * block, side="right"), e - 1
  )
  hidden = jax.nn.silu(jnp.einsum("brd,bdf->brf", rows, wi_gate[block_e])) * jnp.einsum(
    "brd,bdf->brf", rows, wi_up[block_e]
  )  # [blocks, block, F]
  ys = jnp.einsum("brf,bfd->brd", hidden, wo[block_e]).reshape(blocks * block, d)
  pair_row = jnp.zeros((pairs,), jnp.int32).at[order].set(row)  # pair (n, k) -> row
  return jnp.einsum("nkd,nk->nd", ys[pair_row].reshape(n, k, d), top_p)


def small_capacity(n: int, k: int, e: int) -> int:
  """Rows per expert of `capacity_moe` for a call of `n` tokens: 1.5x the
  balanced load, rounded up to 4 (`n` or more: none, run dense).

  Rounding to 4, not 8, lets a 16-token call (a lane of 16 decode slots, 4
  experts, top-2) take 12 rows an expert instead of running dense, which
  is faster on CPU (benchmarks/RESULTS.md#rollout-engine)."""
  return -(-(3 * n * k) // (2 * e) // 4) * 4 if n * k > e else n


def capacity_moe(x, top_i, top_p, wi_gate, wi_up, wo, capacity: int):
  """Top-k MoE with `capacity` rows per expert; exact while no expert gets more.

  For calls too small for `blocked_moe` (a decode step of a few dozen
  slots), where "dense" runs every token through every expert (E rows a
  token): each expert takes its first `capacity` (token, expert) pairs into
  a `[E, capacity, D]` buffer (E * capacity rows, 1.5 k a token with
  `small_capacity`), and the results are scatter-added back to their
  tokens. Pairs past an expert's capacity would be dropped: the caller
  checks the largest load and runs dense instead (`MoE`), so nothing is
  ever dropped. Faster than dense for decode-sized calls on CPU
  (benchmarks/RESULTS.md#rollout-engine).

  Args as `blocked_moe`; `capacity` rows per expert. Returns `[N, D]`.
  """
  n, d = x.shape
  k = top_i.shape[1]
  e = wi_gate.shape[0]
  flat_e = top_i.reshape(-1)  # [P]
  order = jnp.argsort(flat_e, stable=True)  # pairs grouped by expert
  sizes = jnp.bincount(flat_e, length=e)  # [E]
  start = jnp.cumsum(sizes) - sizes
  j = jnp.arange(capacity)[None]
  used = j < sizes[:, None]  # [E, C]
  pair = order[jnp.minimum(start[:, None] + j, n * k - 1)]  # [E, C]; unused rows: any pair
  tok = pair // k
  rows = x[tok]  # [E, C, D]
  hidden = jax.nn.silu(jnp.einsum("ecd,edf->ecf", rows, wi_gate)) * jnp.einsum(
    "ecd,edf->ecf", rows, wi_up
  )
  weight = jnp.where(used, top_p.reshape(-1)[pair], 0)  # unused rows add zero
  ys = jnp.einsum("ecf,efd->ecd", hidden * weight[..., None], wo)
  return jnp.zeros_like(x).at[tok.reshape(-1)].add(ys.reshape(-1, d))


def capacity_or_dense(x, top_i, top_p, wi_gate, wi_up, wo, dense):
  """`capacity_moe` when no expert's load exceeds `small_capacity`, else
  `dense(x, top_i, top_p)`: exact (dropless) whatever the routing. Calls
  whose capacity would not be below the token count run dense outright."""
  n, k = top_i.shape
  e = wi_gate.shape[0]
  cap = small_capacity(n, k, e)
  if cap >= n:
    return dense(x, top_i, top_p)
  fits = jnp.bincount(top_i.reshape(-1), length=e).max() <= cap
  capped = functools.partial(capacity_moe, wi_gate=wi_gate, wi_up=wi_up, wo=wo, capacity=cap)
  return jax.lax.cond(fits, capped, dense, x, top_i, top_p)


def capacity(n: int, k: int, experts_per_device: int, ep: int, capacity_factor: float) -> int:
  """Rows per (source, destination) device pair; see the module docstring."""
  dropless = n * min(k, experts_per_device)
  if capacity_factor <= 0:
    return max(dropless, 1)
  return max(1, min(dropless, math.ceil(capacity_factor * n * k / ep)))


def _dispatch_combine(x, top_i, top_p, mask, wg, wu, wo, *, expert_axes, ep, capacity_factor):
  """Steps 2-5 of the module docstring for one block of a device's tokens.

  x [n, D], top_i/top_p [n, k], mask [n]; wg/wu [E/EP, D, F/T], wo
  [E/EP, F/T, D] (this device's experts, gathered in D). Returns
  (out [n, D], partial over F/T; dropped, an int32 scalar).
  """
  e_loc = wg.shape[0]
  n, d = x.shape
  k = top_i.shape[1]

  c = capacity(n, k, e_loc, ep, capacity_factor)

  # Pairs in rank-major order (p = r * n + t): all first choices, then all
  # second choices, ... so that capacity keeps the strongest assignments.
  pair_e = top_i.T.reshape(-1)  # [n*k] global expert id
  pair_t = jnp.tile(jnp.arange(n, dtype=jnp.int32), k)  # [n*k] token
  valid = jnp.tile(mask, k)  # [n*k]
  dest = pair_e // e_loc  # [n*k] destination device along the expert axes
  onehot = (dest[:, None] == jnp.arange(ep)[None, :]) & valid[:, None]  # [n*k, EP]
  rank = jnp.cumsum(onehot.astype(jnp.int32), axis=0) - 1  # [n*k, EP]
  pos = jnp.take_along_axis(rank, dest[:, None], axis=1)[:, 0]  # [n*k] row in dest block
  keep = valid & (pos < c)
  dropped = jnp.sum(valid & ~keep).astype(jnp.int32)
  slot = jnp.where(keep, dest * c + pos, ep * c)  # [n*k]; ep*c = nowhere

  # The send buffer as a gather from the tokens (its transpose is a
  # scatter-add into x's gradient). Empty rows read an appended zero row and
  # carry local expert id e_loc, which no group claims.
  src = jnp.full((ep * c + 1,), n, jnp.int32).at[slot].set(pair_t)[: ep * c]  # [EP*C]
  send_e = jnp.full((ep * c + 1,), e_loc, jnp.int32).at[slot].set(pair_e % e_loc)[: ep * c]
  x_pad = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])  # [n+1, D]
  send_x = x_pad[src]  # [EP*C, D]

  name = _name(expert_axes)
  recv_x = jax.lax.all_to_all(send_x, name, 0, 0, tiled=True)  # [EP*C, D], by source
  recv_e = jax.lax.all_to_all(send_e, name, 0, 0, tiled=True)  # [EP*C]

  # Grouped matmul over this device's experts; empty rows sort last and fall
  # outside every group, where ragged_dot returns zeros.
  order = jnp.argsort(recv_e, stable=True)  # [EP*C]
  sizes = jnp.sum(jax.nn.one_hot(recv_e, e_loc, dtype=jnp.int32), axis=0)  # [E/EP]
  xs = recv_x[order]
  hidden = jax.nn.silu(jax.lax.ragged_dot(xs, wg, sizes)) * jax.lax.ragged_dot(
    xs, wu, sizes
  )  # [EP*C, F/T]
  ys = jax.lax.ragged_dot(hidden, wo, sizes)  # [EP*C, D], partial over F/T
  ys = ys[jnp.argsort(order)]  # back to received order

  back = jax.lax.all_to_all(ys, name, 0, 0, tiled=True)  # [EP*C, D], by send slot
  back = jnp.concatenate([back, jnp.zeros((1, d), back.dtype)])  # dropped -> 0
  y_pairs = back[slot].reshape(k, n, d)  # [k, n, D]
  out = jnp.einsum("knd,nk->nd", y_pairs, top_p.astype(y_pairs.dtype))  # [n, D]
  return out, dropped


def _ep_local(
  x,
  top_i,
  top_p,
  mask,
  wg,
  wu,
  wo,
  *,
  expert_axes,
  gather_d_axes,
  gather_f_axes,
  psum_f_axes,
  ep,
  capacity_factor,
  chunk,
):
  """One device's share of the expert-parallel MoE (runs inside shard_map).

  Shapes are per device: x [n, D], top_i/top_p [n, k], mask [n],
  wg/wu [E/EP, D/fs, F/T], wo [E/EP, F/T, D/fs].
  Returns (out [n, D], dropped [1] int32).
  """
  # FSDP: this device's experts, whole in D (and in F where F is sharded over
  # axes that also shard tokens). Never a gather over the expert axes.
  if gather_d_axes:
    wg = jax.lax.all_gather(wg, _name(gather_d_axes), axis=1, tiled=True)
    wu = jax.lax.all_gather(wu, _name(gather_d_axes), axis=1, tiled=True)
    wo = jax.lax.all_gather(wo, _name(gather_d_axes), axis=2, tiled=True)
  if gather_f_axes:
    wg = jax.lax.all_gather(wg, _name(gather_f_axes), axis=2, tiled=True)
    wu = jax.lax.all_gather(wu, _name(gather_f_axes), axis=2, tiled=True)
    wo = jax.lax.all_gather(wo, _name(gather_f_axes), axis=1, tiled=True)
  n, d = x.shape
  run = functools.partial(
    _dispatch_combine, expert_axes=expert_axes, ep=ep, capacity_factor=capacity_factor
  )
  if not chunk or n <= chunk:
    out, dropped = run(x, top_i, top_p, mask, wg, wu, wo)
  else:
    # Dispatch rounds of `chunk` tokens (module docstring, "Dispatch in
    # rounds"). Every device runs the same number of rounds, so the
    # all-to-alls pair up. Each round is rematerialised: the backward keeps
    # a round's inputs, not its buffers.
    pad = -n % chunk
    if pad:
      x = jnp.pad(x, ((0, pad), (0, 0)))
      top_i, top_p = (jnp.pad(a, ((0, pad), (0, 0))) for a in (top_i, top_p))
      mask = jnp.pad(mask, (0, pad))  # False: never dispatched
    rounds = lambda a: a.reshape((-1, chunk) + a.shape[1:])
    one = jax.checkpoint(
      lambda xs: run(*xs, wg, wu, wo), policy=jax.checkpoint_policies.nothing_saveable
    )
    out, dropped = jax.lax.map(one, tuple(rounds(a) for a in (x, top_i, top_p, mask)))
    out, dropped = out.reshape(-1, d)[:n], jnp.sum(dropped)
  if psum_f_axes:
    out = jax.lax.psum(out, _name(psum_f_axes))
  return out, dropped[None]


def _expert_layout(mesh, rules, w_shape: tuple[int, int, int]):
  """The mesh axes of tokens, experts, d_model and d_ff under `rules`, checked.

  Returns (token_axes, expert_axes, d_axes, f_axes, wi spec, wo spec); raises
  ValueError (one line) when the rules shard wi and wo inconsistently, name an
  axis the mesh lacks, or a dimension does not divide over its axes.
  """
  e, d, f = w_shape
  token_spec = nn.logical_to_mesh_axes(("batch", "length"), rules)
  token_axes = _axes(token_spec[0]) + _axes(token_spec[1])
  w_in_spec = nn.logical_to_mesh_axes(("expert", "embed", "mlp"), rules)
  w_out_spec = nn.logical_to_mesh_axes(("expert", "mlp", "embed"), rules)
  expert_axes, d_axes, f_axes = (_axes(a) for a in w_in_spec)
  if (_axes(w_out_spec[0]), _axes(w_out_spec[1]), _axes(w_out_spec[2])) != (
    expert_axes,
    f_axes,
    d_axes,
  ):
    raise ValueError(
      f"Rules shard wi {w_in_spec} and wo {w_out_spec} inconsistently "
      '("embed" and "mlp" on one mesh axis?).'
    )
  for a in token_axes + expert_axes + d_axes + f_axes:
    if a not in mesh.axis_names:
      raise ValueError(f"Sharding rule names mesh axis {a!r}; mesh has {mesh.axis_names}")
  if _size(mesh, expert_axes) > 1:
    for what, dim, axes in (
      ("num_experts", e, expert_axes),
      ("d_model", d, d_axes),
      ("moe_d_ff", f, f_axes),
    ):
      if dim % _size(mesh, axes):
        raise ValueError(
          f"{what}={dim} does not divide over mesh axes {axes} (size {_size(mesh, axes)})."
        )
  return token_axes, expert_axes, d_axes, f_axes, w_in_spec, w_out_spec


def expert_parallel_moe(
  x: Array,
  top_i: Array,
  top_p: Array,
  wi_gate: Array,
  wi_up: Array,
  wo: Array,
  *,
  token_mask: Array | None = None,
  capacity_factor: float = 0.0,
  dispatch_chunk: int = 0,
  mesh: Any = None,
  rules: Any = None,
) -> tuple[Array, Array]:
  """Top-k routed SwiGLU experts, expert-parallel over the mesh.

  Args:
    x: [N, D] token activations (the flattened batch).
    top_i: [N, k] int chosen experts per token; top_p: [N, k] their weights.
    wi_gate, wi_up: [E, D, F]; wo: [E, F, D] expert weights (already in the
      compute dtype).
    token_mask: [N] bool, False for padding (not dispatched, output zero).
    capacity_factor: <= 0 for dropless, else rows per device pair relative to
      a balanced load (module docstring).
    dispatch_chunk: > 0: each device dispatches its tokens in rounds of this
      many (module docstring, "Dispatch in rounds"); 0: all in one round.
    mesh: defaults to the ambient mesh (`jax.set_mesh`, or `with mesh:`).
    rules: logical axis rules; default flax's current `nn.logical_axis_rules`.
      The token axes are those of "batch" (and "length"), the expert axes
      those of "expert", and the weights are taken as sharded by
      ("expert", "embed", "mlp") / ("expert", "mlp", "embed"), as the MoE
      module declares them.

  Returns:
    (out [N, D], dropped): `dropped` is the int32 count of (token, expert)
    pairs dropped for capacity over the whole batch (0 when dropless).
    Without a mesh or expert parallelism it runs `ragged_moe` (dropless).
  """
  n = x.shape[0]
  if token_mask is None:
    token_mask = jnp.ones((n,), bool)
  token_mask = token_mask.astype(bool)
  mesh = ambient_mesh() if mesh is None else mesh
  rules = nn.get_logical_axis_rules() if rules is None else rules
  zero = jnp.zeros((), jnp.int32)
  if mesh is None or not rules:
    return ragged_moe(x, top_i, top_p, wi_gate, wi_up, wo, token_mask), zero

  token_axes, expert_axes, d_axes, f_axes, w_in_spec, w_out_spec = _expert_layout(
    mesh, rules, wi_gate.shape
  )
  ep = _size(mesh, expert_axes)
  if ep == 1:
    return ragged_moe(x, top_i, top_p, wi_gate, wi_up, wo, token_mask), zero
  # Tokens replicated over some expert axes (the batch is not sharded over
  # them) are split over those too, so that each token is dispatched once.
  # Doing it in in_specs makes the split a local slice and its transposes an
  # all-gather of the output (forward) and of x's cotangent (backward).
  split_axes = tuple(a for a in expert_axes if a not in token_axes)
  dispatch_axes = token_axes + split_axes
  # F sharded over axes that shard tokens cannot be summed at the end (those
  # devices hold different tokens): gather it instead. Over other axes, keep
  # it sharded and sum the partial outputs.
  gather_f = tuple(a for a in f_axes if a in dispatch_axes)
  psum_f = tuple(a for a in f_axes if a not in dispatch_axes)

  # shard_map needs whole blocks: pad N to the token shards (no-op when the
  # batch divides, as the trainer's sharded batches do).
  pad = -n % _size(mesh, dispatch_axes)
  if pad:
    x = jnp.pad(x, ((0, pad), (0, 0)))
    top_i = jnp.pad(top_i, ((0, pad), (0, 0)))
    top_p = jnp.pad(top_p, ((0, pad), (0, 0)))
    token_mask = jnp.pad(token_mask, (0, pad))  # False: never dispatched

  tok = _name(dispatch_axes)
  body = functools.partial(
    _ep_local,
    expert_axes=expert_axes,
    gather_d_axes=d_axes,
    gather_f_axes=gather_f,
    psum_f_axes=psum_f,
    ep=ep,
    capacity_factor=capacity_factor,
    chunk=dispatch_chunk,
  )
  out, dropped = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(P(tok, None), P(tok, None), P(tok, None), P(tok), w_in_spec, w_in_spec, w_out_spec),
    out_specs=(P(tok, None), P(tok)),
  )(x, top_i.astype(jnp.int32), top_p, token_mask, wi_gate, wi_up, wo)
  return out[:n], jnp.sum(dropped)
