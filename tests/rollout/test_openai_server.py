"""The OpenAI endpoint's server, API surface, owned sessions and hostile replies, over a fake
batcher (no model): what each request asked of the sampler is what the batcher received,
and what it returned is what the client read and the session recorded.

Issue 60's findings, each a test: 200 concurrent clients all answered (200, or 503 with
Retry-After, counted); sampling fields honoured or refused, streaming, n > 1,
top_logprobs, /health, /v1/models/{id}, /v1/completions; sessions owned by whoever
opened them; a reply with a lone surrogate answered, a reply not sent not recorded;
bad numbers 4xx.
"""

import concurrent.futures as cf
import http.client
import json
import threading

import httpx
import openai
import pytest

from sao_jax.envs import chat
from sao_jax.envs.tokenizer import TOKENIZERS
from sao_jax.rollout import http_server, openai_api, serving, sessions

TOK = TOKENIZERS["qwen3"]()
FMT = chat.make_format("qwen3", TOK)
IM_END, CALL, CALL_END = 151645, 151657, 151658
MODEL = "fake"
MAX_LEN = 512
USER = [{"role": "user", "content": "hi"}]


class FakeBatcher:
  """`serving.Batcher`'s API: every request answered with `reply(prompt, sampling)`'s ids
  (after `delay` seconds), log-probs -0.5 - 0.01 k, version 7; the submissions kept."""

  max_len = MAX_LEN
  generated_tokens = engine_errors = 0
  engine = type("E", (), {"version": 7})()

  def __init__(self, reply=None, delay: float = 0.0):
    self.reply = reply or (lambda prompt, sampling: TOK.encode("Hello there.") + [IM_END])
    self.delay, self.submitted = delay, []
    self._lock = threading.Lock()

  def submit(self, prompt, max_new_tokens, *, sampling=None, prefix_key=None):
    with self._lock:
      self.submitted.append((list(prompt), max_new_tokens, sampling, prefix_key))
    ids = list(self.reply(prompt, sampling))[:max_new_tokens]
    top = sampling.top_logprobs if sampling else 0
    completion = serving.Completion(
        tuple(ids), tuple(-0.5 - 0.01 * k for k in range(len(ids))), (7,) * len(ids),
        ids[-1] == IM_END,
        tuple(tuple((t + j, -1.0 - j) for j in range(top)) for t in ids) if top else ())
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
  app = openai_api.OpenAIApp(batcher or FakeBatcher(), FMT, TOK, book, model_name=MODEL,
                             max_turn_tokens=32, owner_key="driver")
  return openai_api.Server(app, **server_kwargs)


@pytest.fixture
def server():
  s = make_server()
  yield s
  s.close()


def open_session(server):
  out = httpx.post(f"{server.url}/v1/sessions").json()
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
      conn.request("POST", "/v1/chat/completions", body,
                   {"Content-Type": "application/json"})
      r = conn.getresponse()
      r.read()
      conn.close()
      return r.status, r.getheader("Retry-After")
    except Exception as e:  # pylint: disable=broad-except  # a reset: what the test counts
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
  for headers, status in (({}, 403), ({"X-Session-Secret": b["secret"]}, 403),
                          ({"X-Session-Secret": a["secret"]}, 200)):
    assert httpx.post(url + chat_path, json=body, headers=headers).status_code == status
  wrong = httpx.post(f"{url}/sessions/{a['id']}/{b['secret']}/v1/chat/completions", json=body)
  assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "forbidden_session"
  # An id the server never issued (a harness naming its own) is not a session.
  assert httpx.post(f"{url}/sessions/mine/v1/chat/completions", json=body,
                    headers={"X-Session-Secret": "x"}).status_code == 404
  reward = f"{url}/v1/sessions/{a['id']}/reward"
  for headers in ({}, {"X-Session-Owner": a["secret"]}, {"X-Session-Owner": b["owner_secret"]}):
    assert httpx.post(reward, json={"reward": 1.0}, headers=headers).status_code == 403
  assert httpx.get(f"{url}/v1/sessions/{a['id']}").status_code == 403
  assert httpx.delete(f"{url}/v1/sessions/{a['id']}").status_code == 403
  out = httpx.post(reward, json={"reward": 1.0}, headers={"X-Session-Owner": a["owner_secret"]})
  assert out.json()["written"] == 2 and len(server.app.book.written) == 2  # two histories
  # No session in the URL: a session of the request's own, never a shared one.
  plain = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
  ids = {plain.chat.completions.create(model=MODEL, messages=USER).model_extra["sao"][
      "session_id"] for _ in range(2)}
  assert len(ids) == 2 and "default" not in ids
  # The driver's owner key rewards any session.
  assert httpx.post(f"{url}/v1/sessions/{ids.pop()}/reward", json={"reward": 0.0},
                    headers={"X-Session-Owner": "driver"}).json()["written"] == 1
  assert httpx.post(f"{url}/v1/sessions/{b['id']}/reward", json={"reward": 0.0},
                    headers={"X-Session-Owner": "drivers"}).status_code == 403
