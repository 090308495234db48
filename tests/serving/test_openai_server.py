"""The OpenAI endpoint's server, API surface, owned sessions and hostile replies, over a fake
batcher (no model): what each request asked of the sampler is what the batcher received,
and what it returned is what the client read and the session recorded.

Each a test: 200 concurrent clients all answered (200, or 503 with
Retry-After, counted); sampling fields honoured or refused, streaming, n > 1,
top_logprobs, /health, /v1/models/{id}, /v1/completions; sessions owned by whoever
opened them; a reply with a lone surrogate answered, a reply not sent not recorded;
bad numbers 4xx.
"""

import concurrent.futures as cf
import http.client
import json
import socket
import struct
import threading

import httpx
import openai
import pytest

from sao_jax.envs import chat
from sao_jax.envs.tokenizer import TOKENIZERS
from sao_jax.serving import batcher as batcher_lib
from sao_jax.serving import http_server, openai_api, sessions

TOK = TOKENIZERS["qwen3"]()
FMT = chat.make_format("qwen3", TOK)
IM_END, CALL, CALL_END = 151645, 151657, 151658
MODEL = "fake"
MAX_LEN = 512
USER = [{"role": "user", "content": "hi"}]
HTTP = httpx.Client(timeout=60)  # one client: a new one per call costs ~0.1 s of CPU


class FakeBatcher:
  """`batcher.Batcher`'s API: every request answered with `reply(prompt, sampling)`'s ids
  (after `delay` seconds), log-probs -0.5 - 0.01 k, version 7; the submissions kept."""

  max_len = MAX_LEN
  generated_tokens = engine_errors = 0
  engine = type("E", (), {"version": 7})()

  def __init__(self, reply=None, delay: float = 0.0):
    self.reply = reply or (lambda prompt, sampling: TOK.encode("Hello there.") + [IM_END])
    self.delay, self.submitted, self.forgotten = delay, [], []
    self._lock = threading.Lock()

  def forget(self, prefix_key):
    self.forgotten.append(prefix_key)

  def counters(self):
    return {"prefill_reused": 5}

  def submit(self, prompt, max_new_tokens, *, sampling=None, prefix_key=None):
    with self._lock:
      self.submitted.append((list(prompt), max_new_tokens, sampling, prefix_key))
    ids = list(self.reply(prompt, sampling))[:max_new_tokens]
    top = sampling.top_logprobs if sampling else 0
    completion = batcher_lib.Completion(
      tuple(ids),
      tuple(-0.5 - 0.01 * k for k in range(len(ids))),
      (7,) * len(ids),
      ids[-1] == IM_END,
      tuple(tuple((t + j, -1.0 - j) for j in range(top)) for t in ids) if top else (),
    )
    future = cf.Future()
    if self.delay:
      threading.Timer(self.delay, future.set_result, (completion,)).start()
    else:
      future.set_result(completion)
    return future


def make_server(batcher=None, **server_kwargs):
  written = []
  book = sessions.SessionBook(FMT, TOK.vocab_size, MAX_LEN, written.append)
  book.written = written
  app = openai_api.OpenAIApp(
    batcher or FakeBatcher(),
    FMT,
    TOK,
    book,
    model_name=MODEL,
    max_turn_tokens=32,
    owner_key="driver",
  )
  return openai_api.Server(app, **server_kwargs)


@pytest.fixture
def server():
  s = make_server()
  yield s
  s.close()


def open_session(server):
  out = HTTP.post(f"{server.url}/v1/sessions").json()
  out["client"] = openai.OpenAI(base_url=out["base_url"], api_key="none", max_retries=0)
  return out


# --- 1. every connection answered ----------------------------------------------------------


def _hammer(url: str, clients: int) -> list:
  """`clients` connections at once, one chat request each: (status, Retry-After) or the
  exception a client got."""
  host, port = url.removeprefix("http://").split(":")
  body = json.dumps({"model": MODEL, "messages": USER, "max_tokens": 4})
  start = threading.Barrier(clients)

  def one(_):
    start.wait()
    try:
      conn = http.client.HTTPConnection(host, int(port), timeout=60)
      conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
      r = conn.getresponse()
      r.read()
      conn.close()
      return r.status, r.getheader("Retry-After")
    except Exception as e:  # noqa: BLE001  # a reset: what the test counts
      return repr(e)

  with cf.ThreadPoolExecutor(clients) as pool:
    return list(pool.map(one, range(clients)))


def test_200_concurrent_clients_are_each_answered_200_or_503_with_retry_after():
  small = make_server(FakeBatcher(delay=0.05), workers=4, max_pending=8)
  try:
    got = _hammer(small.url, 200)
    stats = small.app.stats()
  finally:
    small.close()
  failed = [g for g in got if not isinstance(g, tuple)]
  assert failed == []  # no connection reset, every client read a reply
  busy = [g for g in got if g[0] == 503]
  assert all(retry == "1" for _, retry in busy)
  assert {s for s, _ in got} <= {200, 503} and busy  # the pool of 4 + 8 was full
  assert stats["http/busy"] == len(busy) and stats["completions"] == 200 - len(busy)
  roomy = make_server(FakeBatcher(delay=0.05))  # the default pool holds them all
  try:
    assert _hammer(roomy.url, 200) == [(200, None)] * 200
    assert roomy.app.stats()["sessions/open"] == 200  # each its own session
  finally:
    roomy.close()


# --- 3. sessions owned by whoever opened them ------------------------------------------------


def test_sessions_are_owned_by_whoever_opened_them(server):
  url = server.url
  a, b = open_session(server), open_session(server)
  assert a["id"] != b["id"] and a["base_url"] == f"{url}/sessions/{a['id']}/{a['secret']}/v1"
  r = a["client"].chat.completions.create(model=MODEL, messages=USER)
  assert r.model_extra["sao"]["session_id"] == a["id"]
  chat_path = f"/sessions/{a['id']}/v1/chat/completions"
  body = {"model": MODEL, "messages": USER}
  for headers, status in (
    ({}, 403),
    ({"X-Session-Secret": b["secret"]}, 403),
    ({"X-Session-Secret": a["secret"]}, 200),
  ):
    assert HTTP.post(url + chat_path, json=body, headers=headers).status_code == status
  wrong = HTTP.post(f"{url}/sessions/{a['id']}/{b['secret']}/v1/chat/completions", json=body)
  assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "forbidden_session"
  # An id the server never issued (a harness naming its own) is not a session.
  assert (
    HTTP.post(
      f"{url}/sessions/mine/v1/chat/completions", json=body, headers={"X-Session-Secret": "x"}
    ).status_code
    == 404
  )
  reward = f"{url}/v1/sessions/{a['id']}/reward"
  for headers in ({}, {"X-Session-Owner": a["secret"]}, {"X-Session-Owner": b["owner_secret"]}):
    assert HTTP.post(reward, json={"reward": 1.0}, headers=headers).status_code == 403
  assert HTTP.get(f"{url}/v1/sessions/{a['id']}").status_code == 403
  assert HTTP.delete(f"{url}/v1/sessions/{a['id']}").status_code == 403
  out = HTTP.post(reward, json={"reward": 1.0}, headers={"X-Session-Owner": a["owner_secret"]})
  assert out.json()["written"] == 2 and len(server.app.book.written) == 2  # two histories
  # No session in the URL: a session of the request's own, never a shared one.
  plain = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
  ids = {
    plain.chat.completions.create(model=MODEL, messages=USER).model_extra["sao"]["session_id"]
    for _ in range(2)
  }
  assert len(ids) == 2 and "default" not in ids
  # The driver's owner key rewards any session.
  assert (
    HTTP.post(
      f"{url}/v1/sessions/{ids.pop()}/reward",
      json={"reward": 0.0},
      headers={"X-Session-Owner": "driver"},
    ).json()["written"]
    == 1
  )
  assert (
    HTTP.post(
      f"{url}/v1/sessions/{b['id']}/reward",
      json={"reward": 0.0},
      headers={"X-Session-Owner": "drivers"},
    ).status_code
    == 403
  )


def test_an_ended_session_releases_its_parked_cache_and_stats_show_the_batchers(server):
  """Rewarded and deleted sessions are forgotten by the batcher at once (their
  parked slots and pages freed for others), and /v1/stats carries the
  batcher's prefix counters."""
  a, b = open_session(server), open_session(server)
  for s in (a, b):
    s["client"].chat.completions.create(model=MODEL, messages=USER)
  owner = lambda s: {"X-Session-Owner": s["owner_secret"]}
  assert (
    HTTP.post(
      f"{server.url}/v1/sessions/{a['id']}/reward", json={"reward": 1.0}, headers=owner(a)
    ).status_code
    == 200
  )
  assert HTTP.delete(f"{server.url}/v1/sessions/{b['id']}", headers=owner(b)).status_code == 200
  assert server.app.batcher.forgotten == [a["id"], b["id"]]
  assert HTTP.get(f"{server.url}/v1/stats").json()["batcher/prefill_reused"] == 5


# --- 2. the API surface -------------------------------------------------------------------


def test_sampling_fields_reach_the_batcher_and_n_choices_are_trajectories_of_their_own():
  batcher = FakeBatcher(
    lambda prompt, sampling: TOK.encode(f"seed {sampling.seed if sampling else None}") + [IM_END]
  )
  server = make_server(batcher)
  try:
    a = open_session(server)
    r = a["client"].chat.completions.create(
      model=MODEL,
      messages=USER,
      temperature=0,
      top_p=0.5,
      seed=11,
      n=3,
      logprobs=True,
      top_logprobs=2,
      extra_body={"stop_token_ids": [13]},
    )
    (_, _, sampling, key), *rest = batcher.submitted
    assert sampling == batcher_lib.RequestSampling(
      temperature=0.0, top_p=0.5, seed=11, stop_ids=(13,), top_logprobs=2
    )
    assert key == a["id"] and [s.seed for _, _, s, _ in rest] == [12, 13]
    assert [c.message.content for c in r.choices] == ["seed 11", "seed 12", "seed 13"]
    top = r.choices[0].logprobs.content[0].top_logprobs
    first = TOK.encode("seed 11")[0]
    assert [(t.token, t.logprob) for t in top] == [
      (TOK.decode([first]), -1.0),
      (TOK.decode([first + 1]), -2.0),
    ]
    assert r.model_extra["sao"]["trajectories"] == [0, 1, 2]
    # The harness goes on with the second choice: its trajectory is extended.
    history = USER + [
      {"role": "assistant", "content": "seed 12"},
      {"role": "user", "content": "more"},
    ]
    r2 = a["client"].chat.completions.create(model=MODEL, messages=history)
    assert (r2.model_extra["sao"]["trajectory"], r2.model_extra["sao"]["extended"]) == (1, True)
    assert batcher.submitted[-1][2] is None  # nothing set: the run's sampling
    info = HTTP.get(
      f"{server.url}/v1/sessions/{a['id']}", headers={"X-Session-Owner": a["owner_secret"]}
    ).json()
    assert [t["turns"] for t in info["trajectories"]] == [1, 2, 1]
  finally:
    server.close()


def test_a_stop_string_cuts_the_reply_and_the_recorded_turn(server):
  a = open_session(server)
  batcher = server.app.batcher
  batcher.reply = lambda prompt, sampling: TOK.encode("one two END three four") + [IM_END]
  r = a["client"].chat.completions.create(
    model=MODEL, messages=USER, stop=["END", "zzz"], extra_body={"return_token_ids": True}
  )
  assert r.choices[0].message.content == "one two " and r.choices[0].finish_reason == "stop"
  ids = r.model_extra["sao"]["completion_token_ids"]
  assert "END" in TOK.decode(ids) and "three" not in TOK.decode(ids)
  assert "END" not in TOK.decode(ids[:-1])  # the shortest prefix holding the stop string
  HTTP.post(
    f"{server.url}/v1/sessions/{a['id']}/reward",
    json={"reward": 1.0},
    headers={"X-Session-Owner": a["owner_secret"]},
  )
  (t,) = server.app.book.written
  assert list(t.tokens[t.action_mask]) == ids
  # Without a stop string in the reply nothing is cut.
  r = open_session(server)["client"].chat.completions.create(model=MODEL, messages=USER, stop="zzz")
  assert r.choices[0].message.content == "one two END three four"


def test_streamed_chat_and_completions_are_openais_chunks_then_done(server):
  a = open_session(server)
  stream = a["client"].chat.completions.create(
    model=MODEL, messages=USER, stream=True, logprobs=True, stream_options={"include_usage": True}
  )
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ("Hello there.")
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
  assert (
    chunks[-1].choices == []
    and chunks[-1].usage.completion_tokens == len(TOK.encode("Hello there.")) + 1
  )
  raw = HTTP.post(
    f"{server.url}/v1/completions",
    json={"model": MODEL, "prompt": [11, 12, 13], "stream": True, "max_tokens": 3},
  )
  assert raw.headers["content-type"] == "text/event-stream"
  events = [line[6:] for line in raw.text.splitlines() if line.startswith("data: ")]
  assert events[-1] == "[DONE]"
  texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
  assert "".join(texts) == TOK.decode(TOK.encode("Hello there.")[:3])
  info = HTTP.get(
    f"{server.url}/v1/sessions/{a['id']}", headers={"X-Session-Owner": a["owner_secret"]}
  ).json()
  assert info["requests"] == 1  # the stream was sent whole, then recorded


def test_health_models_by_id_and_completions_of_token_ids(server):
  url = server.url
  assert HTTP.get(f"{url}/health").json() == {"status": "ok"}
  assert HTTP.get(f"{url}/v1/models/{MODEL}").json()["id"] == MODEL
  missing = HTTP.get(f"{url}/v1/models/gpt-4")
  assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
  a = open_session(server)
  c = a["client"]
  r = c.completions.create(model=MODEL, prompt=[11, 12, 13], logprobs=2, max_tokens=2)
  ids = TOK.encode("Hello there.")[:2]
  assert r.choices[0].text == TOK.decode(ids) and r.choices[0].finish_reason == "length"
  assert r.choices[0].logprobs.token_logprobs == pytest.approx([-0.5, -0.51])
  assert r.choices[0].logprobs.top_logprobs[0] == {
    TOK.decode([ids[0]]): -1.0,
    TOK.decode([ids[0] + 1]): -2.0,
  }
  # The next prompt holds the served ids: the same trajectory goes on.
  r = c.completions.create(model=MODEL, prompt=[11, 12, 13] + ids + [14], max_tokens=2)
  assert (r.model_extra["sao"]["trajectory"], r.model_extra["sao"]["extended"]) == (0, True)
  assert c.completions.create(model=MODEL, prompt="Say hi", max_tokens=1).choices[0].text
  bad = HTTP.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [11, -1]})
  assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_prompt"


def test_unsupported_fields_are_refused_in_one_line_and_neutral_ones_accepted(server):
  url = f"{server.url}/v1/chat/completions"
  refused = {
    "logit_bias": {"11": 3},
    "frequency_penalty": 0.5,
    "presence_penalty": -1,
    "response_format": {"type": "json_object"},
    "n": 17,
    "top_k": 5,
    "top_logprobs": 3,
    "stream_options": {"include_usage": True},
    "modalities": ["audio"],
    "stop": [""],
    "temperature": 2.5,
    "top_p": 0,
  }
  for field, value in refused.items():
    r = HTTP.post(url, json={"model": MODEL, "messages": USER, field: value})
    assert r.status_code == 400, field
    message = r.json()["error"]["message"]
    assert field in message and "\n" not in message, field
  neutral = {
    "logit_bias": {},
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "response_format": {"type": "text"},
    "user": "me",
    "n": 1,
    "stream": False,
  }
  assert HTTP.post(url, json={"model": MODEL, "messages": USER, **neutral}).status_code == 200
  assert server.app.stats()["ignored/user"] == 1


# --- 4. replies the model can break, numbers the client can break ----------------------------

BASH = {
  "type": "function",
  "function": {
    "name": "bash",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
  },
}


def test_a_sampled_lone_surrogate_is_answered(server):
  a = open_session(server)
  call = '\n{"name": "bash", "arguments": {"command": "echo \\ud800"}}\n'
  server.app.batcher.reply = lambda prompt, sampling: [CALL] + TOK.encode(call) + [CALL_END, IM_END]
  r = a["client"].chat.completions.create(model=MODEL, messages=USER, tools=[BASH])
  assert r.choices[0].message.tool_calls is None  # not a call the harness could run
  assert server.app.stats()["tool_call_errors/bad_json"] == 1
  # Whatever a string holds, the reply encodes: lone surrogates become U+FFFD, and so in
  # what a session compares the client's next request with.
  assert http_server.encode_json({"a": ["x\ud800y"]}) == '{"a": ["x\ufffdy"]}'.encode()
  assert http_server.clean_text({"k": ["\udfff"]}) == {"k": ["\ufffd"]}


def test_a_reply_not_sent_records_nothing():
  server = make_server(FakeBatcher(delay=0.3))
  try:
    a = open_session(server)
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "messages": USER}).encode()
    with socket.create_connection((host, int(port))) as conn:
      conn.sendall(
        b"POST /sessions/%s/%s/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (a["id"].encode(), a["secret"].encode(), len(body), body)
      )
      conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    # The client reset its connection while the batcher sampled: the write fails.
    owner = {"X-Session-Owner": a["owner_secret"]}
    for _ in range(100):
      if server.app.stats().get("replies/write_failed"):
        break
      threading.Event().wait(0.05)
    assert server.app.stats()["replies/write_failed"] == 1
    assert HTTP.get(f"{server.url}/v1/sessions/{a['id']}", headers=owner).json()["requests"] == 0
    # A reply that cannot be encoded (a NaN log-prob) is a 500, and records nothing.
    nan = FakeBatcher()
    nan.submit = lambda *args, **kw: _done(
      batcher_lib.Completion((11, IM_END), (float("nan"), -1.0), (7, 7), True)
    )
    server.app.batcher = nan
    r = HTTP.post(
      f"{a['base_url']}/chat/completions",
      json={"model": MODEL, "messages": USER, "return_token_ids": True},
    )
    assert r.status_code == 500 and server.app.stats()["replies/unencodable"] == 1
    assert HTTP.get(f"{server.url}/v1/sessions/{a['id']}", headers=owner).json()["requests"] == 0
  finally:
    server.close()


def _done(value):
  future = cf.Future()
  future.set_result(value)
  return future


@pytest.mark.parametrize(
  "body",
  [
    b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1'
    + b"0" * 5000
    + b"}",
    b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
    b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "top_p": 1e999}',
    b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "temperature": true}',
    b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": true}',
    b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "n": false}',
    b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "seed": -1}',
    b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "seed": 1.5}',
    b'{"model": "fake", "prompt": [1' + b"0" * 5000 + b"]}",
  ],
)
def test_bad_numbers_are_400s(server, body):
  path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
  r = HTTP.post(server.url + path, content=body)
  assert r.status_code == 400 and r.json()["error"]["code"].startswith("bad_")


def test_an_engine_failure_after_the_stream_began_is_its_last_event(server):
  a = open_session(server)
  failing = FakeBatcher()
  failing.submit = lambda *args, **kw: _failed(RuntimeError("device lost"))
  server.app.batcher = failing
  raw = HTTP.post(
    f"{a['base_url']}/chat/completions", json={"model": MODEL, "messages": USER, "stream": True}
  )
  events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: ")]
  assert events[0]["choices"][0]["delta"]["role"] == "assistant"
  assert events[-1]["error"]["code"] == "engine_error" and len(events) == 2
  assert server.app.stats()["errors/engine_error"] == 1
  assert (
    HTTP.get(
      f"{server.url}/v1/sessions/{a['id']}", headers={"X-Session-Owner": a["owner_secret"]}
    ).json()["requests"]
    == 0
  )


def _failed(error):
  future = cf.Future()
  future.set_exception(error)
  return future
