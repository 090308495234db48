"""JetStream integration: the only module that imports `jetstream`.

Needs the `jetstream` extra (`pip install -e '.[jetstream]'`, google-jetstream
0.2.2, which pulls in seqio / TensorFlow). Provides:

* `JetStreamEngine`, a real subclass of `jetstream.engine.engine_api.Engine`
  around `PolicyEngine`, so JetStream's orchestrator (continuous batching,
  gRPC streaming) can serve the policy for evaluation and demos;
* `JetStreamTokenizer`, our tokenizers behind JetStream's Tokenizer API;
* `serve(...)`, JetStream's real gRPC server over that engine, bound to
  loopback unless told otherwise (it has no authentication and no TLS).

The RL path does not go through here: JetStream's responses carry token ids
and text only (no log-probs, no versions), and its params cannot be swapped
while it serves. The trainer drives `PolicyEngine` in-process instead.

Two adaptations to JetStream 0.2.2's contract: its `prefill` returns only a
prefix and the first generated token comes from `generate`, so all but the
last prompt token go into the slot's cache (at `insert`) and that one is
left as the slot's next input; and 0.2.2 still calls the `jax.tree_map`
alias that current JAX removed, which is restored below before jetstream is
imported.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import logging

if not hasattr(jax, "tree_map"):  # removed from JAX; jetstream 0.2.2 calls it
  jax.tree_map = jax.tree.map

import grpc
from jetstream.core import orchestrator, server_lib
from jetstream.core.proto import jetstream_pb2_grpc
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

from sao_jax.rollout.engine import DecodeState, PolicyEngine

# Where the server may listen (shared with the OpenAI-compatible server).
from sao_jax.rollout.loopback import LOOPBACK_HOST, exposure_warning


class JetStreamTokenizer(tokenizer_api.Tokenizer):
  """Our tokenizer behind JetStream's API. Stops at EOS and at the turn end.

  `ignore_eos=True` (benchmarks only) declares no stop tokens, so every
  request runs to its `max_tokens`, like other servers' `--ignore-eos`.
  """

  def __init__(self, tokenizer, ignore_eos: bool = False):
    self._tok = tokenizer
    self._ignore_eos = ignore_eos

  def encode(
    self,
    s: str,
    is_bos: bool = True,
    max_prefill_length: int | None = None,
    jax_padding: bool = True,
    **kwargs,
  ):
    del kwargs
    return token_utils.pad_tokens(
      np.asarray(self._tok.encode(s), np.int32),
      self.bos_id,
      self.pad_id,
      is_bos=is_bos,
      max_prefill_length=max_prefill_length,
      jax_padding=jax_padding,
    )

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
    if self._ignore_eos:
      return set()
    return {t for t in (self._tok.eos_id, self._tok.turn_end_id) if t is not None}


class _Prefix(NamedTuple):
  tokens: Any  # int32 [n], the prompt but its last token: `insert` feeds them
  next_token: Any  # int32 [], the last prompt token, fed by the first generate


class _State(NamedTuple):
  inner: DecodeState
  next_tokens: np.ndarray  # int32 [slots], each slot's pending token (host)
  generated: np.ndarray  # int32 [slots], tokens generated since insert (host)
  active: np.ndarray  # bool [slots], slots holding a request


class JetStreamEngine(engine_api.Engine):
  """`PolicyEngine` as a JetStream Engine, on the engine's driver API.

  JetStream's calls map onto `PolicyEngine.step` / `decode`, the calls the
  rollout driver makes:

    prefill   host only: the prompt (after `existing_prefix`'s tokens, if
              any) split into the tokens to feed and the last one, left
              pending (JetStream 0.2.2's prefill returns no first token: it
              comes from `generate`);
    insert    empties the slot (`reset_slots`) and appends the prompt to it
              with one `step` over the slots (only that row valid); the
              step's sample is dropped;
    generate  one `step` feeding each active slot's pending token, or with
              `tokens_per_step` k > 1 one `decode` loop of k tokens a slot.

  Every call samples with the engine's own params and key stream (the
  params JetStream passes are `load_params()`'s, the engine's own). Slots
  are freed by the next insert; JetStream 0.2.2 has no free call.

  `tokens_per_step` > 1 makes each `generate` call run the engine's jitted
  multi-token decode loop (`PolicyEngine.decode`) and return that many
  tokens a slot, through the Engine API's speculations axis (ResultTokens
  `[slots, k]` tokens and validity): JetStream's orchestrator streams them
  in order and stops a request at its first stop token, as it does for one
  token a call. The orchestrator's host work (queues, detokenising, gRPC)
  is then paid once per k tokens. A request's `max_tokens` is honoured to
  the chunk: when it is not a multiple of k, the chunk that would cross it
  is not sent (the request ends up to k - 1 tokens short, never over).
  """

  def __init__(
    self, engine: PolicyEngine, tokenizer, tokens_per_step: int = 1, ignore_eos: bool = False
  ):
    if tokens_per_step < 1:
      raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
    self._engine = engine
    self._tokenizer = tokenizer
    self._k = int(tokens_per_step)
    self._ignore_eos = ignore_eos

  @property
  def policy_engine(self) -> PolicyEngine:
    return self._engine

  def _check_params(self, params) -> None:
    if params is not None and params is not self._engine.params:
      raise ValueError("the bridge samples with the engine's own params (load_params())")

  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int):
    self._check_params(params)
    if true_length < 1:
      raise ValueError("prefill needs at least one token")
    tokens = np.asarray(padded_tokens, np.int32).reshape(-1)[:true_length]
    if existing_prefix is not None:  # its tokens and its pending token go in first
      tokens = np.concatenate(
        [
          np.asarray(existing_prefix.tokens, np.int32).reshape(-1),
          [int(existing_prefix.next_token)],
          tokens,
        ]
      ).astype(np.int32)
    return _Prefix(tokens[:-1], np.int32(tokens[-1]))

  def insert(self, prefix, decode_state, slot: int):
    head = np.asarray(prefix.tokens, np.int32).reshape(-1)
    slots = self._engine.max_concurrent_decodes
    row = np.arange(slots) == slot
    inner = self._engine.reset_slots(decode_state.inner, row)
    if len(head):
      tokens = np.zeros((slots, len(head)), np.int32)
      tokens[slot] = head
      inner, *_ = self._engine.step(inner, tokens, np.broadcast_to(row[:, None], tokens.shape))
    next_tokens, generated, active = (
      decode_state.next_tokens.copy(),
      decode_state.generated.copy(),
      decode_state.active.copy(),
    )
    next_tokens[slot], generated[slot], active[slot] = int(prefix.next_token), 0, True
    return _State(inner, next_tokens, generated, active)

  def generate(self, params, decode_state):
    self._check_params(params)
    k, inner, active = self._k, decode_state.inner, decode_state.active
    pending = decode_state.next_tokens
    if k == 1:
      inner, tok, _, _ = self._engine.step(inner, pending[:, None], active[:, None])
      pending = np.where(active, tok, pending).astype(np.int32)
      tokens, counts = pending[:, None], active.astype(np.int32)
    else:
      room = self._engine.max_prefill_length - 1 - inner.host_lengths
      budgets = np.where(active, np.clip(room, 0, k), 0).astype(np.int32)
      inner, chunk = self._engine.decode(inner, pending, budgets, steps=k)
      inner, chunk = self._engine.collect(inner, chunk)
      tokens, counts = chunk.tokens.astype(np.int32), chunk.counts
      last = tokens[np.arange(len(counts)), np.maximum(counts - 1, 0)]
      pending = np.where(counts > 0, last, pending).astype(np.int32)
    generated = decode_state.generated + counts
    valid = (np.arange(k)[None, :] < counts[:, None]).astype(np.int32)
    data = np.concatenate([tokens, valid, generated[:, None]], axis=1)  # [slots, 2k + 1]
    return _State(inner, pending, generated, active), engine_api.ResultTokens(
      data=data,
      tokens_idx=(0, k),
      valid_idx=(k, 2 * k),
      length_idx=(2 * k, 2 * k + 1),
      samples_per_slot=1,
    )

  def load_params(self, *args, **kwargs):
    del args, kwargs
    return self._engine.params

  def get_prefix_destination_sharding(self) -> Any:
    return None

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path="sao-jax-tokenizer")

  def build_tokenizer(self, metadata) -> tokenizer_api.Tokenizer:
    del metadata
    return JetStreamTokenizer(self._tokenizer, ignore_eos=self._ignore_eos)

  def init_decode_state(self, *args, **kwargs):
    del args, kwargs
    state = self._engine.init_decode_state()
    slots = self._engine.max_concurrent_decodes
    return _State(
      state, np.zeros((slots,), np.int32), np.zeros((slots,), np.int32), np.zeros((slots,), bool)
    )

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
    return self._engine.mesh

  @property
  def colocated_cpus(self):
    return None


class _Server(server_lib.JetStreamServer):
  """JetStream 0.2.2's server bound to `host:port`.

  `server_lib.JetStreamServer` always binds `[::]` (every interface); this
  is its constructor with the address as an argument, and its start / stop
  unchanged.
  """

  def __init__(self, driver: orchestrator.Driver, threads: int, host: str, port: int, credentials):
    self._executor = futures.ThreadPoolExecutor(max_workers=threads)
    self._loop = asyncio.new_event_loop()
    self._loop.set_default_executor(self._executor)
    self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True)
    self._loop_thread.start()

    async def make_server():
      return grpc.aio.server(self._executor)

    self._grpc_server = asyncio.run_coroutine_threadsafe(make_server(), self._loop).result()
    self._driver = driver
    jetstream_pb2_grpc.add_OrchestratorServicer_to_server(
      orchestrator.LLMOrchestrator(driver=driver), self._grpc_server
    )
    address = host.strip("[]")
    address = f"[{address}]" if ":" in address else address
    self._grpc_server.add_secure_port(f"{address}:{port}", credentials)


def serve(
  engine: JetStreamEngine, port: int, threads: int = 4, host: str = LOOPBACK_HOST
) -> server_lib.JetStreamServer:
  """Starts JetStream's gRPC server over `engine` on `host:port`.

  Plain-text gRPC without authentication, so the default is loopback only;
  any other `host` logs `exposure_warning(host)`.
  """
  warning = exposure_warning(host)
  if warning:
    logging.warning("%s", warning)
  params = engine.load_params()
  driver = orchestrator.Driver(
    prefill_engines=[engine],
    generate_engines=[engine],
    prefill_params=[params],
    generate_params=[params],
    interleaved_mode=True,
  )
  server = _Server(driver, threads, host, port, grpc.insecure_server_credentials())
  server.start()
  return server
