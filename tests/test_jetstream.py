"""The policy behind JetStream's Engine API, served by JetStream's real gRPC server."""

import numpy as np
import pytest

pytest.importorskip("jetstream", reason="the 'jetstream' extra (make test installs it)")

import grpc  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import portpicker  # pylint: disable=g-import-not-at-top,wrong-import-position

from sao_jax.envs.tokenizer import CharTokenizer  # pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax.models import config as mcfg  # pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax.models import policy  # pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax.rollout import jetstream_bridge  # pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax.rollout.engine import PolicyEngine, SamplingConfig  # pylint: disable=g-import-not-at-top,wrong-import-position
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # pylint: disable=g-import-not-at-top,wrong-import-position
from jetstream.engine import engine_api  # pylint: disable=g-import-not-at-top,wrong-import-position

TOK = CharTokenizer()
CFG = mcfg.tiny(vocab_size=TOK.vocab_size)


@pytest.fixture(scope="module")
def engine():
  params = policy.init_params(CFG, jax.random.key(0))
  return jetstream_bridge.JetStreamEngine(
      # top_k=1: greedy, so the stream can be checked token by token.
      PolicyEngine(CFG, params, slots=4, max_len=128, seed=1,
                   sampling=SamplingConfig(top_k=1)), TOK)


def test_is_a_jetstream_engine_and_matches_teacher_forcing(engine):
  assert isinstance(engine, engine_api.Engine)
  padded, true_length = engine.build_tokenizer(engine.get_tokenizer()).encode(
      "12 plus 3\n", max_prefill_length=64, jax_padding=False)
  state = engine.init_decode_state()
  state = engine.insert(engine.prefill(params=engine.load_params(), padded_tokens=padded,
                                       true_length=true_length), state, slot=2)
  tokens = []
  for _ in range(6):
    state, result = engine.generate(engine.load_params(), state)
    slot = result.get_result_at_slot(2)
    assert slot.valid[0, 0] == 1
    tokens.append(int(slot.tokens[0, 0]))
  assert int(result.get_result_at_slot(2).lengths[0]) == 6
  # Greedy decoding through the Engine API equals the teacher-forced argmax.
  seq = np.concatenate([np.asarray(padded)[:true_length], tokens]).astype(np.int32)
  n = len(seq)
  logits, _ = policy.Transformer(CFG).apply({"params": engine.load_params()}, seq[None],
                                            np.arange(n)[None], np.ones((1, n), np.int32))
  np.testing.assert_array_equal(np.argmax(np.asarray(logits)[0, true_length - 1:n - 1], -1),
                                tokens)


def test_grpc_server_streams_a_completion(engine):
  port = portpicker.pick_unused_port()
  server = jetstream_bridge.serve(engine, port)
  try:
    with grpc.insecure_channel(f"localhost:{port}") as channel:
      grpc.channel_ready_future(channel).result(timeout=30)
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      request = jetstream_pb2.DecodeRequest(
          text_content=jetstream_pb2.DecodeRequest.TextContent(text="7 times 3\n"),
          max_tokens=12)
      token_ids = []
      for response in stub.Decode(request, timeout=120):
        for sample in response.stream_content.samples:
          token_ids.extend(sample.token_ids)
      assert 1 <= len(token_ids) <= 13
      assert all(0 <= t < TOK.vocab_size for t in token_ids)
      health = stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=30)
      assert health.is_live
  finally:
    server.stop()


def test_launch_serve_answers_on_localhost(tmp_path):
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  port = portpicker.pick_unused_port()
  proc = subprocess.Popen(
      [sys.executable, os.path.join(root, "launch", "serve.py"),
       f"--config={os.path.join(root, 'configs', 'sao_tiny.py')}",
       f"--workdir={tmp_path / 'serve'}", f"--port={port}", "--config.tensorboard=False"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env=dict(os.environ, PYTHONUNBUFFERED="1"))
  try:
    for line in proc.stdout:  # blocks until the server says it is up (or exits)
      if "JetStream server on port" in line:
        break
    else:
      pytest.fail("serve.py exited before serving")
    with grpc.insecure_channel(f"localhost:{port}") as channel:
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      request = jetstream_pb2.DecodeRequest(
          text_content=jetstream_pb2.DecodeRequest.TextContent(text="4 plus 4\n"),
          max_tokens=8)
      n = sum(len(s.token_ids) for r in stub.Decode(request, timeout=120)
              for s in r.stream_content.samples)
      assert n >= 1
  finally:
    proc.kill()
    proc.wait()
