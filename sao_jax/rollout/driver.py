"""The rollout driver: continuous batching of episodes over an engine's slots.

`RolloutDriver` runs episodes of an environment on an `engine_protocol.Engine`,
feeding every slot's pending tokens in one engine step, refilling a free slot
at once and emitting each trajectory the moment it finishes. `SWAP_POLICIES`
names how new params reach in-flight slots ("recompute", "keep", "drain");
`MAX_GRADER_RERUNS` bounds the reruns of an episode whose grader failed. Its
parts are modules of their own, none importing this one: the environment
guard and worker pool (env_pool.py), page admission (admission.py) and the
counters (stats.py, `DriverStats`).

Invariants:
  * a recorded log-prob is the one its token was sampled with, and its
    version that of the params whose logits produced it ("recompute": also
    the teacher-forced log-prob under that version);
  * a trajectory carries the run id and params fingerprint of the versions
    it was sampled with (sao_jax/data/identity.py);
  * no environment failure stops the driver or reaches training unmarked:
    a step that raises, times out or returns garbage ends its episode
    ("env_error", "env_timeout", "env_garbage") with every reward zeroed,
    counted in `DriverStats`; a failing grader reruns its episode;
  * with a paged engine every trajectory still finishes (admission.py).

The design (batching, swaps, faults, pages): docs/design/engine.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time
from typing import Callable, Iterator

import numpy as np

from sao_jax.config import sections
from sao_jax.data import identity
from sao_jax.data.trajectory import Trajectory
from sao_jax.envs import base, chat
from sao_jax.envs.base import Action, Environment, Task
from sao_jax.models import routing as routing_lib
from sao_jax.rollout import admission, engine_protocol, env_pool, slot_loop
from sao_jax.rollout.stats import DriverStats

SWAP_POLICIES = sections.SWAP_POLICIES
# How often one episode is run again after its grader failed (GraderError)
# before it ends as an env_error instead.
MAX_GRADER_RERUNS = 2
# Prompts skipped in a row before the driver gives up: an environment that
# cannot open any episode would otherwise spin the driver through the whole
# (possibly endless) prompt stream without a trajectory or an error.
MAX_CONSECUTIVE_ADMISSION_FAULTS = 100


@dataclasses.dataclass
class _Slot:
  """One slot's episode: its record so far, how much of it is fed (module
  docstring), and where it stands in its turn."""

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
  # Whose params sampled its action tokens (identity.Tokens).
  identities: identity.Tokens = dataclasses.field(default_factory=identity.Tokens)

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


def _routing_rows(s: _Slot, engine) -> np.ndarray | None:
  """A slot's recorded expert choices, one row per token `[T, M, k]` int16: the
  fed tokens' as the engine chose them, NONE for the tokens never fed (the
  last sample)."""
  cfg = engine.cfg
  rows = np.full(
    (len(s.tokens), cfg.num_moe_layers, cfg.experts_per_token), routing_lib.NONE, np.int16
  )
  fed = np.concatenate(s.routing, 0) if s.routing else rows[:0]
  if fed.shape[0] != s.fed:
    raise AssertionError(f"{fed.shape[0]} routing rows for {s.fed} fed tokens")
  rows[: s.fed] = fed.reshape(fed.shape[0], *rows.shape[1:])
  return rows


# --- the driver -------------------------------------------------------------------


class RolloutDriver:
  """Runs episodes of `env` with `engine`, emitting finished Trajectories.

  `rollout` (default: the engine's) is the config's rollout section
  (sao_jax/config/sections.py), of which the driver reads samples_per_prompt,
  max_turn_tokens, decode_steps, swap_policy, env_workers and env_timeout.

  Environment faults (docs/design/engine.md, "Environment faults") are bounded by:
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

  def __init__(
    self,
    engine: engine_protocol.Engine,
    env: Environment,
    tokenizer,
    prompts: Iterator[int],
    emit: Callable[[Trajectory], None],
    rollout: sections.Rollout | None = None,
    *,
    static_batching: bool = False,
    max_stuck_env_steps: int | None = None,
    max_observation_chars: int | None = None,
    tool_latency_s: float = 0.0,
    chat_format=None,
    max_tool_output_tokens: int = 0,
    on_finish: Callable[[Trajectory, object], None] | None = None,
  ):
    problem = engine_protocol.engine_problem(engine)
    if problem is not None:
      raise TypeError(f"RolloutDriver: engine {type(engine).__name__} {problem}")
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
    # expert choices and the trajectory carries them (Engine's default: none).
    self.record_routing = bool(engine.record_routing)
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
    self.max_stuck_env_steps = (
      4 * r.env_workers if max_stuck_env_steps is None else max_stuck_env_steps
    )
    self.max_observation_chars = (
      16 * self.max_len if max_observation_chars is None else max_observation_chars
    )
    self.stats = DriverStats()
    self._slots: list[_Slot | None] = [None] * engine.max_concurrent_decodes
    self._state = engine.init_decode_state()
    # The environment steps in flight, each a slot's (rollout/env_pool.py).
    self._steps = env_pool.EnvSteps(
      r.env_workers, self.env_timeout, self.max_observation_chars, tool_latency_s
    )
    self._lock = threading.Lock()
    self._pending_params = None
    # The identity (run id, params fingerprint) of each version the engine
    # held: the engine's first version has none unless its owner notes it.
    self.identity = identity.Ledger()
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
    # A paged engine's page reservations (rollout/admission.py).
    self._pages = admission.PageAdmission(engine, self.max_turn_tokens, self.max_len, self.stats)
    self._admissions = 0

  # --- public -----------------------------------------------------------

  def update_params(self, params, version: int, meta: dict | None = None) -> None:
    """Thread-safe: the new params apply between steps, per `swap_policy`.

    They are copied now, in the caller's thread: the trainer may donate its
    buffers to the next step before the driver applies them. `meta`: the
    version's weights meta, whose run id and fingerprint (identity.py) the
    trajectories it samples carry; without one they carry none.
    """
    copied = self.engine.load_params(params)
    with self._lock:
      self._pending_params = (copied, version, meta)

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
      except BaseException as e:  # noqa: BLE001  # re-raised by check()
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
    self._steps.close()

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
    return self._steps.stuck

  # --- the loop -----------------------------------------------------------

  def _admitted_enough(self, target) -> bool:
    return self.stats.finished + self.busy_slots < target

  def _iterate(self, admit: bool) -> bool:
    """One pass: params, env results, admissions, one engine step. False when done."""
    self._maybe_swap_params()
    self._collect_env_results(block=False)
    if admit and not (self.swap_policy == "drain" and self._pending_params is not None):
      self._admit()
    ready = self._pages.reserve(self._slots, self._state)
    if self._pages.blocked:  # where a whole group of slots waits for pages, one is preempted
      self._state = self._pages.preempt(self._slots, self._state)
    if ready:
      self._engine_step(ready, admit)
      return True
    if self._steps:
      self._collect_env_results(block=True)
      return True
    return self.busy_slots > 0 or (admit and not self._prompts_done)

  def _maybe_swap_params(self):
    with self._lock:
      pending = self._pending_params
      if pending is None:
        return
      if self.swap_policy == "drain" and self.busy_slots:
        return
      self._pending_params = None
    params, version, meta = pending
    self.engine.update_params(params, version, copied=True)
    self.identity.note(version, meta)  # from now on, its tokens are this version's
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
            f"{self.stats.env_fault_log[-1]}"
          )
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
        raise env_pool.Garbage(
          f"env.task returned a {type(task).__name__} that is not a Task: it has {problem}"
        )
      prompt = self._prompt_ids(task)
      if len(prompt) >= self.max_len:
        raise env_pool.Garbage(
          f"a prompt of {len(prompt)} tokens leaves no room for an action (max_len {self.max_len})"
        )
    except Exception as e:  # noqa: BLE001  # the environment's failure
      self.stats.count_fault("task_error", f"prompt {index}", env_pool.describe(e))
      return []
    try:
      episodes = [self.env.episode(task) for _ in range(self.samples_per_prompt)]
    except Exception as e:  # noqa: BLE001
      self.stats.count_fault("episode_error", f"prompt {index}", env_pool.describe(e))
      return []
    self._group += 1
    return [(task, self._group, ep, prompt, 0) for ep in episodes]

  def _admit(self):
    if self.static_batching and self.busy_slots:
      return
    # A paged engine's slot groups without pages to admit into (in-flight slots
    # take their pages first).
    full = self._pages.full_groups(self._slots, self._state)
    for i, s in enumerate(self._slots):
      if s is not None or self._pages.closed(self._state, i, full):
        continue
      nxt = self._next_task()
      if nxt is None:
        return
      task, group, episode, prompt, reruns = nxt
      if not self._pages.admits(self._state, i, len(prompt), full):
        self._queued.append(nxt)  # it waits for pages, first in line
        continue
      self._state = self.engine.reset_slots(self._state, np.arange(len(self._slots)) == i)
      self._pages.take(self._state, i, len(prompt))
      slot = _Slot(
        task,
        episode,
        group,
        [],
        [],
        [],
        [],
        [],
        [],
        time.time(),
        admitted=self._admissions,
        reruns=reruns,
        prompt=prompt,
      )
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
    tokens, valid = slot_loop.prefill_feed(
      {i: self._slots[i].tokens[self._slots[i].fed :] for i in chosen},
      len(self._slots),
      self.max_len,
    )
    start = time.perf_counter()
    self._state, sampled, logp, version = self.engine.step(self._state, tokens, valid)
    self.stats.generate_seconds += time.perf_counter() - start
    self.stats.steps += 1
    self.stats.prefill_steps += 1
    for i in chosen:
      s = self._slots[i]
      if self.record_routing:
        s.routing.append(self._state.routing[i, : int(valid[i].sum())])
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
    rows = {}
    for i in ready:
      s = self._slots[i]
      rows[i] = (
        s.tokens[-1],
        min(self.max_turn_tokens - s.turn_tokens, self.max_len - len(s.tokens)),
      )
    tokens, budgets = slot_loop.decode_feed(rows, len(self._slots))
    start = time.perf_counter()
    self._state, chunk = self.engine.decode(
      self._state, tokens, budgets, steps=self.decode_steps, stop_token=self.turn_end_id
    )
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
    for i, k, token, logp in slot_loop.samples(chunk, ready):
      if self._slots[i] is None:
        raise AssertionError(f"the engine decoded slot {i} past the end of its episode")
      if self.record_routing:  # the pending token's experts, as it was fed
        self._slots[i].routing.append(chunk.routing[i, k : k + 1])
      self._slots[i].fed += 1  # the pending token went into the cache
      self._on_sample(i, token, logp, chunk.version)

  def _on_sample(self, i: int, token: int, logp: float, version: int):
    s = self._slots[i]
    if s.turn_tokens == 0:
      s.turn_starts.append(len(s.tokens))
    s.append([token], action=True, logprob=logp, version=version)
    s.identities.add(version, self.identity.get(version))
    s.turn_tokens += 1
    self.stats.generated_tokens += 1
    if len(s.tokens) >= self.max_len:
      self._finish(i, "length")
    elif token == self.turn_end_id or s.turn_tokens >= self.max_turn_tokens:
      action = self._action(s.task, s.tokens[s.turn_starts[-1] :])
      s.waiting = True
      s.turn_tokens = 0
      self._steps.submit(i, s.episode, action)

  def _prompt_ids(self, task: Task) -> list[int]:
    return self.format.prompt_ids(
      env_pool.plain_prompt(task.prompt), env_pool.plain_tools(base.task_tools(task))
    )

  def _action(self, task: Task, ids: list) -> Action:
    """One sampled turn as the environment sees it: its text and parsed tool calls.

    Tool calls are parsed from the ids (the format's control tokens), and
    checked against the task's declared tools; a malformed one is counted
    here and handed to the environment as an error (it answers it), never
    raised.
    """
    tools = base.task_tools(task)
    # The tools type arguments a call syntax leaves text (qwen3_5's XML calls).
    parsed = self.format.parse_turn(ids, tools)
    calls, errors, sequence = [], [], []
    for item in parsed.sequence:  # in the order the turn wrote them
      if isinstance(item, chat.ToolCall):
        problem = chat.validate_call(item, tools)
        if problem is not None:
          item = (problem, f"{item.name[:60]!r}: {problem}")
      (calls if isinstance(item, chat.ToolCall) else errors).append(item)
      sequence.append(item)
    for reason, _ in errors:
      self.stats.tool_call_errors[reason] += 1
    self.stats.tool_calls += len(calls)
    return Action(
      parsed.text,
      parsed=parsed,
      tool_calls=tuple(calls),
      tool_errors=tuple(errors),
      tool_sequence=tuple(sequence),
    )

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

  def _collect_env_results(self, block: bool):
    """Hands finished steps back to their slots and ends steps past their deadline.

    With `block`, first waits (event-driven, no polling) until a step
    finishes, the earliest deadline passes, or `stop()` wakes it.
    """
    if not self._steps:
      return
    if block:
      self.stats.env_wait_seconds += self._steps.wait(self._wake)
    for i, out in self._steps.finished():
      self._on_env_result(i, out)

  def _on_env_result(self, i: int, out: env_pool.EnvOutcome | None):
    s = self._slots[i]
    if out is None:  # cancelled: only `stop()` cancels, the slot is dropped
      self._slots[i] = None
      self._release(i)
      return
    s.env_seconds += out.seconds
    s.waiting = False
    if out.abandoned:
      self._on_env_timeout(i, out.detail)
      return
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

  def _on_env_timeout(self, i: int, detail: str):
    s = self._slots[i]
    self._fault(i, "env_timeout", detail)
    stuck = self._steps.stuck
    if stuck > self.max_stuck_env_steps:
      # Counted, never raised: a policy whose tool calls hang must not be able
      # to stop its own training; each stuck thread exits when its step returns.
      self.stats.count_fault(
        "env_stuck",
        f"prompt {s.task.index}",
        f"{stuck} steps stuck past env_timeout={self.env_timeout}s "
        f"(max_stuck_env_steps={self.max_stuck_env_steps})",
      )

  # --- faults and finishing --------------------------------------------------------

  def _release(self, i: int):
    """A paged engine's slot `i` gives its pages back (host-side: no device call)."""
    self._pages.release(self._slots, self._state, i)

  def _fault(self, i: int, reason: str, detail: str):
    """Ends slot i's episode with fault `reason`: every reward zeroed (module docstring)."""
    s = self._slots[i]
    s.rewards = [0.0] * len(s.rewards)
    self.stats.count_fault(reason, f"prompt {s.task.index} turn {len(s.turn_starts)}", detail)
    self._finish(i, reason)

  def _rerun(self, i: int, detail: str):
    """Slot i's grader failed (`GraderError`): its episode is not emitted but run
    again, from its prompt, with a fresh episode of the same task and group,
    first in line; past `MAX_GRADER_RERUNS` it ends as an `env_error`."""
    s = self._slots[i]
    self.stats.count_fault(
      "grader_error", f"prompt {s.task.index} turn {len(s.turn_starts)}", detail
    )
    if s.reruns >= MAX_GRADER_RERUNS:
      self._fault(i, "env_error", f"the grader failed {s.reruns + 1} times: {detail}")
      return
    try:
      episode = self.env.episode(s.task)
    except Exception as e:  # noqa: BLE001
      self._fault(i, "env_error", f"grader_error, then env.episode failed: {env_pool.describe(e)}")
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
      prompt_id=int(s.task.index),
      group_id=s.group_id,
      finish_reason=reason,
      start_time=s.start_time,
      end_time=time.time(),
      env_seconds=s.env_seconds,
      **s.identities.fields(),
    )
    self.stats.finished += 1
    if self._on_finish is not None:
      self._on_finish(traj, s.episode)
    self._emit(traj)
