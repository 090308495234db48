"""Serves a policy through JetStream's gRPC server (evaluation and demos).

    python launch/serve.py --config=configs/sao_tiny.py --workdir=workdirs/sao_tiny --port=9000

Loads the latest checkpoint's policy (fresh params if the workdir has none)
and serves it until interrupted on `--host` (default 127.0.0.1: this machine
only). The endpoint has no authentication and no TLS; a host beyond loopback
(`--host=0.0.0.0`) logs a warning saying so. Needs the `jetstream` extra.
Query it with JetStream's own client, e.g. `jetstream.core.proto.jetstream_pb2_grpc.
OrchestratorStub(channel).Decode(DecodeRequest(text_content=...))`.
"""

import threading

from absl import flags, logging
from ml_collections import config_flags

from sao_jax import configuration, factories, trainer
from sao_jax.rollout import jetstream_bridge

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory whose latest checkpoint to serve.")
_HOST = flags.DEFINE_string(
    "host", jetstream_bridge.LOOPBACK_HOST, "Address to bind. Beyond loopback the endpoint is "
    "reachable by anyone on the network, unauthenticated and unencrypted (a warning is logged).")
_PORT = flags.DEFINE_integer("port", 9000, "gRPC port.")
_SLOTS = flags.DEFINE_integer("slots", 8, "Concurrent decode slots.")
_TOKENS_PER_STEP = flags.DEFINE_integer(
    "tokens_per_step", 8, "Tokens per slot per JetStream generate call (the engine's jitted "
    "decode loop; 1: one token a call). See benchmarks/RESULTS.md, serving.")
_IGNORE_EOS = flags.DEFINE_bool(
    "ignore_eos", False, "Benchmarks only: no stop tokens, every request runs to max_tokens.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  run = trainer.load_run(_CONFIG.value, _WORKDIR.value)
  # The run's engine (its rollout section: max_len, sampling, the cache) with
  # the server's slots: on rollout.mesh over this host's devices when the
  # config sets one, else on one device (factories.engine_mesh).
  engine = factories.make_engine(_CONFIG.value, run.model_cfg, run.state.policy, seed=0,
                                 slots=_SLOTS.value)
  server = jetstream_bridge.serve(jetstream_bridge.JetStreamEngine(
      engine, run.tok, tokens_per_step=_TOKENS_PER_STEP.value, ignore_eos=_IGNORE_EOS.value), _PORT.value,
      host=_HOST.value)
  print(f"JetStream server on port {_PORT.value} ({_HOST.value})", flush=True)
  try:
    threading.Event().wait()
  finally:
    server.stop()


if __name__ == "__main__":
  configuration.run(main)
