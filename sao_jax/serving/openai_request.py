"""An OpenAI request body, checked: what the endpoint honours, refused in one line otherwise.

`openai_api.py` serves; this module reads a chat completion or completion
body into a `Generation` (how to sample, how many, how to answer) plus the
messages and tools, or raises `ApiError` (OpenAI's error object and its
status). The rule: a field is honoured, or accepted because it changes
nothing the client can see (`user`, `metadata`, ...; counted as
`ignored/<field>`), or refused with a 400 naming it. Never silently dropped:

  * honoured: `temperature`, `top_p`, `seed`, `stop` (strings, cut on the
    server), `stop_token_ids` (ids, the engine stops), `n`, `stream`,
    `stream_options.include_usage`, `logprobs`, `top_logprobs`,
    `max_tokens` / `max_completion_tokens`, `tools`, `tool_choice` "auto" /
    "none";
  * refused unless neutral: `presence_penalty` / `frequency_penalty` (0),
    `logit_bias` ({}), `response_format` ({"type": "text"}), `modalities`
    (["text"]), `top_k` (-1), `min_p` (0), `repetition_penalty` (1),
    `echo` / `best_of` / `suffix` (completions).

Numbers are strict: a bool is not a number, NaN / Infinity and integers of
more than `MAX_DIGITS` digits are refused when the body is parsed, so no
body reaches the standard library's 4300-digit limit (a 500).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from sao_jax.serving import batcher

MAX_DIGITS = 40
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# OpenAI's rule for a function name.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ROLES = {
  "system": "system",
  "developer": "system",
  "user": "user",
  "assistant": "assistant",
  "tool": "tool",
}
# Accepted and ignored, counted: they change nothing a client can see in a reply.
IGNORED_FIELDS = (
  "user",
  "metadata",
  "store",
  "service_tier",
  "parallel_tool_calls",
  "reasoning_effort",
  "prediction",
)
# Accepted only at their neutral value (the value meaning "off").
_NEUTRAL = {
  "presence_penalty": (0, 0.0),
  "frequency_penalty": (0, 0.0),
  "logit_bias": ({},),
  "response_format": ({"type": "text"},),
  "modalities": (["text"],),
  "top_k": (-1, 0),
  "min_p": (0, 0.0),
  "repetition_penalty": (1, 1.0),
  "echo": (False,),
  "best_of": (1,),
  "suffix": ("",),
  "audio": (),
}
_CHAT_FIELDS = frozenset(
  (
    "model",
    "messages",
    "tools",
    "tool_choice",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stop_token_ids",
    "return_token_ids",
  )
  + IGNORED_FIELDS
  + tuple(_NEUTRAL)
)
_COMPLETION_FIELDS = (
  _CHAT_FIELDS - {"messages", "tools", "tool_choice", "top_logprobs", "max_completion_tokens"}
) | {"prompt"}


class ApiError(Exception):
  """A refused request: HTTP status, counted reason, OpenAI error type and message."""

  def __init__(
    self,
    status: int,
    reason: str,
    message: str,
    param: str | None = None,
    kind: str = "invalid_request_error",
    code: str | None = None,
    headers: dict | None = None,
  ):
    super().__init__(message)
    self.status, self.reason, self.message = status, reason, message
    self.param, self.kind, self.code = param, kind, code or reason
    self.headers = headers or {}

  def body(self) -> dict:
    return {
      "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
    }


def bad(reason: str, message: str, param: str | None = None) -> ApiError:
  return ApiError(400, reason, message, param)


# --- the body ----------------------------------------------------------------------------


def _int(text: str) -> int:
  if len(text.lstrip("-")) > MAX_DIGITS:
    raise bad("bad_number", f"an integer of {len(text)} digits; at most {MAX_DIGITS}")
  return int(text)


def _float(text: str) -> float:
  value = float(text)
  if not math.isfinite(value):
    raise bad("bad_number", f"the number {text[:40]} is beyond a float")
  return value


def _constant(name: str):
  raise bad("bad_number", f"{name} is not a JSON number; send a finite number")


def loads(body: bytes | None):
  """The JSON body, numbers strict (module docstring); ApiError otherwise."""
  if not body:
    raise bad("bad_json", "the body is empty; send a JSON object")
  try:
    return json.loads(body, parse_int=_int, parse_float=_float, parse_constant=_constant)
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
    raise bad("bad_json", f"the body is not JSON: {str(e)[:120]}") from None


def integer(body: dict, name: str, lo: int, hi: int, default=None):
  """`body[name]` as an int in [lo, hi] (bools refused); `default` when absent or null."""
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
    raise bad(f"bad_{name}", f"{name} must be an integer in [{lo}, {hi}]", name)
  return value


def number(body: dict, name: str, lo: float, hi: float, default=None, open_lo: bool = False):
  """`body[name]` as a finite float in [lo, hi] ((lo, hi] if `open_lo`)."""
  value = body.get(name)
  if value is None:
    return default
  if (
    isinstance(value, bool)
    or not isinstance(value, (int, float))
    or not (lo < value if open_lo else lo <= value)
    or not value <= hi
  ):
    span = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
    raise bad(f"bad_{name}", f"{name} must be a number in {span}", name)
  return float(value)


def flag(body: dict, name: str) -> bool:
  value = body.get(name)
  if value is not None and not isinstance(value, bool):
    raise bad(f"bad_{name}", f"{name} must be true or false", name)
  return bool(value)


def check_fields(body: dict, known: frozenset, count) -> None:
  """Refuses a non-neutral unsupported field; counts ignored and unknown ones."""
  for name, value in body.items():
    if name in _NEUTRAL:
      if value is not None and not any(
        value == v and type(value) is type(v) for v in _NEUTRAL[name]
      ):
        raise bad(
          f"unsupported_{name}",
          f"{name} is not supported (only "
          f"{' or '.join(json.dumps(v) for v in _NEUTRAL[name]) or 'null'})",
          name,
        )
    elif name in IGNORED_FIELDS:
      if value is not None:
        count(f"ignored/{name}")
    elif name not in known:
      count("ignored/unknown_field")


# --- how to sample and answer -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Generation:
  """What a request asks of the sampler and of the reply."""

  limit: int | None  # max new tokens (None: the server's default)
  n: int  # independent completions
  stream: bool
  include_usage: bool  # stream: a last chunk with `usage`
  logprobs: bool
  top_logprobs: int
  stop: tuple[str, ...]  # strings the reply is cut before
  sampling: batcher.RequestSampling | None  # None: the run's sampling
  return_ids: bool  # the prompt and completion ids in the reply's `sao` object


def _stop(body: dict, vocab_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
  stop = body.get("stop")
  stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
  if not (
    isinstance(stop, list)
    and len(stop) <= MAX_STOP_STRINGS
    and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
  ):
    raise bad(
      "bad_stop",
      f"stop must be a string or a list of at most {MAX_STOP_STRINGS} "
      f"non-empty strings of at most {MAX_STOP_CHARS} characters",
      "stop",
    )
  ids = body.get("stop_token_ids") or []
  if not (
    isinstance(ids, list)
    and len(ids) <= batcher.MAX_STOP_IDS
    and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)
  ):
    raise bad(
      "bad_stop_token_ids",
      f"stop_token_ids must be a list of at most "
      f"{batcher.MAX_STOP_IDS} token ids in [0, {vocab_size})",
      "stop_token_ids",
    )
  return tuple(stop), tuple(ids)


def generation(
  body: dict, *, chat: bool, vocab_size: int, default: batcher.RequestSampling | None
) -> Generation:
  """The request's `Generation` (ApiError on a bad or unsupported value)."""
  limit = body.get("max_completion_tokens") if chat else None
  limit = integer(body, "max_tokens", 1, 1 << 40) if limit is None else limit
  if chat:
    limit = integer({"max_tokens": limit}, "max_tokens", 1, 1 << 40)
  n = integer(body, "n", 1, MAX_N, 1)
  stream = flag(body, "stream")
  options = body.get("stream_options")
  if options is not None and not (
    stream and isinstance(options, dict) and set(options) <= {"include_usage"}
  ):
    raise bad(
      "bad_stream_options",
      'stream_options is {"include_usage": bool}, with stream: true',
      "stream_options",
    )
  include_usage = flag(options or {}, "include_usage")
  if chat:
    logprobs = flag(body, "logprobs")
    top = integer(body, "top_logprobs", 0, batcher.MAX_TOP_LOGPROBS, 0)
    if top and not logprobs:
      raise bad("bad_top_logprobs", "top_logprobs needs logprobs: true", "top_logprobs")
  else:  # the legacy field: an int, the alternatives per token
    top = integer(body, "logprobs", 0, batcher.MAX_TOP_LOGPROBS)
    logprobs, top = top is not None, top or 0
  stop, stop_ids = _stop(body, vocab_size)
  temperature = number(body, "temperature", 0.0, 2.0)
  top_p = number(body, "top_p", 0.0, 1.0, open_lo=True)
  seed = integer(body, "seed", 0, 2**63 - 1)
  sampling = None
  if (temperature, top_p, seed) != (None,) * 3 or stop_ids or top:
    base = default or batcher.RequestSampling()
    sampling = batcher.RequestSampling(
      temperature=base.temperature if temperature is None else temperature,
      top_p=base.top_p if top_p is None else top_p,
      seed=seed,
      stop_ids=stop_ids,
      top_logprobs=top,
    )
  return Generation(
    limit, n, stream, include_usage, logprobs, top, stop, sampling, flag(body, "return_token_ids")
  )


def completion_prompt(body: dict, tokenizer) -> list[int]:
  """/v1/completions' `prompt`: token ids, a string, or a list of one of either."""
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]  # a batch of one
  if isinstance(prompt, str) and prompt:
    return list(tokenizer.encode(prompt))
  if (
    isinstance(prompt, list)
    and prompt
    and all(
      isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tokenizer.vocab_size
      for t in prompt
    )
  ):
    return list(prompt)
  raise bad(
    "bad_prompt",
    f"prompt must be a non-empty string or a non-empty list of token "
    f"ids in [0, {tokenizer.vocab_size}) (one prompt a request)",
    "prompt",
  )


# --- messages and tools ------------------------------------------------------------------


def _text(content, where: str) -> str:
  """A message's content as text: a string, or a list of text parts joined."""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = []
    for part in content:
      if not (
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
      ):
        raise ApiError(
          400, "unsupported_content", f"{where}: only text content parts are supported", "messages"
        )
      parts.append(part["text"])
    return "".join(parts)
  raise bad(
    "bad_messages", f"{where}: content must be a string or a list of text parts", "messages"
  )


def _tool_calls(calls, where: str) -> list[dict]:
  if not isinstance(calls, list):
    raise bad("bad_messages", f"{where}: tool_calls must be a list", "messages")
  out = []
  for j, call in enumerate(calls):
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
      raise bad("bad_messages", f"{where}: tool_calls[{j}] needs function.name", "messages")
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, (str, dict)):
      raise bad(
        "bad_messages",
        f"{where}: tool_calls[{j}].function.arguments must be a JSON string",
        "messages",
      )
    out.append({"name": fn["name"], "arguments": arguments})
  return out


def parse_messages(raw) -> list[dict]:
  """OpenAI messages as the chat format's: role, text content, flat tool calls."""
  if not isinstance(raw, list) or not raw:
    raise bad("bad_messages", "messages must be a non-empty list", "messages")
  out = []
  for k, m in enumerate(raw):
    where = f"messages[{k}]"
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
      raise bad("bad_messages", f"{where}: role must be one of {sorted(_ROLES)}", "messages")
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
        raise bad("bad_messages", f"{where}: {m['role']} message without content", "messages")
      message["content"] = _text(m["content"], where)
    out.append(message)
  if out[-1]["role"] == "assistant":
    raise bad("bad_messages", "the last message is the assistant's: nothing to answer", "messages")
  return out


def parse_tools(raw) -> list[dict]:
  """OpenAI function tools, checked; returned as given (the prompt shows them so)."""
  if raw is None:
    return []
  if not isinstance(raw, list):
    raise bad("bad_tools", "tools must be a list", "tools")
  names = set()
  for k, tool in enumerate(raw):
    where = f"tools[{k}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
      raise bad("bad_tools", f'{where}: only {{"type": "function"}} tools', "tools")
    fn = tool.get("function")
    if (
      not isinstance(fn, dict)
      or not isinstance(fn.get("name"), str)
      or not _TOOL_NAME.match(fn["name"])
    ):
      raise bad("bad_tools", f"{where}: function.name must match [A-Za-z0-9_-]{{1,64}}", "tools")
    if fn["name"] in names:
      raise bad("bad_tools", f"{where}: a second tool named {fn['name']!r}", "tools")
    names.add(fn["name"])
    if "description" in fn and not isinstance(fn["description"], str):
      raise bad("bad_tools", f"{where}: function.description must be a string", "tools")
    params = fn.get("parameters")
    if params is not None:
      if not isinstance(params, dict):
        raise bad(
          "bad_tools", f"{where}: function.parameters must be a JSON schema object", "tools"
        )
      if not isinstance(params.get("properties", {}), dict) or not (
        isinstance(params.get("required", []), list)
        and all(isinstance(r, str) for r in params.get("required", []))
      ):
        raise bad(
          "bad_tools",
          f"{where}: parameters.properties must be an object and "
          "parameters.required a list of names",
          "tools",
        )
  return raw
