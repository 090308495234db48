"""An OpenAI-compatible endpoint over the policy, recording what it serves for RL.

Any agent harness that speaks OpenAI's chat completions API (mini-swe-agent,
OpenHands, a script with the `openai` client) can drive the policy here,
and every session it runs becomes training data: `launch/serve.py
--api=openai` serves a run's policy (its latest checkpoint, or fresh params)
through the run's own engine (`PolicyEngine`, continuously batched by
`batcher.Batcher`) and renders messages with the run's chat format, the
renderer the trainer's rollouts use, token for token. Sessions are
recorded by `sessions.py`'s rule and written, once their owner posts the
reward, to the fleet's trajectory shards, which a trainer in `rl.mode =
"fleet"` reads and validates like any rollout process's.

Routes:

    POST   /v1/sessions                      opens a session: {"id", "secret",
                                             "owner_secret", "base_url"}
    POST   {base}/chat/completions           a session's request, where {base} is
    POST   {base}/completions                the session's base_url,
                                             /sessions/{id}/{secret}/v1, or
                                             /sessions/{id}/v1 with the header
                                             X-Session-Secret: {secret}
    POST   /v1/chat/completions, /v1/completions
                                             a session of the request's own (its
                                             id and secrets in the reply's `sao`)
    GET    /v1/models, /v1/models/{model}    the served model (404 another)
    GET    /health                           {"status": "ok"} (no key needed)
    POST   /v1/sessions/{id}/reward  {"reward": float, "prompt_id": int?}
                                             ends the session: its trajectories
                                             are written
    DELETE /v1/sessions/{id}                 ends it, writes nothing
    GET    /v1/sessions/{id}                 its trajectories and requests
    GET    /v1/stats                         every counter below

The last three need the owner: the header `X-Session-Owner:
{owner_secret}`, or the server's `owner_key` (a driver that rewards every
session). A session's request without its secret is 403; an id the server
never issued is 404. Whoever opens a session owns it, and the harness is
given only its base URL, so it can sample but not reward.

Requests (`openai_request.py` has the rules): a chat completion takes
`messages` (system / developer / user / assistant / tool; text content or
text parts) and `tools` (function schemas); both kinds take `temperature`
(0: greedy), `top_p`, `seed`, `stop` (strings, cut on the server) and
`stop_token_ids`, `n` (each choice its own trajectory), `stream` (server-sent
events in OpenAI's chunk format, `data: [DONE]` last,
`stream_options.include_usage`), `logprobs` / `top_logprobs`, `max_tokens`
(default `rollout.max_turn_tokens`; cut to the room left in
`rollout.max_len`) and, beyond OpenAI's fields, `return_token_ids` (the
prompt and completion ids, in the reply's `sao` object). `/v1/completions`
takes a `prompt` of token ids or text. What is not supported is refused in
one line (400), never dropped. A chat reply carries the assistant message's
`content`, `tool_calls` (parsed from the sampled ids) and
`reasoning_content`, `finish_reason` and `usage`; its `sao` object says where
the tokens were recorded (session, trajectory, turn, extended) and the
policy version. A stream is sent once the completion is sampled (the role
chunk first, at once), not token by token.

A turn is recorded only once its reply was sent whole; a reply that could
not be encoded or written records nothing (counted `replies/<reason>`).
Every refusal is OpenAI's error object (`{"error": {"message", "type",
"param", "code"}}`) with its status (400, 401 bad key, 403 a session's
secret missing or wrong, 404 unknown model / session / route, 405, 411,
413, 429 too many sessions, 503 busy or queue full, with `Retry-After`, 500
an engine failure) and is counted (`errors/<reason>`); the HTTP layer
(`http_server.py`: a listen backlog, a bounded worker pool) counts its own
(`http/<reason>`). No request can stop the server.

The server has no TLS and, without `api_key`, no authentication, so it
binds 127.0.0.1 unless told otherwise (`loopback.exposure_warning`).
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import re
import threading
import time
import uuid

from absl import logging

from sao_jax.data import identity
from sao_jax.envs import registry
from sao_jax.rollout import backends, loopback
from sao_jax.serving import batcher as batcher_lib
from sao_jax.serving import http_server, openai_reply, sessions
from sao_jax.serving import openai_request as rq
from sao_jax.serving.openai_request import ApiError, parse_messages, parse_tools
from sao_jax.transport import fleet

_PATH = re.compile(
  r"^(?:/sessions/([^/]+)(?:/([^/]+))?)?/v1/(chat/completions|completions|"
  r"models)(?:/(.+?))?/?$"
)
_SESSION_PATH = re.compile(r"^/v1/sessions(?:/([^/]+)(/reward)?)?/?$")


class OpenAIApp:
  """The endpoint's logic, apart from HTTP: `handle(method, path, headers, body, out)`.

  Args:
    batcher: `batcher.Batcher` over the run's engine.
    chat_format: the run's chat format (`registry.make_format(config.env, tok)`).
    tokenizer: the run's tokenizer.
    book: `sessions.SessionBook`, which validates and writes trajectories.
    model_name: the name `model` must give (and `/v1/models` lists).
    max_turn_tokens: the completion budget when a request sets none.
    api_key: if set, requests must send `Authorization: Bearer <api_key>`.
    owner_key: if set, `X-Session-Owner: <owner_key>` may read, reward and
      delete any session (the driver's key).
    default_sampling: the run's temperature and top_p, for the fields a
      request leaves out when it sets others.
  """

  def __init__(
    self,
    batcher: batcher_lib.Batcher,
    chat_format,
    tokenizer,
    book: sessions.SessionBook,
    *,
    model_name: str,
    max_turn_tokens: int,
    api_key: str | None = None,
    owner_key: str | None = None,
    default_sampling: batcher_lib.RequestSampling | None = None,
  ):
    self.batcher, self.format, self.tok, self.book = batcher, chat_format, tokenizer, book
    # An ended session's parked cache goes at once, not when LRU reaches it.
    book.on_end = getattr(batcher, "forget", None)
    self.model_name, self.max_turn_tokens, self.api_key = model_name, max_turn_tokens, api_key
    self.owner_key, self.default_sampling = owner_key, default_sampling
    self.max_len = batcher.max_len
    self.created = int(time.time())
    self.counts: collections.Counter = collections.Counter()
    self.http_counts: collections.Counter = collections.Counter()  # the HTTP layer's
    self._lock = threading.Lock()

  def count(self, key: str, n: int = 1) -> None:
    with self._lock:
      self.counts[key] += n

  def stats(self) -> dict:
    with self._lock:
      out = dict(self.counts)
    out.update(dict(self.http_counts))
    out.update(dict(self.book.counts))
    out.update(
      {
        "sessions/open": self.book.open_sessions,
        "generated_tokens": self.batcher.generated_tokens,
        "engine_errors": self.batcher.engine_errors,
        "policy_version": int(self.batcher.engine.version),
      }
    )
    if hasattr(self.batcher, "counters"):  # prefill computed / reused / shared, evictions
      out.update({f"batcher/{k}": v for k, v in self.batcher.counters().items()})
    return out

  # --- dispatch ---------------------------------------------------------------------

  def handle(
    self, method: str, path: str, headers: dict, body: bytes | None, out: http_server.Responder
  ) -> None:
    """Answers one request on `out`; never raises."""
    self.count("requests")
    try:
      try:
        path = path.split("?", 1)[0]
        if path != "/health":
          self._check_key(headers)
        reply = self._route(method, path, headers, body, out)
      except ApiError as e:
        self.count(f"errors/{e.reason}")
        if out.started:  # a stream already began: the error as its last event
          out.event(e.body())
          out.end_stream()
        else:
          out.json(e.status, e.body(), e.headers)
        return
      except http_server.SendFailed:
        raise
      except Exception as e:  # noqa: BLE001  # a bug: answered, counted, logged
        logging.exception("openai endpoint: %s %s failed", method, path)
        self.count("errors/internal_error")
        if not out.started:
          out.json(
            500,
            ApiError(
              500, "internal_error", f"internal error: {type(e).__name__}", kind="server_error"
            ).body(),
          )
        return
      if reply is not None:
        out.json(200, reply)
    except http_server.SendFailed as e:  # nothing of the turn was recorded
      self.count(f"replies/{e.reason}")
      if not e.started:
        try:
          out.json(
            500,
            ApiError(500, e.reason, "the reply could not be encoded", kind="server_error").body(),
          )
        except http_server.SendFailed:
          pass

  def _check_key(self, headers: dict):
    if self.api_key is None:
      return
    given = headers.get("authorization", "").encode("utf-8", "replace")
    if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
      raise ApiError(
        401,
        "unauthorized",
        "a missing or wrong API key (Authorization: Bearer)",
        kind="invalid_request_error",
        code="invalid_api_key",
      )

  def _route(
    self, method: str, path: str, headers: dict, body: bytes | None, out: http_server.Responder
  ) -> dict | None:
    """The reply to send, or None when the route answered on `out` itself."""
    match = _PATH.match(path)
    if match:
      session_id, secret, what, model = match.groups()
      if what == "models":
        self._method(method, "GET")
        return self._models(model)
      if model is not None:
        raise ApiError(404, "not_found", f"no route {path[:80]!r}", code="not_found")
      self._method(method, "POST")
      ref = None if session_id is None else (session_id, secret or headers.get("x-session-secret"))
      self._generate(ref, rq.loads(body), out, chat=what == "chat/completions")
      return None
    match = _SESSION_PATH.match(path)
    if match:
      session_id, reward = match.groups()
      if session_id is None:
        self._method(method, "POST")
        return self._open_session(headers)
      s = self._owned(session_id, headers)
      if reward:
        self._method(method, "POST")
        return self._reward(s.id, rq.loads(body))
      self._method(method, "GET", "DELETE")
      return self._session_info(s, delete=method == "DELETE")
    if path in ("/v1/stats", "/health"):
      self._method(method, "GET")
      return self.stats() if path == "/v1/stats" else {"status": "ok"}
    raise ApiError(404, "not_found", f"no route {path[:80]!r}", code="not_found")

  @staticmethod
  def _method(method: str, *allowed: str):
    if method not in allowed:
      raise ApiError(405, "method_not_allowed", f"use {' or '.join(allowed)} here")

  def _model(self) -> dict:
    return {
      "id": self.model_name,
      "object": "model",
      "created": self.created,
      "owned_by": "sao-jax",
      "max_model_len": self.max_len,
    }

  def _models(self, model: str | None) -> dict:
    if model is None:
      return {"object": "list", "data": [self._model()]}
    if model != self.model_name:
      raise ApiError(
        404,
        "unknown_model",
        f"the model {model[:80]!r} does not exist; this server serves {self.model_name!r}",
        "model",
        code="model_not_found",
      )
    return self._model()

  # --- sessions -------------------------------------------------------------------------

  def _open_session(self, headers: dict) -> dict:
    s = self._new_session()
    return {
      "id": s.id,
      "secret": s.secret,
      "owner_secret": s.owner_secret,
      "base_url": f"http://{headers.get('host', 'localhost')}/sessions/{s.id}/{s.secret}/v1",
    }

  def _new_session(self) -> sessions.Session:
    try:
      return self.book.open()
    except sessions.TooManySessions as e:
      raise ApiError(
        429, "too_many_sessions", str(e), kind="rate_limit_error", headers={"Retry-After": "10"}
      ) from None

  def _find(self, session_id: str) -> sessions.Session:
    try:
      s = self.book.get(session_id)
    except ValueError as e:
      raise rq.bad("bad_session", str(e)) from None
    if s is None:
      raise ApiError(
        404,
        "unknown_session",
        f"no open session {session_id[:40]!r}; open one with POST /v1/sessions",
        "session",
      )
    return s

  def _owned(self, session_id: str, headers: dict) -> sessions.Session:
    """The session, if the request shows its owner's secret or the server's owner key."""
    s = self._find(session_id)
    given = headers.get("x-session-owner")
    if not (
      s.allows(given, owner=True)
      or (
        self.owner_key is not None
        and given is not None
        and hmac.compare_digest(given.encode("utf-8", "replace"), self.owner_key.encode())
      )
    ):
      raise ApiError(
        403,
        "forbidden_session",
        "this session's owner secret is missing or wrong (X-Session-Owner)",
        "session",
      )
    return s

  def _reward(self, session: str, body) -> dict:
    if not isinstance(body, dict):
      raise rq.bad("bad_reward", 'the body must be a JSON object {"reward": number}')
    reward = rq.number(body, "reward", -float("inf"), float("inf"))
    if reward is None:
      raise rq.bad("bad_reward", "reward must be a finite number", "reward")
    prompt_id = rq.integer(body, "prompt_id", -(2**63), 2**63 - 1)
    out = self.book.reward(session, reward, prompt_id)
    if out is None:
      raise ApiError(404, "unknown_session", f"no open session {session!r}", "session")
    return out

  def _session_info(self, s: sessions.Session, delete: bool) -> dict:
    if delete:
      if not self.book.discard(s.id):
        raise ApiError(404, "unknown_session", f"no open session {s.id!r}", "session")
      return {"session_id": s.id, "deleted": True}
    with s.lock:
      return {
        "session_id": s.id,
        "requests": s.requests,
        "trajectories": [{"tokens": len(r.tokens), "turns": len(r.turn_starts)} for r in s.records],
      }

  def _lock_session(self, ref) -> tuple[sessions.Session, bool]:
    """The request's session, locked by the caller's thread, and whether it is new."""
    if ref is None:
      s, fresh = self._new_session(), True
    else:
      s, fresh = self._find(ref[0]), False
      if not s.allows(ref[1]):
        raise ApiError(
          403,
          "forbidden_session",
          "this session's secret is missing or wrong (the base_url's, or X-Session-Secret)",
          "session",
        )
    s.lock.acquire()
    if s.ended:  # rewarded or expired meanwhile
      s.lock.release()
      raise ApiError(404, "unknown_session", f"the session {s.id!r} has ended", "session")
    return s, fresh

  # --- completions ----------------------------------------------------------------------

  def _request(self, body, chat: bool) -> dict:
    """The request's fields, checked (ApiError otherwise)."""
    if not isinstance(body, dict):
      raise rq.bad("not_an_object", "the body must be a JSON object")
    model = body.get("model")
    if model != self.model_name:
      raise ApiError(
        404,
        "unknown_model",
        f"the model {str(model)[:80]!r} does not exist; this server serves {self.model_name!r}",
        "model",
        code="model_not_found",
      )
    rq.check_fields(body, rq._CHAT_FIELDS if chat else rq._COMPLETION_FIELDS, self.count)
    gen = rq.generation(
      body, chat=chat, vocab_size=self.tok.vocab_size, default=self.default_sampling
    )
    if not chat:
      return {
        "gen": gen,
        "prompt": rq.completion_prompt(body, self.tok),
        "messages": None,
        "tools": [],
      }
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
      raise rq.bad(
        "unsupported_tool_choice",
        'tool_choice must be "auto" or "none": the policy\'s calls are not constrained',
        "tool_choice",
      )
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    if tools and not self.format.renders_tools:
      raise rq.bad(
        "bad_tools", f"the run's chat format {self.format.name!r} cannot show tools", "tools"
      )
    if any(m.get("tool_calls") for m in messages) and not self.format.renders_tools:
      raise rq.bad(
        "bad_messages", f"the run's chat format {self.format.name!r} has no tool calls", "messages"
      )
    return {"gen": gen, "prompt": None, "messages": messages, "tools": tools}

  def _prompt(self, s: sessions.Session, req: dict) -> tuple[list[int], bool, int]:
    """(prompt ids, bridged, completion budget) of a request on session `s`."""
    if req["messages"] is None:
      prompt, bridged = req["prompt"], False
    else:
      try:
        prompt, bridged = s.prompt_ids(req["messages"], req["tools"])
      except (ValueError, KeyError, TypeError) as e:
        raise rq.bad(
          "render_error",
          f"the chat format cannot render these messages: {str(e)[:200]}",
          "messages",
        ) from None
    room = self.max_len - len(prompt)
    if room < 1:
      raise ApiError(
        400,
        "context_length_exceeded",
        f"the prompt is {len(prompt)} tokens; this model's context is "
        f"{self.max_len} tokens, prompt and completion together",
        "messages",
        code="context_length_exceeded",
      )
    return prompt, bridged, min(req["gen"].limit or self.max_turn_tokens, room)

  def _submit(self, prompt, budget: int, gen: rq.Generation, session_id: str) -> list:
    """The futures of `gen.n` completions (choice i draws with seed + i)."""
    futures = []
    try:
      for i in range(gen.n):
        sampling = gen.sampling
        if sampling is not None and sampling.seed is not None and i:
          sampling = dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**63)
        futures.append(
          self.batcher.submit(prompt, budget, sampling=sampling, prefix_key=session_id)
        )
    except batcher_lib.Overloaded as e:
      for f in futures:
        f.cancel()
      raise ApiError(
        503,
        "overloaded",
        f"the server is overloaded: {e}",
        kind="server_error",
        headers={"Retry-After": "1"},
      ) from None
    except ValueError as e:  # sampling this engine cannot honour (e.g. no per-request sampling)
      for f in futures:
        f.cancel()
      raise rq.bad(
        "unsupported_sampling", f"this engine cannot sample so: {str(e)[:200]}"
      ) from None
    return futures

  def _results(self, futures) -> list[batcher_lib.Completion]:
    out = []
    for f in futures:
      try:
        out.append(f.result())
      except Exception as e:  # noqa: BLE001  # the engine failed this request
        logging.warning("openai endpoint: generation failed: %r", e)
        for g in futures:
          g.cancel()
        raise ApiError(
          500, "engine_error", f"generation failed: {type(e).__name__}", kind="server_error"
        ) from None
    return out

  def _generate(self, ref, body, out: http_server.Responder, chat: bool) -> None:
    """A chat completion or completion: sampled, answered, then recorded."""
    req = self._request(body, chat)
    gen = req["gen"]
    s, fresh = self._lock_session(ref)
    recorded = False
    try:
      prompt, bridged, budget = self._prompt(s, req)
      futures = self._submit(prompt, budget, gen, s.id)
      head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": self.model_name,
      }
      if gen.stream:
        out.start_stream()
        for i in range(gen.n if chat else 0):
          out.event(openai_reply.role_chunk(self._chunk_head(head, gen), i))
      choices = [self._choice(c, i, req) for i, c in enumerate(self._results(futures))]
      extra = self._extra(s, fresh, prompt, bridged, choices, gen)
      usage = {
        "prompt_tokens": len(prompt),
        "completion_tokens": sum(len(c["cut"].completion.tokens) for c in choices),
      }
      usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
      if gen.stream:
        self._stream(out, head, choices, usage, extra, gen)
      else:
        out.json(
          200, {**head, "choices": [c["choice"] for c in choices], "usage": usage, "sao": extra}
        )
      for c in choices:  # sent: recorded
        s.record(prompt, c["cut"].completion, c["seen"], req["tools"], bridged, new=gen.n > 1)
      recorded = True
    finally:
      s.lock.release()
      if fresh and not recorded:
        self.book.discard(s.id)
    self.count("completions", len(choices))
    self.count("completion_tokens", usage["completion_tokens"])

  def _choice(self, completion: batcher_lib.Completion, index: int, req: dict) -> dict:
    """One choice as served: {"cut", "choice" (OpenAI's), "message", "seen"}."""
    gen = req["gen"]
    cut = openai_reply.cut_at_stop(completion, gen.stop, self.tok, self.format.turn_end_id)
    if gen.stop and cut.stop is not None:
      self.count("stop_strings/cut")
    if req["messages"] is None:
      text, finish = openai_reply.completion_text(cut, self.tok, self.format.turn_end_id)
      lp = openai_reply.completion_logprobs(cut.completion, self.tok) if gen.logprobs else None
      return {
        "cut": cut,
        "seen": None,
        "text": text,
        "finish": finish,
        "logprobs": lp,
        "choice": {"index": index, "text": text, "logprobs": lp, "finish_reason": finish},
      }
    message, finish = openai_reply.chat_message(cut, self.format, req["tools"], self.count)
    lp = openai_reply.chat_logprobs(cut.completion, self.tok) if gen.logprobs else None
    returned = {
      "role": "assistant",
      "content": message["content"],
      "tool_calls": [tc["function"] for tc in message.get("tool_calls", ())],
    }
    seen = [sessions.message_key(m) for m in req["messages"]] + [sessions.message_key(returned)]
    return {
      "cut": cut,
      "seen": seen,
      "message": message,
      "finish": finish,
      "logprobs": lp,
      "choice": {"index": index, "message": message, "finish_reason": finish, "logprobs": lp},
    }

  def _extra(
    self, s: sessions.Session, fresh: bool, prompt, bridged: bool, choices, gen: rq.Generation
  ) -> dict:
    """The reply's `sao` object: where each choice will be recorded, and the ids."""
    places = [s.plan(prompt, new=gen.n > 1, offset=i) for i in range(len(choices))]
    first = choices[0]["cut"].completion
    extra = {
      "session_id": s.id,
      "trajectory": places[0].trajectory,
      "turn": places[0].turn,
      "extended": places[0].extended,
      "bridged": bridged,
      "policy_version": first.versions[-1],
    }
    if fresh:  # a session this request opened: it is the caller's
      extra.update(session_secret=s.secret, owner_secret=s.owner_secret)
    if gen.n > 1:
      extra["trajectories"] = [p.trajectory for p in places]
    if gen.return_ids:
      extra.update(
        prompt_token_ids=list(prompt),
        completion_token_ids=list(first.tokens),
        completion_logprobs=list(first.logprobs),
        completion_versions=list(first.versions),
      )
      if gen.n > 1:
        extra["choices_token_ids"] = [list(c["cut"].completion.tokens) for c in choices]
    return extra

  @staticmethod
  def _chunk_head(head: dict, gen: rq.Generation) -> dict:
    chunk = {
      **head,
      "object": "chat.completion.chunk"
      if head["object"] == "chat.completion"
      else "text_completion",
    }
    if gen.include_usage:
      chunk["usage"] = None
    return chunk

  def _stream(
    self,
    out: http_server.Responder,
    head: dict,
    choices,
    usage: dict,
    extra: dict,
    gen: rq.Generation,
  ) -> None:
    chunk_head = self._chunk_head(head, gen)
    for i, c in enumerate(choices):
      if "message" in c:
        chunks = openai_reply.chat_chunks(chunk_head, i, c["message"], c["finish"], c["logprobs"])
      else:
        chunks = openai_reply.completion_chunks(
          chunk_head, i, c["text"], c["finish"], c["logprobs"]
        )
      if i == len(choices) - 1:
        chunks[-1]["sao"] = extra
      for chunk in chunks:
        out.event(chunk)
    if gen.include_usage:
      out.event({**chunk_head, "choices": [], "usage": usage})
    out.event("[DONE]")
    out.end_stream()


# --- HTTP -----------------------------------------------------------------------------------


class _Handler(http_server.Handler):
  """Reads a request's body (a Content-Length, at most `max_body_bytes`) for the app."""

  server_version = "sao-jax"

  def _serve(self, method: str):
    app: OpenAIApp = self.server.app
    out = http_server.Responder(self)
    body, error = None, None
    length = self.headers.get("Content-Length")
    if method == "POST":
      if self.headers.get("Transfer-Encoding") or length is None:
        error = ApiError(411, "length_required", "send a Content-Length (no chunked bodies)")
      else:
        try:
          n = int(length) if len(length) < 20 else -1
        except ValueError:
          n = -1
        if n < 0:
          error = rq.bad("bad_json", "a malformed Content-Length")
        elif n > self.server.max_body_bytes:
          error = ApiError(
            413, "body_too_large", f"the body is {n} bytes; at most {self.server.max_body_bytes}"
          )
        else:
          body = self.rfile.read(n)
    if error is not None:
      app.count("requests")
      app.count(f"errors/{error.reason}")
      self.close_connection = True  # the unread body would be taken for the next request
      try:
        out.json(error.status, error.body())
      except http_server.SendFailed:
        app.count("replies/write_failed")
      return
    headers = {k.lower(): v for k, v in self.headers.items()}
    app.handle(method, self.path, headers, body, out)

  def do_GET(self):
    self._serve("GET")

  def do_POST(self):
    self._serve("POST")

  def do_DELETE(self):
    self._serve("DELETE")

  def do_PUT(self):
    self._serve("PUT")


class Server:
  """`app` over HTTP on `host:port` (0: a free port), on `http_server.PooledHTTPServer`.

  `workers` requests are served at once (a request holds its worker until
  its reply is sent, a harness's idle connection holds none); `max_pending`
  more connections with a request wait for one; beyond them a request is
  answered 503 with `Retry-After`. `backlog`: the kernel's queue of
  connections not yet accepted. `port` is the bound port; `close` stops
  serving and ends every connection; the batcher is the caller's to close,
  after.
  """

  def __init__(
    self,
    app: OpenAIApp,
    host: str = loopback.LOOPBACK_HOST,
    port: int = 0,
    max_body_bytes: int | None = None,
    *,
    workers: int = 64,
    max_pending: int = 1024,
    backlog: int = 1024,
    max_connections: int = 4096,
  ):
    warning = loopback.exposure_warning(
      host, "the OpenAI-compatible endpoint", authenticated=app.api_key is not None
    )
    if warning:
      logging.warning("%s", warning)
    self.app = app
    self._http = http_server.PooledHTTPServer(
      (host, port),
      _Handler,
      workers=workers,
      max_pending=max_pending,
      backlog=backlog,
      max_connections=max_connections,
      counts=app.http_counts,
    )
    self._http.app = app
    # Room for a whole context of text: a token is a few bytes, JSON escapes double some.
    self._http.max_body_bytes = max_body_bytes or max(1 << 20, 64 * app.max_len)
    self.host, self.port = host, self._http.server_address[1]

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}"

  def close(self) -> None:
    self._http.close()


class Endpoint:
  """A run's engine served over HTTP, its rewarded sessions written to the fleet's shards.

  `launch/serve.py --api=openai` is this plus flags. `config` is the run's
  (its chat format, `rollout.max_turn_tokens` / `decode_steps`, and the
  fleet's shard rotation: `fleet.shard_trajectories`, `fleet.shard_seconds`);
  `root` the fleet directory (`fleet.root_of(config, workdir)`), whose
  `trajectories/<rollout_id>-<seq>.array_record` shards a trainer in
  `rl.mode = "fleet"` reads. `rotate()` closes a shard older than
  `fleet.shard_seconds` (call it now and then); `close()` stops serving and
  renames the open shard, so everything written is visible.

  `follow_weights`: `poll_weights()` (call it now and then) takes the
  newest policy version a fleet trainer published under `root` into the
  engine, as a rollout process does (`fleet.WeightFollower`); requests in
  flight go on over their caches, and each token records the version
  that sampled it, and each trajectory the trainer's run id and the
  fingerprints of the versions it used (sao_jax/data/identity.py). Without
  it the endpoint serves the params it was given, and its trajectories
  carry no identity: a fleet trainer refuses them (`missing_run_id`).

  `open_session()` and `reward(session_id, reward)` are the owner's path in
  this process (no secret needed); `owner_key` gives a driver elsewhere the
  same over HTTP. `workers`: requests served at once (default: four per
  engine slot, at least 64).
  """

  def __init__(
    self,
    config,
    engine,
    tokenizer,
    root: str,
    *,
    host: str = loopback.LOOPBACK_HOST,
    port: int = 0,
    model_name: str = "sao-jax",
    api_key: str | None = None,
    owner_key: str | None = None,
    rollout_id: str = "openai",
    max_sessions: int = 1024,
    idle_seconds: float = 3600.0,
    decode_steps: int | None = None,
    follow_weights: bool = False,
    workers: int | None = None,
    backlog: int = 1024,
  ):
    chat_format = registry.make_format(config.env, tokenizer)
    f = config.fleet
    self.writer = fleet.ShardWriter(root, rollout_id, f.shard_trajectories, f.shard_seconds)
    # The backend's completer: the Batcher over the JAX engine's slots, or
    # requests handed to a vLLM server as they come (serving/vllm_serving.py).
    completer = backends.get(config.rollout.backend).build_completer()
    self.batcher = completer(
      engine, chat_format.turn_end_id, decode_steps=decode_steps or config.rollout.decode_steps
    )
    # Whose params each version is (the run id and fingerprint that came with
    # it, sao_jax/data/identity.py): only followed versions have one.
    self.identity = identity.Ledger()
    self.book = sessions.SessionBook(
      chat_format,
      tokenizer.vocab_size,
      engine.max_prefill_length,
      self.writer.write,
      current_version=lambda: engine.version,
      max_sessions=max_sessions,
      idle_seconds=idle_seconds,
      identity=self.identity,
    )
    self.app = OpenAIApp(
      self.batcher,
      chat_format,
      tokenizer,
      self.book,
      model_name=model_name,
      max_turn_tokens=config.rollout.max_turn_tokens,
      api_key=api_key,
      owner_key=owner_key,
      default_sampling=batcher_lib.RequestSampling(
        temperature=config.rollout.temperature, top_p=config.rollout.top_p
      ),
    )
    try:
      self.server = Server(
        self.app,
        host,
        port,
        workers=workers or max(64, 4 * engine.max_concurrent_decodes),
        backlog=backlog,
      )
    except BaseException:
      self.batcher.close()
      raise
    self.url = self.server.url
    self.follower = fleet.WeightFollower(root, engine.abstract_params()) if follow_weights else None

  def rotate(self) -> None:
    self.writer.rotate_if_older()

  def open_session(self) -> dict:
    """A new session: its id, secrets and the base URL to give a harness."""
    s = self.book.open()
    return {
      "id": s.id,
      "secret": s.secret,
      "owner_secret": s.owner_secret,
      "base_url": f"{self.url}/sessions/{s.id}/{s.secret}/v1",
    }

  def reward(self, session_id: str, reward: float, prompt_id: int | None = None) -> dict | None:
    """Ends a session with `reward` (`SessionBook.reward`); None for an unknown one."""
    return self.book.reward(session_id, reward, prompt_id)

  def poll_weights(self) -> int | None:
    """The version taken into the engine, if the fleet published a different one."""
    got = None if self.follower is None else self.follower.poll()
    if got is None:
      return None
    params, version, meta = got
    self.identity.note(version, meta)
    self.batcher.update_params(params, version, copied=True)
    self.app.count("weights/updates")
    return version

  def close(self) -> None:
    self.server.close()
    self.batcher.close()
    self.writer.close()
    if self.follower is not None:
      self.follower.close()
