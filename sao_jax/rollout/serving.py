"""Completions of independent requests over the engine's slots, continuously batched.

The OpenAI-compatible server (`openai_api.py`) hands each request's prompt
ids to a `Batcher` and waits for the sampled ids. One thread of the
batcher's own drives the engine, as the rollout driver does for episodes:

  * a queued request takes a free slot at once (its slot is reset; a paged
    engine first reserves the pages of prompt plus budget, and a request
    that does not fit waits, first in line, until a slot gives pages back);
  * slots with prompt tokens still to feed go in one prefill `step` of
    bucketed width (a prompt wider than the largest bucket takes several);
    the step's sample at a prompt's last token is its first sampled token;
  * otherwise every slot with a pending token decodes in one `decode` call
    of `decode_steps` tokens, each slot stopped at the stop token or its
    budget;
  * a request is answered the moment its turn ends.

Each sampled token comes with its log-prob under the engine's sampling
distribution and the version of the params whose logits produced it
(`Completion`). New params (`update_params`) swap in between engine calls;
requests in flight keep their caches (the driver's "keep" policy), and
every token still records the version that sampled it.

No prefix is cached across requests: each request's prompt is prefilled
whole (an agent session's next request repeats its whole history). The
queue is bounded (`max_queue`): beyond it `submit` raises `Overloaded`, which
the server answers with 503. An engine call that raises fails the requests
in flight with that error (counted in `engine_errors`), the decode state is
rebuilt and the batcher goes on.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import queue
import threading
import time

import numpy as np


class Overloaded(RuntimeError):
  """The batcher's queue is full."""


class Closed(RuntimeError):
  """The batcher was closed."""


# The most stop ids and top_logprobs a request may ask for (OpenAI's top_logprobs limit).
MAX_STOP_IDS = 16
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class RequestSampling:
  """How one request samples (the OpenAI fields `temperature`, `top_p`, `seed`, stop ids,
  `top_logprobs`).

  Attributes:
    temperature: 0 is greedy (argmax); otherwise the logits' divisor.
    top_p: nucleus mass kept (1.0: off).
    seed: makes the request's draws reproducible whatever else is batched
      with it (its own key stream); None: the engine's stream.
    stop_ids: token ids that end the turn once sampled (kept as its last
      token), besides the batcher's stop token.
    top_logprobs: the most likely alternatives returned per token (0: none).
  """
  temperature: float = 1.0
  top_p: float = 1.0
  seed: int | None = None
  stop_ids: tuple[int, ...] = ()
  top_logprobs: int = 0

  def __post_init__(self):
    t, p = self.temperature, self.top_p
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
      raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {p!r}")
    if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                  or not 0 <= self.seed < 2**63):
      raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
    ids = self.stop_ids
    if not isinstance(ids, tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
      raise ValueError(f"stop_ids must be a tuple of token ids >= 0, got {ids!r}")
    if len(ids) > MAX_STOP_IDS:
      raise ValueError(f"stop_ids takes at most {MAX_STOP_IDS} ids, got {len(ids)}")
    k = self.top_logprobs
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
      raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0



@dataclasses.dataclass(frozen=True)
class Completion:
  """What one request sampled: at least one token."""
  tokens: tuple[int, ...]
  logprobs: tuple[float, ...]  # under the request's sampling distribution (RequestSampling)
  versions: tuple[int, ...]  # of the params whose logits produced each token
  stopped: bool  # the last token is a stop token (False: the budget ran out)
  # Per token, with `top_logprobs` k > 0: k (id, log-prob) pairs, most likely first.
  top_logprobs: tuple = ()


@dataclasses.dataclass
class _Request:
  prompt: list[int]
  budget: int
  future: cf.Future
  sampling: RequestSampling = RequestSampling()
  prefix_key: str | None = None
  fed: int = 0  # prompt tokens in the slot's cache
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)


_CLOSE = object()


class Batcher:
  """Continuous batching of independent completions (see the module docstring).

  Args:
    engine: a `PolicyEngine` (or anything with its driver API).
    stop_token: ends a completion once sampled (kept as its last token):
      the chat format's turn end.
    decode_steps: tokens a slot decodes per engine call.
    max_queue: requests waiting for a slot beyond which `submit` refuses.
  """

  def __init__(self, engine, stop_token: int, *, decode_steps: int = 1, max_queue: int = 256):
    if decode_steps < 1:
      raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
    self.engine, self.stop_token, self.decode_steps = engine, int(stop_token), decode_steps
    self.max_len = engine.max_prefill_length
    self._slots: list[_Request | None] = [None] * engine.max_concurrent_decodes
    self._queue: queue.Queue = queue.Queue(max_queue)
    self._waiting: collections.deque = collections.deque()  # taken from the queue, no pages yet
    self._state = engine.init_decode_state()
    self._closed = threading.Event()
    self.generated_tokens = 0
    self.generate_seconds = 0.0
    self.engine_errors = 0
    self._thread = threading.Thread(target=self._run, name="completions", daemon=True)
    self._thread.start()

  # --- public -------------------------------------------------------------------

  def submit(self, prompt, max_new_tokens: int, *, sampling: RequestSampling | None = None,
             prefix_key: str | None = None) -> cf.Future:
    """A future of the `Completion` of `prompt` (token ids), up to `max_new_tokens` tokens.

    `sampling`: the request's (default `RequestSampling()`). `prefix_key`:
    the session the request belongs to; a request that extends its
    session's previous prompt and completion reuses that cache.

    Raises ValueError for a request that cannot fit the engine (empty
    prompt, prompt plus budget beyond max_len), `Overloaded` when the queue
    is full, `Closed` after `close`.
    """
    sampling = RequestSampling() if sampling is None else sampling
    if not isinstance(sampling, RequestSampling):
      raise TypeError(f"sampling must be a RequestSampling, got {type(sampling).__name__}")
    if prefix_key is not None and not isinstance(prefix_key, str):
      raise TypeError(f"prefix_key must be a str or None, got {type(prefix_key).__name__}")
    prompt = [int(t) for t in prompt]
    if not prompt:
      raise ValueError("empty prompt")
    if max_new_tokens < 1 or len(prompt) + max_new_tokens > self.max_len:
      raise ValueError(f"a prompt of {len(prompt)} tokens plus {max_new_tokens} new ones does "
                       f"not fit max_len {self.max_len}")
    if self._closed.is_set():
      raise Closed("the batcher is closed")
    request = _Request(prompt, int(max_new_tokens), cf.Future(), sampling, prefix_key)
    try:
      self._queue.put_nowait(request)
    except queue.Full:
      raise Overloaded(f"{self._queue.maxsize} requests are waiting already") from None
    return request.future

  def update_params(self, params, version: int, *, copied: bool = False) -> None:
    """New params for the tokens sampled from the next engine call on (thread-safe);
    `copied`: already in the engine's layout (`PolicyEngine.update_params`)."""
    self.engine.update_params(params, version, copied=copied)

  @property
  def busy_slots(self) -> int:
    return sum(s is not None for s in self._slots)

  def close(self, timeout: float = 60.0) -> None:
    """Stops the thread; requests not finished fail with `Closed`."""
    self._closed.set()
    try:
      self._queue.put_nowait(_CLOSE)
    except queue.Full:
      pass  # the thread sees `_closed` after its current pass
    self._thread.join(timeout)

  # --- the thread -----------------------------------------------------------------

  def _run(self):
    try:
      while not self._closed.is_set():
        try:
          self._admit(block=self.busy_slots == 0)
          if self.busy_slots:
            self._pass()
        except Exception as e:  # pylint: disable=broad-except
          self._fail_in_flight(e)
    finally:
      self._closed.set()  # later submits are refused, not left waiting
      error = Closed("the batcher is closed")
      for r in list(self._slots) + list(self._waiting):
        if r is not None and not r.future.done():
          r.future.set_exception(error)
      while True:
        try:
          r = self._queue.get_nowait()
        except queue.Empty:
          break
        if r is not _CLOSE and not r.future.done():
          r.future.set_exception(error)

  def _fail_in_flight(self, error: Exception):
    self.engine_errors += 1
    for i, r in enumerate(self._slots):
      if r is not None:
        r.future.set_exception(error)
        self._slots[i] = None
    self._state = self.engine.init_decode_state()

  def _next_request(self, block: bool) -> _Request | None:
    if self._waiting:
      return self._waiting.popleft()
    try:
      r = self._queue.get(block=block)
    except queue.Empty:
      return None
    if r is _CLOSE:
      self._closed.set()
      return None
    return r

  def _admit(self, block: bool):
    """Free slots take queued requests; blocks for one when nothing is in flight."""
    n = len(self._slots)
    for i in range(n):
      if self._slots[i] is not None:
        continue
      r = None
      while r is None:
        r = self._next_request(block and self.busy_slots == 0)
        if r is None:
          return
        if not r.future.set_running_or_notify_cancel():
          r = None  # the caller gave up on it
      self._state = self.engine.reset_slots(self._state, np.arange(n) == i)
      if not self.engine.reserve(self._state, i, len(r.prompt) + r.budget):
        self._waiting.appendleft(r)  # no pages until a slot finishes
        return
      self._slots[i] = r

  def _pass(self):
    start = time.perf_counter()
    active = [i for i, r in enumerate(self._slots) if r is not None]
    prefill = [i for i in active if self._slots[i].fed < len(self._slots[i].prompt)]
    n = len(self._slots)
    if prefill:
      width = min(max(len(self._slots[i].prompt) - self._slots[i].fed for i in prefill),
                  self.engine.prefill_buckets[-1])
      tokens = np.zeros((n, width), np.int32)
      valid = np.zeros((n, width), bool)
      for i in prefill:
        r = self._slots[i]
        chunk = r.prompt[r.fed:r.fed + width]
        tokens[i, :len(chunk)], valid[i, :len(chunk)] = chunk, True
      self._state, sampled, logp, version = self.engine.step(self._state, tokens, valid)
      for i in prefill:
        r = self._slots[i]
        r.fed += int(valid[i].sum())
        if r.fed == len(r.prompt):  # the sample at the prompt's last token
          self._on_sample(i, int(sampled[i]), float(logp[i]), int(version))
    else:
      tokens = np.zeros((n,), np.int32)
      budgets = np.zeros((n,), np.int32)
      for i in active:
        r = self._slots[i]
        tokens[i], budgets[i] = r.tokens[-1], r.budget - len(r.tokens)
      self._state, chunk = self.engine.decode(self._state, tokens, budgets,
                                              steps=self.decode_steps, stop_token=self.stop_token)
      self._state, chunk = self.engine.collect(self._state, chunk)
      for i in active:
        for k in range(int(chunk.counts[i])):
          self._on_sample(i, int(chunk.tokens[i, k]), float(chunk.logprobs[i, k]),
                          int(chunk.version))
    self.generate_seconds += time.perf_counter() - start

  def _on_sample(self, i: int, token: int, logp: float, version: int):
    r = self._slots[i]
    if r is None:
      raise AssertionError(f"the engine sampled for slot {i} past the end of its request")
    r.tokens.append(token)
    r.logprobs.append(logp)
    r.versions.append(version)
    self.generated_tokens += 1
    stopped = token == self.stop_token
    if stopped or len(r.tokens) >= r.budget:
      self._slots[i] = None
      self.engine.release_pages(self._state, np.arange(len(self._slots)) == i)
      r.future.set_result(Completion(tuple(r.tokens), tuple(r.logprobs), tuple(r.versions),
                                     stopped))
