"""The LM head over a subset of the vocabulary (`ModelConfig.vocab_ids`).

A model trained from scratch on one task never writes most of a 151,669-id
vocabulary, yet a full head spends d_model x 151,669 multiply-adds on every
position it meets (most of the tiny model's forward pass at Qwen3's
vocabulary: benchmarks/RESULTS.md#models-and-the-train-step). With `vocab_ids` the head has one
column per covered id, and the model maps ids at its own boundary, so
everything outside it (trajectories, the engine's sampled tokens, stop
tokens, the tokenizer) sees the tokenizer's ids only:

    input id t      -> embedding row  index(t)    (S = len(vocab_ids):
                                                    every uncovered id
                                                    shares row S)
    head column j   -> sampled id     vocab_ids[j]
    log pi(t | ...) =  log-softmax over the S columns at index(t)

The policy's distribution is over the subset: an uncovered id has
probability 0, so it is never sampled and never an action; where one is
a teacher-forced target (prompt or tool-output text only) its log-prob is
reported as 0, the value positions without a prediction already get.
Which ids a run covers: sao_jax/envs/head_vocab.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig

Array = jax.Array


def embedding_rows(cfg: ModelConfig) -> int:
  """Rows of the embedding table: the vocabulary, or the subset plus a shared row."""
  return cfg.head_size + 1 if cfg.vocab_ids else cfg.vocab_size


def _ids(cfg: ModelConfig) -> Array:
  return jnp.asarray(cfg.vocab_ids, jnp.int32)


def index(cfg: ModelConfig, tokens: Array) -> Array:
  """Tokenizer ids -> head / embedding indices; an uncovered id -> S (the shared row).

  The identity without a subset.
  """
  if not cfg.vocab_ids:
    return tokens
  ids = _ids(cfg)
  at = jnp.clip(jnp.searchsorted(ids, tokens), 0, ids.shape[0] - 1).astype(tokens.dtype)
  return jnp.where(ids[at] == tokens, at, ids.shape[0]).astype(tokens.dtype)


def covered(cfg: ModelConfig, tokens: Array) -> Array:
  """True where a tokenizer id has a head column (everywhere without a subset)."""
  if not cfg.vocab_ids:
    return jnp.ones(jnp.shape(tokens), bool)
  return index(cfg, tokens) < cfg.head_size


def token_ids(cfg: ModelConfig, columns: Array) -> Array:
  """Head columns (what a sampler draws from the logits) -> tokenizer ids."""
  if not cfg.vocab_ids:
    return columns
  return jnp.take(_ids(cfg), columns).astype(columns.dtype)
