"""An OpenAI-compatible chat endpoint over the policy, recording what it serves for RL.

Any agent harness that speaks OpenAI's chat completions API (mini-swe-agent,
OpenHands, a script with the `openai` client) can drive the policy here,
and every session it runs becomes training data: `launch/serve.py
--api=openai` serves a run's policy (its latest checkpoint, or fresh params)
through the run's own engine (`PolicyEngine`, continuously batched by
`serving.Batcher`) and renders messages with the run's chat format, the
renderer the trainer's rollouts use, token for token. Sessions are
recorded by `sessions.py`'s rule and written, once the caller posts their
reward, to the fleet's trajectory shards, which a trainer in `rl.mode =
"fleet"` reads and validates like any rollout process's.

Routes (a session's id is in the path, so a harness needs only a base URL):

    POST   /v1/chat/completions                     the session "default"
    POST   /sessions/{id}/v1/chat/completions       the session {id}
    GET    /v1/models, /sessions/{id}/v1/models     the served model
    POST   /v1/sessions/{id}/reward   {"reward": float, "prompt_id": int?}
                                                    ends the session: its
                                                    trajectories are written
    DELETE /v1/sessions/{id}                        ends it, writes nothing
    GET    /v1/sessions/{id}                        its trajectories and requests
    GET    /v1/stats                                every counter below

A chat completion takes `model` (the served name), `messages` (system /
developer / user / assistant / tool; text content or text parts), `tools`
(function schemas), `max_tokens` or `max_completion_tokens` (default
`rollout.max_turn_tokens`; cut to the room left in `rollout.max_len`),
`logprobs` (the sampled tokens' log-probs), and, beyond OpenAI's fields,
`return_token_ids` (the prompt and completion ids, in the reply's `sao`
object). It answers with OpenAI's shape: the assistant message's `content`,
`tool_calls` (parsed from the sampled ids, each with a fresh id, arguments
as a JSON string) and `reasoning_content` (a think block's text), the
`finish_reason` ("tool_calls", "stop" or "length") and `usage`; its `sao`
object says where the tokens were recorded (session, trajectory, turn,
whether the request extended the trajectory) and the policy version.

Sampling is the run's (`rollout.temperature`, `top_k`, `top_p`): the recorded
log-probs are the behaviour probabilities the trainer divides by, so a
request's `temperature`, `top_p`, `stop`, `seed`, penalties and the like are
ignored, each counted (`ignored/<field>`). What cannot be honoured at all is
refused: `n` > 1, `stream`, a `tool_choice` other than "auto" / "none".
Every refusal is OpenAI's error object (`{"error": {"message", "type",
"param", "code"}}`) with its status (400 bad request, 401 bad key, 404
unknown model / session / route, 405, 411, 413, 429 too many sessions, 503
queue full, 500 an engine failure) and is counted (`errors/<reason>`); no
request can stop the server.

The server has no TLS and, without `api_key`, no authentication, so it
binds 127.0.0.1 unless told otherwise (`loopback.exposure_warning`).
"""

from __future__ import annotations

import collections
import hmac
import http.server
import json
import math
import re
import socket
import threading
import time
import uuid
from typing import Any

from absl import logging

from sao_jax.data import fleet
from sao_jax.envs import chat, registry
from sao_jax.rollout import loopback, serving, sessions

DEFAULT_SESSION = "default"
# OpenAI's rule for a function name.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}
# Request fields accepted and ignored (sampling is the run's): counted when set.
IGNORED_FIELDS = ("temperature", "top_p", "top_k", "stop", "seed", "presence_penalty",
                  "frequency_penalty", "logit_bias", "response_format", "user", "metadata",
                  "store", "parallel_tool_calls", "service_tier", "stream_options",
                  "reasoning_effort", "top_logprobs", "modalities", "prediction")
_KNOWN_FIELDS = frozenset(("model", "messages", "tools", "tool_choice", "max_tokens",
                           "max_completion_tokens", "n", "stream", "logprobs",
                           "return_token_ids") + IGNORED_FIELDS)
_PATH = re.compile(r"^(?:/sessions/([^/]+))?/v1/(chat/completions|models)/?$")
_SESSION_PATH = re.compile(r"^/v1/sessions/([^/]+)(/reward)?/?$")


class ApiError(Exception):
  """A refused request: HTTP status, counted reason, OpenAI error type and message."""

  def __init__(self, status: int, reason: str, message: str, param: str | None = None,
               kind: str = "invalid_request_error", code: str | None = None):
    super().__init__(message)
    self.status, self.reason, self.message = status, reason, message
    self.param, self.kind, self.code = param, kind, code or reason

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}


def _bad(reason: str, message: str, param: str | None = None) -> ApiError:
  return ApiError(400, reason, message, param)


# --- request parsing ------------------------------------------------------------------


def _text(content, where: str) -> str:
  """A message's content as text: a string, or a list of text parts joined."""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = []
    for part in content:
      if not (isinstance(part, dict) and part.get("type") == "text"
              and isinstance(part.get("text"), str)):
        raise ApiError(400, "unsupported_content", f"{where}: only text content parts are "
                       "supported", "messages")
      parts.append(part["text"])
    return "".join(parts)
  raise _bad("bad_messages", f"{where}: content must be a string or a list of text parts",
             "messages")


def _tool_calls(calls, where: str) -> list[dict]:
  if not isinstance(calls, list):
    raise _bad("bad_messages", f"{where}: tool_calls must be a list", "messages")
  out = []
  for j, call in enumerate(calls):
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
      raise _bad("bad_messages", f"{where}: tool_calls[{j}] needs function.name", "messages")
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, (str, dict)):
      raise _bad("bad_messages", f"{where}: tool_calls[{j}].function.arguments must be a "
                 "JSON string", "messages")
    out.append({"name": fn["name"], "arguments": arguments})
  return out


def parse_messages(raw) -> list[dict]:
  """OpenAI messages as the chat format's: role, text content, flat tool calls."""
  if not isinstance(raw, list) or not raw:
    raise _bad("bad_messages", "messages must be a non-empty list", "messages")
  out = []
  for k, m in enumerate(raw):
    where = f"messages[{k}]"
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
      raise _bad("bad_messages", f"{where}: role must be one of {sorted(_ROLES)}", "messages")
    role = _ROLES[m["role"]]
    message = {"role": role}
    if role == "assistant":
      message["content"] = "" if m.get("content") is None else _text(m["content"], where)
      if m.get("tool_calls"):
        message["tool_calls"] = _tool_calls(m["tool_calls"], where)
      reasoning = m.get("reasoning_content")
      if isinstance(reasoning, str) and reasoning:
        message["reasoning_content"] = reasoning
    else:
      if "content" not in m:
        raise _bad("bad_messages", f"{where}: {m['role']} message without content", "messages")
      message["content"] = _text(m["content"], where)
    out.append(message)
  if out[-1]["role"] == "assistant":
    raise _bad("bad_messages", "the last message is the assistant's: nothing to answer",
               "messages")
  return out


def parse_tools(raw) -> list[dict]:
  """OpenAI function tools, checked; returned as given (the prompt shows them so)."""
  if raw is None:
    return []
  if not isinstance(raw, list):
    raise _bad("bad_tools", "tools must be a list", "tools")
  names = set()
  for k, tool in enumerate(raw):
    where = f"tools[{k}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
      raise _bad("bad_tools", f"{where}: only {{\"type\": \"function\"}} tools", "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _TOOL_NAME.match(
        fn["name"]):
      raise _bad("bad_tools", f"{where}: function.name must match [A-Za-z0-9_-]{{1,64}}",
                 "tools")
    if fn["name"] in names:
      raise _bad("bad_tools", f"{where}: a second tool named {fn['name']!r}", "tools")
    names.add(fn["name"])
    if "description" in fn and not isinstance(fn["description"], str):
      raise _bad("bad_tools", f"{where}: function.description must be a string", "tools")
    params = fn.get("parameters")
    if params is not None:
      if not isinstance(params, dict):
        raise _bad("bad_tools", f"{where}: function.parameters must be a JSON schema object",
                   "tools")
      if not isinstance(params.get("properties", {}), dict) or not (
          isinstance(params.get("required", []), list)
          and all(isinstance(r, str) for r in params.get("required", []))):
        raise _bad("bad_tools", f"{where}: parameters.properties must be an object and "
                   "parameters.required a list of names", "tools")
  return raw


# --- the application ---------------------------------------------------------------------


class OpenAIApp:
  """The endpoint's logic, apart from HTTP: `handle(method, path, headers, body)`.

  Args:
    batcher: `serving.Batcher` over the run's engine.
    chat_format: the run's chat format (`registry.make_format(config.env, tok)`).
    tokenizer: the run's tokenizer.
    book: `sessions.SessionBook`, which validates and writes trajectories.
    model_name: the name `model` must give (and `/v1/models` lists).
    max_turn_tokens: the completion budget when a request sets none.
    api_key: if set, requests must send `Authorization: Bearer <api_key>`.
  """

  def __init__(self, batcher: serving.Batcher, chat_format, tokenizer, book: sessions.SessionBook,
               *, model_name: str, max_turn_tokens: int, api_key: str | None = None):
    self.batcher, self.format, self.tok, self.book = batcher, chat_format, tokenizer, book
    self.model_name, self.max_turn_tokens, self.api_key = model_name, max_turn_tokens, api_key
    self.max_len = batcher.max_len
    self.created = int(time.time())
    self.counts: collections.Counter = collections.Counter()
    self._lock = threading.Lock()

  def count(self, key: str, n: int = 1) -> None:
    with self._lock:
      self.counts[key] += n

  def stats(self) -> dict:
    with self._lock:
      out = dict(self.counts)
    out.update(dict(self.book.counts))
    out.update({"sessions/open": self.book.open_sessions,
                "generated_tokens": self.batcher.generated_tokens,
                "engine_errors": self.batcher.engine_errors,
                "policy_version": int(self.batcher.engine.version)})
    return out

  # --- dispatch ---------------------------------------------------------------------

  def handle(self, method: str, path: str, headers: dict, body: bytes | None
             ) -> tuple[int, dict]:
    """(HTTP status, JSON body) of one request; never raises."""
    self.count("requests")
    try:
      self._check_key(headers)
      return 200, self._route(method, path.split("?", 1)[0], body)
    except ApiError as e:
      self.count(f"errors/{e.reason}")
      return e.status, e.body()
    except Exception as e:  # pylint: disable=broad-except  # a bug: answered, counted, logged
      logging.exception("openai endpoint: %s %s failed", method, path)
      self.count("errors/internal_error")
      return 500, ApiError(500, "internal_error", f"internal error: {type(e).__name__}",
                           kind="server_error").body()

  def _check_key(self, headers: dict):
    if self.api_key is None:
      return
    given = headers.get("authorization", "").encode("utf-8", "replace")
    if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
      raise ApiError(401, "unauthorized", "a missing or wrong API key (Authorization: Bearer)",
                     kind="invalid_request_error", code="invalid_api_key")

  def _route(self, method: str, path: str, body: bytes | None) -> dict:
    match = _PATH.match(path)
    if match:
      session, what = match.group(1), match.group(2)
      if what == "models":
        self._method(method, "GET")
        return self._models()
      self._method(method, "POST")
      return self._chat(session or DEFAULT_SESSION, _json(body))
    match = _SESSION_PATH.match(path)
    if match:
      session, reward = match.group(1), match.group(2)
      if not sessions.SESSION_ID.match(session):
        raise _bad("bad_session", "a session id is 1 to 128 of A-Z a-z 0-9 _ . : -")
      if reward:
        self._method(method, "POST")
        return self._reward(session, _json(body))
      self._method(method, "GET", "DELETE")
      return self._session(session, delete=method == "DELETE")
    if path == "/v1/stats":
      self._method(method, "GET")
      return self.stats()
    raise ApiError(404, "not_found", f"no route {path[:80]!r}", code="not_found")

  @staticmethod
  def _method(method: str, *allowed: str):
    if method not in allowed:
      raise ApiError(405, "method_not_allowed", f"use {' or '.join(allowed)} here")

  def _models(self) -> dict:
    return {"object": "list", "data": [{
        "id": self.model_name, "object": "model", "created": self.created,
        "owned_by": "sao-jax", "max_model_len": self.max_len}]}

  # --- sessions -------------------------------------------------------------------------

  def _reward(self, session: str, body) -> dict:
    if not isinstance(body, dict):
      raise _bad("bad_reward", "the body must be a JSON object {\"reward\": number}")
    reward = body.get("reward")
    try:
      finite = not isinstance(reward, bool) and math.isfinite(reward)
    except (TypeError, OverflowError):  # not a number; an int beyond any float
      finite = False
    if not finite:
      raise _bad("bad_reward", "reward must be a finite number", "reward")
    prompt_id = body.get("prompt_id")
    if prompt_id is not None and (isinstance(prompt_id, bool) or not isinstance(prompt_id, int)
                                  or not -2**63 <= prompt_id < 2**63):
      raise _bad("bad_reward", "prompt_id must be an integer", "prompt_id")
    out = self.book.reward(session, float(reward), prompt_id)
    if out is None:
      raise ApiError(404, "unknown_session", f"no open session {session!r}", "session")
    return out

  def _session(self, session: str, delete: bool) -> dict:
    if delete:
      if not self.book.discard(session):
        raise ApiError(404, "unknown_session", f"no open session {session!r}", "session")
      return {"session_id": session, "deleted": True}
    s = self.book.get(session, create=False)
    if s is None:
      raise ApiError(404, "unknown_session", f"no open session {session!r}", "session")
    with s.lock:
      records = s.closed + ([s.current] if s.current is not None else [])
      return {"session_id": session, "requests": s.requests, "trajectories": [
          {"tokens": len(r.tokens), "turns": len(r.turn_starts)} for r in records]}

  # --- chat completions -----------------------------------------------------------------

  def _request(self, body) -> dict:
    """The request's fields, checked (ApiError otherwise)."""
    if not isinstance(body, dict):
      raise _bad("not_an_object", "the body must be a JSON object")
    model = body.get("model")
    if model != self.model_name:
      raise ApiError(404, "unknown_model", f"the model {str(model)[:80]!r} does not exist; "
                     f"this server serves {self.model_name!r}", "model", code="model_not_found")
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
      raise _bad("unsupported_n", "n must be 1: one sample per request (each is recorded)", "n")
    if body.get("stream"):
      raise _bad("unsupported_stream", "streaming is not supported", "stream")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
      raise _bad("unsupported_tool_choice", "tool_choice must be \"auto\" or \"none\": the "
                 "policy's calls are not constrained", "tool_choice")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1):
      raise _bad("bad_max_tokens", "max_tokens must be a positive integer", "max_tokens")
    for field in body:
      if field in IGNORED_FIELDS and body[field] is not None:
        self.count(f"ignored/{field}")
      elif field not in _KNOWN_FIELDS:
        self.count("ignored/unknown_field")
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    if tools and not self.format.renders_tools:
      raise _bad("bad_tools", f"the run's chat format {self.format.name!r} cannot show tools",
                 "tools")
    if any(m.get("tool_calls") for m in messages) and not self.format.renders_tools:
      raise _bad("bad_messages", f"the run's chat format {self.format.name!r} has no tool "
                 "calls", "messages")
    return {"messages": messages, "tools": tools, "limit": limit,
            "logprobs": bool(body.get("logprobs")), "ids": bool(body.get("return_token_ids"))}

  def _open(self, session: str) -> sessions.Session:
    """The session, locked by the caller's thread (a new one if the last ended)."""
    while True:
      try:
        s = self.book.get(session)
      except ValueError as e:
        raise _bad("bad_session", str(e)) from None
      except sessions.TooManySessions as e:
        raise ApiError(429, "too_many_sessions", str(e), kind="rate_limit_error") from None
      s.lock.acquire()
      if not s.ended:
        return s
      s.lock.release()  # rewarded or expired meanwhile: the next request opens a new one

  def _chat(self, session: str, body) -> dict:
    req = self._request(body)
    s = self._open(session)
    try:
      try:
        prompt, bridged = s.prompt_ids(req["messages"], req["tools"])
      except (ValueError, KeyError, TypeError) as e:
        raise _bad("render_error", f"the chat format cannot render these messages: "
                   f"{str(e)[:200]}", "messages") from None
      room = self.max_len - len(prompt)
      if room < 1:
        raise ApiError(400, "context_length_exceeded",
                       f"the prompt is {len(prompt)} tokens; this model's context is "
                       f"{self.max_len} tokens, prompt and completion together", "messages",
                       code="context_length_exceeded")
      budget = min(req["limit"] or self.max_turn_tokens, room)
      try:
        completion = self.batcher.submit(prompt, budget).result()
      except serving.Overloaded as e:
        raise ApiError(503, "overloaded", f"the server is overloaded: {e}",
                       kind="server_error") from None
      except Exception as e:  # pylint: disable=broad-except  # the engine failed this request
        logging.warning("openai endpoint: generation failed: %r", e)
        raise ApiError(500, "engine_error", f"generation failed: {type(e).__name__}",
                       kind="server_error") from None
      message, finish = self._message(completion, req["tools"])
      returned = {"role": "assistant", "content": message["content"],
                  "tool_calls": [tc["function"] for tc in message.get("tool_calls", ())]}
      where = s.record(prompt, completion, req["messages"], req["tools"], returned, bridged)
    finally:
      s.lock.release()
    self.count("completions")
    self.count("completion_tokens", len(completion.tokens))
    choice = {"index": 0, "message": message, "finish_reason": finish,
              "logprobs": self._logprobs(completion) if req["logprobs"] else None}
    extra = {"session_id": session, "trajectory": where.trajectory, "turn": where.turn,
             "extended": where.extended, "bridged": where.bridged,
             "policy_version": completion.versions[-1]}
    if req["ids"]:
      extra.update(prompt_token_ids=list(prompt), completion_token_ids=list(completion.tokens),
                   completion_logprobs=list(completion.logprobs),
                   completion_versions=list(completion.versions))
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion.tokens),
                      "total_tokens": len(prompt) + len(completion.tokens)},
            "sao": extra}

  def _message(self, completion: serving.Completion, tools) -> tuple[dict, str]:
    """The assistant message of a completion and its finish reason."""
    parsed = self.format.parse_turn(completion.tokens, tools or ())
    for reason, _ in parsed.errors:
      self.count(f"tool_call_errors/{reason}")
    calls = []
    for call in parsed.tool_calls:
      problem = chat.validate_call(call, tools) if tools else "unknown_tool"
      if problem is not None:
        self.count(f"tool_call_errors/{problem}")  # still the harness's to answer
      calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {
          "name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}})
    message: dict[str, Any] = {"role": "assistant",
                               "content": parsed.content if parsed.content or not calls else None}
    if calls:
      message["tool_calls"] = calls
    if parsed.reasoning:
      message["reasoning_content"] = parsed.reasoning
    finish = "tool_calls" if calls else ("stop" if completion.stopped else "length")
    return message, finish

  def _logprobs(self, completion: serving.Completion) -> dict:
    to_bytes = getattr(self.tok, "decode_bytes", None)
    content = []
    for t, lp in zip(completion.tokens, completion.logprobs):
      raw = to_bytes([t]) if to_bytes else self.tok.decode([t]).encode()
      content.append({"token": self.tok.decode([t]), "logprob": lp, "bytes": list(raw),
                      "top_logprobs": []})
    return {"content": content}


def _json(body: bytes | None):
  if not body:
    raise _bad("bad_json", "the body is empty; send a JSON object")
  try:
    return json.loads(body)
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    raise _bad("bad_json", f"the body is not JSON: {str(e)[:120]}") from None


# --- HTTP -----------------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"  # keep-alive: a harness reuses its connection
  server_version = "sao-jax"
  timeout = 600  # seconds a connection may sit idle or trickle a request in

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    logging.debug("openai endpoint: " + format, *args)

  def _serve(self, method: str):
    app: OpenAIApp = self.server.app
    body, error = None, None
    length = self.headers.get("Content-Length")
    if method == "POST":
      if self.headers.get("Transfer-Encoding") or length is None:
        error = ApiError(411, "length_required", "send a Content-Length (no chunked bodies)")
      else:
        try:
          n = int(length)
        except ValueError:
          n = -1
        if n < 0:
          error = _bad("bad_json", "a malformed Content-Length")
        elif n > self.server.max_body_bytes:
          error = ApiError(413, "body_too_large", f"the body is {n} bytes; at most "
                           f"{self.server.max_body_bytes}")
        else:
          body = self.rfile.read(n)
    if error is not None:
      app.count("requests")
      app.count(f"errors/{error.reason}")
      self.close_connection = True  # the unread body would be taken for the next request
      self._send(error.status, error.body())
      return
    headers = {k.lower(): v for k, v in self.headers.items()}
    self._send(*app.handle(method, self.path, headers, body))

  def _send(self, status: int, payload: dict):
    data = json.dumps(payload, ensure_ascii=False).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    if self.close_connection:
      self.send_header("Connection", "close")
    self.end_headers()
    self.wfile.write(data)

  def do_GET(self):  # pylint: disable=invalid-name
    self._serve("GET")

  def do_POST(self):  # pylint: disable=invalid-name
    self._serve("POST")

  def do_DELETE(self):  # pylint: disable=invalid-name
    self._serve("DELETE")

  def do_PUT(self):  # pylint: disable=invalid-name
    self._serve("PUT")


class _HTTPServer(http.server.ThreadingHTTPServer):
  """A thread a connection, every one of which `close` ends and joins.

  A harness keeps its connection open between requests (keep-alive), so
  its handler thread sits in a read; `close_connections` shuts those
  sockets down so the threads return, and `server_close` joins them
  (threads are not daemons), so none is left to wake during interpreter
  shutdown.
  """

  daemon_threads = False
  block_on_close = True

  def __init__(self, address, handler):
    self._open: set = set()
    self._open_lock = threading.Lock()
    super().__init__(address, handler)

  def process_request(self, request, client_address):
    with self._open_lock:
      self._open.add(request)
    super().process_request(request, client_address)

  def shutdown_request(self, request):
    with self._open_lock:
      self._open.discard(request)
    super().shutdown_request(request)

  def close_connections(self):
    with self._open_lock:
      conns = list(self._open)
    for conn in conns:
      try:
        conn.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass  # closed meanwhile


class Server:
  """`app` over HTTP on `host:port` (0: a free port), a thread a connection.

  `port` is the bound port; `close` stops serving and ends every connection
  (a request in flight is answered first); the batcher is the caller's to
  close, after.
  """

  def __init__(self, app: OpenAIApp, host: str = loopback.LOOPBACK_HOST, port: int = 0,
               max_body_bytes: int | None = None):
    warning = loopback.exposure_warning(host, "the OpenAI-compatible endpoint",
                                        authenticated=app.api_key is not None)
    if warning:
      logging.warning("%s", warning)
    self.app = app
    self._http = _HTTPServer((host, port), _Handler)
    self._http.app = app
    # Room for a whole context of text: a token is a few bytes, JSON escapes double some.
    self._http.max_body_bytes = max_body_bytes or max(1 << 20, 64 * app.max_len)
    self.host, self.port = host, self._http.server_address[1]
    self._thread = threading.Thread(target=self._http.serve_forever, name="openai-http",
                                    daemon=True)
    self._thread.start()

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}"

  def close(self) -> None:
    self._http.shutdown()  # no new connections
    self._http.close_connections()
    self._http.server_close()  # joins the connections' threads
    self._thread.join(10.0)


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
  that sampled it. Without it the endpoint serves the params it was given.
  """

  def __init__(self, config, engine, tokenizer, root: str, *, host: str = loopback.LOOPBACK_HOST,
               port: int = 0, model_name: str = "sao-jax", api_key: str | None = None,
               rollout_id: str = "openai", max_sessions: int = 1024,
               idle_seconds: float = 3600.0, decode_steps: int | None = None,
               follow_weights: bool = False):
    chat_format = registry.make_format(config.env, tokenizer)
    f = config.fleet
    self.writer = fleet.ShardWriter(root, rollout_id, f.shard_trajectories, f.shard_seconds)
    self.batcher = serving.Batcher(engine, chat_format.turn_end_id,
                                   decode_steps=decode_steps or config.rollout.decode_steps)
    self.book = sessions.SessionBook(chat_format, tokenizer.vocab_size,
                                     engine.max_prefill_length, self.writer.write,
                                     current_version=lambda: engine.version,
                                     max_sessions=max_sessions, idle_seconds=idle_seconds)
    self.app = OpenAIApp(self.batcher, chat_format, tokenizer, self.book, model_name=model_name,
                         max_turn_tokens=config.rollout.max_turn_tokens, api_key=api_key)
    try:
      self.server = Server(self.app, host, port)
    except BaseException:
      self.batcher.close()
      raise
    self.url = self.server.url
    self.follower = (fleet.WeightFollower(root, engine.abstract_params()) if follow_weights
                     else None)

  def rotate(self) -> None:
    self.writer.rotate_if_older()

  def poll_weights(self) -> int | None:
    """The version taken into the engine, if the fleet published a different one."""
    got = None if self.follower is None else self.follower.poll()
    if got is None:
      return None
    params, version, _ = got
    self.batcher.update_params(params, version, copied=True)
    self.app.count("weights/updates")
    return version

  def close(self) -> None:
    self.server.close()
    self.batcher.close()
    self.writer.close()
    if self.follower is not None:
      self.follower.close()
