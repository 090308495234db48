"""Chat formats: how prompts, sampled turns and observations become token ids.

The rollout driver never re-tokenizes a transcript. It renders the prompt
once (`prompt_ids`), appends what the policy samples up to and including
the turn-end token (the action tokens), then appends each observation as
the format's *bridge* to the next turn (`observation_ids`, not action
tokens). A demonstration is built the same way, with `action_ids` standing
in for what the model would have sampled. So the trained tokens are exactly
the sampled ones, and for a tool cycle the transcript is also what Qwen3's
official chat template renders for the same conversation (`render`).

A Qwen3 transcript with one tool call (`enable_thinking=True`):

    ids                                                   action   built by
    <|im_start|>system\\n{system}\\n\\n# Tools ... <tools>   False    prompt_ids
      {"type": "function", ...}\\n</tools> ...<|im_end|>\\n
    <|im_start|>user\\n{question}<|im_end|>\\n               False
    <|im_start|>assistant\\n                                False    (generation prompt)
    <think>\\n{reasoning}\\n</think>\\n\\n{content}\\n         True     sampled (action_ids)
    <tool_call>\\n{"name": "python", "arguments": {..}}\\n    True
    </tool_call><|im_end|>                                True     the turn end is sampled
    \\n<|im_start|>user\\n<tool_response>\\n{output}\\n        False    observation_ids:
      </tool_response><|im_end|>\\n<|im_start|>assistant\\n  False      the bridge
    <think>\\n...\\n</think>\\n\\nThe answer is 53.<|im_end|>  True     sampled

Control tokens (`<|im_start|>`, `<tool_call>`, `<think>`, ...) enter by id
(`tokenizer.special_id`) and every piece of text by `tokenizer.encode`,
which never yields a control token. Text that spells `<|im_end|>` in a
message, a tool schema or a program's output therefore stays text. This is
one deliberate difference from Hugging Face's `apply_chat_template`, which
renders a string and lets the tokenizer match added tokens inside it, so a
user message containing "<|im_end|>" would end the turn there. Where no
content spells a control token, `render` equals the official template
tokenized that way, token for token (tests/envs/test_chat.py and
test_chat_qwen3_5.py check it), including
the control tokens the template itself writes as text: the instructions of
its tools block contain "<tool_call></tool_call>" and an example call, and
those come out as ids 151657 / 151658 (Qwen3.5: 248058 / 248059), as the
official tokenizer makes them.

Tool calls are parsed from ids (`parse_turn`): a call is what lies between
the `<tool_call>` and `</tool_call>` ids, so a turn that writes the text
"<tool_call>" has made no call. Formats:

    "raw"    the toy environments' format: the prompt text (after <bos>), each
             action then the tokenizer's turn end, observations as text.
    "plain"  role-free text for base models: message contents joined by
             blank lines; the turn end is <eos>.
    "qwen3"  Qwen3's chat template (Qwen3-30B-A3B), with tools and thinking.
    "qwen3_5"  Qwen3.5's chat template (Qwen3.5-35B-A3B): XML tool calls, the
             think block opened by the generation prompt.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  text: str  # the turn decoded, without the turn end
  content: str  # outside tool calls and <think>...</think>, stripped
  reasoning: str  # inside <think>...</think> ("" if none)
  tool_calls: tuple[ToolCall, ...]  # well-formed calls only
  # (reason, message) of malformed calls, reasons from CALL_ERRORS.
  errors: tuple[tuple[str, str], ...]
  ended: bool  # the turn end was sampled (False: cut at the turn limit)
  # The calls and the malformed ones together, in the order the turn wrote
  # them: Qwen's tool responses carry no call ids, so they must answer in
  # this order.
  sequence: tuple = ()


# Why a call was malformed: qwen3's JSON calls "bad_json" / "not_an_object",
# qwen3_5's XML calls "bad_xml"; either "missing_name", "bad_arguments", and a
# <tool_call> the turn never closed "unclosed".
CALL_ERRORS = ("bad_json", "not_an_object", "missing_name", "bad_arguments", "unclosed", "bad_xml")


class ChatFormat:
  """The interface the driver and the demonstrations use; see the module docstring."""

  name = "base"
  turn_end_id: int
  # Whether the format renders tool schemas and parses tool calls.
  renders_tools = False

  def __init__(self, tokenizer):
    self.tok = tokenizer

  def prompt_ids(self, prompt, tools=()) -> list[int]:
    """A task's prompt (text, or messages), ending with the generation prompt."""
    raise NotImplementedError

  def observation_ids(self, observation) -> list[int]:
    """The bridge after a sampled turn end: text, or tool / user messages."""
    raise NotImplementedError

  def action_ids(self, message) -> list[int]:
    """An assistant turn exactly as given, turn end included."""
    raise NotImplementedError

  def cut_turn_ids(self) -> list[int]:
    """What closes a turn cut at the turn limit before the bridge (not action tokens).

    Text formats: nothing (the toys' transcripts always ran on). Role
    formats close the turn with their turn end, so the next bridge starts
    where the template expects it.
    """
    return []

  def demonstration_ids(self, message) -> list[int]:
    """A demonstration's assistant turn as this format's policy samples it (SFT's target).

    The same as `action_ids` unless the format's generation prompt decides
    part of the turn (qwen3's thinking switch).
    """
    return self.action_ids(message)

  def parse_turn(self, ids: Sequence[int], tools=()) -> ParsedTurn:
    """One sampled turn (its turn end, if sampled, the last id); `tools`, the
    task's declared tools, type arguments where the call syntax leaves them text."""
    raise NotImplementedError

  def render(self, messages, tools=(), add_generation_prompt: bool = False) -> list[int]:
    """A whole conversation (system / user / assistant / tool messages)."""
    raise NotImplementedError


# --- text formats: raw and plain -------------------------------------------------


class _TextFormat(ChatFormat):
  """A format without roles or control tokens: every piece is text.

  Its generation prompt is empty, so a conversation rendered whole is just
  the driver's concatenation: the prompt, then each assistant turn, then
  each run of tool / user messages as one observation.
  """

  def _check_no_tools(self, tools):
    if tools:
      raise ValueError(
        f"the {self.name!r} chat format cannot show tools to the model; "
        "use chat_format 'qwen3' for tasks with tools"
      )

  def _bos(self) -> list[int]:
    return [self.tok.bos_id] if self.tok.bos_id is not None else []

  def _action_text(self, message) -> str:
    if isinstance(message, str):
      return message
    if message.get("tool_calls"):
      raise ValueError(f"the {self.name!r} chat format has no tool calls")
    if message.get("reasoning_content"):
      raise ValueError(f"the {self.name!r} chat format has no reasoning channel")
    return message.get("content") or ""

  def action_ids(self, message) -> list[int]:
    return self.tok.encode(self._action_text(message)) + [self.turn_end_id]

  def parse_turn(self, ids: Sequence[int], tools=()) -> ParsedTurn:
    del tools  # no tool calls
    ids = list(ids)
    ended = bool(ids) and ids[-1] == self.turn_end_id
    # Every turn-end id is dropped, as the driver always did; the engine stops
    # at the first, so only the last id can be one.
    text = self.tok.decode([t for t in ids if t != self.turn_end_id])
    return ParsedTurn(text=text, content=text, reasoning="", tool_calls=(), errors=(), ended=ended)

  def _prompt_from(self, messages) -> Any:
    raise NotImplementedError

  def render(self, messages, tools=(), add_generation_prompt: bool = False) -> list[int]:
    del add_generation_prompt  # empty in a text format
    messages = list(messages)
    first = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    ids = self.prompt_ids(self._prompt_from(messages[:first]), tools)
    k = first
    while k < len(messages):
      if messages[k]["role"] == "assistant":
        ids += self.action_ids(messages[k])
        k += 1
        continue
      run = []
      while k < len(messages) and messages[k]["role"] != "assistant":
        run.append(messages[k])
        k += 1
      ids += self.observation_ids(run)
    return ids


class RawFormat(_TextFormat):
  """The toy environments' format, as the driver and demonstrations always built it.

  Prompt: <bos> (if the tokenizer has one) + the prompt text; an action: its
  text + the tokenizer's turn end; an observation: its text (`encode_lossy`,
  so that a tool's output can never fail the episode). No roles, no tools.
  """

  name = "raw"

  def __init__(self, tokenizer):
    super().__init__(tokenizer)
    self.turn_end_id = tokenizer.turn_end_id

  def prompt_ids(self, prompt, tools=()) -> list[int]:
    self._check_no_tools(tools)
    if not isinstance(prompt, str):
      raise ValueError(
        "the 'raw' chat format takes a text prompt, not messages; "
        "use chat_format 'plain' or 'qwen3' for chat messages"
      )
    return self._bos() + self.tok.encode(prompt)

  def observation_ids(self, observation) -> list[int]:
    if isinstance(observation, str):
      return self.tok.encode_lossy(observation)
    return self.tok.encode_lossy("".join(m["content"] for m in observation))

  def _prompt_from(self, messages):
    if len(messages) != 1 or messages[0]["role"] != "user":
      raise ValueError("the 'raw' chat format renders one user prompt, then turns")
    return messages[0]["content"]


class PlainFormat(_TextFormat):
  """Role-free text, for a base model: contents joined by blank lines.

  Prompt: <bos> + the message contents joined by "\\n\\n", then "\\n"; an
  action: its text + <eos> (the tokenizer's turn end if it has no eos); an
  observation: its text (messages: their contents joined alike). No tools.
  """

  name = "plain"

  def __init__(self, tokenizer):
    super().__init__(tokenizer)
    self.turn_end_id = tokenizer.eos_id if tokenizer.eos_id is not None else (tokenizer.turn_end_id)

  @staticmethod
  def _join(messages) -> str:
    return "\n\n".join(m["content"] for m in messages) + "\n" if messages else ""

  def prompt_ids(self, prompt, tools=()) -> list[int]:
    self._check_no_tools(tools)
    text = prompt + "\n" if isinstance(prompt, str) else self._join(list(prompt))
    return self._bos() + self.tok.encode(text)

  def observation_ids(self, observation) -> list[int]:
    if isinstance(observation, str):
      return self.tok.encode_lossy(observation)
    return self.tok.encode_lossy(self._join(list(observation)))

  def _prompt_from(self, messages):
    return messages


# --- qwen3 and qwen3_5: what the two templates share ---------------------------------

_QWEN_CONTROL = (
  "<|im_start|>",
  "<|im_end|>",
  "<tool_call>",
  "</tool_call>",
  "<tool_response>",
  "</tool_response>",
  "<think>",
  "</think>",
)


class _Special(int):
  """A control token's id in a list of pieces (text pieces are strs)."""


def function_schema(tool: dict) -> dict:
  """A tool's function dict, from an OpenAI schema or the bare function dict."""
  fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
  if not isinstance(fn.get("name"), str):
    raise ValueError(f"tool schema without a function name: {str(tool)[:80]}")
  return fn


def _openai_tool(tool: dict) -> dict:
  """The {"type": "function", "function": {...}} form Qwen was trained to read."""
  return tool if isinstance(tool.get("function"), dict) else {"type": "function", "function": tool}


def _tool_json(tool: dict) -> str:
  """A tool as the templates' `tojson` writes it (transformers': ensure_ascii=False, ", ")."""
  return json.dumps(_openai_tool(tool), ensure_ascii=False)


class _QwenFormat(ChatFormat):
  """ChatML turns, as Qwen3's and Qwen3.5's templates both write them.

  Shared: <|im_start|>ROLE\\n ... <|im_end|>\\n turns; the tools block in the
  system turn; tool results as one user turn of <tool_response> blocks
  (consecutive tool messages share it); think blocks; a call is what lies
  between the <tool_call> and </tool_call> ids. Each template's own rules
  (what a turn's text is trimmed to, when a think block shows, how a call is
  written and read, the generation prompt) are the subclasses' hooks.
  """

  renders_tools = True
  family = "Qwen"  # the model family, for messages

  def __init__(self, tokenizer, enable_thinking: bool = True):
    super().__init__(tokenizer)
    try:
      ids = {t: tokenizer.special_id(t) for t in _QWEN_CONTROL}
    except KeyError as e:
      raise ValueError(
        f"chat_format {self.name!r} needs {self.family}'s tokenizer "
        f"(env.tokenizer = {self.name!r}): {e.args[0]}"
      ) from None
    self.enable_thinking = bool(enable_thinking)
    self._control = {t: _Special(i) for t, i in ids.items()}
    self.im_start, self.im_end = self._control["<|im_start|>"], self._control["<|im_end|>"]
    self.call_start = self._control["<tool_call>"]
    self.call_end = self._control["</tool_call>"]
    self.response_start = self._control["<tool_response>"]
    self.response_end = self._control["</tool_response>"]
    self.think_start, self.think_end = self._control["<think>"], self._control["</think>"]
    self.turn_end_id = int(self.im_end)

  # --- pieces -> ids --------------------------------------------------------------

  def _ids(self, pieces: list) -> list[int]:
    """Control ids as they are; each run of text between them encoded as one string.

    Encoding the whole run at once matters: BPE merges across what the
    template writes as separate strings ("assistant\\n" + content), exactly
    as the official tokenizer does when it splits the rendered string only
    at control tokens.
    """
    out, text = [], []
    for piece in pieces:
      if isinstance(piece, _Special):
        if text:
          out += self.tok.encode("".join(text))
          text = []
        out.append(int(piece))
      else:
        text.append(piece)
    if text:
      out += self.tok.encode("".join(text))
    return out

  def _literal(self, text: str) -> list:
    """The template's own text, its control-token spellings made ids (as the
    official tokenizer reads them). Only for the template's constants: content
    never goes through here."""
    parts = re.split("(" + "|".join(map(re.escape, self._control)) + ")", text)
    return [self._control[p] if k % 2 else p for k, p in enumerate(parts)]

  # --- the template's hooks ---------------------------------------------------------

  @staticmethod
  def _text(content: str) -> str:
    """A message's content as the template writes it."""
    return content

  def _system_turn(self, system: str | None, tools) -> list:
    raise NotImplementedError

  def _later_system(self, content: str) -> list:
    raise NotImplementedError

  def _no_query(self, messages) -> int:
    """The last-query index when no user turn is a query."""
    raise NotImplementedError

  def _shows_thinking(self, k: int, last_query: int, n: int, reasoning: str) -> bool:
    raise NotImplementedError

  def _assistant(self, message: dict, show_thinking) -> list:
    raise NotImplementedError

  def _generation_prompt(self) -> list:
    raise NotImplementedError

  def _read_call(self, body: str, tools) -> tuple[ToolCall | None, tuple[str, str] | None]:
    raise NotImplementedError

  # --- shared pieces ----------------------------------------------------------------

  def _content_and_reasoning(self, message: dict) -> tuple[str, str]:
    """(content, reasoning) as both templates take them from an assistant message:
    `reasoning_content` if given, else what the content's <think>...</think> holds."""
    content, reasoning = self._text(message.get("content") or ""), message.get("reasoning_content")
    if isinstance(reasoning, str):
      return content, reasoning
    if "</think>" in content:
      head = content.split("</think>")[0]
      return (
        content.split("</think>")[-1].lstrip("\n"),
        head.rstrip("\n").split("<think>")[-1].lstrip("\n"),
      )
    return content, ""

  def _tool_run(self, contents: list[str]) -> list:
    pieces = [self.im_start, "user"]
    for c in contents:
      pieces += ["\n", self.response_start, "\n" + self._text(c) + "\n", self.response_end]
    return pieces + [self.im_end, "\n"]

  def _user(self, role: str, content: str) -> list:
    return [self.im_start, role + "\n" + self._text(content), self.im_end, "\n"]

  def _turns(self, messages, k: int = 0) -> tuple[list, int]:
    """The turn of the user or system message at `k`, or of the run of tool messages
    that starts there, and the index after it."""
    if messages[k]["role"] != "tool":
      return self._user(messages[k]["role"], messages[k]["content"]), k + 1
    run = []
    while k < len(messages) and messages[k]["role"] == "tool":
      run.append(messages[k]["content"])
      k += 1
    return self._tool_run(run), k

  def _last_query(self, messages) -> int:
    """The last user turn that is a real query, not a wrapped tool response."""
    for k in range(len(messages) - 1, -1, -1):
      c = self._text(messages[k].get("content") or "")  # a call-only turn has None
      if messages[k]["role"] == "user" and not (
        c.startswith("<tool_response>") and c.endswith("</tool_response>")
      ):
        return k
    return self._no_query(messages)

  # --- the interface ----------------------------------------------------------------

  def render(self, messages, tools=(), add_generation_prompt: bool = False) -> list[int]:
    messages = [dict(m) for m in messages]
    for k, m in enumerate(messages):
      if m.get("role") not in ("system", "user", "assistant", "tool"):
        raise ValueError(
          f"message {k}: role {m.get('role')!r} is not system / user / assistant / tool"
        )
      if m["role"] != "assistant" and not isinstance(m.get("content"), str):
        raise ValueError(f"message {k} ({m['role']}): content must be a str")
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    pieces = self._system_turn(system, tools)
    last_query, k = self._last_query(messages), int(system is not None)
    while k < len(messages):
      m = messages[k]
      if m["role"] == "assistant":
        _, reasoning = self._content_and_reasoning(m)
        show = self._shows_thinking(k, last_query, len(messages), reasoning)
        pieces += [self.im_start, "assistant\n"] + self._assistant(m, show) + ["\n"]
        k += 1
      elif m["role"] == "system":
        pieces += self._later_system(m["content"])
        k += 1
      else:
        turn, k = self._turns(messages, k)
        pieces += turn
    if add_generation_prompt:
      pieces += self._generation_prompt()
    return self._ids(pieces)

  def prompt_ids(self, prompt, tools=()) -> list[int]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return self.render(messages, tools, add_generation_prompt=True)

  def cut_turn_ids(self) -> list[int]:
    """<|im_end|>: a turn cut before its sampled turn end is closed, unsampled, so
    the bridge's "\\n<|im_start|>user" follows a closed assistant turn."""
    return [self.turn_end_id]

  def observation_ids(self, observation) -> list[int]:
    """ "\\n" (after the sampled <|im_end|>), the new turns, the generation prompt.

    A str is one user message; "" or [] adds no turn (two assistant turns
    in a row, as the template renders them).
    """
    if isinstance(observation, str):
      observation = [{"role": "user", "content": observation}] if observation else []
    observation = list(observation)
    pieces, k = ["\n"], 0
    while k < len(observation):
      role = observation[k]["role"]
      if role not in ("tool", "user"):
        raise ValueError(f"observation message {k}: role {role!r} is not tool / user")
      turn, k = self._turns(observation, k)
      pieces += turn
    return self._ids(pieces + self._generation_prompt())

  def parse_turn(self, ids: Sequence[int], tools=()) -> ParsedTurn:
    """Content, reasoning and tool calls, split at control-token ids only.

    Reasoning is what lies inside <think>...</think> (or before a lone
    </think>, or after a <think> that never closed); a call is what lies
    between <tool_call> and </tool_call>, read by the template's own call
    syntax (`tools`, if given, types its arguments where the syntax leaves
    them text). A malformed call is reported in `errors` and the rest of the
    turn still parsed.
    """
    ids = [int(t) for t in ids]
    ended = bool(ids) and ids[-1] == self.turn_end_id
    body = ids[:-1] if ended else ids
    if self.think_end in body:
      cut = body.index(self.think_end)
      start = body.index(self.think_start) + 1 if self.think_start in body[:cut] else 0
      reasoning_ids, rest = body[start:cut], body[cut + 1 :]
      outside = body[: max(start - 1, 0)] + rest
    elif self.think_start in body:  # thinking cut off
      start = body.index(self.think_start)
      reasoning_ids, outside = body[start + 1 :], body[:start]
    else:
      reasoning_ids, outside = [], body
    content_ids, calls, errors, sequence, k = [], [], [], [], 0
    while k < len(outside):
      if outside[k] != self.call_start:
        content_ids.append(outside[k])
        k += 1
        continue
      if self.call_end not in outside[k + 1 :]:
        errors.append(("unclosed", "a <tool_call> without </tool_call> (the turn was cut)"))
        sequence.append(errors[-1])
        break
      end = outside.index(self.call_end, k + 1)
      call, error = self._read_call(self.tok.decode(outside[k + 1 : end]), tools)
      if call is not None:
        calls.append(call)
      else:
        errors.append(error)
      sequence.append(call if call is not None else error)
      k = end + 1
    return ParsedTurn(
      text=self.tok.decode(body),
      content=self.tok.decode(content_ids).strip(),
      reasoning=self.tok.decode(reasoning_ids).strip("\n"),
      tool_calls=tuple(calls),
      errors=tuple(errors),
      ended=ended,
      sequence=tuple(sequence),
    )


# --- qwen3 --------------------------------------------------------------------------

# Qwen3's tools block, as its template writes it. Its instructions name the
# <tool_call> tags in text that the official tokenizer turns into the control
# tokens, so `_literal` makes them ids.
_QWEN3_TOOLS_INTRO = (
  "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_QWEN3_TOOLS_OUTRO = (
  "\n</tools>\n\nFor each function call, return a json object with function name and "
  "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
  '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class Qwen3Format(_QwenFormat):
  """Qwen3's chat template (Qwen3-30B-A3B's tokenizer_config.json), token in / token out.

  `render` follows the template line by line: the tools block in the system
  turn; tool results as user turns wrapped in <tool_response> (consecutive
  tool messages share one); `<think>` shown only for assistant turns after
  the last real user query (tool responses are not queries); the generation
  prompt with an empty think block when thinking is off. Calls are JSON:
  {"name": ..., "arguments": {...}}. Differences, all deliberate: content that
  spells a control token stays text; an unknown role raises instead of
  vanishing; an assistant's `content: None` is "".

  The driver's transcript (prompt, sampled turns, bridges) equals `render`
  of the same conversation for tool cycles with thinking on where every
  sampled turn's think block holds reasoning. A turn whose think block is
  empty keeps it in the transcript, while the template drops an empty
  block from turns before the last (a tool turn with `<think>\\n\\n</think>`
  makes the transcript longer than the re-render, 331 vs 327 tokens in one
  case); with thinking off the transcript keeps the empty think block of
  each generation prompt, which the template drops from earlier turns. In
  both cases the transcript is what the model saw, which is what trains.
  """

  name = "qwen3"
  family = "Qwen3"

  def _generation_prompt(self) -> list:
    pieces = [self.im_start, "assistant\n"]
    if not self.enable_thinking:
      pieces += [self.think_start, "\n\n", self.think_end, "\n\n"]
    return pieces

  def _system_turn(self, system: str | None, tools) -> list:
    if not tools:
      return [] if system is None else self._user("system", system)
    pieces = [
      self.im_start,
      "system\n" + ("" if system is None else system + "\n\n"),
      _QWEN3_TOOLS_INTRO,
    ] + ["\n" + _tool_json(tool) for tool in tools]
    return pieces + self._literal(_QWEN3_TOOLS_OUTRO) + [self.im_end, "\n"]

  def _later_system(self, content: str) -> list:
    return self._user("system", content)

  def _no_query(self, messages) -> int:
    return len(messages) - 1  # the template's namespace default

  def _shows_thinking(self, k: int, last_query: int, n: int, reasoning: str) -> bool:
    return k > last_query and (k == n - 1 or bool(reasoning))

  def _calls(self, content: str, tool_calls) -> list:
    pieces = []
    for k, call in enumerate(tool_calls or ()):
      if k > 0 or content:
        pieces.append("\n")
      if isinstance(call.get("function"), dict):
        call = call["function"]
      arguments = call.get("arguments", {})
      if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
      pieces += [
        self.call_start,
        '\n{"name": "' + call["name"] + '", "arguments": ' + arguments + "}\n",
        self.call_end,
      ]
    return pieces

  def _assistant(self, message: dict, show_thinking: bool | None) -> list:
    """An assistant turn after its "<|im_start|>assistant\\n", through <|im_end|>.

    show_thinking None: as sampled (a think block iff reasoning_content is
    given); True / False: the template's rule for this position.
    """
    content, reasoning = self._content_and_reasoning(message)
    if show_thinking is None:
      show_thinking = isinstance(message.get("reasoning_content"), str)
    pieces = []
    if show_thinking:
      pieces += [
        self.think_start,
        "\n" + reasoning.strip("\n") + "\n",
        self.think_end,
        "\n\n" + content.lstrip("\n"),
      ]
    else:
      pieces.append(content)
    return pieces + self._calls(content, message.get("tool_calls")) + [self.im_end]

  def _read_call(self, body: str, tools) -> tuple[ToolCall | None, tuple[str, str] | None]:
    del tools  # JSON carries its own types
    return _read_json_call(body)

  def action_ids(self, message) -> list[int]:
    if isinstance(message, str):
      message = {"role": "assistant", "content": message}
    return self._ids(self._assistant(message, None))

  def demonstration_ids(self, message) -> list[int]:
    """The turn as a Qwen3 policy samples it in this thinking mode.

    Thinking on: Qwen3 opens every turn with a think block, so a message
    without `reasoning_content` gets an empty one (`<think>\\n\\n</think>\\n\\n`,
    as the template writes the last turn). SFT then teaches the layout the
    driver will sample instead of turns that skip the block. Thinking off:
    the generation prompt already holds the empty block, so any reasoning
    is dropped and the turn is its content and calls.
    """
    if isinstance(message, str):
      message = {"role": "assistant", "content": message}
    content, reasoning = self._content_and_reasoning(message)
    message = dict(message, content=content, reasoning_content=reasoning)
    return self._ids(self._assistant(message, self.enable_thinking))


# --- qwen3_5 ------------------------------------------------------------------------

# Qwen3.5's tools block, as its template writes it (the instructions' <tool_call>
# spellings become the control ids, as for Qwen3).
_QWEN3_5_TOOLS_INTRO = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
_QWEN3_5_TOOLS_OUTRO = (
  "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with "
  "NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
  "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>"
  "\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
  "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST "
  "follow the specified format: an inner <function=...></function> block must be nested "
  "within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You "
  "may provide optional reasoning for your function call in natural language BEFORE the "
  "function call, but NOT after\n- If there is no function call available, answer the "
  "question like normal with your current knowledge and do not tell the user about "
  "function calls\n</IMPORTANT>"
)


class Qwen3_5Format(_QwenFormat):
  """Qwen3.5's chat template (Qwen3.5-35B-A3B's chat_template.jinja), token in / token out.

  Where it differs from Qwen3's, `render` follows it line by line:

  - every message's content is trimmed; a system message after the first
    raises, as does a conversation without a user query;
  - the tools block comes first in the system turn, the system prompt after
    its instructions;
  - calls are XML, as Qwen3-Coder's: <tool_call>\\n<function=NAME>\\n then, per
    argument, <parameter=ARG>\\nVALUE\\n</parameter>\\n, then </function>\\n
    </tool_call>; a str VALUE is written as is, an object or array as JSON,
    anything else as Python's str() (True, None, 2.5);
  - every assistant turn after the last real user query shows its think block,
    an empty one too (Qwen3 dropped empty blocks from earlier turns);
  - the generation prompt opens the think block ("<think>\\n") with thinking
    on and holds an empty one with thinking off.

  So the policy's turn starts inside the generation prompt: `action_ids` (and
  `demonstration_ids`, the same) is what follows this format's generation
  prompt, which depends on the thinking mode, and the driver's transcript of
  a tool cycle equals `render` of the same conversation in both modes, except
  where a thinking turn's reasoning is empty ("</think>" sampled right after
  "<think>\\n", where the template writes "<think>\\n\\n</think>"). Deliberate
  differences: content that spells a control token stays text; arguments
  given as a JSON string are parsed (the template raises); tool output given
  first (no user turn before it) still opens a user turn.
  """

  name = "qwen3_5"
  family = "Qwen3.5"

  @staticmethod
  def _text(content: str) -> str:
    return content.strip()

  def _generation_prompt(self) -> list:
    if self.enable_thinking:
      return [self.im_start, "assistant\n", self.think_start, "\n"]
    return [self.im_start, "assistant\n", self.think_start, "\n\n", self.think_end, "\n\n"]

  def _system_turn(self, system: str | None, tools) -> list:
    if not tools:
      return [] if system is None else self._user("system", system)
    pieces = [self.im_start, "system\n" + _QWEN3_5_TOOLS_INTRO]
    pieces += ["\n" + _tool_json(tool) for tool in tools] + self._literal(_QWEN3_5_TOOLS_OUTRO)
    if system is not None and system.strip():
      pieces.append("\n\n" + system.strip())
    return pieces + [self.im_end, "\n"]

  def _later_system(self, content: str) -> list:
    raise ValueError(
      "chat_format 'qwen3_5': a system message must be the first message "
      "(Qwen3.5's template: 'System message must be at the beginning.')"
    )

  def _no_query(self, messages) -> int:
    raise ValueError(
      "chat_format 'qwen3_5': no user query in the messages (Qwen3.5's "
      "template: 'No user query found in messages.')"
    )

  def _shows_thinking(self, k: int, last_query: int, n: int, reasoning: str) -> bool:
    return k > last_query

  def _content_and_reasoning(self, message: dict) -> tuple[str, str]:
    content, reasoning = super()._content_and_reasoning(message)
    return content, reasoning.strip()

  def _calls(self, content: str, tool_calls) -> list:
    pieces = []
    for k, call in enumerate(tool_calls or ()):
      if isinstance(call.get("function"), dict):
        call = call["function"]
      arguments = call.get("arguments") or {}
      if isinstance(arguments, str):  # OpenAI style: the arguments as a JSON string
        arguments = json.loads(arguments) if arguments.strip() else {}
      if not isinstance(arguments, dict):
        raise ValueError(f"tool call {call.get('name')!r}: arguments must be an object")
      head = ("\n\n" if content.strip() else "") if k == 0 else "\n"
      body = "".join(
        f"<parameter={key}>\n{_parameter_text(value)}\n</parameter>\n"
        for key, value in arguments.items()
      )
      pieces += [
        head,
        self.call_start,
        f"\n<function={call['name']}>\n{body}</function>\n",
        self.call_end,
      ]
    return pieces

  def _assistant(self, message: dict, show_thinking: bool) -> list:
    """An assistant turn after its "<|im_start|>assistant\\n", through <|im_end|>."""
    content, reasoning = self._content_and_reasoning(message)
    pieces = [content]
    if show_thinking:
      pieces = [self.think_start, "\n" + reasoning + "\n", self.think_end, "\n\n" + content]
    return pieces + self._calls(content, message.get("tool_calls")) + [self.im_end]

  def _read_call(self, body: str, tools) -> tuple[ToolCall | None, tuple[str, str] | None]:
    return _read_xml_call(body, tools)

  def action_ids(self, message) -> list[int]:
    """The turn as sampled after this format's generation prompt, turn end included.

    Thinking on (the prompt ended in "<think>\\n"): the reasoning and "\\n" (none
    if it is empty), </think>, "\\n\\n", the content, the calls. Thinking off
    (the prompt holds the empty block): the content and the calls; reasoning
    is dropped, as it cannot follow the closed block.
    """
    if isinstance(message, str):
      message = {"role": "assistant", "content": message}
    content, reasoning = self._content_and_reasoning(message)
    pieces = [content]
    if self.enable_thinking:
      pieces = [reasoning + "\n" if reasoning else "", self.think_end, "\n\n" + content]
    return self._ids(pieces + self._calls(content, message.get("tool_calls")) + [self.im_end])


# --- reading calls: model output, so hostile ----------------------------------------


def _strict_json(text: str):
  """`json.loads` for model output: plain JSON only, or ValueError / RecursionError.

  Refused besides what `json` refuses: NaN / Infinity, numbers that overflow
  a float (1e999), integers past Python's digit limit (a ValueError of
  `json` itself) and strings with a lone surrogate ("\\ud800"), which no
  tool could write out as UTF-8.
  """

  def constant(name):
    raise ValueError(f"{name} is not JSON")

  def finite(literal):
    value = float(literal)
    if not math.isfinite(value):
      raise ValueError(f"{literal[:20]} overflows a float")
    return value

  value = json.loads(text, parse_constant=constant, parse_float=finite)
  stack = [value]
  while stack:
    item = stack.pop()
    if isinstance(item, str):
      item.encode("utf-8")  # UnicodeEncodeError (a ValueError) on a lone surrogate
    elif isinstance(item, dict):
      stack += list(item) + list(item.values())
    elif isinstance(item, list):
      stack += item
  return value


def _read_json_call(body: str) -> tuple[ToolCall | None, tuple[str, str] | None]:
  """One Qwen3 call's JSON, as (ToolCall, None) or (None, (reason, message))."""
  try:
    obj = _strict_json(body)
  except (ValueError, RecursionError) as e:
    return None, ("bad_json", f"the tool call is not JSON: {str(e)[:80]}")
  if not isinstance(obj, dict):
    return None, ("not_an_object", f"the tool call is a JSON {type(obj).__name__}, not an object")
  name = obj.get("name")
  if not isinstance(name, str) or not name:
    return None, ("missing_name", 'the tool call has no "name" string')
  arguments = obj.get("arguments", {})
  if isinstance(arguments, str):  # OpenAI style: the arguments as a JSON string
    try:
      arguments = _strict_json(arguments)
    except (ValueError, RecursionError):
      return None, ("bad_arguments", f"{name[:60]!r}: arguments are not a JSON object")
  if not isinstance(arguments, dict):
    return None, (
      "bad_arguments",
      f"{name[:60]!r}: arguments are a {type(arguments).__name__}, not an object",
    )
  return ToolCall(name, arguments), None


_SPACE = re.compile(r"\s*")
_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"


def _parameter_text(value) -> str:
  """An argument as Qwen3.5's template writes it: `tojson` for objects and arrays,
  else jinja's `string` (Python's str())."""
  if isinstance(value, (dict, list, tuple)):
    return json.dumps(value, ensure_ascii=False)
  return str(value)


def _xml_parameters(text: str, name: str) -> tuple[dict | None, tuple[str, str] | None]:
  """The <parameter=ARG>\\nVALUE\\n</parameter> blocks of one call, as {ARG: VALUE}."""
  arguments, pos = {}, _SPACE.match(text).end()
  while pos < len(text):
    if not text.startswith(_PARAMETER, pos):
      return None, ("bad_xml", f"{name[:60]!r}: text outside <parameter=...> blocks")
    head_end = text.find(">", pos)
    end = text.find(_PARAMETER_END, head_end) if head_end >= 0 else -1
    if end < 0:
      return None, ("bad_xml", f"{name[:60]!r}: a <parameter=...> block is not closed")
    key = text[pos + len(_PARAMETER) : head_end].strip()
    if not key or "<" in key or "\n" in key:
      return None, ("bad_arguments", f"{name[:60]!r}: a parameter without a name")
    if key in arguments:
      return None, ("bad_arguments", f"{name[:60]!r}: parameter {key[:60]!r} given twice")
    value = text[head_end + 1 : end]  # the template writes one "\n" on each side
    value = value[1:] if value.startswith("\n") else value
    arguments[key] = value[:-1] if value.endswith("\n") else value
    pos = _SPACE.match(text, end + len(_PARAMETER_END)).end()
  return arguments, None


def _read_xml_call(body: str, tools=()) -> tuple[ToolCall | None, tuple[str, str] | None]:
  """One Qwen3.5 call, as (ToolCall, None) or (None, (reason, message)).

  The call is <function=NAME> (blank lines around it allowed), its
  <parameter=ARG> blocks, </function>: anything else is "bad_xml"; an empty
  NAME is "missing_name"; a nameless or repeated parameter "bad_arguments".
  VALUEs are text; where `tools` declares the function, each is read as its
  parameter's declared JSON type (vLLM's Qwen3-Coder parser does the same), and
  one that does not read as it is "bad_arguments".
  """
  text = body.strip()
  if not (text.startswith(_FUNCTION) and text.endswith(_FUNCTION_END)):
    return None, ("bad_xml", "the tool call is not <function=NAME>...</function>")
  inner = text[len(_FUNCTION) : len(text) - len(_FUNCTION_END)]
  head_end = inner.find(">")
  name = inner[:head_end].strip()
  if head_end < 0 or "<" in name or "\n" in name:
    return None, ("bad_xml", "the <function=NAME> tag is not closed on its line")
  if not name:
    return None, ("missing_name", "the tool call has no function name")
  arguments, error = _xml_parameters(inner[head_end + 1 :], name)
  if error is not None:
    return None, error
  schema = next((fn for fn in map(function_schema, tools) if fn["name"] == name), None)
  properties = ((schema or {}).get("parameters") or {}).get("properties") or {}
  for key, value in arguments.items():
    types = _known_types(properties.get(key))
    typed = _typed(value, types)
    if typed is _UNTYPED:
      return None, ("bad_arguments", f"{name[:60]!r}: {key[:60]!r} is not {' / '.join(types)}")
    arguments[key] = typed
  return ToolCall(name, arguments), None


_UNTYPED = object()
_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _typed(text: str, known: list[str]):
  """A parameter's text as one of its declared JSON types (`_known_types`); the text
  itself where a string is allowed or no type is known; _UNTYPED where none reads it."""
  if not known or "string" in known:
    return text
  word = text.strip()
  for t in known:
    if t == "null" and word.lower() in ("null", "none"):
      return None
    if t == "boolean" and word.lower() in ("true", "false"):
      return word.lower() == "true"
    try:
      if t in ("integer", "number") and _INTEGER.fullmatch(word):
        return int(word)  # ValueError past Python's digit limit
      if t in ("integer", "number") and _DECIMAL.fullmatch(word):
        value = float(word)
        if math.isfinite(value) and _JSON_TYPES[t](value):
          return value
      if t in ("object", "array"):
        value = _strict_json(word)
        if _JSON_TYPES[t](value):
          return value
    except (ValueError, RecursionError):
      continue
  return _UNTYPED


# --- tool calls and tool output -------------------------------------------------------

_JSON_TYPES = {
  "string": lambda v: isinstance(v, str),
  "integer": lambda v: (
    (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and math.isfinite(v) and v.is_integer())
  ),
  "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
  "boolean": lambda v: isinstance(v, bool),
  "array": lambda v: isinstance(v, list),
  "object": lambda v: isinstance(v, dict),
  "null": lambda v: v is None,
}


def _known_types(spec) -> list[str]:
  """The JSON types a parameter's schema declares (its "type", a name or a list), those
  this module knows only."""
  declared = spec.get("type") if isinstance(spec, dict) else None
  types = (
    [declared]
    if isinstance(declared, str)
    else (list(declared) if isinstance(declared, (list, tuple)) else [])
  )
  return [t for t in types if t in _JSON_TYPES]


def validate_call(call: ToolCall, tools) -> str | None:
  """Why `call` does not fit the declared `tools`, or None if it does.

  "unknown_tool": no tool of that name. "bad_arguments": a required
  argument missing, one the schema does not declare (unless
  `additionalProperties` allows it), or one of the wrong JSON type. Only the
  top level of `parameters` is checked (types, required, properties): enough
  to turn a wrong call into an error message rather than a crash in the
  tool, without a JSON-schema dependency.
  """
  schema = next((fn for fn in map(function_schema, tools) if fn["name"] == call.name), None)
  if schema is None:
    return "unknown_tool"
  parameters = schema.get("parameters") or {}
  properties = parameters.get("properties") or {}
  if any(name not in call.arguments for name in parameters.get("required") or ()):
    return "bad_arguments"
  extra_ok = parameters.get("additionalProperties", False) not in (False, None)
  for name, value in call.arguments.items():
    if name not in properties:
      if not extra_ok:
        return "bad_arguments"
      continue
    known = _known_types(properties[name])
    if known and not any(_JSON_TYPES[t](value) for t in known):
      return "bad_arguments"
  return None


def cap_tokens(ids: Sequence[int], max_tokens: int, tokenizer) -> tuple[list[int], bool]:
  """`ids` cut to at most `max_tokens`: head and tail kept, a marker between.

  The marker "\\n...[N tokens truncated]...\\n" (N: the ids left out) is
  encoded with `encode_lossy` and counted in the budget, so the result is
  exactly `max_tokens` long when cut. Head and tail both matter for tool
  output: the head says what ran, the tail holds the error or the result.
  Too small a budget for the marker keeps the head only.
  """
  ids = list(ids)
  if len(ids) <= max_tokens:
    return ids, False
  dropped = len(ids) - max_tokens
  for _ in range(8):  # the marker's length depends on N's digits: settle it
    marker = tokenizer.encode_lossy(f"\n...[{dropped} tokens truncated]...\n")
    kept = max_tokens - len(marker)
    if kept < 2:
      return ids[:max_tokens], True
    if len(ids) - kept == dropped:
      break
    dropped = len(ids) - kept
  head = (kept + 1) // 2
  tail = kept - head
  return ids[:head] + marker + (ids[len(ids) - tail :] if tail else []), True


# --- the table ---------------------------------------------------------------------

FORMATS: dict[str, type] = {
  "raw": RawFormat,
  "plain": PlainFormat,
  "qwen3": Qwen3Format,
  "qwen3_5": Qwen3_5Format,
}


def format_options(name: str) -> set[str]:
  """The options chat format `name` takes (qwen3, qwen3_5: enable_thinking)."""
  if name not in FORMATS:
    raise ValueError(f"unknown chat format {name!r}: one of {sorted(FORMATS)}")
  return set(inspect.signature(FORMATS[name].__init__).parameters) - {"self", "tokenizer"}


def make_format(name: str, tokenizer, **options) -> ChatFormat:
  """The chat format `name` over `tokenizer`; `options` are the format's own
  (`format_options`)."""
  accepted = format_options(name)
  cls = FORMATS[name]
  unknown = sorted(set(options) - accepted)
  if unknown:
    raise ValueError(
      f"chat format {name!r} takes no option {unknown}; its options: {sorted(accepted) or 'none'}"
    )
  return cls(tokenizer, **options)
