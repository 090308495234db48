"""The LM head over a vocabulary subset (`ModelConfig.vocab_ids`, `model.vocab_subset`).

The oracle is the same model with a full head: its embedding rows and head
columns at the covered ids are the subset model's, so the subset model's
log-probs must be the full model's logits restricted to those columns and
renormalised, and the engine must sample tokenizer ids of the subset whose
log-probs the train step recomputes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from runs import load_config_module

from sao_jax.config import sections
from sao_jax.data import packing
from sao_jax.data.trajectory import Trajectory
from sao_jax.models import config as mcfg
from sao_jax.models import head_vocab, policy
from sao_jax.rollout.batch_sampler import generate_batch
from sao_jax.rollout.engine import PolicyEngine
from sao_jax.train import configuration

FULL = 300
IDS = tuple(range(0, 300, 7)) + (299,)  # 44 ids, the last and first included
CFG = dataclasses.replace(mcfg.tiny(vocab_size=FULL), vocab_ids=IDS)


def test_ids_map_to_columns_and_back():
  ids = jnp.asarray(IDS)
  assert (head_vocab.index(CFG, ids) == jnp.arange(len(IDS))).all()
  assert (head_vocab.token_ids(CFG, jnp.arange(len(IDS))) == ids).all()
  others = jnp.asarray([1, 8, 298])
  assert (head_vocab.index(CFG, others) == len(IDS)).all()  # the shared row
  assert head_vocab.covered(CFG, ids).all() and not head_vocab.covered(CFG, others).any()
  params = policy.init_params(CFG, jax.random.key(0))
  assert params["embed"].shape == (len(IDS) + 1, 64)
  assert params["lm_head"].shape == (64, len(IDS))
  full = dataclasses.replace(CFG, vocab_ids=())
  assert head_vocab.index(full, others).tolist() == [1, 8, 298]
  for bad in ((5, 3), (3, 3), (0, FULL)):
    with pytest.raises(ValueError, match="vocab_ids"):
      dataclasses.replace(CFG, vocab_ids=bad)


def _full_params(params):
  """The full-head model that the subset model is a restriction of."""
  rows = head_vocab.index(CFG, jnp.arange(FULL))
  head = jnp.full((64, FULL), 0.0).at[:, jnp.asarray(IDS)].set(params["lm_head"])
  return dict(params, embed=params["embed"][rows], lm_head=head)


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  trajs = []
  for n, start in ((40, 10), (25, 6)):
    tokens = rng.integers(0, FULL, n).astype(np.int32)  # prompts: any id
    tokens[start:] = rng.choice(IDS, n - start)  # actions: covered ids
    mask = np.arange(n) >= start
    trajs.append(
      Trajectory(
        tokens=tokens,
        action_mask=mask,
        rollout_logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
        policy_version=np.where(mask, 0, -1).astype(np.int32),
        rewards=np.zeros(n, np.float32),
        turn_starts=np.asarray([start], np.int32),
        prompt_id=seed,
      )
    )
  return {
    k: jnp.asarray(v)
    for k, v in packing.pack(trajs, rows=2, buckets=(64,), action_index=True).items()
  }


@pytest.mark.parametrize("chunk,at_actions", [(0, False), (16, True)])
def test_logprobs_and_gradients_are_the_full_models_over_the_subset(chunk, at_actions):
  cfg = dataclasses.replace(CFG, logits_chunk=chunk)
  params = policy.init_params(cfg, jax.random.key(1))
  batch = _batch()
  inputs = (batch["tokens"], batch["positions"], batch["segment_ids"])
  mask = batch["action_mask"]
  weights = jax.random.normal(jax.random.key(2), mask.shape)

  def loss(p):
    logp, _ = policy.token_logprobs(
      cfg, p, *inputs, temperature=0.7, action_index=batch["action_index"] if at_actions else None
    )
    return jnp.sum(jnp.where(mask, logp * weights, 0.0)), logp

  (_, logp), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  # The oracle: the full model's logits at the subset's columns, renormalised.
  full_cfg = dataclasses.replace(cfg, vocab_ids=(), logits_chunk=0)
  from sao_jax.models.transformer import Transformer

  def oracle(p):
    logits, _ = Transformer(full_cfg, "lm").apply({"params": _full_params(p)}, *inputs)
    sub = jax.nn.log_softmax(logits[..., jnp.asarray(IDS)] / 0.7, -1)
    prev = jnp.concatenate([jnp.zeros_like(sub[:, :1]), sub[:, :-1]], 1)
    cols = head_vocab.index(cfg, inputs[0])
    at = jnp.take_along_axis(prev, jnp.minimum(cols, len(IDS) - 1)[..., None], -1)[..., 0]
    return jnp.sum(jnp.where(mask, at * weights, 0.0)), at

  (_, want), want_grad = jax.value_and_grad(oracle, has_aux=True)(params)
  np.testing.assert_allclose(np.where(mask, logp, 0), np.where(mask, want, 0), rtol=1e-5, atol=1e-5)
  # A target outside the subset (prompt text) has no log-prob.
  uncovered = ~np.asarray(head_vocab.covered(cfg, inputs[0]))
  assert uncovered.any() and (np.asarray(logp)[uncovered] == 0).all()
  for name in ("embed", "lm_head"):
    np.testing.assert_allclose(grad[name], want_grad[name], rtol=1e-4, atol=1e-6)


def test_the_engine_samples_subset_ids_whose_logprobs_the_trainer_recomputes():
  params = policy.init_params(CFG, jax.random.key(3))
  engine = PolicyEngine(CFG, params, sections.Rollout(slots=2, max_len=64), seed=5)
  prompts = [[1, 8, 15, 298], [0, 2, 3]]  # uncovered ids read through the shared row
  out, out_lp, counts = generate_batch(engine, prompts, 12)
  assert set(out.ravel().tolist()) <= set(IDS) and (counts == 12).all()
  for prompt, toks, lps in zip(prompts, out, out_lp):
    row = jnp.asarray([prompt + toks.tolist()], jnp.int32)
    logp, _ = policy.token_logprobs(
      CFG, params, row, jnp.arange(row.shape[1])[None], jnp.ones_like(row)
    )
    np.testing.assert_allclose(np.asarray(logp)[0, len(prompt) :], lps, rtol=1e-4, atol=1e-4)


def test_config_refuses_a_subset_with_an_imported_checkpoint():
  c = load_config_module("math_tool_cpu.py").get_config()
  assert c.model.vocab_subset == "env"
  configuration.validate(c, num_devices=8)
  configuration.set_field(c, "sft.init_from_hf", "/some/hf_dir")
  with pytest.raises(sections.ConfigError, match="full head") as e:
    configuration.validate(c, num_devices=8)
  assert "\n" not in str(e.value)


def test_an_environment_without_a_row_list_is_refused():
  from sao_jax.train import factories

  c = load_config_module("sao_tiny.py").get_config()  # python_tool: generated tasks
  c.model.vocab_subset = "env"
  with pytest.raises(sections.ConfigError, match="finite row list") as e:
    factories.build_model_config(c)
  assert "\n" not in str(e.value)


def test_a_checkpoint_of_another_head_is_refused_in_one_line(tmp_path):
  """A restore under other head ids (another dataset, or vocab_subset switched)
  is one line naming the field, before orbax's shape error."""
  import types

  from sao_jax.data.checkpoint import Checkpointer
  from sao_jax.train import run as run_lib

  ckpt = Checkpointer(str(tmp_path / "checkpoints"), name="run")
  ckpt.save(1, {"w": np.zeros(3, np.float32)}, {"vocab_ids": list(IDS)}, force=True)
  ckpt.wait()
  ckpt.close()
  same = types.SimpleNamespace(workdir=str(tmp_path), model_cfg=CFG, meta={})
  run_lib._check_vocab_ids(same, 1)
  for other in (dataclasses.replace(CFG, vocab_ids=IDS[:-1]), mcfg.tiny(vocab_size=FULL)):
    with pytest.raises(sections.ConfigError, match="model.vocab_subset") as e:
      run_lib._check_vocab_ids(
        types.SimpleNamespace(workdir=str(tmp_path), model_cfg=other, meta={}), 1
      )
    assert "\n" not in str(e.value)
