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
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time
from typing import Callable, Iterator

import numpy as np

from sao_jax.data.trajectory import Trajectory
from sao_jax.envs.base import Environment, StepResult, Task
from sao_jax.rollout.engine import PolicyEngine

SWAP_POLICIES = ("recompute", "keep", "drain")


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


class RolloutDriver:
  """Runs episodes of `env` with `engine`, emitting finished Trajectories."""

  def __init__(self, engine: PolicyEngine, env: Environment, tokenizer,
               prompts: Iterator[int], emit: Callable[[Trajectory], None], *,
               samples_per_prompt: int = 1, max_turn_tokens: int = 32,
               env_workers: int = 4, swap_policy: str = "recompute",
               static_batching: bool = False):
    if swap_policy not in SWAP_POLICIES:
      raise ValueError(f"swap_policy must be one of {SWAP_POLICIES}, got {swap_policy!r}")
    if samples_per_prompt < 1:
      raise ValueError("samples_per_prompt must be >= 1")
    self.engine, self.env, self.tok = engine, env, tokenizer
    self._prompts = prompts
    self._emit = emit
    self.samples_per_prompt = samples_per_prompt
    self.max_turn_tokens = max_turn_tokens
    self.swap_policy = swap_policy
    # The baseline of benchmarks/rollout.py: admit only when every slot is
    # free, i.e. one static batch at a time.
    self.static_batching = static_batching
    self.max_len = engine.max_prefill_length
    self.stats = DriverStats()
    self._slots: list[_Slot | None] = [None] * engine.max_concurrent_decodes
    self._state = engine.init_decode_state()
    self._pool = cf.ThreadPoolExecutor(env_workers, thread_name_prefix="env")
    self._futures: dict[cf.Future, int] = {}
    self._lock = threading.Lock()
    self._pending_params = None
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self._queued: list[tuple[Task, int]] = []  # G copies of the current prompt
    self._prompts_done = False
    self._group = 0

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
    """Runs in a background thread; `check()` re-raises its failure."""

    def body():
      try:
        self.run()
      except BaseException as e:  # pylint: disable=broad-except
        self._error = e

    self._thread = threading.Thread(target=body, name="rollout-driver", daemon=True)
    self._thread.start()

  def stop(self, timeout: float = 60.0) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout)
    self._pool.shutdown(wait=False, cancel_futures=True)

  def check(self) -> None:
    if self._error is not None:
      raise RuntimeError("rollout driver failed") from self._error

  @property
  def alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  @property
  def busy_slots(self) -> int:
    return sum(s is not None for s in self._slots)

  # --- the loop -----------------------------------------------------------

  def _admitted_enough(self, target) -> bool:
    return self.stats.finished + self.busy_slots < target

  def _iterate(self, admit: bool) -> bool:
    """One pass: params, env results, admissions, one engine step. False when done."""
    self._maybe_swap_params()
    self._collect_env_results(block=False)
    if admit and not (self.swap_policy == "drain" and self._pending_params is not None):
      self._admit()
    ready = [i for i, s in enumerate(self._slots)
             if s is not None and not s.waiting and len(s.tokens) > s.fed]
    if ready:
      self._engine_step(ready)
      return True
    if self._futures:
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
    self.engine.update_params(*pending, copied=True)
    self.stats.param_swaps += 1
    if self.swap_policy == "recompute":
      in_flight = np.array([s is not None for s in self._slots])
      for s in self._slots:
        if s is not None:
          s.fed = 0
      self._state = self.engine.reset_slots(self._state, in_flight)

  def _next_task(self) -> tuple[Task, int] | None:
    if not self._queued:
      if self._prompts_done:
        return None
      try:
        index = next(self._prompts)
      except StopIteration:
        self._prompts_done = True
        return None
      task = self.env.task(int(index))
      self._group += 1
      self._queued = [(task, self._group)] * self.samples_per_prompt
    return self._queued.pop()

  def _admit(self):
    if self.static_batching and self.busy_slots:
      return
    for i, s in enumerate(self._slots):
      if s is not None:
        continue
      nxt = self._next_task()
      if nxt is None:
        return
      task, group = nxt
      slot = _Slot(task, self.env.episode(task), group, [], [], [], [], [], [], time.time())
      prompt = ([self.tok.bos_id] if self.tok.bos_id is not None else []) + self.tok.encode(
          task.prompt)
      slot.append(prompt)
      self._slots[i] = slot
      self._state = self.engine.reset_slots(self._state, np.arange(len(self._slots)) == i)

  def _engine_step(self, ready: list[int]):
    pending = {i: len(self._slots[i].tokens) - self._slots[i].fed for i in ready}
    long = [i for i in ready if pending[i] > 1]
    chosen = long if long else ready
    width = min(max(pending[i] for i in chosen), self.engine.prefill_buckets[-1])
    n = len(self._slots)
    tokens = np.zeros((n, width), np.int32)
    valid = np.zeros((n, width), bool)
    for i in chosen:
      s = self._slots[i]
      chunk = s.tokens[s.fed:s.fed + width]
      tokens[i, :len(chunk)] = chunk
      valid[i, :len(chunk)] = True
    self._state, sampled, logp, version = self.engine.step(self._state, tokens, valid)
    self.stats.steps += 1
    if long:
      self.stats.prefill_steps += 1
    else:
      self.stats.decode_steps += 1
    for i in chosen:
      s = self._slots[i]
      s.fed += int(valid[i].sum())
      if s.fed < len(s.tokens):
        continue  # a long append continues next step; its sample is discarded
      self._on_sample(i, int(sampled[i]), float(logp[i]), version)

  def _on_sample(self, i: int, token: int, logp: float, version: int):
    s = self._slots[i]
    if s.turn_tokens == 0:
      s.turn_starts.append(len(s.tokens))
    s.append([token], action=True, logprob=logp, version=version)
    s.turn_tokens += 1
    self.stats.generated_tokens += 1
    if len(s.tokens) >= self.max_len:
      self._finish(i, "length")
    elif token == self.tok.turn_end_id or s.turn_tokens >= self.max_turn_tokens:
      start = s.turn_starts[-1]
      action_ids = [t for t in s.tokens[start:] if t != self.tok.turn_end_id]
      text = self.tok.decode(action_ids)
      s.waiting = True
      s.turn_tokens = 0
      self._futures[self._pool.submit(self._env_step, s.episode, text)] = i

  @staticmethod
  def _env_step(episode, text: str) -> tuple[StepResult, float]:
    start = time.time()
    result = episode.step(text)
    return result, time.time() - start

  def _collect_env_results(self, block: bool):
    if not self._futures:
      return
    if block:
      start = time.time()
      done, _ = cf.wait(list(self._futures), return_when=cf.FIRST_COMPLETED)
      self.stats.env_wait_seconds += time.time() - start
    else:
      done = [f for f in self._futures if f.done()]
    for f in done:
      i = self._futures.pop(f)
      result, seconds = f.result()  # an environment bug surfaces here
      s = self._slots[i]
      s.env_seconds += seconds
      s.waiting = False
      s.rewards[-1] += float(result.reward)  # a turn's reward: its last action token
      if result.done:
        self._finish(i, result.info.get("finish_reason", "done"))
        continue
      obs = self.tok.encode_lossy(result.observation)
      if len(s.tokens) + len(obs) + 1 >= self.max_len:
        self._finish(i, "length")
        continue
      s.append(obs)

  def _finish(self, i: int, reason: str):
    s = self._slots[i]
    self._slots[i] = None
    traj = Trajectory(
        tokens=np.asarray(s.tokens, np.int32),
        action_mask=np.asarray(s.action_mask, bool),
        rollout_logprobs=np.asarray(s.logprobs, np.float32),
        policy_version=np.asarray(s.versions, np.int32),
        rewards=np.asarray(s.rewards, np.float32),
        turn_starts=np.asarray(s.turn_starts, np.int32),
        prompt_id=s.task.index, group_id=s.group_id, finish_reason=reason,
        start_time=s.start_time, end_time=time.time(), env_seconds=s.env_seconds)
    self.stats.finished += 1
    self._emit(traj)
