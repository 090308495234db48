"""Completions of independent requests over the engine's slots, continuously batched.

The OpenAI-compatible server (`openai_api.py`) hands each request's prompt
ids to a `Batcher` and waits for the sampled ids. One thread of the
batcher's own drives the engine, as the rollout driver does for episodes:

  * a queued request takes a slot at once: its session's parked slot if it
    has one (below), else a free slot, else the least recently used parked
    slot, evicted. A paged engine first reserves the pages of prompt plus
    budget (evicting parked slots' pages, least recently used first, when
    the pool is short); a request that does not fit waits, first in line,
    until a slot gives pages back;
  * slots with prompt tokens still to feed go in one prefill `step` of
    bucketed width (a prompt wider than the largest bucket takes several);
    the step's sample at a prompt's last token is its first sampled token;
  * otherwise every slot with a pending token decodes in one `decode` call
    of `decode_steps` tokens, each slot stopped at a stop id or its budget;
  * a request is answered the moment its turn ends.

Sampling, per request (`RequestSampling`)
-----------------------------------------
Each request samples with its own temperature, top_p and stop ids in the
engine's batched programs (`PolicyEngine.serve_step` / `serve_decode`:
per-slot arrays, one compile for every mix of values; sampling.py,
"per-slot sampling"). Temperature 0 is greedy. Each request draws from its
own key stream (draw n: `fold_in(key, n)`, the key from its `seed`, or
from the batcher's generator without one), so a seeded request samples the
same tokens whatever is batched with it. A sampled stop id ends the turn
(kept as its last token, `stopped`). The log-prob recorded for each token
is that of the behaviour distribution the token was drawn from -- the
logits over the temperature, the engine's top-k, the request's nucleus,
renormalised; the driver's `rollout_logprobs` rule -- and a greedy token's
is 0 (a point mass; a DIS ratio against it is the policy's probability of
the argmax). `top_logprobs` k returns, per token, the k likeliest (id,
log-prob) pairs under that same distribution, those with a finite log-prob
only (a greedy token's list is itself at 0). An engine without
`serve_step` (a test's scripted double) samples with its own distribution:
it takes only requests without `sampling`.

Prefix reuse (`prefix_key`)
---------------------------
A request with a `prefix_key` (its session) leaves its slot's cache
parked under that key when it finishes: the prompt and every sampled token
but the last (which was sampled, never fed). The session's next request
takes that slot back and keeps the longest common prefix of the parked
tokens and its prompt (at most all but the prompt's last token, whose
logits it samples from), so only the new tokens are prefilled: an agent
session's next request repeats its history and appends a tool result. A
model with recurrent layers (Qwen3.5's Gated DeltaNet) keeps a state of the
whole parked prefix, so there the prefix is reused only whole (the prompt
extends every parked token), else the slot starts over. Parked caches are
dropped when the params change version (tokens then record the params
whose logits produced them, as a fresh prefill's would) and after an
engine error. A parked slot is evicted, least recently used first, when a
request needs its slot or its pages (`evictions`); a paged engine's parked
slot keeps only the pages of its parked tokens.

Sessions that begin alike (a system prompt and tools) share pages on a
paged engine: a request that keeps nothing of its own session's starts
from the full pages other slots hold of its prompt's start (in flight or
parked; each slot offers its prompt's full pages once prefilled, and its
parked tokens'), refcounted in the pool (paging.py, "Shared prefixes").
Only whole pages are shared, so up to page_size - 1 tokens of the common
prefix are prefilled again; a dense cache, and a model with recurrent
layers (whose state is per slot, not in pages), share nothing.
`prefill_computed` counts the prompt tokens fed, `prefill_reused` those
found in the session's parked cache and `prefill_shared` those found in
other sessions' pages.

Each sampled token comes with its version of the params (`Completion`).
New params (`update_params`) swap in between engine calls; requests in
flight keep their caches (the driver's "keep" policy), and every token
still records the version that sampled it. The queue is bounded
(`max_queue`): beyond it `submit` raises `Overloaded`, which the server
answers with 503. An engine call that raises fails the requests in flight
with that error (counted in `engine_errors`), the decode state is rebuilt
and the batcher goes on.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import queue
import threading
import time

import numpy as np

from sao_jax.rollout import engine_protocol, slot_loop
from sao_jax.rollout import sampling as sampling_lib


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
    if self.seed is not None and (
      isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
    ):
      raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
    ids = self.stop_ids
    if not isinstance(ids, tuple) or not all(
      isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
      raise ValueError(f"stop_ids must be a tuple of token ids >= 0, got {ids!r}")
    if len(ids) > MAX_STOP_IDS:
      raise ValueError(f"stop_ids takes at most {MAX_STOP_IDS} ids, got {len(ids)}")
    k = self.top_logprobs
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
      raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def check_request(prompt, max_new_tokens: int, sampling, prefix_key, max_len: int) -> list[int]:
  """`prompt` as a list of ids, once the request is one a completer can take
  (`Batcher.submit`'s and every other completer's checks); TypeError or
  ValueError otherwise."""
  if sampling is not None and not isinstance(sampling, RequestSampling):
    raise TypeError(f"sampling must be a RequestSampling, got {type(sampling).__name__}")
  if prefix_key is not None and not isinstance(prefix_key, str):
    raise TypeError(f"prefix_key must be a str or None, got {type(prefix_key).__name__}")
  prompt = [int(t) for t in prompt]
  if not prompt:
    raise ValueError("empty prompt")
  if max_new_tokens < 1 or len(prompt) + max_new_tokens > max_len:
    raise ValueError(
      f"a prompt of {len(prompt)} tokens plus {max_new_tokens} new ones does "
      f"not fit max_len {max_len}"
    )
  return prompt


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
  key: np.ndarray | None = None  # [2] uint32: the request's key stream (set at admission)
  admitted_version: int = -1  # the engine's params version when it took its slot
  fed: int = 0  # prompt tokens in the slot's cache
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  tops: list = dataclasses.field(default_factory=list)

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return self.sampling.stop_ids


@dataclasses.dataclass
class _Parked:
  """A session's cache left in a slot between its requests."""

  slot: int
  tokens: list[int]  # what the slot's cache holds, in order
  version: int  # of the params that computed it


_CLOSE = object()
_WAKE = object()  # a `forget` for an idle thread


class Batcher:
  """Continuous batching of independent completions (see the module docstring).

  Args:
    engine: an `engine_protocol.Engine` (a `PolicyEngine`, or a user's).
    stop_token: ends a completion once sampled (kept as its last token):
      the chat format's turn end.
    decode_steps: tokens a slot decodes per engine call.
    max_queue: requests waiting for a slot beyond which `submit` refuses.
    seed: of the key streams of requests without a seed.
  """

  def __init__(
    self, engine, stop_token: int, *, decode_steps: int = 1, max_queue: int = 256, seed: int = 0
  ):
    if decode_steps < 1:
      raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
    problem = engine_protocol.engine_problem(engine)
    if problem is not None:
      raise TypeError(f"Batcher: engine {type(engine).__name__} {problem}")
    self.engine, self.stop_token, self.decode_steps = engine, int(stop_token), decode_steps
    self.max_len = engine.max_prefill_length
    # Per-request sampling in the engine's programs (module docstring).
    self.per_request_sampling = engine.per_request_sampling
    # Reusing part of a parked prefix needs the cache cut back (no recurrent layers).
    self._rewindable = engine.can_rewind
    # Pages shared between sessions' common prefixes (a paged engine's).
    self._shares = engine.shares_prefixes
    self._slots: list[_Request | None] = [None] * engine.max_concurrent_decodes
    self._parked: collections.OrderedDict[str, _Parked] = collections.OrderedDict()  # LRU first
    self._forget: collections.deque = collections.deque()  # keys to drop, from other threads
    self._queue: queue.Queue = queue.Queue(max_queue)
    self._waiting: collections.deque = collections.deque()  # taken from the queue, no pages yet
    self._state = engine.init_decode_state()
    self._keys = np.random.default_rng(seed)
    self._closed = threading.Event()
    self.generated_tokens = 0
    self.generate_seconds = 0.0
    self.engine_errors = 0
    self.prefill_computed = 0  # prompt tokens fed to the engine
    self.prefill_reused = 0  # prompt tokens found in the session's parked cache
    self.prefill_shared = 0  # prompt tokens found in pages other sessions share
    self.prefix_hits = 0  # requests that reused a parked cache
    self.evictions = 0  # parked caches dropped for another request's slot or pages
    self._thread = threading.Thread(target=self._run, name="completions", daemon=True)
    self._thread.start()

  # --- public -------------------------------------------------------------------

  def submit(
    self,
    prompt,
    max_new_tokens: int,
    *,
    sampling: RequestSampling | None = None,
    prefix_key: str | None = None,
  ) -> cf.Future:
    """A future of the `Completion` of `prompt` (token ids), up to `max_new_tokens` tokens.

    `sampling`: the request's (module docstring); None: the engine's own
    temperature and top_p. `prefix_key`: the session the request belongs
    to; a request that extends its session's previous prompt and completion
    reuses that cache (module docstring, "Prefix reuse").

    Raises ValueError for a request that cannot fit the engine (empty
    prompt, prompt plus budget beyond max_len) or sampling it cannot honour,
    `Overloaded` when the queue is full, `Closed` after `close`.
    """
    if sampling is not None and not self.per_request_sampling:
      raise ValueError("this engine samples only with its own distribution (no serve_step)")
    prompt = check_request(prompt, max_new_tokens, sampling, prefix_key, self.max_len)
    if self._closed.is_set():
      raise Closed("the batcher is closed")
    request = _Request(
      prompt,
      int(max_new_tokens),
      cf.Future(),
      self._default_sampling() if sampling is None else sampling,
      prefix_key,
    )
    try:
      self._queue.put_nowait(request)
    except queue.Full:
      raise Overloaded(f"{self._queue.maxsize} requests are waiting already") from None
    return request.future

  def _default_sampling(self) -> RequestSampling:
    """The engine's own temperature and top_p (its top-k applies to every request)."""
    own = self.engine.sampling
    return RequestSampling() if own is None else RequestSampling(own.temperature, own.top_p)

  def forget(self, prefix_key: str) -> None:
    """Drops `prefix_key`'s parked cache (thread-safe; done before the next admission)."""
    self._forget.append(prefix_key)
    try:
      self._queue.put_nowait(_WAKE)
    except queue.Full:
      pass  # the thread is busy: it drops the cache at its next admission

  def update_params(self, params, version: int, *, copied: bool = False) -> None:
    """New params for the tokens sampled from the next engine call on (thread-safe);
    `copied`: already in the engine's layout (`PolicyEngine.update_params`)."""
    self.engine.update_params(params, version, copied=copied)

  @property
  def busy_slots(self) -> int:
    return sum(s is not None for s in self._slots)

  @property
  def parked(self) -> int:
    """Sessions whose cache is parked in a slot."""
    return len(self._parked)

  def counters(self) -> dict:
    """The batcher's counts, for a stats endpoint."""
    return {
      "generated_tokens": self.generated_tokens,
      "engine_errors": self.engine_errors,
      "prefill_computed": self.prefill_computed,
      "prefill_reused": self.prefill_reused,
      "prefill_shared": self.prefill_shared,
      "prefix_hits": self.prefix_hits,
      "evictions": self.evictions,
      "parked": self.parked,
      "busy_slots": self.busy_slots,
    }

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
        except Exception as e:  # noqa: BLE001
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
        if r is not _CLOSE and r is not _WAKE and not r.future.done():
          r.future.set_exception(error)

  def _fail_in_flight(self, error: Exception):
    self.engine_errors += 1
    for i, r in enumerate(self._slots):
      if r is not None:
        r.future.set_exception(error)
        self._slots[i] = None
    self._parked.clear()  # the rebuilt state holds no cache
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
    return None if r is _WAKE else r

  # --- admission: slots, parked caches, pages ----------------------------------

  def _admit(self, block: bool):
    """Queued requests take slots while any is not busy; blocks for one when
    nothing is in flight."""
    while self._forget:
      self._drop(self._forget.popleft())
    while self.busy_slots < len(self._slots):
      r = self._next_request(block and self.busy_slots == 0)
      if r is None:
        return
      if not r.future.set_running_or_notify_cancel():
        continue  # the caller gave up on it
      if not self._place(r):
        self._waiting.appendleft(r)  # no pages until a slot finishes
        return

  def _place(self, r: _Request) -> bool:
    """Puts `r` in a slot with its pages, reusing its session's parked cache;
    False (r placed nowhere, its session's cache still parked) when the pages
    are not there even with every other parked cache evicted."""
    i, keep, shared, parked = self._slot_for(r)
    while not self.engine.reserve(self._state, i, len(r.prompt) + r.budget):
      if not self._evict_lru():
        if parked is not None and keep == len(parked.tokens):
          self._parked[r.prefix_key] = parked  # back, most recent
        else:
          self._reset(i)
        return False
    if r.key is None:
      r.key = (
        sampling_lib.seed_key(r.sampling.seed)
        if r.sampling.seed is not None
        else self._keys.integers(0, 2**32, size=2, dtype=np.uint32)
      )
    r.fed, r.admitted_version = keep + shared, int(self.engine.version)
    self.prefill_reused += keep
    self.prefill_shared += shared
    self.prefix_hits += keep > 0
    self._slots[i] = r
    return True

  def _slot_for(self, r: _Request) -> tuple[int, int, int, _Parked | None]:
    """(slot, cached tokens of its session it keeps, tokens of other sessions'
    shared pages it starts with, its parked entry) for `r`: its session's
    parked slot (cut back to the prefix it shares with the prompt, or reset),
    else a free slot, else the least recently used parked slot, reset; a
    slot that keeps nothing of its session's takes the pages other slots
    share of the prompt's start."""
    parked = self._parked.pop(r.prefix_key, None) if r.prefix_key is not None else None
    if parked is not None:
      i, keep = parked.slot, _shared_prefix(parked.tokens, r.prompt)
      if parked.version != int(self.engine.version) or (
        keep < len(parked.tokens) and not self._rewindable
      ):
        keep = 0
      if keep == 0:
        self._reset(i)
      elif keep < len(parked.tokens):
        self._state = self.engine.rewind(self._state, i, keep)
        keep = int(self._state.host_lengths[i])  # a cut inside a shared page falls to its start
      if keep:
        return i, keep, 0, parked
    else:
      i = self._free_slot()
      self._reset(i)
    if not self._shares:
      return i, 0, 0, parked
    self._state = self.engine.share_prefix(self._state, i, r.prompt[:-1])
    return i, 0, int(self._state.host_lengths[i]), parked

  def _free_slot(self) -> int:
    """A slot neither busy nor parked, the least recently used parked one
    evicted when there is none."""
    taken = {p.slot for p in self._parked.values()}
    free = [i for i, s in enumerate(self._slots) if s is None and i not in taken]
    if free:
      return free[0]
    oldest = next(iter(self._parked.values())).slot
    self._evict_lru()
    return oldest

  def _reset(self, i: int):
    self._state = self.engine.reset_slots(self._state, np.arange(len(self._slots)) == i)

  def _evict_lru(self) -> bool:
    """Drops the least recently used parked cache (counted); False: none parked."""
    if not self._parked:
      return False
    _, parked = self._parked.popitem(last=False)
    self._reset(parked.slot)
    self.evictions += 1
    return True

  def _drop(self, key: str):
    parked = self._parked.pop(key, None)
    if parked is not None:
      self._reset(parked.slot)

  def _park(self, i: int, r: _Request):
    """Leaves slot i's cache to `r`'s session (a paged engine keeps only the
    pages of its tokens), or gives its pages back when `r` has no session."""
    if r.prefix_key is None:
      self.engine.release_pages(self._state, np.arange(len(self._slots)) == i)
      return
    self._drop(r.prefix_key)  # an older cache of the session (a concurrent request's)
    tokens = r.prompt + r.tokens[:-1]  # the last sampled token was never fed
    if self._shares:
      self.engine.trim_pages(self._state, i, len(tokens))
      self.engine.register_prefix(self._state, i, tokens)
    # A cache computed by more than one version is never reused (-1 matches none).
    same = all(v == r.admitted_version for v in r.versions)
    self._parked[r.prefix_key] = _Parked(i, tokens, r.admitted_version if same else -1)

  # --- engine calls ------------------------------------------------------------

  def _pass(self):
    start = time.perf_counter()
    active = [i for i, r in enumerate(self._slots) if r is not None]
    prefill = [i for i in active if self._slots[i].fed < len(self._slots[i].prompt)]
    if prefill:
      self._prefill(prefill)
    else:
      self._decode(active)
    self.generate_seconds += time.perf_counter() - start

  def _prefill(self, prefill: list[int]):
    """One step feeding the next chunk of each prefilling slot's prompt."""
    tokens, valid = slot_loop.prefill_feed(
      {i: self._slots[i].prompt[self._slots[i].fed :] for i in prefill},
      len(self._slots),
      self.max_len,
    )
    if self.per_request_sampling:
      top_n = self._top_n()
      self._state, sampled, logp, top, version = self.engine.serve_step(
        self._state, tokens, valid, self._slot_sampling(), top_n=top_n
      )
    else:
      self._state, sampled, logp, version = self.engine.step(self._state, tokens, valid)
      top = None
    for i in prefill:
      r = self._slots[i]
      r.fed += int(valid[i].sum())
      self.prefill_computed += int(valid[i].sum())
      if r.fed == len(r.prompt):  # the sample at the prompt's last token
        if self._shares:  # the prompt's full pages, for sessions that begin alike
          self.engine.register_prefix(self._state, i, r.prompt)
        self._on_sample(
          i,
          int(sampled[i]),
          float(logp[i]),
          int(version),
          None if top is None else (top[0][i], top[1][i]),
        )

  def _decode(self, active: list[int]):
    """One decode call of every active slot; its samples to their requests."""
    tokens, budgets = slot_loop.decode_feed(
      {
        i: (self._slots[i].tokens[-1], self._slots[i].budget - len(self._slots[i].tokens))
        for i in active
      },
      len(self._slots),
    )
    if self.per_request_sampling:
      self._state, chunk = self.engine.serve_decode(
        self._state,
        tokens,
        budgets,
        self._slot_sampling(),
        steps=self.decode_steps,
        stop_token=self.stop_token,
        top_n=self._top_n(),
      )
    else:
      self._state, chunk = self.engine.decode(
        self._state, tokens, budgets, steps=self.decode_steps, stop_token=self.stop_token
      )
    self._state, chunk = self.engine.collect(self._state, chunk)
    # Alternatives come with per-request sampling only (a request without it asks none).
    top_ids = chunk.top_ids if self.per_request_sampling else None
    for i, k, token, logp in slot_loop.samples(chunk, active):
      top = None if top_ids is None else (top_ids[i, k], chunk.top_logprobs[i, k])
      self._on_sample(i, token, logp, int(chunk.version), top)

  def _top_n(self) -> int:
    """The alternatives a call computes: none, or the most any request may ask
    (one compile more, not one a value)."""
    asked = any(r is not None and r.sampling.top_logprobs for r in self._slots)
    return MAX_TOP_LOGPROBS if asked else 0

  def _slot_sampling(self) -> sampling_lib.SlotSampling:
    """Each slot's request's sampling as the engine's per-slot arrays."""
    n = len(self._slots)
    temperature, top_p = np.ones((n,), np.float32), np.ones((n,), np.float32)
    keys, draws = np.zeros((n, 2), np.uint32), np.zeros((n,), np.int32)
    stops = np.full((n, MAX_STOP_IDS + 1), -1, np.int32)
    for i, r in enumerate(self._slots):
      if r is None:
        continue
      temperature[i], top_p[i] = r.sampling.temperature, r.sampling.top_p
      keys[i], draws[i] = r.key, len(r.tokens)
      ids = (self.stop_token,) + r.stop_ids
      stops[i, : len(ids)] = ids
    return sampling_lib.SlotSampling(temperature, top_p, keys, draws, stops)

  def _on_sample(self, i: int, token: int, logp: float, version: int, top=None):
    r = self._slots[i]
    if r is None:
      raise AssertionError(f"the engine sampled for slot {i} past the end of its request")
    r.tokens.append(token)
    r.logprobs.append(logp)
    r.versions.append(version)
    if r.sampling.top_logprobs:
      ids, lps = top
      k = r.sampling.top_logprobs
      r.tops.append(tuple((int(t), float(l)) for t, l in zip(ids[:k], lps[:k]) if l > -np.inf))
    self.generated_tokens += 1
    stopped = token == self.stop_token or token in r.stop_ids
    if stopped or len(r.tokens) >= r.budget:
      self._slots[i] = None
      self._park(i, r)
      r.future.set_result(
        Completion(tuple(r.tokens), tuple(r.logprobs), tuple(r.versions), stopped, tuple(r.tops))
      )


def _shared_prefix(cached: list[int], prompt: list[int]) -> int:
  """Tokens of `cached` a request for `prompt` keeps: their common prefix,
  short of the prompt's last token (whose logits the request samples from)."""
  n = min(len(cached), len(prompt) - 1)
  a, b = np.asarray(cached[:n]), np.asarray(prompt[:n])
  differ = np.flatnonzero(a != b)
  return int(differ[0]) if differ.size else n
