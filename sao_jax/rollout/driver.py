"""The rollout driver: continuous batching over the engine's slots.

Per slot the driver keeps the record of its trajectory so far (tokens, mask,
log-probs, versions, rewards) and `fed`, how many of those tokens are in the
slot's KV cache. Everything in `record[fed:]` is pending input: the prompt
after admission, the last sampled token while decoding, the turn-end token
plus an observation after an environment step. One engine step feeds every
slot's pending tokens and samples each slot's next token:

  * slots with long pending input (prompts, observations) go in a prefill
    step of bucketed width; slots with one pending token in a decode step of
    width 1, so decoding never pays for a long append;
  * a slot whose turn ended is handed to an environment worker thread and
    sits out until its observation arrives; decoding of the other slots goes
    on meanwhile;
  * a free slot is refilled with the next prompt immediately;
  * a finished trajectory is emitted the moment it finishes.

New params (`update_params`, thread-safe) are applied between steps with a
swap policy for in-flight slots:

  * "recompute": apply now; every in-flight slot re-feeds its whole record
    under the new params (fed = 0), so every recorded log-prob is exactly the
    teacher-forced log-prob under its recorded version;
  * "keep": apply now and keep the caches (cheapest; the cache mixes versions,
    the recorded log-prob is still the one actually sampled from);
  * "drain": stop admitting, let in-flight slots finish under the old params,
    then apply.

"keep" is the cheapest per swap and "recompute" the dearest (it re-feeds
every in-flight record; `benchmarks/rollout.py` measures the three:
benchmarks/RESULTS.md, "Weight swaps: cost per swap by policy"). The
configs still default to "recompute": in the CPU main job the cheaper swaps
let rollout outrun training and raised policy lag (docs/DESIGN.md,
"Decisions"; benchmarks/RESULTS.md, "The main job with the faster rollout
defaults"). Keep's log-probs are still exactly those its tokens were
sampled with (the behaviour probability DIS divides by); the version of a
token is that of the weights whose logits produced it, over a cache that may
hold older versions' keys.

Environments are code the driver does not trust (they run model-written code
and are written against a loose protocol), so no environment failure may stop
the driver or put a bad record into training. A step that raises, does not
return within `env_timeout` seconds, or returns garbage ends its episode with
finish reason "env_error", "env_timeout" or "env_garbage": the trajectory is
still emitted, so the trainer sees and counts the fault, but with every reward
zeroed, rewards of earlier turns included. Zeroing the whole episode means a
broken environment can never pay out: it cannot reward the policy for
reaching the state that breaks it, and a half-finished episode's partial
credit is not comparable with finished ones. `env.task` or `env.episode`
failing at admission skips that prompt (its whole group). Every fault is
counted in `DriverStats.env_faults` and its message kept, bounded, in
`DriverStats.env_fault_log`; the other slots go on meanwhile.

A grader that fails (`Episode.step` raises `sao_jax.envs.base.GraderError`:
the grader itself broke, not the answer) is not a score: the episode is
counted as `grader_error`, not emitted, and run again from its prompt with a
fresh episode of the same task in the same group, first in line; only after
`MAX_GRADER_RERUNS` reruns does it end as an `env_error`. Steps stuck past
`env_timeout` hold a thread each until they return; beyond
`max_stuck_env_steps` of them each timeout is also counted as `env_stuck`,
but the driver never stops for them.

Paged cache (an engine with `kv_cache="paged"`): admission is bounded by
free pages, not by free slots. The rule is to reserve a turn ahead: before
a slot is fed (its prompt, an observation, or its turn's decoding) it
holds pages for everything it can write until its turn ends,
`min(len(record) + max_turn_tokens - turn_tokens, max_len)` positions
(`PolicyEngine.reserve`). That need stays constant while a turn decodes
(each sampled token adds one to both terms), so a decode call never needs
a page it was not given, and grows only when an observation arrives and a
new turn starts. In-flight slots reserve first, oldest first; a slot whose
reservation fails waits with its input pending ("blocked"), and no prompt
is admitted into its group of slots while one waits. A prompt is admitted
only if its first turn's pages can be reserved, else it waits, queued.
When every slot of a group is blocked (none decoding, none at an
environment, so no pages will come back), the youngest slot holding pages
is preempted: its pages go back and its record is re-fed from the start
once pages allow (as a "recompute" swap re-feeds; its recorded tokens,
log-probs and versions stand). The oldest then always proceeds, since a
group's pages hold one max_len trajectory (the engine checks), so every
trajectory finishes. A finished trajectory's pages go back at once.
`DriverStats.page_waits` counts passes that deferred an admission or
blocked a slot, `preemptions` the preempted slots.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import math
import numbers
import queue
import threading
import time
from typing import Callable, Iterator

import numpy as np

from sao_jax.config import sections
from sao_jax.data.trajectory import ENV_FAULTS, FINISH_REASONS, Trajectory
from sao_jax.envs import base, chat
from sao_jax.envs.base import Action, Environment, GraderError, StepResult, Task
from sao_jax.models import routing as routing_lib
from sao_jax.rollout.engine import PolicyEngine

SWAP_POLICIES = sections.SWAP_POLICIES
# How often one episode is run again after its grader failed (GraderError)
# before it ends as an env_error instead.
MAX_GRADER_RERUNS = 2
# `DriverStats.env_faults` keys of prompts skipped at admission: `env.task`
# failed or gave an unusable task, or `env.episode` failed.
ADMISSION_FAULTS = ("task_error", "episode_error")
# How many fault messages `DriverStats.env_fault_log` keeps (the latest): enough
# to diagnose, bounded so that a systematically failing environment cannot
# grow the driver's memory.
FAULT_LOG_SIZE = 16
_MESSAGE_CHARS = 300
# Prompts skipped in a row before the driver gives up: an environment that
# cannot open any episode would otherwise spin the driver through the whole
# (possibly endless) prompt stream without a trajectory or an error.
MAX_CONSECUTIVE_ADMISSION_FAULTS = 100
# float32 is what the Trajectory stores: a larger finite reward would become inf.
_MAX_REWARD = float(np.finfo(np.float32).max)


@dataclasses.dataclass
class _Slot:
  task: Task
  episode: object
  group_id: int
  tokens: list
  action_mask: list
  logprobs: list
  versions: list
  rewards: list
  turn_starts: list
  start_time: float
  fed: int = 0
  turn_tokens: int = 0
  waiting: bool = False
  env_seconds: float = 0.0
  admitted: int = 0  # admission order (a paged engine's pages go oldest first)
  reruns: int = 0  # times this episode was run again after a grader_error
  prompt: list = dataclasses.field(default_factory=list)  # its prompt's tokens
  # A recording engine's (rl.routing_replay): the expert choices of the fed
  # tokens, arrays [n, M * k] in feeding order (their rows total `fed`).
  routing: list = dataclasses.field(default_factory=list)

  def refeed(self):
    """The cache dropped this slot's entries: its record is fed again from the
    start (and its routing recorded again, as the new feeding chooses)."""
    self.fed = 0
    self.routing.clear()

  def append(self, tokens, action=False, logprob=0.0, version=-1):
    for t in tokens:
      self.tokens.append(int(t))
      self.action_mask.append(action)
      self.logprobs.append(float(logprob) if action else 0.0)
      self.versions.append(int(version) if action else -1)
      self.rewards.append(0.0)


@dataclasses.dataclass
class DriverStats:
  steps: int = 0
  prefill_steps: int = 0
  decode_steps: int = 0
  generated_tokens: int = 0
  finished: int = 0
  param_swaps: int = 0
  env_wait_seconds: float = 0.0
  # Seconds from dispatching an engine call to holding its results on the
  # host (device time plus transfer, less the host work overlapped with it).
  generate_seconds: float = 0.0
  # Decode-loop iterations run (one token for each decoding slot each).
  decode_iterations: int = 0
  # Environment faults by reason: the ENV_FAULTS keys count emitted (zero
  # reward) trajectories, the ADMISSION_FAULTS keys count skipped prompts,
  # "grader_error" counts graders that failed (GraderError), "env_stuck"
  # timeouts while more than max_stuck_env_steps steps were stuck.
  env_faults: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  # "<reason> prompt <id> ...: <message>" of the latest faults, for logs.
  env_fault_log: collections.deque = dataclasses.field(
      default_factory=lambda: collections.deque(maxlen=FAULT_LOG_SIZE))
  # Observations cut to `max_observation_chars`, or tool output cut to
  # `max_tool_output_tokens`; not a fault, the episode goes on.
  observations_truncated: int = 0
  # Malformed tool calls by reason (chat.ParsedTurn.errors, chat.validate_call):
  # the episode goes on, the environment answers with an error.
  tool_call_errors: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  # Well-formed tool calls handed to the environment (the valid-call rate is
  # tool_calls / (tool_calls + sum(tool_call_errors))).
  tool_calls: int = 0
  # What environments report in `StepResult.info["events"]` (e.g. a verifier
  # timeout), by name.
  env_events: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  # A paged engine's: passes where an admission or a slot waited for pages,
  # and slots preempted (pages returned, record re-fed) to unblock a group.
  page_waits: int = 0
  preemptions: int = 0
  # Episodes run again from their prompt after a grader_error (not emitted).
  reruns: int = 0


# --- environment steps, off the driver thread ---------------------------------


class _Garbage(ValueError):
  """What an environment returned breaks the protocol of `sao_jax.envs.base`."""


@dataclasses.dataclass(frozen=True)
class _EnvOutcome:
  """One environment step as plain, checked values, or the fault that ended it."""
  seconds: float
  fault: str | None = None  # one of ENV_FAULTS
  detail: str = ""
  observation: str | tuple = ""  # text, or ({"role", "content"}, ...) messages
  reward: float = 0.0
  done: bool = False
  finish_reason: str = "done"
  truncated: bool = False
  events: tuple = ()


def _describe(e: BaseException) -> str:
  """`Type: message` for the fault log, bounded; never raises."""
  name = type(e).__name__
  try:
    message = str(e)
  except Exception:  # pylint: disable=broad-except  # a broken __str__ is the env's too
    return name
  if len(message) > _MESSAGE_CHARS:
    message = message[:_MESSAGE_CHARS] + "..."
  if isinstance(e, _Garbage):
    return message
  return f"{name}: {message}" if message else name


def _check_result(result, max_chars: int) -> _EnvOutcome:
  """`result` as plain values; raises `_Garbage` where it breaks the protocol.

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
    raise _Garbage(f"step returned {type(result).__name__}, not a StepResult")
  reward, done, observation, info = result.reward, result.done, result.observation, result.info
  if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real):
    raise _Garbage(f"reward is a {type(reward).__name__}, not a real number")
  reward = float(reward)
  if not (math.isfinite(reward) and abs(reward) <= _MAX_REWARD):
    raise _Garbage(f"reward {reward!r} is not finite in float32")
  if not isinstance(done, (bool, np.bool_)):
    raise _Garbage(f"done is a {type(done).__name__}, not a bool")
  if not isinstance(info, dict):
    raise _Garbage(f"info is a {type(info).__name__}, not a dict")
  observation, truncated = _plain_observation(observation, max_chars)
  events = dict.get(info, "events", ())
  if not isinstance(events, (list, tuple)) or len(events) > _MAX_EVENTS or not all(
      isinstance(e, str) and 0 < len(e) <= 40 for e in events):
    raise _Garbage(f"info['events'] must be a list of at most {_MAX_EVENTS} names "
                   "of 1-40 characters")
  events = tuple(str.__str__(e) for e in events)
  reason = "done"
  if done:
    reason = dict.get(info, "finish_reason", "done")
    if not isinstance(reason, str):
      raise _Garbage(f"finish_reason is a {type(reason).__name__}, not a str")
    reason = str.__str__(reason)
    if reason in ENV_FAULTS:  # the environment reports its own failure
      return _EnvOutcome(0.0, reason, "reported by the environment")
    if reason not in FINISH_REASONS:
      raise _Garbage(f"unknown finish_reason {reason[:40]!r}")
  return _EnvOutcome(0.0, None, "", observation, reward, bool(done), reason, truncated, events)


_MAX_EVENTS = 8
_OBSERVATION_ROLES = ("tool", "user")


def _plain_observation(observation, max_chars: int) -> tuple[str | tuple, bool]:
  """An observation as exact strs (or a tuple of plain message dicts), cut to `max_chars`."""
  if isinstance(observation, str):
    text = str.__str__(observation)
    return text[:max_chars], len(text) > max_chars
  if not isinstance(observation, (list, tuple)):
    raise _Garbage(f"observation is a {type(observation).__name__}, not a str or messages")
  if len(observation) > 64:
    raise _Garbage(f"observation has {len(observation)} messages, more than 64")
  messages, truncated = [], False
  for k, message in enumerate(observation):
    if not isinstance(message, dict):
      raise _Garbage(f"observation message {k} is a {type(message).__name__}, not a dict")
    role, content = dict.get(message, "role"), dict.get(message, "content")
    if not isinstance(role, str) or str.__str__(role) not in _OBSERVATION_ROLES:
      raise _Garbage(f"observation message {k}: role must be one of {_OBSERVATION_ROLES}")
    if not isinstance(content, str):
      raise _Garbage(f"observation message {k}: content is a {type(content).__name__}, "
                     "not a str")
    content = str.__str__(content)
    truncated |= len(content) > max_chars
    messages.append({"role": str.__str__(role), "content": content[:max_chars]})
  return tuple(messages), truncated


def _env_step(episode, text: str, max_chars: int, latency_s: float = 0.0) -> _EnvOutcome:
  """Runs in a worker: one `episode.step`, its result checked and made plain.

  Everything that touches the environment's objects happens here, under the
  step's timeout: a result whose attributes raise or hang cannot hurt the
  driver thread, which only ever sees an `_EnvOutcome`. `latency_s` is a
  simulated tool latency, slept before the step (part of its time).
  """
  start = time.monotonic()
  if latency_s:
    time.sleep(latency_s)
  try:
    result = episode.step(text)
  except GraderError as e:  # the grader failed, not the answer: run the episode again
    return _EnvOutcome(time.monotonic() - start, "grader_error", _describe(e))
  except Exception as e:  # pylint: disable=broad-except
    return _EnvOutcome(time.monotonic() - start, "env_error", _describe(e))
  try:
    outcome = _check_result(result, max_chars)
  except Exception as e:  # pylint: disable=broad-except  # _Garbage, or a raising attribute
    return _EnvOutcome(time.monotonic() - start, "env_garbage", _describe(e))
  return dataclasses.replace(outcome, seconds=time.monotonic() - start)


class _EnvPool:
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
    threading.Thread(target=self._work, name=f"{self._name}_{self._spawned}",
                     daemon=True).start()

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
      except BaseException as e:  # pylint: disable=broad-except  # handed to the driver
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


def _routing_rows(s: _Slot, engine) -> np.ndarray | None:
  """A slot's recorded expert choices, one row per token `[T, M, k]` int16: the
  fed tokens' as the engine chose them, NONE for the tokens never fed (the
  last sample)."""
  cfg = engine.cfg
  rows = np.full((len(s.tokens), cfg.num_moe_layers, cfg.experts_per_token), routing_lib.NONE,
                 np.int16)
  fed = np.concatenate(s.routing, 0) if s.routing else rows[:0]
  if fed.shape[0] != s.fed:
    raise AssertionError(f"{fed.shape[0]} routing rows for {s.fed} fed tokens")
  rows[:s.fed] = fed.reshape(fed.shape[0], *rows.shape[1:])
  return rows


def _plain_prompt(prompt):
  """A task's prompt as exact strs: a str, or a tuple of {"role", "content"} messages."""
  if isinstance(prompt, str):
    return str.__str__(prompt)
  if not isinstance(prompt, (list, tuple)) or not prompt:
    raise _Garbage(f"task prompt is a {type(prompt).__name__}, not a str or messages")
  out = []
  for k, m in enumerate(prompt):
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)):
      raise _Garbage(f"task prompt message {k} is not a {{'role': str, 'content': str}}")
    out.append({"role": str.__str__(m["role"]), "content": str.__str__(m["content"])})
  return tuple(out)


def _plain_tools(tools):
  if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
    raise _Garbage("task tools must be a list of function schemas (dicts)")
  return tuple(tools)


# --- the driver -------------------------------------------------------------------


class RolloutDriver:
  """Runs episodes of `env` with `engine`, emitting finished Trajectories.

  `rollout` (default: the engine's) is the config's rollout section
  (sao_jax/config/sections.py), of which the driver reads samples_per_prompt,
  max_turn_tokens, decode_steps, swap_policy, env_workers and env_timeout.

  Environment faults (module docstring) are bounded by:
    rollout.env_timeout: seconds one `Episode.step` may run (None: no limit). The
      environment's sandbox has its own wall clock; this is the last line of
      defence against an environment that hangs outside it.
    max_stuck_env_steps: abandoned steps still running at once beyond which
      each further timeout is also counted as "env_stuck" (each holds a
      thread until its step returns); the driver never stops for them (a
      policy's hanging tool calls must not stop its own training); default
      4 * env_workers.
    max_observation_chars: an observation is cut to this many characters
      before tokenizing; default 16 * max_len, more than any tokenizer in use
      fits into max_len tokens, so the cut only spares the tokenizer.

  Decoding runs `decode_steps` tokens per engine call (`PolicyEngine.decode`,
  a jitted loop that stops each slot at its turn-end token, its turn's token
  budget or `max_len`); a slot whose turn ends inside a call idles for the
  rest of it, so the value trades host round trips against that idling
  (1: one token per call). While a call runs on the device the driver does
  its host work: finished environment steps, admissions, tokenizing.
  `tool_latency_s` sleeps in every environment step (a simulated tool call).
  `on_finish(trajectory, episode)`, if given, is called with each finished
  trajectory and the episode that produced it, just before it is emitted
  (evaluation reads what its own episode wrapper recorded, e.g. a verdict).
  """

  def __init__(self, engine: PolicyEngine, env: Environment, tokenizer,
               prompts: Iterator[int], emit: Callable[[Trajectory], None],
               rollout: sections.Rollout | None = None, *, static_batching: bool = False,
               max_stuck_env_steps: int | None = None,
               max_observation_chars: int | None = None, tool_latency_s: float = 0.0,
               chat_format=None, max_tool_output_tokens: int = 0,
               on_finish: Callable[[Trajectory, object], None] | None = None):
    r = engine.rollout if rollout is None else rollout
    if not isinstance(r, sections.Rollout):
      raise TypeError(f"rollout must be a sections.Rollout, got {type(r).__name__}")
    if tool_latency_s < 0:
      raise ValueError(f"tool_latency_s must be >= 0, got {tool_latency_s}")
    if max_tool_output_tokens < 0:
      raise ValueError(f"max_tool_output_tokens must be >= 0, got {max_tool_output_tokens}")
    self.rollout = r
    self.engine, self.env, self.tok = engine, env, tokenizer
    # A recording engine (rl.routing_replay): each slot keeps its fed tokens'
    # expert choices and the trajectory carries them. An engine without the
    # attribute (the JetStream bridge, a test's scripted engine) records none.
    self.record_routing = bool(getattr(engine, "record_routing", False))
    # How prompts, turn ends and observations become tokens (sao_jax/envs/chat.py);
    # None (for direct callers): the toys' raw text format.
    self.format = chat_format if chat_format is not None else chat.RawFormat(tokenizer)
    self.turn_end_id = self.format.turn_end_id
    self.max_tool_output_tokens = max_tool_output_tokens
    self._prompts = prompts
    self._emit = emit
    self._on_finish = on_finish
    self.samples_per_prompt = r.samples_per_prompt
    self.max_turn_tokens = r.max_turn_tokens
    self.swap_policy = r.swap_policy
    self.decode_steps = r.decode_steps
    self.tool_latency_s = tool_latency_s
    # The baseline of benchmarks/rollout.py: admit only when every slot is
    # free, i.e. one static batch at a time.
    self.static_batching = static_batching
    self.max_len = engine.max_prefill_length
    self.env_timeout = r.env_timeout
    self.max_stuck_env_steps = (4 * r.env_workers if max_stuck_env_steps is None
                                else max_stuck_env_steps)
    self.max_observation_chars = (16 * self.max_len if max_observation_chars is None
                                  else max_observation_chars)
    self.stats = DriverStats()
    self._slots: list[_Slot | None] = [None] * engine.max_concurrent_decodes
    self._state = engine.init_decode_state()
    self._pool = _EnvPool(r.env_workers, "env")
    self._futures: dict[cf.Future, int] = {}
    self._lock = threading.Lock()
    self._pending_params = None
    self._stop = threading.Event()
    # Done on `stop()`: wakes the driver from its wait for environment steps.
    self._wake: cf.Future = cf.Future()
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    # The G (task, group, episode, prompt tokens) of the current prompt.
    # (task, group, episode, prompt tokens, reruns so far) waiting for a slot.
    self._queued: list[tuple[Task, int, object, list, int]] = []
    self._prompts_done = False
    self._group = 0
    # A paged engine's pages (module docstring, "Paged cache"); engines
    # without `reserve` (test doubles) have every slot's positions.
    self._paged = bool(getattr(engine, "paged", False))
    self._admissions = 0
    self._blocked: set[int] = set()  # slots waiting for pages, as of the last reservation

  # --- public -----------------------------------------------------------

  def update_params(self, params, version: int) -> None:
    """Thread-safe: the new params apply between steps, per `swap_policy`.

    They are copied now, in the caller's thread: the trainer may donate its
    buffers to the next step before the driver applies them.
    """
    copied = self.engine.load_params(params)
    with self._lock:
      self._pending_params = (copied, version)

  def run(self, max_trajectories: int | None = None) -> None:
    """Runs in the calling thread until prompts run out, `max_trajectories`
    trajectories finished, or `stop()`."""
    target = None if max_trajectories is None else self.stats.finished + max_trajectories
    while not self._stop.is_set():
      if target is not None and self.stats.finished >= target:
        break
      if not self._iterate(admit=target is None or self._admitted_enough(target)):
        break

  def start(self) -> None:
    """Runs `run()` in a background thread; `check()` re-raises its failure.

    The thread stores its exception rather than letting it vanish into the
    thread's stderr: the consumer learns of it from `check()` (the trainer
    calls it whenever no trajectory arrives) and stops waiting.
    """
    if self._thread is not None:
      raise RuntimeError("the rollout driver was already started")

    def body():
      try:
        self.run()
      except BaseException as e:  # pylint: disable=broad-except  # re-raised by check()
        self._error = e

    self._thread = threading.Thread(target=body, name="rollout-driver", daemon=True)
    self._thread.start()

  def stop(self, timeout: float = 60.0) -> None:
    """Stops the driver and its environment workers; idempotent, and safe
    after a failure (which it does not raise: that is `check()`'s job).

    Wakes the driver if it waits for environment steps. Steps still running
    are left to finish on their own (a thread cannot be killed); their
    results are dropped, and queued steps are cancelled.
    """
    self._stop.set()
    with self._lock:
      if not self._wake.done():
        self._wake.set_result(None)
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout)
    self._pool.close()

  def check(self) -> None:
    """Re-raises the failure of the `start()`ed driver thread, if any."""
    if self._error is not None:
      e = self._error
      raise RuntimeError(f"rollout driver failed: {type(e).__name__}: {e}") from e

  @property
  def alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  @property
  def busy_slots(self) -> int:
    return sum(s is not None for s in self._slots)

  @property
  def stuck_env_steps(self) -> int:
    """Environment steps abandoned past `env_timeout` whose threads still run."""
    return self._pool.stuck

  # --- the loop -----------------------------------------------------------

  def _admitted_enough(self, target) -> bool:
    return self.stats.finished + self.busy_slots < target

  def _iterate(self, admit: bool) -> bool:
    """One pass: params, env results, admissions, one engine step. False when done."""
    self._maybe_swap_params()
    self._collect_env_results(block=False)
    if admit and not (self.swap_policy == "drain" and self._pending_params is not None):
      self._admit()
    ready = self._reserve_pages()
    if self._blocked:
      self._preempt()  # where a whole group of slots waits for pages
    if ready:
      self._engine_step(ready, admit)
      return True
    if self._futures:
      self._collect_env_results(block=True)
      return True
    return self.busy_slots > 0 or (admit and not self._prompts_done)

  # --- pages (a paged engine) ---------------------------------------------------

  def _page_need(self, s: _Slot) -> int:
    """Positions slot `s` can write before its turn ends: what it reserves."""
    return min(len(s.tokens) + self.max_turn_tokens - s.turn_tokens, self.max_len)

  def _reserve_pages(self, count: bool = True) -> list[int]:
    """The slots with pending input that hold their pages (module docstring,
    "Paged cache"): in-flight slots reserve, oldest first; the rest wait
    (a pass with one counts in `page_waits`, if `count`)."""
    pending = [i for i, s in enumerate(self._slots)
               if s is not None and not s.waiting and len(s.tokens) > s.fed]
    if not self._paged:
      return pending
    ready, blocked = [], set()
    for i in sorted(pending, key=lambda i: self._slots[i].admitted):
      if self.engine.reserve(self._state, i, self._page_need(self._slots[i])):
        ready.append(i)
      else:
        blocked.add(i)
    if blocked and count:
      self.stats.page_waits += 1
    self._blocked = blocked
    return sorted(ready)

  def _blocked_groups(self) -> set[int]:
    pages = self._state.pages
    return {pages.group_of(i) for i in self._blocked}

  def _preempt(self):
    """Frees pages in each group where every slot waits for pages: its
    youngest slot holding pages gives them back and will re-feed its record."""
    pages = self._state.pages
    for g in sorted(self._blocked_groups()):
      members = [i for i, s in enumerate(self._slots)
                 if s is not None and pages.group_of(i) == g]
      if any(i not in self._blocked for i in members):
        continue  # a slot decodes or is at its environment: pages will come back
      oldest = min(members, key=lambda i: self._slots[i].admitted)
      holders = [i for i in members if i != oldest and pages.held(i) > 0]
      if not holders:
        raise AssertionError(f"slot group {g} is blocked with no pages to preempt")
      victim = max(holders, key=lambda i: self._slots[i].admitted)
      self._slots[victim].refeed()
      self._state = self.engine.reset_slots(self._state, np.arange(len(self._slots)) == victim)
      self.stats.preemptions += 1

  def _maybe_swap_params(self):
    with self._lock:
      pending = self._pending_params
      if pending is None:
        return
      if self.swap_policy == "drain" and self.busy_slots:
        return
      self._pending_params = None
    self.engine.update_params(*pending, copied=True)
    self.stats.param_swaps += 1
    if self.swap_policy == "recompute":
      in_flight = np.array([s is not None for s in self._slots])
      for s in self._slots:
        if s is not None:
          s.refeed()
      self._state = self.engine.reset_slots(self._state, in_flight)

  # --- admission ------------------------------------------------------------

  def _next_task(self) -> tuple[Task, int, object, list, int] | None:
    """The next (task, group, episode, prompt tokens, reruns); None when prompts ran out."""
    skipped = 0
    while not self._queued:
      if self._prompts_done:
        return None
      try:
        index = next(self._prompts)
      except StopIteration:
        self._prompts_done = True
        return None
      self._queued = self._open_group(int(index))
      if not self._queued:
        skipped += 1
        if skipped >= MAX_CONSECUTIVE_ADMISSION_FAULTS:
          raise RuntimeError(
              f"the environment failed to open {skipped} prompts in a row; latest: "
              f"{self.stats.env_fault_log[-1]}")
    return self._queued.pop()

  def _open_group(self, index: int) -> list:
    """The G admissions of prompt `index`, or [] (counted) if the env fails on it.

    All G episodes are opened when the prompt is drawn, so that a failing
    `env.episode` skips the whole group: a group is emitted complete or not
    at all (group arms wait for whole groups). `env.task` and `env.episode`
    run on the driver thread: they must be cheap, only `Episode.step` runs
    under `env_timeout`.
    """
    try:
      task = self.env.task(index)
      problem = base.task_problem(task)
      if problem is not None:
        raise _Garbage(f"env.task returned a {type(task).__name__} that is not a Task: "
                       f"it has {problem}")
      prompt = self._prompt_ids(task)
      if len(prompt) >= self.max_len:
        raise _Garbage(f"a prompt of {len(prompt)} tokens leaves no room for an action "
                       f"(max_len {self.max_len})")
    except Exception as e:  # pylint: disable=broad-except  # the environment's failure
      self._count_fault("task_error", f"prompt {index}", _describe(e))
      return []
    try:
      episodes = [self.env.episode(task) for _ in range(self.samples_per_prompt)]
    except Exception as e:  # pylint: disable=broad-except
      self._count_fault("episode_error", f"prompt {index}", _describe(e))
      return []
    self._group += 1
    return [(task, self._group, ep, prompt, 0) for ep in episodes]

  def _admit(self):
    if self.static_batching and self.busy_slots:
      return
    full: set[int] = set()  # a paged engine's slot groups without pages to admit into
    if self._paged:
      self._reserve_pages(count=False)  # in-flight slots take their pages first
      full = self._blocked_groups()
    for i, s in enumerate(self._slots):
      if s is not None:
        continue
      if self._paged and self._state.pages.group_of(i) in full:
        continue
      nxt = self._next_task()
      if nxt is None:
        return
      task, group, episode, prompt, reruns = nxt
      need = min(len(prompt) + self.max_turn_tokens, self.max_len)
      if self._paged and not self._state.pages.can_admit(need, self._state.pages.group_of(i)):
        self._queued.append(nxt)  # it waits for pages, first in line
        full.add(self._state.pages.group_of(i))
        self.stats.page_waits += 1
        continue
      self._state = self.engine.reset_slots(self._state, np.arange(len(self._slots)) == i)
      if self._paged and not self.engine.reserve(self._state, i, need):
        raise AssertionError(f"slot {i}: pages that can_admit promised were not there")
      slot = _Slot(task, episode, group, [], [], [], [], [], [], time.time(),
                   admitted=self._admissions, reruns=reruns, prompt=prompt)
      self._admissions += 1
      slot.append(prompt)
      self._slots[i] = slot

  # --- the engine -------------------------------------------------------------

  def _engine_step(self, ready: list[int], admit: bool):
    pending = {i: len(self._slots[i].tokens) - self._slots[i].fed for i in ready}
    long = [i for i in ready if pending[i] > 1]
    if not long:
      self._decode(ready, admit)
      return
    chosen = long
    width = min(max(pending[i] for i in chosen), self.engine.prefill_buckets[-1])
    n = len(self._slots)
    tokens = np.zeros((n, width), np.int32)
    valid = np.zeros((n, width), bool)
    for i in chosen:
      s = self._slots[i]
      chunk = s.tokens[s.fed:s.fed + width]
      tokens[i, :len(chunk)] = chunk
      valid[i, :len(chunk)] = True
    start = time.perf_counter()
    self._state, sampled, logp, version = self.engine.step(self._state, tokens, valid)
    self.stats.generate_seconds += time.perf_counter() - start
    self.stats.steps += 1
    self.stats.prefill_steps += 1
    for i in chosen:
      s = self._slots[i]
      if self.record_routing:
        s.routing.append(self._state.routing[i, :int(valid[i].sum())])
      s.fed += int(valid[i].sum())
      if s.fed < len(s.tokens):
        continue  # a long append continues next step; its sample is discarded
      self._on_sample(i, int(sampled[i]), float(logp[i]), version)

  def _decode(self, ready: list[int], admit: bool):
    """One `decode` call for the slots with one pending token each.

    Each slot's budget is its turn's remaining tokens, capped by the room
    left before `max_len`, so the engine stops a slot exactly where
    `_on_sample` ends its turn or its episode. The host work of the pass
    (environment results, admissions) runs while the device decodes.
    """
    n = len(self._slots)
    tokens = np.zeros((n,), np.int32)
    budgets = np.zeros((n,), np.int32)
    for i in ready:
      s = self._slots[i]
      tokens[i] = s.tokens[-1]
      budgets[i] = min(self.max_turn_tokens - s.turn_tokens, self.max_len - len(s.tokens))
    start = time.perf_counter()
    self._state, chunk = self.engine.decode(self._state, tokens, budgets, steps=self.decode_steps,
                                            stop_token=self.turn_end_id)
    overlapped = time.perf_counter()
    self._collect_env_results(block=False)
    if admit and not (self.swap_policy == "drain" and self._pending_params is not None):
      self._admit()
    overlapped = time.perf_counter() - overlapped
    self._state, chunk = self.engine.collect(self._state, chunk)
    self.stats.generate_seconds += time.perf_counter() - start - overlapped
    self.stats.steps += 1
    self.stats.decode_steps += 1
    self.stats.decode_iterations += int(chunk.counts.max(initial=0))
    for i in ready:
      for k in range(int(chunk.counts[i])):
        if self._slots[i] is None:
          raise AssertionError(f"the engine decoded slot {i} past the end of its episode")
        if self.record_routing:  # the pending token's experts, as it was fed
          self._slots[i].routing.append(chunk.routing[i, k:k + 1])
        self._slots[i].fed += 1  # the pending token went into the cache
        self._on_sample(i, int(chunk.tokens[i, k]), float(chunk.logprobs[i, k]), chunk.version)

  def _on_sample(self, i: int, token: int, logp: float, version: int):
    s = self._slots[i]
    if s.turn_tokens == 0:
      s.turn_starts.append(len(s.tokens))
    s.append([token], action=True, logprob=logp, version=version)
    s.turn_tokens += 1
    self.stats.generated_tokens += 1
    if len(s.tokens) >= self.max_len:
      self._finish(i, "length")
    elif token == self.turn_end_id or s.turn_tokens >= self.max_turn_tokens:
      action = self._action(s.task, s.tokens[s.turn_starts[-1]:])
      s.waiting = True
      s.turn_tokens = 0
      f = self._pool.submit(_env_step, s.episode, action, self.max_observation_chars,
                            self.tool_latency_s)
      self._futures[f] = i

  def _prompt_ids(self, task: Task) -> list[int]:
    return self.format.prompt_ids(_plain_prompt(task.prompt), _plain_tools(base.task_tools(task)))

  def _action(self, task: Task, ids: list) -> Action:
    """One sampled turn as the environment sees it: its text and parsed tool calls.

    Tool calls are parsed from the ids (the format's control tokens), and
    checked against the task's declared tools; a malformed one is counted
    here and handed to the environment as an error (it answers it), never
    raised.
    """
    parsed = self.format.parse_turn(ids)
    calls, errors, sequence = [], [], []
    for item in parsed.sequence:  # in the order the turn wrote them
      if isinstance(item, chat.ToolCall):
        problem = chat.validate_call(item, base.task_tools(task))
        if problem is not None:
          item = (problem, f"{item.name[:60]!r}: {problem}")
      (calls if isinstance(item, chat.ToolCall) else errors).append(item)
      sequence.append(item)
    for reason, _ in errors:
      self.stats.tool_call_errors[reason] += 1
    self.stats.tool_calls += len(calls)
    return Action(parsed.text, parsed=parsed, tool_calls=tuple(calls),
                  tool_errors=tuple(errors), tool_sequence=tuple(sequence))

  def _observation_ids(self, observation) -> list[int]:
    """An observation's tokens (the format's bridge), tool output capped in tokens."""
    cap = self.max_tool_output_tokens
    if cap and not isinstance(observation, str):
      capped = []
      for message in observation:
        ids = self.tok.encode_lossy(message["content"])
        if len(ids) > cap:
          ids, _ = chat.cap_tokens(ids, cap, self.tok)
          message = {**message, "content": self.tok.decode(ids)}
          self.stats.observations_truncated += 1
        capped.append(message)
      observation = capped
    return self.format.observation_ids(observation)

  # --- environment results ------------------------------------------------------

  def _time_to_deadline(self) -> float | None:
    """Seconds until the earliest running step's deadline (None: no limit).

    A step still queued for a worker starts no earlier than now, so its
    deadline is no earlier than now + env_timeout: waiting that long at most
    cannot miss it, even if it starts during the wait.
    """
    if self.env_timeout is None:
      return None
    now = time.monotonic()
    earliest = now + self.env_timeout
    for f in self._futures:
      started = self._pool.started(f)
      if started is not None:
        earliest = min(earliest, started + self.env_timeout)
    return max(0.0, earliest - now)

  def _collect_env_results(self, block: bool):
    """Hands finished steps back to their slots and ends steps past their deadline.

    With `block`, first waits (event-driven, no polling) until a step
    finishes, the earliest deadline passes, or `stop()` wakes it.
    """
    if not self._futures:
      return
    if block:
      start = time.time()
      cf.wait([*self._futures, self._wake], timeout=self._time_to_deadline(),
              return_when=cf.FIRST_COMPLETED)
      self.stats.env_wait_seconds += time.time() - start
    now = time.monotonic()
    for f, i in list(self._futures.items()):
      started = None if f.done() else self._pool.started(f)
      if started is None:
        if not f.done():
          continue  # queued for a worker
      elif self.env_timeout is None or now < started + self.env_timeout:
        continue  # running, within its deadline
      elif self._pool.abandon(f):
        del self._futures[f]
        self._on_env_timeout(i, now - started)
        continue
      # Done (perhaps just now, between the checks above).
      del self._futures[f]
      self._on_env_result(i, f)

  def _on_env_result(self, i: int, f: cf.Future):
    s = self._slots[i]
    if f.cancelled():  # only `stop()` cancels: the slot is dropped
      self._slots[i] = None
      self._release(i)
      return
    exc = f.exception()  # only what `_env_step` does not catch, e.g. SystemExit
    out = _EnvOutcome(0.0, "env_error", _describe(exc)) if exc is not None else f.result()
    s.env_seconds += out.seconds
    s.waiting = False
    self.stats.env_events.update(out.events)
    if out.fault == "grader_error":
      self._rerun(i, out.detail)
      return
    if out.fault is not None:
      self._fault(i, out.fault, out.detail)
      return
    s.rewards[-1] += out.reward  # a turn's reward: its last action token
    if out.done:
      self._finish(i, out.finish_reason)
      return
    if out.truncated:
      self.stats.observations_truncated += 1
    obs = self._observation_ids(out.observation)
    if s.tokens[-1] != self.turn_end_id:  # cut at the turn limit: the format closes it
      obs = self.format.cut_turn_ids() + obs
    if len(s.tokens) + len(obs) + 1 >= self.max_len:
      self._finish(i, "length")
      return
    s.append(obs)

  def _on_env_timeout(self, i: int, seconds: float):
    s = self._slots[i]
    s.env_seconds += seconds
    s.waiting = False
    self._fault(i, "env_timeout", f"no result within env_timeout={self.env_timeout}s")
    stuck = self._pool.stuck
    if stuck > self.max_stuck_env_steps:
      # Counted, never raised: a policy whose tool calls hang must not be able
      # to stop its own training; each stuck thread exits when its step returns.
      self._count_fault("env_stuck", f"prompt {s.task.index}",
                        f"{stuck} steps stuck past env_timeout={self.env_timeout}s "
                        f"(max_stuck_env_steps={self.max_stuck_env_steps})")

  # --- faults and finishing --------------------------------------------------------

  def _release(self, i: int):
    """A paged engine's slot `i` gives its pages back (host-side: no device call)."""
    if self._paged:
      self.engine.release_pages(self._state, np.arange(len(self._slots)) == i)
      self._blocked.discard(i)

  def _count_fault(self, reason: str, where: str, detail: str):
    self.stats.env_faults[reason] += 1
    self.stats.env_fault_log.append(f"{reason} {where}: {detail}")

  def _fault(self, i: int, reason: str, detail: str):
    """Ends slot i's episode with fault `reason`: zero reward (module docstring)."""
    s = self._slots[i]
    s.rewards = [0.0] * len(s.rewards)
    self._count_fault(reason, f"prompt {s.task.index} turn {len(s.turn_starts)}", detail)
    self._finish(i, reason)

  def _rerun(self, i: int, detail: str):
    """Slot i's grader failed (`GraderError`): its episode is not emitted but run
    again, from its prompt, with a fresh episode of the same task and group,
    first in line; past `MAX_GRADER_RERUNS` it ends as an `env_error`."""
    s = self._slots[i]
    self._count_fault("grader_error", f"prompt {s.task.index} turn {len(s.turn_starts)}", detail)
    if s.reruns >= MAX_GRADER_RERUNS:
      self._fault(i, "env_error", f"the grader failed {s.reruns + 1} times: {detail}")
      return
    try:
      episode = self.env.episode(s.task)
    except Exception as e:  # pylint: disable=broad-except
      self._fault(i, "env_error", f"grader_error, then env.episode failed: {_describe(e)}")
      return
    self.stats.reruns += 1
    self._slots[i] = None
    self._release(i)
    self._queued.append((s.task, s.group_id, episode, s.prompt, s.reruns + 1))

  def _finish(self, i: int, reason: str):
    s = self._slots[i]
    self._slots[i] = None
    self._release(i)
    traj = Trajectory(
        routing=_routing_rows(s, self.engine) if self.record_routing else None,
        tokens=np.asarray(s.tokens, np.int32),
        action_mask=np.asarray(s.action_mask, bool),
        rollout_logprobs=np.asarray(s.logprobs, np.float32),
        policy_version=np.asarray(s.versions, np.int32),
        rewards=np.asarray(s.rewards, np.float32),
        turn_starts=np.asarray(s.turn_starts, np.int32),
        prompt_id=int(s.task.index), group_id=s.group_id, finish_reason=reason,
        start_time=s.start_time, end_time=time.time(), env_seconds=s.env_seconds)
    self.stats.finished += 1
    if self._on_finish is not None:
      self._on_finish(traj, s.episode)
    self._emit(traj)
