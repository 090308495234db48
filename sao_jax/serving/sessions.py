"""Agent sessions as training trajectories: the recording rule of the OpenAI endpoint.

An outside agent harness talks to the policy through `openai_api.py`, one
chat completion at a time, each request carrying the whole conversation so
far. A `Session` turns those requests back into the trajectory the rollout
driver would have built, token for token, out of exactly the ids that were
served (nothing is re-tokenized after the fact):

  * **Prompt ids.** When a request's messages are one of the session's
    trajectories' messages plus the assistant message the client received
    for them (same tools, same contents and tool calls), followed only by
    tool / user messages, its prompt is that trajectory's ids, then the
    chat format's bridge for the new messages (`observation_ids`; a
    completion without a turn end, cut at its budget or a stop string, is
    first closed by `cut_turn_ids`), the driver's transcript rule. Any
    other request is rendered whole (`render(messages, tools,
    add_generation_prompt=True)`, what `prompt_ids` gives a task's prompt).
  * **Extension.** If the prompt ids start with a trajectory's ids (the
    newest such), the new prompt tokens are observation tokens and the
    sampled ids its next action turn. Otherwise a new trajectory starts with
    this prompt (counted, `trajectories/not_extending`): a harness that
    rewrote its history (a summary, a dropped turn, an edited message)
    starts over. Each of a request's `n` > 1 choices is a trajectory of its
    own; the next request extends the one whose choice it continues.
  * **Ownership.** Ids are the server's (`SessionBook.open`), and each
    session has two secrets: `secret`, for the harness's requests, and
    `owner_secret`, for whoever opened it to read, reward or delete it.
  * **Reward.** The owner ends a session with its reward
    (`POST /v1/sessions/{id}/reward`): every trajectory of the session gets
    it on its last action token, is validated (`trajectory.checked`, as the
    trainer's queue and the fleet's feed do) and goes to the sink (the
    fleet's trajectory shards); a malformed one is refused and counted by
    reason. A session discarded (`DELETE`) or idle past `idle_seconds`
    writes nothing (counted).

A session serialises its requests (one lock, held from rendering until the
reply was sent and recorded), so a harness's turns are recorded in order,
and only turns whose replies were sent.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import json
import re
import secrets
import threading
import time
import zlib
from typing import Callable

import numpy as np

from sao_jax.data.trajectory import Trajectory, checked
from sao_jax.serving.batcher import Completion

SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
# Roles a request may add after the messages the session has seen, to be bridged.
_OBSERVATION_ROLES = ("tool", "user")


class TooManySessions(RuntimeError):
  """`max_sessions` sessions are open already."""


def _arguments_key(arguments) -> str:
  """A tool call's arguments compared by value: JSON text is parsed, keys sorted."""
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
      return "raw:" + arguments
  return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def message_key(message: dict) -> tuple:
  """What of a message the model sees, for comparing a request with what was served.

  Role, content (None is "") and the tool calls' names and arguments;
  reasoning is left out (a harness may drop it) and so are call ids (the
  chat format renders none).
  """
  calls = tuple(
    (c["name"], _arguments_key(c.get("arguments", {}))) for c in message.get("tool_calls") or ()
  )
  return (message["role"], message.get("content") or "", calls)


def tools_key(tools) -> str:
  return json.dumps(list(tools or ()), sort_keys=True, ensure_ascii=False)


@dataclasses.dataclass
class _Record:
  """One trajectory in the making: the ids served in one session, in order."""

  tokens: list = dataclasses.field(default_factory=list)
  action_mask: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  turn_starts: list = dataclasses.field(default_factory=list)
  start_time: float = 0.0
  end_time: float = 0.0
  cut: bool = False  # the last completion has no turn end (its budget or a stop string)
  full: bool = False  # the last completion reached max_len
  seen: list = dataclasses.field(default_factory=list)  # message keys served so far
  tools: str = ""  # tools_key of the last request

  def observe(self, ids):
    self.tokens += ids
    self.action_mask += [False] * len(ids)
    self.logprobs += [0.0] * len(ids)
    self.versions += [-1] * len(ids)

  def act(self, completion: Completion):
    self.turn_starts.append(len(self.tokens))
    self.tokens += completion.tokens
    self.action_mask += [True] * len(completion.tokens)
    self.logprobs += completion.logprobs
    self.versions += completion.versions


@dataclasses.dataclass(frozen=True)
class Recorded:
  """Where a request's tokens went."""

  trajectory: int  # index of its trajectory in the session, from 0
  turn: int  # index of its action turn in that trajectory, from 0
  extended: bool  # it extended one of the session's trajectories
  bridged: bool  # its prompt was the transcript plus the format's bridge


class Session:
  """One agent session's trajectories (module docstring). Use under `lock`.

  `secret` lets a client use the session (its requests); `owner_secret`
  lets its owner read, reward or delete it. Both are server-issued.
  """

  def __init__(
    self,
    session_id: str,
    chat_format,
    max_len: int,
    counts: collections.Counter,
    max_trajectories: int = 64,
  ):
    self.id = session_id
    self.secret, self.owner_secret = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    self.format, self.max_len, self._counts = chat_format, max_len, counts
    self.max_trajectories = max_trajectories
    self.lock = threading.Lock()
    self.records: list[_Record] = []  # oldest first; any of them may be extended
    self.requests = 0
    self.last_used = time.time()
    self.ended = False

  @property
  def num_trajectories(self) -> int:
    return len(self.records)

  def allows(self, secret: str | None, owner: bool = False) -> bool:
    """Whether `secret` is this session's (its owner's, if `owner`)."""
    want = self.owner_secret if owner else self.secret
    return secret is not None and hmac.compare_digest(
      secret.encode("utf-8", "replace"), want.encode()
    )

  def prompt_ids(self, messages: list[dict], tools) -> tuple[list[int], bool]:
    """(the request's prompt ids, whether they were bridged onto a trajectory's ids)."""
    keys = [message_key(m) for m in messages]
    for r in reversed(self.records):  # the newest trajectory this request continues
      k = len(r.seen)
      if not (
        0 < k < len(keys)
        and tools_key(tools) == r.tools
        and keys[:k] == r.seen
        and all(m["role"] in _OBSERVATION_ROLES for m in messages[k:])
      ):
        continue
      try:
        bridge = self.format.observation_ids(
          [{"role": m["role"], "content": m["content"]} for m in messages[k:]]
        )
      except ValueError:
        break
      cut = self.format.cut_turn_ids() if r.cut else []
      return list(r.tokens) + cut + bridge, True
    return self.format.render(messages, tools, add_generation_prompt=True), False

  def _extends(self, prompt: list[int]) -> _Record | None:
    for r in reversed(self.records):
      if len(prompt) >= len(r.tokens) and prompt[: len(r.tokens)] == r.tokens:
        return r
    return None

  def plan(self, prompt: list[int], *, new: bool = False, offset: int = 0) -> Recorded:
    """Where `record` would put a request (recording nothing): `offset`, the
    choices of the same request recorded before it (`new` ones)."""
    r = None if new else self._extends(prompt)
    if r is not None:
      return Recorded(self.records.index(r), len(r.turn_starts), True, False)
    return Recorded(min(len(self.records) + offset, self.max_trajectories - 1), 0, False, False)

  def record(
    self,
    prompt: list[int],
    completion: Completion,
    seen: list[tuple] | None,
    tools,
    bridged: bool,
    *,
    new: bool = False,
  ) -> Recorded:
    """Appends a request that was served and answered.

    `seen`: `message_key`s of the request's messages and of the assistant
    message the client received (None: a raw completion, which no chat
    request bridges onto). `new`: a trajectory of its own even if the prompt
    extends one (each of `n` > 1 choices).
    """
    now = time.time()
    self.requests += 1
    self.last_used = now
    r = None if new else self._extends(prompt)
    extended = r is not None
    if extended:
      r.observe(prompt[len(r.tokens) :])
      self._counts["turns/extended"] += 1
    else:
      self._counts[
        "trajectories/not_extending" if self.records else "trajectories/new_session"
      ] += 1
      if len(self.records) >= self.max_trajectories:  # memory stays bounded: oldest out
        self.records.pop(0)
        self._counts["trajectories/dropped_session_full"] += 1
      r = _Record(start_time=now)
      self.records.append(r)
      r.observe(prompt)
    self._counts["prompts/bridged" if bridged else "prompts/rendered"] += 1
    r.act(completion)
    r.cut = completion.tokens[-1] != self.format.turn_end_id
    r.full = len(r.tokens) >= self.max_len
    r.end_time = now
    r.seen, r.tools = list(seen or ()), tools_key(tools)
    return Recorded(self.records.index(r), len(r.turn_starts) - 1, extended, bridged)

  def trajectories(self, reward: float, prompt_id: int) -> list[Trajectory]:
    """Every trajectory of the session with `reward` on its last action token."""
    out = []
    for r in self.records:
      mask = np.asarray(r.action_mask, bool)
      rewards = np.zeros(mask.shape, np.float32)
      rewards[np.flatnonzero(mask)[-1]] = reward
      out.append(
        Trajectory(
          tokens=np.asarray(r.tokens, np.int32),
          action_mask=mask,
          rollout_logprobs=np.asarray(r.logprobs, np.float32),
          policy_version=np.asarray(r.versions, np.int32),
          rewards=rewards,
          turn_starts=np.asarray(r.turn_starts, np.int32),
          prompt_id=prompt_id,
          finish_reason="length" if r.full else "done",
          start_time=r.start_time,
          end_time=r.end_time,
        )
      )
    return out


class SessionBook:
  """The open sessions of one server, and where their trajectories go.

  Args:
    chat_format: the run's chat format (renders prompts, bridges observations).
    vocab_size, max_len: what a trajectory is validated against.
    sink: takes each valid trajectory of a rewarded session (the fleet's
      `ShardWriter.write`); it may block (backpressure).
    current_version: the newest policy version (a trajectory from a later
      one is refused, as the trainer's queue refuses it); None: not checked.
    max_sessions: open sessions beyond which a new one is refused.
    idle_seconds: a session unused this long is discarded (counted
      `sessions/expired`) when the next session opens.
    max_trajectories: a session holding this many trajectories drops its
      oldest to start another (counted `trajectories/dropped_session_full`),
      so a harness that never extends cannot grow the server's memory
      without bound.
    identity: the identity (run id, params fingerprint) of each version the
      engine held (sao_jax/data/identity.py Ledger), stamped on the
      trajectories; None: they carry none (a fleet trainer refuses them).
  """

  def __init__(
    self,
    chat_format,
    vocab_size: int,
    max_len: int,
    sink: Callable[[Trajectory], None],
    *,
    current_version: Callable[[], int] | None = None,
    max_sessions: int = 1024,
    idle_seconds: float = 3600.0,
    max_trajectories: int = 64,
    identity=None,
  ):
    self.format, self.vocab_size, self.max_len = chat_format, vocab_size, max_len
    self.identity = identity
    self._sink, self._current_version = sink, current_version
    self.max_sessions, self.idle_seconds = max_sessions, idle_seconds
    self.max_trajectories = max_trajectories
    self._sessions: dict[str, Session] = {}
    self._lock = threading.Lock()
    self.counts: collections.Counter = collections.Counter()
    # Called with a session's id once it ends (rewarded, deleted, expired): the
    # server drops the session's parked cache (`Batcher.forget`). Must not block.
    self.on_end: Callable[[str], None] | None = None

  def _ended(self, session_id: str) -> None:
    if self.on_end is not None:
      self.on_end(session_id)

  def open(self) -> Session:
    """A new session with a server-issued id and secrets; TooManySessions when full."""
    with self._lock:
      self._expire_locked(time.time())
      if len(self._sessions) >= self.max_sessions:
        raise TooManySessions(f"{self.max_sessions} sessions are open; reward or delete some")
      session_id = "s" + secrets.token_hex(12)
      s = self._sessions[session_id] = Session(
        session_id, self.format, self.max_len, self.counts, self.max_trajectories
      )
      self.counts["sessions/opened"] += 1
      return s

  def get(self, session_id: str) -> Session | None:
    """The open session `session_id`, or None; ValueError for a malformed id."""
    if not SESSION_ID.match(session_id):
      raise ValueError(f"session id {session_id[:40]!r}: 1 to 128 of A-Z a-z 0-9 _ . : -")
    with self._lock:
      return self._sessions.get(session_id)

  def _expire_locked(self, now: float):
    for sid in [
      sid
      for sid, s in self._sessions.items()
      if now - s.last_used > self.idle_seconds and not s.lock.locked()
    ]:
      self._sessions.pop(sid).ended = True
      self.counts["sessions/expired"] += 1
      self._ended(sid)

  def _pop(self, session_id: str) -> Session | None:
    with self._lock:
      return self._sessions.pop(session_id, None)

  @property
  def open_sessions(self) -> int:
    return len(self._sessions)

  def reward(self, session_id: str, reward: float, prompt_id: int | None = None) -> dict | None:
    """Ends the session with `reward`: its trajectories validated and written.

    Returns {"trajectories", "written", "refused": {reason: n}}, or None for
    an unknown session. `prompt_id` (default: a hash of the session id) is
    the trajectories' task index.
    """
    s = self.get(session_id)
    if s is None:
      return None
    with s.lock:  # waits for a request in flight
      if s.ended or self._pop(session_id) is not s:
        return None
      s.ended = True
      self._ended(session_id)
      pid = zlib.crc32(session_id.encode()) if prompt_id is None else int(prompt_id)
      version = None if self._current_version is None else self._current_version()
      written, refused = 0, collections.Counter()
      trajectories = s.trajectories(float(reward), pid)
      if self.identity is not None:
        trajectories = [self.identity.stamp(t) for t in trajectories]
      for t in trajectories:
        good, reason = checked(t, self.vocab_size, self.max_len, version)
        if good is None:
          refused[reason] += 1
          self.counts[f"refused/{reason}"] += 1
          continue
        self._sink(good)
        written += 1
      self.counts["sessions/rewarded"] += 1
      self.counts["trajectories/written"] += written
    return {
      "session_id": session_id,
      "trajectories": len(trajectories),
      "written": written,
      "refused": dict(refused),
    }

  def discard(self, session_id: str) -> bool:
    """Ends the session without writing anything; False if there is none."""
    s = self.get(session_id)
    if s is None:
      return False
    with s.lock:
      if s.ended or self._pop(session_id) is not s:
        return False
      s.ended = True
      self.counts["sessions/discarded"] += 1
    self._ended(session_id)
    return True
