"""Serves a run's policy: JetStream's gRPC server, or an OpenAI-compatible HTTP endpoint.

    python launch/serve.py --config=configs/sao_tiny.py --workdir=workdirs/sao_tiny --port=9000
    python launch/serve.py --api=openai --config=configs/math_tool_tiny.py \\
        --workdir=workdirs/math_tool_tiny --port=8000

Loads the latest checkpoint's policy (fresh params if the workdir has none)
and serves it until interrupted on `--host` (default 127.0.0.1: this machine
only). Neither endpoint has TLS; a host beyond loopback (`--host=0.0.0.0`)
logs a warning saying so.

`--api=jetstream` (the default; needs the `jetstream` extra): query it with
JetStream's own client, e.g. `jetstream.core.proto.jetstream_pb2_grpc.
OrchestratorStub(channel).Decode(DecodeRequest(text_content=...))`.

`--api=openai`: `/v1/chat/completions` (with tools, streaming, `n`),
`/v1/completions` and `/v1/models`, rendered with the run's chat format and
sampled by the run's engine (sao_jax/serving/openai_api.py has the routes
and fields). `POST /v1/sessions` opens a session and answers its `base_url`
(point a harness there; any API key unless `--api_key`) and its
`owner_secret`; every session is recorded token for token, and
`POST /v1/sessions/<id>/reward` with `{"reward": r}` and the header
`X-Session-Owner: <owner_secret>` (or `--owner_key`) ends it and writes its
trajectories to the run's fleet shards (`fleet.root`, default
`<workdir>/fleet`), which a trainer of the same config with
`--config.rl.mode=fleet` trains on. With `--follow_weights` it serves the
newest version that trainer publishes, as a rollout process does.
"""

import os
import sys
import threading
import time

from absl import flags, logging
from ml_collections import config_flags

from sao_jax.rollout import loopback
from sao_jax.train import configuration, factories, trainer
from sao_jax.transport import fleet

# --config files import the repository's `configs` package, which is not
# installed: this checkout's root joins sys.path, whatever the working directory.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory whose latest checkpoint to serve.")
_API = flags.DEFINE_enum(
  "api",
  "jetstream",
  ["jetstream", "openai"],
  "jetstream: JetStream's gRPC server; openai: the OpenAI-compatible "
  "HTTP endpoint that records sessions for training.",
)
_HOST = flags.DEFINE_string(
  "host",
  loopback.LOOPBACK_HOST,
  "Address to bind. Beyond loopback the endpoint is "
  "reachable by anyone on the network, unencrypted and (without --api_key) "
  "unauthenticated (a warning is logged).",
)
_PORT = flags.DEFINE_integer("port", 9000, "Port (gRPC or HTTP).")
_SLOTS = flags.DEFINE_integer("slots", 8, "Concurrent decode slots.")
_TOKENS_PER_STEP = flags.DEFINE_integer(
  "tokens_per_step",
  8,
  "Tokens per slot per engine decode call (JetStream: per generate "
  "call; 1: one token a call). Measured: benchmarks/RESULTS.md#serving-endpoint.",
)
_IGNORE_EOS = flags.DEFINE_bool(
  "ignore_eos",
  False,
  "JetStream, benchmarks only: no stop tokens, every request runs to max_tokens.",
)
_MODEL_NAME = flags.DEFINE_string(
  "model_name", "sao-jax", "openai: the name requests give as `model`."
)
_API_KEY = flags.DEFINE_string(
  "api_key", None, "openai: if set, requests must send `Authorization: Bearer <key>`."
)
_OWNER_KEY = flags.DEFINE_string(
  "owner_key",
  None,
  "openai: if set, `X-Session-Owner: <key>` may read, reward and delete "
  "any session (a driver's key; without it only the owner secret of each session, "
  "returned when it is opened, may).",
)
_WORKERS = flags.DEFINE_integer(
  "workers",
  None,
  "openai: requests served at once (default: "
  "4 per slot, at least 64); beyond them and 1024 waiting, a "
  "request is answered 503 with Retry-After.",
)
_BACKLOG = flags.DEFINE_integer(
  "backlog",
  1024,
  "openai: the listening socket's backlog (connections the kernel holds before they are accepted).",
)
_ROLLOUT_ID = flags.DEFINE_string(
  "rollout_id",
  "openai",
  "openai: the name of this server's trajectory shards under the fleet root.",
)
_MAX_SESSIONS = flags.DEFINE_integer("max_sessions", 1024, "openai: open sessions at most.")
_FOLLOW_WEIGHTS = flags.DEFINE_bool(
  "follow_weights",
  False,
  "openai: serve the newest policy version a fleet trainer "
  "(--config.rl.mode=fleet, the same fleet root) publishes, polled every "
  "fleet.poll_seconds, instead of the checkpoint loaded at start.",
)
_SESSION_IDLE_S = flags.DEFINE_float(
  "session_idle_s", 3600.0, "openai: a session unused this long is discarded (nothing written)."
)
flags.mark_flags_as_required(["config", "workdir"])


def _serve_jetstream(jetstream_bridge, run, engine):
  server = jetstream_bridge.serve(
    jetstream_bridge.JetStreamEngine(
      engine, run.tok, tokens_per_step=_TOKENS_PER_STEP.value, ignore_eos=_IGNORE_EOS.value
    ),
    _PORT.value,
    host=_HOST.value,
  )
  print(f"JetStream server on port {_PORT.value} ({_HOST.value})", flush=True)
  try:
    threading.Event().wait()
  finally:
    server.stop()


def _serve_openai(config, run, engine):
  from sao_jax.serving import openai_api

  root = fleet.root_of(config, _WORKDIR.value)
  endpoint = openai_api.Endpoint(
    config,
    engine,
    run.tok,
    root,
    host=_HOST.value,
    port=_PORT.value,
    model_name=_MODEL_NAME.value,
    api_key=_API_KEY.value,
    owner_key=_OWNER_KEY.value,
    rollout_id=_ROLLOUT_ID.value,
    max_sessions=_MAX_SESSIONS.value,
    idle_seconds=_SESSION_IDLE_S.value,
    decode_steps=_TOKENS_PER_STEP.value,
    follow_weights=_FOLLOW_WEIGHTS.value,
    workers=_WORKERS.value,
    backlog=_BACKLOG.value,
  )
  print(
    f"OpenAI-compatible endpoint at {endpoint.url}/v1 (model {_MODEL_NAME.value!r}, "
    f"policy version {engine.version}); open a session with POST {endpoint.url}/v1/sessions; "
    f"trajectories to {fleet.trajectories_dir(root)}",
    flush=True,
  )
  try:
    while not threading.Event().wait(config.fleet.poll_seconds):
      endpoint.rotate()  # a shard becomes visible by count or by age
      version = endpoint.poll_weights()
      if version is not None:
        print(f"serving policy version {version}", flush=True)
  finally:
    endpoint.close()


def main(argv):
  del argv
  bridge = None
  if _API.value == "jetstream":
    # Imported only here (it needs the jetstream extra), and before the verbosity
    # is set: importing jetstream sets up logging of its own.
    from sao_jax.serving import jetstream_bridge as bridge
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  run = trainer.load_run(config, _WORKDIR.value)
  # The run's engine (its rollout section: max_len, sampling, the cache) with
  # the server's slots: on rollout.mesh over this host's devices when the
  # config sets one, else on one device (factories.engine_mesh).
  # Serving for training data draws a new sample stream each launch (seed from the
  # clock); JetStream's demos keep seed 0.
  seed = time.time_ns() % (1 << 31) if _API.value == "openai" else 0
  engine = factories.make_engine(
    config, run.model_cfg, run.policy_params(), int(run.state.step), seed=seed, slots=_SLOTS.value
  )
  if _API.value == "openai":
    _serve_openai(config, run, engine)
  else:
    _serve_jetstream(bridge, run, engine)


if __name__ == "__main__":
  configuration.run(main)
