"""The environment guard and its worker pool: environment steps off the driver thread.

Environments are code the driver does not trust (they run model-written code
and are written against a loose protocol). This module is the boundary: every
call into an `Episode.step` and every look at what it returned happens here,
in a worker thread under the step's deadline, and what comes back to the
driver thread is an `EnvOutcome` of plain, checked values (or the fault that
ended the step), never the environment's own objects. It is separate from
the episode loop (rollout/driver.py) because it is the one place that has to
hold against a hostile environment, and it can be read, and reasoned about,
without the engine:

  * `env_step` runs one step and `check_result` checks its result against
    the protocol of `sao_jax.envs.base`: a step that raises is an
    "env_error" (a `GraderError`, a "grader_error"), a result that breaks
    the protocol "env_garbage"; observations are cut to a size;
  * `EnvPool` is the worker threads, where the worker of a step past its
    deadline is written off and replaced;
  * `EnvSteps` is the steps in flight, one per waiting slot: it submits
    them, waits for the first to finish or pass its deadline, and hands
    back finished ones and timed-out ones ("env_timeout") in its order;
  * `plain_prompt` and `plain_tools` check a task's prompt and tools,
    which the driver reads at admission on its own thread.

What a fault costs the episode (zero reward, a rerun for a failed grader)
and how faults are counted is the driver's (rollout/driver.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import numbers
import queue
import threading
import time
from typing import Iterator

import numpy as np

from sao_jax.data.trajectory import ENV_FAULTS, FINISH_REASONS
from sao_jax.envs.base import GraderError, StepResult

_MESSAGE_CHARS = 300
# float32 is what the Trajectory stores: a larger finite reward would become inf.
_MAX_REWARD = float(np.finfo(np.float32).max)
_MAX_EVENTS = 8
_OBSERVATION_ROLES = ("tool", "user")


class Garbage(ValueError):
  """What an environment returned breaks the protocol of `sao_jax.envs.base`."""


@dataclasses.dataclass(frozen=True)
class EnvOutcome:
  """One environment step as plain, checked values, or the fault that ended it."""

  seconds: float
  fault: str | None = None  # one of ENV_FAULTS, or "grader_error"
  detail: str = ""
  observation: str | tuple = ""  # text, or ({"role", "content"}, ...) messages
  reward: float = 0.0
  done: bool = False
  finish_reason: str = "done"
  truncated: bool = False
  events: tuple = ()
  # No result within the deadline: the step's worker was written off (the
  # fault is "env_timeout"; an environment may also report that one itself).
  abandoned: bool = False


def describe(e: BaseException) -> str:
  """`Type: message` for the fault log, bounded; never raises."""
  name = type(e).__name__
  try:
    message = str(e)
  except Exception:  # noqa: BLE001  # a broken __str__ is the env's too
    return name
  if len(message) > _MESSAGE_CHARS:
    message = message[:_MESSAGE_CHARS] + "..."
  if isinstance(e, Garbage):
    return message
  return f"{name}: {message}" if message else name


def check_result(result, max_chars: int) -> EnvOutcome:
  """`result` as plain values; raises `Garbage` where it breaks the protocol.

  A reward must be a finite real number (Python or numpy) that fits float32.
  A bool reward counts as garbage: `StepResult.reward` is a float, and a bool
  there almost always means fields in the wrong place, e.g.
  `StepResult(obs, done, reward)`, which must not pay out as 1.0. `done` must
  be a bool (numpy's included). An observation must be a str; one longer than
  `max_chars` is cut there rather than failed, since only the first
  `max_len` tokens could ever be used. It may also be a list of messages
  (`{"role": "tool" | "user", "content": str}`) for a chat format, each
  content cut alike. `info["events"]`, if present, is a list of short names
  the driver counts. Strs are copied to exact `str`s so that no subclass
  method of the environment's ever runs on the driver thread.
  """
  if not isinstance(result, StepResult):
    raise Garbage(f"step returned {type(result).__name__}, not a StepResult")
  reward, done, observation, info = result.reward, result.done, result.observation, result.info
  if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real):
    raise Garbage(f"reward is a {type(reward).__name__}, not a real number")
  reward = float(reward)
  if not (math.isfinite(reward) and abs(reward) <= _MAX_REWARD):
    raise Garbage(f"reward {reward!r} is not finite in float32")
  if not isinstance(done, (bool, np.bool_)):
    raise Garbage(f"done is a {type(done).__name__}, not a bool")
  if not isinstance(info, dict):
    raise Garbage(f"info is a {type(info).__name__}, not a dict")
  observation, truncated = plain_observation(observation, max_chars)
  events = dict.get(info, "events", ())
  if (
    not isinstance(events, (list, tuple))
    or len(events) > _MAX_EVENTS
    or not all(isinstance(e, str) and 0 < len(e) <= 40 for e in events)
  ):
    raise Garbage(
      f"info['events'] must be a list of at most {_MAX_EVENTS} names of 1-40 characters"
    )
  events = tuple(str.__str__(e) for e in events)
  reason = "done"
  if done:
    reason = dict.get(info, "finish_reason", "done")
    if not isinstance(reason, str):
      raise Garbage(f"finish_reason is a {type(reason).__name__}, not a str")
    reason = str.__str__(reason)
    if reason in ENV_FAULTS:  # the environment reports its own failure
      return EnvOutcome(0.0, reason, "reported by the environment")
    if reason not in FINISH_REASONS:
      raise Garbage(f"unknown finish_reason {reason[:40]!r}")
  return EnvOutcome(0.0, None, "", observation, reward, bool(done), reason, truncated, events)


_MAX_EVENTS = 8
_OBSERVATION_ROLES = ("tool", "user")


def plain_observation(observation, max_chars: int) -> tuple[str | tuple, bool]:
  """An observation as exact strs (or a tuple of plain message dicts), cut to `max_chars`."""
  if isinstance(observation, str):
    text = str.__str__(observation)
    return text[:max_chars], len(text) > max_chars
  if not isinstance(observation, (list, tuple)):
    raise Garbage(f"observation is a {type(observation).__name__}, not a str or messages")
  if len(observation) > 64:
    raise Garbage(f"observation has {len(observation)} messages, more than 64")
  messages, truncated = [], False
  for k, message in enumerate(observation):
    if not isinstance(message, dict):
      raise Garbage(f"observation message {k} is a {type(message).__name__}, not a dict")
    role, content = dict.get(message, "role"), dict.get(message, "content")
    if not isinstance(role, str) or str.__str__(role) not in _OBSERVATION_ROLES:
      raise Garbage(f"observation message {k}: role must be one of {_OBSERVATION_ROLES}")
    if not isinstance(content, str):
      raise Garbage(f"observation message {k}: content is a {type(content).__name__}, not a str")
    content = str.__str__(content)
    truncated |= len(content) > max_chars
    messages.append({"role": str.__str__(role), "content": content[:max_chars]})
  return tuple(messages), truncated


def env_step(episode, text: str, max_chars: int, latency_s: float = 0.0) -> EnvOutcome:
  """Runs in a worker: one `episode.step`, its result checked and made plain.

  Everything that touches the environment's objects happens here, under the
  step's timeout: a result whose attributes raise or hang cannot hurt the
  driver thread, which only ever sees an `EnvOutcome`. `latency_s` is a
  simulated tool latency, slept before the step (part of its time).
  """
  start = time.monotonic()
  if latency_s:
    time.sleep(latency_s)
  try:
    result = episode.step(text)
  except GraderError as e:  # the grader failed, not the answer: run the episode again
    return EnvOutcome(time.monotonic() - start, "grader_error", describe(e))
  except Exception as e:  # noqa: BLE001
    return EnvOutcome(time.monotonic() - start, "env_error", describe(e))
  try:
    outcome = check_result(result, max_chars)
  except Exception as e:  # noqa: BLE001  # Garbage, or a raising attribute
    return EnvOutcome(time.monotonic() - start, "env_garbage", describe(e))
  return dataclasses.replace(outcome, seconds=time.monotonic() - start)


class EnvPool:
  """Worker threads for environment steps, where a stuck worker can be written off.

  Not a ThreadPoolExecutor, for two reasons. A Python thread cannot be
  killed, so a step that never returns keeps its worker forever: the
  executor's pool would shrink with every hang and, once all its workers
  hang, run nothing; here `abandon` retires the worker of a step past its
  deadline (it exits if the step ever returns) and starts a replacement, so
  `size` workers stay free for the other slots. And the executor's workers
  are joined at interpreter exit, so one hung step would keep the process
  from exiting; these are daemon threads.
  """

  def __init__(self, size: int, name: str):
    self.size = size
    self._name = name
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._running: dict[cf.Future, tuple[threading.Thread, float]] = {}
    self._retired: set[threading.Thread] = set()  # abandoned, still inside a step
    self._spawned = 0
    self._closed = False
    for _ in range(size):
      self._spawn()

  def _spawn(self):
    self._spawned += 1
    threading.Thread(target=self._work, name=f"{self._name}_{self._spawned}", daemon=True).start()

  def submit(self, fn, *args) -> cf.Future:
    if self._closed:
      raise RuntimeError("the environment worker pool is closed (the driver was stopped)")
    f = cf.Future()
    self._queue.put((f, fn, args))
    return f

  def started(self, f: cf.Future) -> float | None:
    """When `f` started running (time.monotonic), None if queued or finished."""
    with self._lock:
      entry = self._running.get(f)
    return None if entry is None else entry[1]

  def abandon(self, f: cf.Future) -> bool:
    """Writes off the worker running `f`; False if `f` is not running (it finished)."""
    with self._lock:
      entry = self._running.pop(f, None)
      if entry is None:
        return False
      self._retired.add(entry[0])
      if not self._closed:
        self._spawn()
    return True

  @property
  def stuck(self) -> int:
    """Abandoned steps whose workers have not returned yet."""
    with self._lock:
      return len(self._retired)

  def close(self) -> None:
    """Cancels queued steps and lets the free workers exit; idempotent, never blocks."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    while True:
      try:
        item = self._queue.get_nowait()
      except queue.Empty:
        break
      if item is not None:
        item[0].cancel()
    for _ in range(self.size):
      self._queue.put(None)

  def _work(self):
    me = threading.current_thread()
    while True:
      item = self._queue.get()
      if item is None:
        return
      f, fn, args = item
      if not f.set_running_or_notify_cancel():
        continue
      with self._lock:
        self._running[f] = (me, time.monotonic())
      try:
        result = fn(*args)
      except BaseException as e:  # noqa: BLE001  # handed to the driver
        f.set_exception(e)
      else:
        f.set_result(result)
      # The result is set before `f` leaves `_running`: `abandon` finding
      # nothing therefore means `f` is done.
      with self._lock:
        self._running.pop(f, None)
        if me in self._retired:  # a replacement took this worker's place
          self._retired.discard(me)
          return


def plain_prompt(prompt):
  """A task's prompt as exact strs: a str, or a tuple of {"role", "content"} messages."""
  if isinstance(prompt, str):
    return str.__str__(prompt)
  if not isinstance(prompt, (list, tuple)) or not prompt:
    raise Garbage(f"task prompt is a {type(prompt).__name__}, not a str or messages")
  out = []
  for k, m in enumerate(prompt):
    if not (
      isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
    ):
      raise Garbage(f"task prompt message {k} is not a {{'role': str, 'content': str}}")
    out.append({"role": str.__str__(m["role"]), "content": str.__str__(m["content"])})
  return tuple(out)


def plain_tools(tools):
  """A task's tools as a tuple of function schemas (dicts, as the chat format reads them)."""
  if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
    raise Garbage("task tools must be a list of function schemas (dicts)")
  return tuple(tools)


class EnvSteps:
  """The environment steps in flight, each a slot's, on an `EnvPool` under `timeout`.

  Only the driver thread calls it. `submit` starts slot i's step; `wait`
  blocks until one finishes or the earliest deadline passes; `finished`
  hands back, in submission order, the steps that finished and those past
  their deadline, whose workers it writes off.
  """

  def __init__(self, workers: int, timeout: float | None, max_chars: int, latency_s: float):
    self.timeout = timeout
    self._max_chars = max_chars
    self._latency_s = latency_s
    self._pool = EnvPool(workers, "env")
    self._futures: dict[cf.Future, int] = {}

  def __len__(self) -> int:
    """Steps submitted and not yet handed back."""
    return len(self._futures)

  @property
  def stuck(self) -> int:
    """Steps abandoned past `timeout` whose workers have not returned yet."""
    return self._pool.stuck

  def submit(self, i: int, episode, action) -> None:
    """Starts `episode.step(action)` for slot `i` (queued for a free worker)."""
    f = self._pool.submit(env_step, episode, action, self._max_chars, self._latency_s)
    self._futures[f] = i

  def close(self) -> None:
    """Cancels queued steps (`finished` hands them back as None); never blocks."""
    self._pool.close()

  def time_to_deadline(self) -> float | None:
    """Seconds until the earliest running step's deadline (None: no limit).

    A step still queued for a worker starts no earlier than now, so its
    deadline is no earlier than now + timeout: waiting that long at most
    cannot miss it, even if it starts during the wait.
    """
    if self.timeout is None:
      return None
    now = time.monotonic()
    earliest = now + self.timeout
    for f in self._futures:
      started = self._pool.started(f)
      if started is not None:
        earliest = min(earliest, started + self.timeout)
    return max(0.0, earliest - now)

  def wait(self, wake: cf.Future) -> float:
    """Waits (event-driven, no polling) until a step finishes, the earliest
    deadline passes, or `wake` is done; the seconds it waited."""
    start = time.time()
    cf.wait([*self._futures, wake], timeout=self.time_to_deadline(), return_when=cf.FIRST_COMPLETED)
    return time.time() - start

  def finished(self) -> Iterator[tuple[int, EnvOutcome | None]]:
    """(slot, outcome) of each step done or past its deadline, as found.

    A step past its deadline is abandoned and comes back as an
    "env_timeout" outcome with `abandoned` set; a cancelled one (only
    `close` cancels) as None. Lazily: the caller handles each before the
    next step is looked at.
    """
    now = time.monotonic()
    for f, i in list(self._futures.items()):
      started = None if f.done() else self._pool.started(f)
      if started is None:
        if not f.done():
          continue  # queued for a worker
      elif self.timeout is None or now < started + self.timeout:
        continue  # running, within its deadline
      elif self._pool.abandon(f):
        del self._futures[f]
        yield (
          i,
          EnvOutcome(
            now - started,
            "env_timeout",
            f"no result within env_timeout={self.timeout}s",
            abandoned=True,
          ),
        )
        continue
      # Done (perhaps just now, between the checks above).
      del self._futures[f]
      yield i, _outcome(f)


def _outcome(f: cf.Future) -> EnvOutcome | None:
  """A done step's outcome; None if it was cancelled."""
  if f.cancelled():
    return None
  exc = f.exception()  # only what `env_step` does not catch, e.g. SystemExit
  return EnvOutcome(0.0, "env_error", describe(exc)) if exc is not None else f.result()
