"""The policy behind JetStream's Engine API, served by JetStream's real gRPC server."""

import ipaddress
import os

import numpy as np
import pytest

pytest.importorskip("jetstream", reason="the 'jetstream' extra (make test installs it)")

import grpc
import jax
import portpicker
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
from jetstream.engine import engine_api

from sao_jax.config import sections
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy
from sao_jax.rollout import loopback
from sao_jax.rollout.engine import PolicyEngine
from sao_jax.serving import jetstream_bridge

TOK = CharTokenizer()
CFG = mcfg.tiny(vocab_size=TOK.vocab_size)


@pytest.fixture(scope="module")
def engine():
  params = policy.init_params(CFG, jax.random.key(0))
  return jetstream_bridge.JetStreamEngine(
    # top_k=1: greedy, so the stream can be checked token by token.
    PolicyEngine(CFG, params, sections.Rollout(slots=4, max_len=128, top_k=1), seed=1),
    TOK,
  )


def _teacher_forced_argmax(params, prompt, tokens):
  seq = np.concatenate([prompt, tokens]).astype(np.int32)
  n = len(seq)
  logits, _ = policy.Transformer(CFG).apply(
    {"params": params}, seq[None], np.arange(n)[None], np.ones((1, n), np.int32)
  )
  return np.argmax(np.asarray(logits)[0, len(prompt) - 1 : n - 1], -1)


def _start(js_engine, text: str, slot: int):
  """A fresh decode state with `text` prefilled into `slot`; (state, prompt ids)."""
  padded, true_length = js_engine.build_tokenizer(js_engine.get_tokenizer()).encode(
    text, max_prefill_length=64, jax_padding=False
  )
  state = js_engine.insert(
    js_engine.prefill(
      params=js_engine.load_params(), padded_tokens=padded, true_length=true_length
    ),
    js_engine.init_decode_state(),
    slot=slot,
  )
  return state, np.asarray(padded)[:true_length]


def test_is_a_jetstream_engine_and_matches_teacher_forcing(engine):
  assert isinstance(engine, engine_api.Engine)
  state, prompt = _start(engine, "12 plus 3\n", slot=2)
  tokens = []
  for _ in range(6):
    state, result = engine.generate(engine.load_params(), state)
    slot = result.get_result_at_slot(2)
    assert slot.valid[0, 0] == 1
    tokens.append(int(slot.tokens[0, 0]))
  assert int(result.get_result_at_slot(2).lengths[0]) == 6
  # Greedy decoding through the Engine API equals the teacher-forced argmax.
  np.testing.assert_array_equal(
    _teacher_forced_argmax(engine.load_params(), prompt, tokens), tokens
  )


def test_prefill_onto_an_existing_prefix_equals_one_prefill(engine):
  params = engine.load_params()
  head, tail, whole = (
    np.asarray(TOK.encode(t), np.int32) for t in ("12 pl", "us 3\n", "12 plus 3\n")
  )
  prefix = engine.prefill(params=params, padded_tokens=head, true_length=len(head))
  prefix = engine.prefill(
    params=params, existing_prefix=prefix, padded_tokens=tail, true_length=len(tail)
  )
  state = engine.insert(prefix, engine.init_decode_state(), slot=0)
  state = engine.insert(
    engine.prefill(params=params, padded_tokens=whole, true_length=len(whole)), state, slot=3
  )
  for _ in range(5):  # greedy: both slots hold the same sequence, so sample the same
    state, result = engine.generate(params, state)
    np.testing.assert_array_equal(
      result.get_result_at_slot(0).tokens, result.get_result_at_slot(3).tokens
    )


def test_several_tokens_per_generate_call_match_teacher_forcing(engine):
  multi = jetstream_bridge.JetStreamEngine(engine.policy_engine, TOK, tokens_per_step=4)
  state, prompt = _start(multi, "9 minus 4\n", slot=1)
  tokens = []
  for call in range(3):
    state, result = multi.generate(multi.load_params(), state)
    assert result.data.shape == (4, 2 * 4 + 1)
    slot = result.get_result_at_slot(1)
    assert slot.tokens.shape == (1, 4) and slot.valid.tolist() == [[1, 1, 1, 1]]
    assert int(slot.lengths[0]) == 4 * (call + 1)
    tokens += slot.tokens[0].tolist()
    # Slots never inserted stay idle: nothing valid, nothing generated.
    assert result.get_result_at_slot(0).valid.sum() == 0
  np.testing.assert_array_equal(_teacher_forced_argmax(multi.load_params(), prompt, tokens), tokens)


def test_several_tokens_per_call_stop_at_the_cache_end():
  params = policy.init_params(CFG, jax.random.key(0))
  multi = jetstream_bridge.JetStreamEngine(
    PolicyEngine(CFG, params, sections.Rollout(slots=2, max_len=16, top_k=1), seed=1),
    TOK,
    tokens_per_step=4,
  )
  state = multi.init_decode_state()
  state = multi.insert(
    multi.prefill(params=multi.load_params(), padded_tokens=np.arange(3, 10), true_length=7),
    state,
    slot=0,
  )
  valid = []
  for _ in range(4):
    state, result = multi.generate(multi.load_params(), state)
    valid.append(int(result.get_result_at_slot(0).valid.sum()))
  # 6 prompt tokens in the cache, one pending: room for 9 more (max_len 16), then none.
  assert valid == [4, 4, 1, 0]


def test_ignore_eos_declares_no_stop_tokens(engine):
  assert engine.build_tokenizer(None).stop_tokens == {TOK.eos_id, TOK.turn_end_id}
  quiet = jetstream_bridge.JetStreamEngine(engine.policy_engine, TOK, ignore_eos=True)
  assert quiet.build_tokenizer(None).stop_tokens == set()


def _stream(js_engine, text: str, max_tokens: int, check_health: bool = False) -> list[int]:
  """The token ids JetStream's real gRPC server streams for one request."""
  port = portpicker.pick_unused_port()
  server = jetstream_bridge.serve(js_engine, port)
  try:
    with grpc.insecure_channel(f"localhost:{port}") as channel:
      grpc.channel_ready_future(channel).result(timeout=30)
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      request = jetstream_pb2.DecodeRequest(
        text_content=jetstream_pb2.DecodeRequest.TextContent(text=text), max_tokens=max_tokens
      )
      token_ids = [
        t
        for r in stub.Decode(request, timeout=120)
        for s in r.stream_content.samples
        for t in s.token_ids
      ]
      if check_health:
        assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=30).is_live
      return token_ids
  finally:
    server.stop()


@pytest.mark.parametrize("max_tokens,expected", [(12, 12), (10, 8)])
def test_grpc_stream_with_several_tokens_per_call_honours_max_tokens(max_tokens, expected):
  params = policy.init_params(CFG, jax.random.key(0))
  multi = jetstream_bridge.JetStreamEngine(
    PolicyEngine(CFG, params, sections.Rollout(slots=4, max_len=128), seed=1),
    TOK,
    tokens_per_step=4,
    ignore_eos=True,
  )
  # Chunks of 4: never past max_tokens; short of it by the chunk that would cross it.
  assert len(_stream(multi, "7 times 3\n", max_tokens)) == expected


def test_grpc_server_streams_a_completion(engine):
  token_ids = _stream(engine, "7 times 3\n", 12, check_health=True)
  assert 1 <= len(token_ids) <= 13
  assert all(0 <= t < TOK.vocab_size for t in token_ids)


def _listening_addresses(port: int) -> set[str]:
  """The local addresses of this machine's listening TCP sockets on `port`."""
  found = set()
  for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
    try:
      with open(table) as f:
        rows = f.read().splitlines()[1:]
    except OSError:
      continue
    for row in rows:
      local, state = row.split()[1], row.split()[3]
      address, hex_port = local.split(":")
      if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
        # The kernel prints each 32-bit word of the address in host (little-endian) order.
        raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, width, 8))
        found.add(str(ipaddress.ip_address(raw)))
  return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_server_listens_on_loopback_only_by_default(engine):
  port = portpicker.pick_unused_port()
  server = jetstream_bridge.serve(engine, port)
  try:
    addresses = _listening_addresses(port)
  finally:
    server.stop()
  assert addresses, "nothing listens on the port"
  # gRPC may hold 127.0.0.1 on an IPv6 socket, listed as ::ffff:127.0.0.1.
  assert all(loopback.is_loopback(a) for a in addresses), addresses
  assert not addresses & {"0.0.0.0", "::"}


@pytest.mark.parametrize(
  "host,loopback",
  [
    ("127.0.0.1", True),
    ("127.0.1.1", True),
    ("::1", True),
    ("[::1]", True),
    ("::ffff:127.0.0.1", True),
    ("::ffff:10.0.0.1", False),
    ("localhost", True),
    ("LOCALHOST", True),
    ("0.0.0.0", False),
    ("::", False),
    ("[::]", False),
    ("10.1.2.3", False),
    ("192.168.0.7", False),
    ("fe80::1", False),
    ("example.com", False),
  ],
)
def test_exposure_warning_beyond_loopback(host, loopback):
  # Checks the address only: nothing is bound here.
  warning = jetstream_bridge.exposure_warning(host)
  assert (warning is None) == loopback
  if not loopback:
    assert "unauthenticated" in warning and "unencrypted" in warning and host in warning


def test_serve_logs_the_exposure_warning(monkeypatch):
  logged = []
  monkeypatch.setattr(jetstream_bridge.logging, "warning", lambda fmt, *a: logged.append(fmt % a))

  class Refused(Exception):
    pass

  class NoParams:  # stops serve() right after the warning, before anything binds
    def load_params(self):
      raise Refused

  with pytest.raises(Refused):
    jetstream_bridge.serve(NoParams(), 0, host="0.0.0.0")
  assert len(logged) == 1 and "unauthenticated" in logged[0]
  logged.clear()
  with pytest.raises(Refused):
    jetstream_bridge.serve(NoParams(), 0)
  assert not logged


def test_launch_serve_answers_on_localhost(tmp_path):
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  port = portpicker.pick_unused_port()
  proc = subprocess.Popen(
    [
      sys.executable,
      os.path.join(root, "launch", "serve.py"),
      f"--config={os.path.join(root, 'configs', 'sao_tiny.py')}",
      f"--workdir={tmp_path / 'serve'}",
      f"--port={port}",
      "--config.tensorboard=False",
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=dict(os.environ, PYTHONUNBUFFERED="1"),
  )
  try:
    for line in proc.stdout:  # blocks until the server says it is up (or exits)
      if "JetStream server on port" in line:
        break
    else:
      pytest.fail("serve.py exited before serving")
    with grpc.insecure_channel(f"localhost:{port}") as channel:
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      request = jetstream_pb2.DecodeRequest(
        text_content=jetstream_pb2.DecodeRequest.TextContent(text="4 plus 4\n"), max_tokens=8
      )
      n = sum(
        len(s.token_ids)
        for r in stub.Decode(request, timeout=120)
        for s in r.stream_content.samples
      )
      assert n >= 1
  finally:
    proc.kill()
    proc.wait()
