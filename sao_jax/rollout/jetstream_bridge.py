"""JetStream integration: the only module that imports `jetstream`.

Needs the `jetstream` extra (`pip install -e '.[jetstream]'`, google-jetstream
0.2.2, which pulls in seqio / TensorFlow). Provides:

* `JetStreamEngine`, a real subclass of `jetstream.engine.engine_api.Engine`
  around `PolicyEngine`, so JetStream's orchestrator (continuous batching,
  gRPC streaming) can serve the policy for evaluation and demos;
* `JetStreamTokenizer`, our tokenizers behind JetStream's Tokenizer API;
* `serve(...)`, JetStream's real gRPC server over that engine.

The RL path does not go through here: JetStream's responses carry token ids
and text only (no log-probs, no versions), and its params cannot be swapped
while it serves. The trainer drives `PolicyEngine` in-process instead.

Two adaptations to JetStream 0.2.2's contract: its `prefill` returns only a
prefix and the first generated token comes from `generate`, so `prefill`
here feeds all but the last prompt token and leaves that one as the slot's
next input; and 0.2.2 still calls the `jax.tree_map` alias that current JAX
removed, which is restored below before jetstream is imported.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

if not hasattr(jax, "tree_map"):  # removed from JAX; jetstream 0.2.2 calls it
  jax.tree_map = jax.tree.map

# pylint: disable=g-import-not-at-top,wrong-import-position
import grpc
from jetstream.core import orchestrator, server_lib
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

from sao_jax.rollout.engine import DecodeState, PolicyEngine, Prefix


class JetStreamTokenizer(tokenizer_api.Tokenizer):
  """Our tokenizer behind JetStream's API. Stops at EOS and at the turn end."""

  def __init__(self, tokenizer):
    self._tok = tokenizer

  def encode(self, s: str, is_bos: bool = True, max_prefill_length: int | None = None,
             jax_padding: bool = True, **kwargs):
    del kwargs
    return token_utils.pad_tokens(np.asarray(self._tok.encode(s), np.int32), self.bos_id,
                                  self.pad_id, is_bos=is_bos,
                                  max_prefill_length=max_prefill_length,
                                  jax_padding=jax_padding)

  def decode(self, token_ids: list[int], **kwargs) -> str:
    del kwargs
    return self._tok.decode(token_ids)

  @property
  def pad_id(self) -> int:
    return self._tok.pad_id

  @property
  def eos_id(self) -> int:
    return self._tok.eos_id

  @property
  def bos_id(self) -> int:
    return self._tok.bos_id

  @property
  def stop_tokens(self) -> set[int]:
    return {t for t in (self._tok.eos_id, self._tok.turn_end_id) if t is not None}


class _Prefix(NamedTuple):
  prefix: Prefix
  next_token: Any  # int32 [], the last prompt token, fed by the first generate


class _State(NamedTuple):
  inner: DecodeState
  generated: Any  # int32 [slots], tokens generated since insert


class JetStreamEngine(engine_api.Engine):
  """`PolicyEngine` as a JetStream Engine."""

  def __init__(self, engine: PolicyEngine, tokenizer):
    self._engine = engine
    self._tokenizer = tokenizer
    self._mesh = jax.sharding.Mesh(np.asarray([engine._device]), ("data",))  # pylint: disable=protected-access

  @property
  def policy_engine(self) -> PolicyEngine:
    return self._engine

  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int):
    tokens = np.asarray(padded_tokens, np.int32).reshape(-1)[:true_length]
    if true_length < 1:
      raise ValueError("prefill needs at least one token")
    inner_prefix = None
    if existing_prefix is not None:  # its pending token goes in first
      inner_prefix = existing_prefix.prefix
      tokens = np.concatenate([[int(existing_prefix.next_token)], tokens]).astype(np.int32)
      true_length += 1
    head = np.zeros(max(len(tokens), 1), np.int32)
    head[:true_length - 1] = tokens[:true_length - 1]
    prefix, _ = self._engine.prefill(params=params, existing_prefix=inner_prefix,
                                     padded_tokens=head, true_length=true_length - 1)
    return _Prefix(prefix, jnp.asarray(tokens[true_length - 1], jnp.int32))

  def insert(self, prefix, decode_state, slot: int):
    inner = self._engine.insert(prefix.prefix, decode_state.inner, slot,
                                first_token=prefix.next_token)
    return _State(inner, decode_state.generated.at[slot].set(0))

  def generate(self, params, decode_state):
    inner, result = self._engine.generate(params, decode_state.inner)
    generated = decode_state.generated + inner.active.astype(jnp.int32)
    data = np.stack([result.tokens, np.asarray(inner.active, np.int32),
                     np.asarray(generated)], axis=1).astype(np.int32)  # [slots, 3]
    return _State(inner, generated), engine_api.ResultTokens(
        data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
        samples_per_slot=1)

  def load_params(self, *args, **kwargs):
    del args, kwargs
    return self._engine.params

  def get_prefix_destination_sharding(self) -> Any:
    return None

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path="sao-jax-tokenizer")

  def build_tokenizer(self, metadata) -> tokenizer_api.Tokenizer:
    del metadata
    return JetStreamTokenizer(self._tokenizer)

  def init_decode_state(self, *args, **kwargs):
    del args, kwargs
    state = self._engine.init_decode_state()
    return _State(state, jnp.zeros_like(state.lengths))

  @property
  def max_concurrent_decodes(self) -> int:
    return self._engine.max_concurrent_decodes

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._engine.max_prefill_length

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._mesh

  @property
  def colocated_cpus(self):
    return None


def serve(engine: JetStreamEngine, port: int, threads: int = 4) -> server_lib.JetStreamServer:
  """Starts JetStream's gRPC server (insecure, for localhost) over `engine`."""
  params = engine.load_params()
  driver = orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine],
                               prefill_params=[params], generate_params=[params],
                               interleaved_mode=True)
  server = server_lib.JetStreamServer(driver, threads, port,
                                      grpc.insecure_server_credentials())
  server.start()
  return server
