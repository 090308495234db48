"""The batcher's per-request sampling and prefix reuse (serving/batcher.py).

The oracle is the model teacher-forced over prompt and completion: each
recorded log-prob must be that of its token under the request's behaviour
distribution (`sampling_logprobs` of the logits with the request's
temperature and top_p), a greedy token the argmax at log-prob 0, and a
completion that reused a parked prefix must equal the same seeded request
prefilled from scratch.
"""

import concurrent.futures as cf
import functools

import jax
import numpy as np
import pytest
from fakes import random_params

from sao_jax.config import sections
from sao_jax.models import config as mcfg
from sao_jax.models.transformer import Transformer, lm_head_weight, lm_logits
from sao_jax.rollout.engine import PolicyEngine
from sao_jax.rollout.sampling import SamplingConfig, sampling_logprobs
from sao_jax.serving import batcher as batcher_lib

VOCAB, STOP, MAX_LEN = 64, 63, 64
CFG = mcfg.tiny(vocab_size=VOCAB)
R = batcher_lib.RequestSampling


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(temperature=-0.5),
    dict(temperature=float("nan")),
    dict(temperature=float("inf")),
    dict(temperature="1"),
    dict(top_p=0.0),
    dict(top_p=1.5),
    dict(seed=-1),
    dict(seed=1.5),
    dict(seed=True),
    dict(stop_ids=[3]),
    dict(stop_ids=(-1,)),
    dict(stop_ids=tuple(range(17))),
    dict(top_logprobs=21),
    dict(top_logprobs=-1),
  ],
)
def test_request_sampling_refuses_bad_values_in_one_line(kwargs):
  with pytest.raises(ValueError) as e:
    batcher_lib.RequestSampling(**kwargs)
  assert "\n" not in str(e.value) and next(iter(kwargs)) in str(e.value)


def test_request_sampling_defaults_are_the_engine_distribution():
  s = batcher_lib.RequestSampling()
  assert (s.temperature, s.top_p, s.seed, s.stop_ids, s.top_logprobs) == (1.0, 1.0, None, (), 0)
  assert batcher_lib.RequestSampling(temperature=0).greedy and not s.greedy


# --- a tiny engine behind a batcher ---------------------------------------------------


def make_batcher(cfg=CFG, slots=3, params=None, **rollout):
  params = random_params(cfg, 0.5) if params is None else params
  engine = PolicyEngine(
    cfg,
    params,
    sections.Rollout(slots=slots, max_len=MAX_LEN, prefill_buckets=(16,), **rollout),
    seed=1,
  )
  return batcher_lib.Batcher(engine, STOP, decode_steps=4), params


@pytest.fixture(scope="module")
def dense():
  batcher, params = make_batcher()
  yield batcher, params
  batcher.close()


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params, tokens):
  n = tokens.shape[1]
  hidden, _ = Transformer(cfg, "hidden").apply(
    {"params": params}, tokens, np.arange(n)[None], np.ones((1, n), np.int32)
  )
  return lm_logits(cfg, hidden[0], lm_head_weight(cfg, params))


def teacher_logits(params, prompt, completion, cfg=CFG):
  """`[len(completion), V]`: the logits each completion token was drawn from."""
  seq = list(prompt) + list(completion)
  padded = np.zeros((1, MAX_LEN), np.int32)  # one compile; causal, so the padding is unseen
  padded[0, : len(seq)] = seq
  return np.asarray(_logits(cfg, params, padded))[len(prompt) - 1 : len(seq) - 1]


def behaviour_logprobs(params, prompt, c, s: batcher_lib.RequestSampling, cfg=CFG):
  """`[len(c.tokens), V]` teacher-forced log-probs of the request's distribution."""
  logits = teacher_logits(params, prompt, c.tokens, cfg)
  return np.asarray(sampling_logprobs(logits, SamplingConfig(s.temperature, 0, s.top_p)))


# --- sampling ----------------------------------------------------------------------


def test_greedy_requests_take_the_argmax_at_log_prob_zero_and_repeat(dense):
  batcher, params = dense
  g = R(temperature=0)
  first, second = (batcher.submit([5, 6, 7], 12, sampling=g).result() for _ in range(2))
  assert first.tokens == second.tokens
  assert set(first.logprobs) == {0.0}
  want = teacher_logits(params, [5, 6, 7], first.tokens).argmax(-1)
  np.testing.assert_array_equal(first.tokens, want)


def test_recorded_logprobs_are_the_behaviour_distributions_of_each_request(dense):
  """Three requests batched together, each its own temperature and nucleus:
  every log-prob and top_logprobs entry equals the teacher-forced one."""
  batcher, params = dense
  asks = [
    ([1, 2, 3, 4], R(temperature=0.7, top_p=0.8, top_logprobs=5)),
    ([9, 8], R(temperature=1.3)),
    ([10, 11, 12], R(top_p=0.5, top_logprobs=2)),
  ]
  futures = [batcher.submit(p, 16, sampling=s) for p, s in asks]
  checked = 0
  for (prompt, s), f in zip(asks, futures):
    c = f.result()
    ref = behaviour_logprobs(params, prompt, c, s)
    np.testing.assert_allclose(c.logprobs, ref[np.arange(len(c.tokens)), c.tokens], atol=2e-4)
    checked += len(c.tokens)
    if not s.top_logprobs:
      assert c.top_logprobs == ()
      continue
    assert len(c.top_logprobs) == len(c.tokens)
    for row, top in zip(ref, c.top_logprobs):
      finite = np.sort(row[np.isfinite(row)])[::-1][: s.top_logprobs]
      ids, lps = zip(*top)
      np.testing.assert_allclose(lps, finite, atol=2e-4)  # the likeliest, in order
      np.testing.assert_allclose(row[list(ids)], lps, atol=2e-4)
  assert checked >= 24


def test_a_seeded_request_samples_the_same_whatever_is_batched_with_it(dense):
  batcher, _ = dense
  s = R(temperature=1.5, seed=2**40 + 11)
  alone = batcher.submit([3, 4, 5], 16, sampling=s).result()
  others = [batcher.submit([7] * k, 16) for k in (2, 9)]
  batched = batcher.submit([3, 4, 5], 16, sampling=s).result()
  cf.wait(others)
  assert alone.tokens == batched.tokens
  np.testing.assert_allclose(alone.logprobs, batched.logprobs, atol=1e-5)
  other_seed = batcher.submit([3, 4, 5], 16, sampling=R(temperature=1.5, seed=11)).result()
  assert other_seed.tokens != alone.tokens  # the seed's high bits count


def test_a_stop_id_ends_the_turn_and_is_kept(dense):
  batcher, _ = dense
  full = batcher.submit([5, 6, 7], 12, sampling=R(temperature=0)).result()
  stop = next(t for k, t in enumerate(full.tokens) if k >= 2 and t not in full.tokens[:k])
  cut = batcher.submit([5, 6, 7], 12, sampling=R(temperature=0, stop_ids=(stop,))).result()
  assert cut.stopped and cut.tokens == full.tokens[: full.tokens.index(stop) + 1]


# --- prefix reuse ------------------------------------------------------------------


def run_session(batcher, turns, key, s):
  """Turns of one session: each prompt is the last prompt, its completion and
  `turns[k]` (a tool result); returns the (prompt, completion) pairs."""
  out, prompt = [], []
  for obs in turns:
    prompt = prompt + (list(out[-1][1].tokens) if out else []) + obs
    out.append((prompt, batcher.submit(prompt, 6, sampling=s, prefix_key=key).result()))
  return out


# The paged variant is slow: the eviction and sharing tests below run paged
# sessions against their from-scratch twins in the default run.
@pytest.mark.parametrize("kv_cache", ["dense", pytest.param("paged", marks=pytest.mark.slow)])
def test_a_session_prefills_only_its_new_tokens_and_samples_as_from_scratch(kv_cache):
  batcher, _ = make_batcher(slots=2, kv_cache=kv_cache, page_size=8)
  try:
    s = R(temperature=1.0, seed=3)
    turns = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]
    session = run_session(batcher, turns, "a", s)
    computed, reused = batcher.prefill_computed, batcher.prefill_reused
    # Every turn after the first finds its history but the last sampled token.
    assert reused == sum(len(p) + len(c.tokens) - 1 for p, c in session[:-1])
    assert computed == sum(len(p) for p, _ in session) - reused
    assert batcher.prefix_hits == 3
    for prompt, c in session:  # the same seeded requests, each prefilled whole
      scratch = batcher.submit(prompt, 6, sampling=s).result()
      assert scratch.tokens == c.tokens
      np.testing.assert_allclose(scratch.logprobs, c.logprobs, atol=1e-5)
  finally:
    batcher.close()


def test_a_rewritten_history_keeps_only_the_shared_prefix(dense):
  batcher, _ = dense
  s = R(seed=5)
  prompt = [1, 2, 3, 4, 5, 6, 7, 8]
  batcher.submit(prompt, 6, sampling=s, prefix_key="rewrite").result()
  hits, reused = batcher.prefix_hits, batcher.prefill_reused
  edited = prompt[:3] + [20, 21, 22]
  c = batcher.submit(edited, 6, sampling=s, prefix_key="rewrite").result()
  assert (batcher.prefix_hits, batcher.prefill_reused) == (hits + 1, reused + 3)
  scratch = batcher.submit(edited, 6, sampling=s).result()
  assert scratch.tokens == c.tokens
  np.testing.assert_allclose(scratch.logprobs, c.logprobs, atol=1e-5)


def test_parked_caches_are_evicted_least_recently_used_when_pages_run_short():
  """Two parked sessions fill the pool (8 pages of 8); a third request's pages
  evict the older one, which then starts over; the other still reuses, and
  every completion equals its from-scratch twin."""
  batcher, _ = make_batcher(slots=3, kv_cache="paged", page_size=8, kv_pages=8)
  try:
    s = R(seed=9)
    history = {}
    for key, start in (("a", 1), ("b", 25)):  # nothing in common: no page shared
      prompt = list(range(start, start + 24))
      history[key] = prompt + list(
        batcher.submit(prompt, 6, sampling=s, prefix_key=key).result().tokens
      )
    assert batcher.parked == 2 and batcher.evictions == 0
    batcher.submit(list(range(49, 59)), 6, sampling=s).result()
    assert batcher.evictions == 1 and batcher.parked == 1
    for key, hits, evictions in (("b", 1, 1), ("a", 1, 2)):
      prompt = history[key] + [40, 41]
      c = batcher.submit(prompt, 6, sampling=s, prefix_key=key).result()
      # "b" reuses its cache (its from-scratch twin shares b's full pages);
      # "a" was evicted and starts over, its pages evicting b's.
      assert (batcher.prefix_hits, batcher.evictions) == (hits, evictions)
      scratch = batcher.submit(prompt, 6, sampling=s).result()
      assert scratch.tokens == c.tokens
      np.testing.assert_allclose(scratch.logprobs, c.logprobs, atol=1e-5)
  finally:
    batcher.close()


@pytest.mark.parametrize("kv_cache", ["dense", pytest.param("paged", marks=pytest.mark.slow)])
def test_the_hybrid_models_recurrent_state_is_reused_whole_or_not_at_all(kv_cache):
  """tiny_hybrid (Gated DeltaNet layers): a session extending its history
  continues the parked recurrent state; a rewritten history starts over
  (the state cannot be cut back; `rewind` refuses), and shares no pages."""
  cfg = mcfg.tiny_hybrid(VOCAB)
  batcher, params = make_batcher(cfg, slots=2, kv_cache=kv_cache, page_size=8)
  try:
    s = R(temperature=0.9, seed=4)
    session = run_session(batcher, [[1, 2, 3, 4], [5, 6], [7]], "h", s)
    assert batcher.prefix_hits == 2
    for prompt, c in session:
      ref = behaviour_logprobs(params, prompt, c, s, cfg)
      np.testing.assert_allclose(c.logprobs, ref[np.arange(len(c.tokens)), c.tokens], atol=2e-4)
    edited = session[-1][0][:3] + [30, 31]
    c = batcher.submit(edited, 6, sampling=s, prefix_key="h").result()
    assert batcher.prefix_hits == 2  # started over
    ref = behaviour_logprobs(params, edited, c, s, cfg)
    np.testing.assert_allclose(c.logprobs, ref[np.arange(len(c.tokens)), c.tokens], atol=2e-4)
    assert batcher.prefill_shared == 0
    engine = batcher.engine
    with pytest.raises(ValueError, match="recurrent"):
      engine.rewind(engine.init_decode_state(), 0, 0)
  finally:
    batcher.close()


def test_sessions_that_begin_alike_share_the_full_pages_of_their_prefix():
  """A paged engine (pages of 8): a second session with the same 20-token
  system prompt starts from the first's two full pages (16 positions),
  samples exactly the behaviour distribution, and every page comes back."""
  batcher, params = make_batcher(slots=3, kv_cache="paged", page_size=8)
  try:
    system = list(range(1, 21))
    s = R(temperature=0.8, seed=6)
    first = batcher.submit(system + [30, 31], 6, sampling=s, prefix_key="x").result()
    assert batcher.prefill_shared == 0
    prompt = system + [40, 41, 42]
    second = batcher.submit(prompt, 6, sampling=s, prefix_key="y").result()
    assert batcher.prefill_shared == 16
    ref = behaviour_logprobs(params, prompt, second, s)
    np.testing.assert_allclose(
      second.logprobs, ref[np.arange(len(second.tokens)), second.tokens], atol=2e-4
    )
    pages = batcher._state.pages
    pages.check()
    assert pages.refs.max() == 2  # the shared pages, held by both parked sessions
    for key in ("x", "y"):
      batcher.forget(key)
    batcher.submit([5], 1).result()  # after the forgets are done
    pages.check()
    assert pages.used_pages == 0 and first.tokens
  finally:
    batcher.close()
