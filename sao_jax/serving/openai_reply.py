"""What the endpoint answers for a sampled completion: OpenAI's choices, log-probs and stream chunks.

`openai_api.py` samples; this module turns one `batcher.Completion` into
what a client reads, apart from HTTP:

  * `cut_at_stop`: a `stop` string is checked on the decoded text (the
    engine knows only ids): the completion is cut at the first token whose
    text completes a stop string, and the reply's text before it. The
    engine may have sampled a few tokens more (up to its decode chunk);
    they are neither returned nor recorded.
  * `chat_message` / `completion_text`: the assistant message (content,
    tool calls parsed from the sampled ids, reasoning) or the raw text, and
    the finish reason.
  * `chat_logprobs` / `completion_logprobs`: per token, its log-prob and the
    `top_logprobs` alternatives, in the chat and legacy shapes (-inf as
    OpenAI's -9999.0).
  * `chat_chunks` / `completion_chunks`: the same reply as stream chunks
    (`chat.completion.chunk` / `text_completion`).

Every string a client reads has lone surrogates replaced (`clean_text`),
so what a session later compares a client's request with is what the
client received.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from typing import Any

from sao_jax.envs import chat
from sao_jax.serving import batcher
from sao_jax.serving.http_server import clean_text


@dataclasses.dataclass(frozen=True)
class Cut:
  """A completion as served: its tokens (cut at a stop string) and why it ended."""

  completion: batcher.Completion  # what is returned and recorded
  stop: str | None  # the stop string it was cut at


def _body_text(tok, ids, turn_end: int) -> str:
  return tok.decode([t for t in ids if t != turn_end])


def cut_at_stop(completion: batcher.Completion, stops, tok, turn_end: int) -> Cut:
  """`completion` up to the first token whose text completes one of `stops`."""
  ids = completion.tokens
  if not stops:
    return Cut(completion, None)
  text = _body_text(tok, ids, turn_end)
  if not any(s in text for s in stops):
    return Cut(completion, None)
  lo, hi = 1, len(ids)  # the shortest prefix whose text holds a stop string
  while lo < hi:
    mid = (lo + hi) // 2
    if any(s in _body_text(tok, ids[:mid], turn_end) for s in stops):
      hi = mid
    else:
      lo = mid + 1
  text = _body_text(tok, ids[:lo], turn_end)
  stop = min((s for s in stops if s in text), key=text.index)
  c = completion
  return Cut(
    dataclasses.replace(
      c,
      tokens=c.tokens[:lo],
      logprobs=c.logprobs[:lo],
      versions=c.versions[:lo],
      stopped=True,
      top_logprobs=c.top_logprobs[:lo],
    ),
    stop,
  )


def _before(text: str, stop: str | None) -> str:
  return text if stop is None or stop not in text else text[: text.index(stop)]


def finish_reason(cut: Cut, calls: bool) -> str:
  if calls:
    return "tool_calls"
  return "stop" if cut.stop is not None or cut.completion.stopped else "length"


def chat_message(cut: Cut, chat_format, tools, count) -> tuple[dict, str]:
  """The assistant message of `cut` and its finish reason; malformed calls counted."""
  parsed = chat_format.parse_turn(cut.completion.tokens, tools or ())
  for reason, _ in parsed.errors:
    count(f"tool_call_errors/{reason}")
  calls = []
  for call in parsed.tool_calls:
    problem = chat.validate_call(call, tools) if tools else "unknown_tool"
    if problem is not None:
      count(f"tool_call_errors/{problem}")  # still the harness's to answer
    calls.append(
      {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
          "name": call.name,
          "arguments": json.dumps(call.arguments, ensure_ascii=False),
        },
      }
    )
  content = _before(parsed.content, cut.stop)
  message: dict[str, Any] = {
    "role": "assistant",
    "content": content if content or not calls else None,
  }
  if calls:
    message["tool_calls"] = calls
  reasoning = _before(parsed.reasoning, cut.stop)
  if reasoning:
    message["reasoning_content"] = reasoning
  return clean_text(message), finish_reason(cut, bool(calls))


def completion_text(cut: Cut, tok, turn_end: int) -> tuple[str, str]:
  """The text of a raw completion (without the turn end) and its finish reason."""
  return clean_text(_before(_body_text(tok, cut.completion.tokens, turn_end), cut.stop)), (
    finish_reason(cut, False)
  )


def _lp(value: float) -> float:
  return float(value) if math.isfinite(value) else -9999.0


def _piece(tok, t: int) -> tuple[str, list[int]]:
  to_bytes = getattr(tok, "decode_bytes", None)
  raw = to_bytes([t]) if to_bytes else tok.decode([t]).encode("utf-8", "replace")
  return clean_text(tok.decode([t])), list(raw)


def chat_logprobs(completion: batcher.Completion, tok) -> dict:
  """OpenAI's chat `logprobs`: per token its text, bytes, log-prob and alternatives."""
  content = []
  for k, (t, lp) in enumerate(zip(completion.tokens, completion.logprobs)):
    text, raw = _piece(tok, t)
    top = []
    for alt, alt_lp in completion.top_logprobs[k] if completion.top_logprobs else ():
      alt_text, alt_raw = _piece(tok, alt)
      top.append({"token": alt_text, "logprob": _lp(alt_lp), "bytes": alt_raw})
    content.append({"token": text, "logprob": _lp(lp), "bytes": raw, "top_logprobs": top})
  return {"content": content}


def completion_logprobs(completion: batcher.Completion, tok) -> dict:
  """The legacy completions' `logprobs`: tokens, their log-probs, alternatives, offsets."""
  tokens, offsets, at, tops = [], [], 0, []
  for k, t in enumerate(completion.tokens):
    text, _ = _piece(tok, t)
    tokens.append(text)
    offsets.append(at)
    at += len(text)
    if completion.top_logprobs:
      tops.append({_piece(tok, alt)[0]: _lp(alt_lp) for alt, alt_lp in completion.top_logprobs[k]})
  return {
    "tokens": tokens,
    "token_logprobs": [_lp(x) for x in completion.logprobs],
    "top_logprobs": tops if completion.top_logprobs else None,
    "text_offset": offsets,
  }


# --- streams ---------------------------------------------------------------------------------


def chat_chunks(
  head: dict, index: int, message: dict, finish: str, logprobs: dict | None
) -> list[dict]:
  """Chunks of one choice after its role chunk: reasoning, content (with its
  log-probs), each tool call, then the finish reason. `head`: id, object, created,
  model (and usage: None when the stream ends with a usage chunk)."""

  def chunk(delta, finish_reason=None, lp=None):
    return {
      **head,
      "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}],
    }

  out = []
  if message.get("reasoning_content"):
    out.append(chunk({"reasoning_content": message["reasoning_content"]}))
  if message.get("content") or logprobs is not None:
    out.append(chunk({"content": message.get("content") or ""}, lp=logprobs))
  for j, call in enumerate(message.get("tool_calls", ())):
    out.append(chunk({"tool_calls": [{"index": j, **call}]}))
  out.append(chunk({}, finish))
  return out


def role_chunk(head: dict, index: int) -> dict:
  return {
    **head,
    "choices": [
      {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
      }
    ],
  }


def completion_chunks(
  head: dict, index: int, text: str, finish: str, logprobs: dict | None
) -> list[dict]:
  return [
    {
      **head,
      "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}],
    },
    {**head, "choices": [{"index": index, "text": "", "logprobs": None, "finish_reason": finish}]},
  ]
