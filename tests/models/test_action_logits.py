"""The head at action tokens only: packing's `action_index` and `token_logprobs` on it.

With a vocabulary-wide head the log-probs of a row are computed only where
the losses read them (the action tokens). The oracle is the full head:
values and gradients at action tokens must equal it; elsewhere the
log-prob is 0.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.data import packing
from sao_jax.data.trajectory import Trajectory
from sao_jax.models import config as mcfg
from sao_jax.models import policy


def _traj(n, starts, lengths, seed):
  rng = np.random.default_rng(seed)
  mask = np.zeros(n, bool)
  for s, k in zip(starts, lengths):
    mask[s : s + k] = True
  rewards = np.zeros(n, np.float32)
  rewards[np.flatnonzero(mask)[-1]] = 1.0
  return Trajectory(
    tokens=rng.integers(0, 97, n).astype(np.int32),
    action_mask=mask,
    rollout_logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
    policy_version=np.where(mask, 0, -1).astype(np.int32),
    rewards=rewards,
    turn_starts=np.asarray(starts, np.int32),
    prompt_id=seed,
  )


def test_action_width_is_the_smallest_bucket_that_holds_the_row():
  assert packing.action_width([3, 7], 64) == 8
  assert packing.action_width([9], 64) == 16
  assert packing.action_width([17, 0], 64) == 24
  assert packing.action_width([33], 64) == 40
  assert packing.action_width([64], 64) == 64
  assert packing.action_width([0], 64) == 8
  assert packing.action_width([5], 4) == 4


def test_pack_lists_each_rows_action_positions():
  trajs = [_traj(20, [5, 12], [3, 4], 0), _traj(30, [10], [15], 1), _traj(12, [4], [2], 2)]
  batch = packing.pack(trajs, rows=2, buckets=(32, 64), action_index=True)
  index, mask = batch["action_index"], batch["action_mask"]
  assert index.shape == (2, packing.action_width(mask.sum(1), mask.shape[1]))
  for r in range(2):
    where = np.flatnonzero(mask[r])
    assert index[r, : len(where)].tolist() == where.tolist()
    assert (index[r, len(where) :] == -1).all()
  # A host's rows of the same batch get the same width.
  part = packing.pack(trajs, rows=2, buckets=(32, 64), row_ids=[1], action_index=True)
  assert part["action_index"].tolist() == index[1:].tolist()
  assert "action_index" not in packing.pack(trajs, rows=2, buckets=(32, 64))


@pytest.mark.parametrize("chunk", [0, 8])
def test_logprobs_and_gradients_equal_the_full_head_at_action_tokens(chunk):
  cfg = dataclasses.replace(mcfg.tiny(vocab_size=97), logits_chunk=chunk)
  params = policy.init_params(cfg, jax.random.key(0))
  trajs = [_traj(20, [5, 12], [3, 4], 0), _traj(30, [10], [15], 1), _traj(12, [4], [2], 2)]
  batch = {
    k: jnp.asarray(v)
    for k, v in packing.pack(trajs, rows=2, buckets=(64,), action_index=True).items()
  }
  inputs = (batch["tokens"], batch["positions"], batch["segment_ids"])
  mask = batch["action_mask"]
  weights = jax.random.normal(jax.random.key(1), mask.shape)

  def loss(p, index):
    logp, _ = policy.token_logprobs(cfg, p, *inputs, temperature=0.7, action_index=index)
    return jnp.sum(jnp.where(mask, logp * weights, 0.0)), logp

  (full_loss, full), full_grad = jax.value_and_grad(loss, has_aux=True)(params, None)
  (act_loss, act), act_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(
    params, batch["action_index"]
  )
  np.testing.assert_allclose(np.where(mask, act, 0), np.where(mask, full, 0), rtol=1e-5, atol=1e-5)
  assert (np.asarray(act)[~np.asarray(mask)] == 0).all()
  np.testing.assert_allclose(act_loss, full_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(act_grad), jax.tree.leaves(full_grad)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)  # fp32 sums in another order
