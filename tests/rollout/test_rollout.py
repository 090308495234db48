"""Engine, driver and environments (the sandbox: tests/envs/test_sandbox.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import EchoEnv

from sao_jax.config import sections
from sao_jax.data.trajectory import validate
from sao_jax.envs import sandbox
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.envs.python_tool import PythonTool
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy
from sao_jax.rollout import engine as eng_lib
from sao_jax.rollout import programs as programs_lib
from sao_jax.rollout.batch_sampler import LaneSampler, generate_batch
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import KeyStream, PolicyEngine, SamplingConfig, sampling_logprobs

TOK = CharTokenizer()
CFG = mcfg.tiny(vocab_size=TOK.vocab_size)
MAX_LEN = 128
logprobs_fn = jax.jit(policy.token_logprobs, static_argnums=(0, 5))


@pytest.fixture(scope="module")
def params():
  p0 = policy.init_params(CFG, jax.random.key(0))
  p1 = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), p0)
  return {0: p0, 1: p1}


# The paged cache of the tests: pages of 8 positions, the dense size's pool by default.
PAGED = dict(kv_cache="paged", page_size=8)


def run_driver(
  params, swap_policy, n=12, swap_after=3, slots=4, env=None, decode_steps=8, kv_cache="dense"
):
  kw = PAGED if kv_cache == "paged" else {}
  rollout = sections.Rollout(
    slots=slots,
    max_len=MAX_LEN,
    max_turn_tokens=6,
    swap_policy=swap_policy,
    decode_steps=decode_steps,
    **kw,
  )
  engine = PolicyEngine(CFG, params[0], rollout, seed=3)
  out = []
  driver = RolloutDriver(engine, env or EchoEnv(), TOK, iter(range(1000)), None)

  def emit(t):
    out.append(t)
    if len(out) == swap_after:
      driver.update_params(params[1], 1)

  driver._emit = emit
  driver.run(max_trajectories=n)
  return out, driver


def assert_logprobs_match_teacher_forcing(trajs, params):
  checked = 0
  for t in trajs:
    n = len(t)
    for version in set(t.policy_version[t.action_mask].tolist()):
      lp, _ = logprobs_fn(
        CFG, params[version], t.tokens[None], np.arange(n)[None], np.ones((1, n), np.int32), 1.0
      )
      sel = t.action_mask & (t.policy_version == version)
      np.testing.assert_allclose(np.asarray(lp)[0, sel], t.rollout_logprobs[sel], atol=2e-4)
      checked += int(sel.sum())
  return checked


def assert_turns_end_at_their_stops(trajs, max_turn_tokens=6):
  """Each action run ends at the turn-end token, at the turn budget, or at max_len."""
  for t in trajs:
    runs = np.split(np.arange(len(t)), np.flatnonzero(np.diff(t.action_mask.astype(int))) + 1)
    for r in (r for r in runs if t.action_mask[r[0]]):
      action = t.tokens[r]
      assert len(action) <= max_turn_tokens
      assert TOK.turn_end_id not in action[:-1]
      assert (
        action[-1] == TOK.turn_end_id
        or len(action) == max_turn_tokens
        or (r[-1] == len(t) - 1 and len(t) == MAX_LEN)
      )


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
@pytest.mark.parametrize("decode_steps", [1, 8])
def test_recorded_logprobs_equal_teacher_forced_across_swap_and_turns(
  params, decode_steps, kv_cache
):
  trajs, driver = run_driver(params, "recompute", decode_steps=decode_steps, kv_cache=kv_cache)
  assert len(trajs) == 12 and driver.stats.param_swaps == 1
  assert_turns_end_at_their_stops(trajs)
  if decode_steps > 1:  # several tokens per engine call
    assert driver.stats.decode_iterations > driver.stats.decode_steps
  assert all(validate(t, TOK.vocab_size, MAX_LEN) is None for t in trajs)
  assert any(t.num_turns >= 3 for t in trajs)  # multi-turn appends covered
  spanning = [t for t in trajs if {0, 1} <= set(t.policy_version[t.action_mask].tolist())]
  assert spanning, "some trajectory should span the weight swap"
  assert assert_logprobs_match_teacher_forcing(trajs, params) > 100


def _multi_turn(engine, turns=4):
  """The same calls into any engine: four prompts, then turns of a decode
  call (a stop token, per-slot budgets) and an observation appended by a
  step; slot 2's trajectory ends after turn 1 and a new prompt takes the
  slot (a paged engine reuses the freed pages). Returns every sample."""
  rng = np.random.default_rng(7)
  slots = engine.max_concurrent_decodes
  prompts = [TOK.encode(t) for t in ("12 plus 3\n", "q\n", "7 times 2\n", "ab\n")]
  tokens = np.zeros((slots, 16), np.int32)
  valid = np.zeros((slots, 16), bool)
  for i, p in enumerate(prompts):
    tokens[i, : len(p)], valid[i, : len(p)] = p, True
  state, pending, lp, _ = engine.step(engine.init_decode_state(), tokens, valid)
  out = [(pending.copy(), lp.copy())]
  for turn in range(turns):
    budgets = rng.integers(3, 12, slots).astype(np.int32)
    state, chunk = engine.decode(state, pending, budgets, steps=12, stop_token=TOK.turn_end_id)
    state, chunk = engine.collect(state, chunk)
    out.append((chunk.tokens, chunk.logprobs))
    if turn == 1:  # slot 2's trajectory ends; a new prompt takes the slot
      state = engine.reset_slots(state, np.arange(slots) == 2)
    # Observations of varying length (slot 2's new prompt at turn 1), after
    # each slot's last sampled (pending) token.
    width = 8
    obs = rng.integers(1, TOK.vocab_size, (slots, width)).astype(np.int32)
    n = rng.integers(1, width, slots)
    last = chunk.tokens[np.arange(slots), np.maximum(chunk.counts - 1, 0)]
    last = np.where(chunk.counts > 0, last, pending)
    obs[:, 0] = np.where(np.arange(slots) == 2, obs[:, 0], last) if turn == 1 else last
    valid = np.arange(width)[None] < n[:, None]
    state, pending, lp, _ = engine.step(state, obs, valid)
    out.append((pending.copy(), lp.copy()))
  return out, state


@pytest.mark.parametrize(
  "kv_buckets,in_place", [(None, False), ((32, 64), False), ((32, 64), True)]
)
def test_paged_engine_samples_and_logprobs_equal_the_dense_engine(
  params, kv_buckets, in_place, monkeypatch
):
  # Same seed, same calls: the same tokens and log-probs over several turns,
  # a freed slot re-admitted, with and without kv buckets (the table's
  # first columns). The decode loop runs on the pages gathered once per
  # call, or (in_place, the TPU kernel's loop) writes and reads the pages
  # at every step.
  monkeypatch.setattr(programs_lib, "_decode_in_place", lambda cfg, page: in_place)
  dense = PolicyEngine(
    CFG, params[0], sections.Rollout(slots=4, max_len=MAX_LEN), seed=9, kv_buckets=kv_buckets
  )
  paged = PolicyEngine(
    CFG,
    params[0],
    sections.Rollout(slots=4, max_len=MAX_LEN, **PAGED),
    seed=9,
    kv_buckets=kv_buckets,
  )
  ref, dstate = _multi_turn(dense)
  got, pstate = _multi_turn(paged)
  assert dstate.host_lengths.max() > 32  # past the first bucket
  for (t0, l0), (t1, l1) in zip(ref, got):
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_allclose(l1, l0, atol=1e-6, rtol=0)
  np.testing.assert_array_equal(pstate.host_lengths, dstate.host_lengths)
  pages = pstate.pages
  pages.check()
  for b in range(4):  # pages as the slot grew: its length plus its last budget, at most
    assert (
      pages.pages_for(pstate.host_lengths[b])
      <= pages.held(b)
      <= pages.pages_for(pstate.host_lengths[b] + 12)
    )
  # Paged memory is the pool: kv_pages=0 is the dense cache's size.
  assert paged.kv_pages * paged.page_size == 4 * MAX_LEN


def test_paged_engine_reports_exhaustion_and_checks_its_pool(params):
  # The rollout section checks the pool and the page size (a ConfigError, a
  # ValueError); the engine checks the pool per slot group (test_engine_sharded.py).
  with pytest.raises(
    sections.ConfigError,
    match=r"rollout.kv_pages = 15: must be 0 or >= rollout.max_len / "
    r"rollout.page_size \(16\): the pool must hold one whole trajectory",
  ):
    PolicyEngine(CFG, params[0], sections.Rollout(slots=4, max_len=MAX_LEN, kv_pages=15, **PAGED))
  with pytest.raises(
    sections.ConfigError,
    match=r"rollout.page_size = 7: must be a divisor of rollout.max_len \(128\)",
  ):
    PolicyEngine(
      CFG, params[0], sections.Rollout(slots=4, max_len=MAX_LEN, kv_cache="paged", page_size=7)
    )
  with pytest.raises(
    sections.ConfigError, match=r"rollout.kv_cache = 'ragged': must be one of \('dense', 'paged'\)"
  ):
    PolicyEngine(CFG, params[0], sections.Rollout(slots=4, max_len=MAX_LEN, kv_cache="ragged"))
  engine = PolicyEngine(
    CFG, params[0], sections.Rollout(slots=4, max_len=MAX_LEN, kv_pages=16, **PAGED)
  )
  state = engine.init_decode_state()
  assert engine.reserve(state, 0, 100) and not engine.reserve(state, 1, 40)  # 13 + 5 > 16
  assert engine.reserve(state, 1, 24) and state.pages.free_pages() == 0
  tokens = np.ones((4, 8), np.int32)
  with pytest.raises(eng_lib.PagePoolExhausted, match="slot 2 needs pages"):
    engine.step(state, tokens, np.arange(4)[:, None] == 2 + 0 * tokens)


@pytest.mark.parametrize("max_turn_tokens,slots", [(6, 8), (24, 4)])
def test_paged_driver_with_a_small_pool_waits_and_returns_every_page(
  params, max_turn_tokens, slots
):
  # A pool of 16 pages (one max_len trajectory; the dense cache is 16 a
  # slot): admission waits for pages, and with long turns every slot blocks,
  # so the youngest is preempted and re-fed. All trajectories finish,
  # teacher-forced, and every page comes back.
  engine = PolicyEngine(
    CFG,
    params[0],
    sections.Rollout(
      slots=slots,
      max_len=MAX_LEN,
      kv_pages=16,
      max_turn_tokens=max_turn_tokens,
      swap_policy="keep",
      decode_steps=8,
      **PAGED,
    ),
    seed=3,
  )
  out = []
  driver = RolloutDriver(engine, EchoEnv(), TOK, iter(range(14)), out.append)
  driver.run()
  assert len(out) == 14 and sorted(t.prompt_id for t in out) == list(range(14))
  assert driver.stats.page_waits > 0
  if max_turn_tokens == 24:
    assert driver.stats.preemptions > 0
  pages = driver._state.pages
  pages.check()
  assert pages.used_pages == 0 and (pages.table == -1).all()
  assert all(validate(t, TOK.vocab_size, MAX_LEN) is None for t in out)
  assert any(t.num_turns >= 3 for t in out)
  assert assert_logprobs_match_teacher_forcing(out, params) > 100


def test_drain_never_mixes_versions_and_keep_does(params):
  trajs, _ = run_driver(params, "drain")
  assert all(len(set(t.policy_version[t.action_mask].tolist())) == 1 for t in trajs)
  assert_logprobs_match_teacher_forcing(trajs, params)
  trajs, _ = run_driver(params, "keep")
  assert any(len(set(t.policy_version[t.action_mask].tolist())) == 2 for t in trajs)
  assert all(validate(t, TOK.vocab_size, MAX_LEN) is None for t in trajs)


def test_samples_per_prompt_share_group_ids(params):
  engine = PolicyEngine(
    CFG,
    params[0],
    sections.Rollout(
      slots=4,
      max_len=MAX_LEN,
      samples_per_prompt=4,
      max_turn_tokens=4,
      swap_policy="keep",
      decode_steps=8,
    ),
  )
  out = []
  RolloutDriver(engine, EchoEnv(), TOK, iter(range(3)), out.append).run()
  groups = {}
  for t in out:
    groups.setdefault(t.group_id, set()).add(t.prompt_id)
  assert len(out) == 12 and len(groups) == 3
  assert all(len(v) == 1 for v in groups.values())


def test_slots_filled_one_at_a_time_then_decoded_are_teacher_forced(params):
  # The JetStream bridge's use of `step` (jetstream_bridge.py): a prompt
  # appended to one slot by a step where only its row is valid, then steps
  # feeding every filled slot's pending token.
  engine = PolicyEngine(CFG, params[0], sections.Rollout(slots=3, max_len=MAX_LEN))
  state = engine.init_decode_state()
  prompts = [TOK.encode("12 plus 3\n"), TOK.encode("7 times 2\n")]
  seqs, lps = {}, {}
  pending, filled = np.zeros(3, np.int32), np.zeros(3, bool)
  for slot, prompt in zip((0, 2), prompts):
    tokens = np.zeros((3, 16), np.int32)
    valid = np.zeros((3, 16), bool)
    tokens[slot, : len(prompt)], valid[slot, : len(prompt)] = prompt, True
    state, tok, lp, version = engine.step(state, tokens, valid)
    assert version == 0
    pending[slot], filled[slot] = tok[slot], True
    seqs[slot], lps[slot] = list(prompt) + [int(tok[slot])], [float(lp[slot])]
  for _ in range(5):
    state, tok, lp, version = engine.step(state, pending[:, None], filled[:, None])
    assert version == 0
    for slot in seqs:
      seqs[slot].append(int(tok[slot]))
      lps[slot].append(float(lp[slot]))
    pending = np.where(filled, tok, pending).astype(np.int32)
  for slot, prompt in zip((0, 2), prompts):
    n = len(seqs[slot])
    lp, _ = logprobs_fn(
      CFG,
      params[0],
      np.asarray(seqs[slot])[None],
      np.arange(n)[None],
      np.ones((1, n), np.int32),
      1.0,
    )
    np.testing.assert_allclose(np.asarray(lp)[0, len(prompt) :], lps[slot], atol=2e-4)


def test_sampling_distribution_top_k_top_p():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  lp = np.exp(np.asarray(sampling_logprobs(logits, SamplingConfig(top_p=0.7))))[0]
  np.testing.assert_allclose(lp, [0.625, 0.375, 0, 0], atol=1e-6)
  lp = np.exp(np.asarray(sampling_logprobs(logits, SamplingConfig(top_k=3, temperature=2.0))))[0]
  w = np.sqrt([0.5, 0.3, 0.15])
  np.testing.assert_allclose(lp, list(w / w.sum()) + [0], atol=1e-6)
  with pytest.raises(ValueError):
    SamplingConfig(temperature=0.0)


def test_sampled_tokens_follow_the_sampling_distribution():
  """200k draws (fixed keys) from a top-k-truncated distribution: frequencies
  within 5 standard errors of the probabilities, a masked token never drawn,
  and each returned log-prob that of its token."""
  from sao_jax.rollout.engine import sample

  probs = np.array([0.02, 0.5, 0.0, 0.25, 0.13, 0.1])  # token 2 impossible; top_k=4 drops 0
  logits = jnp.log(jnp.asarray(np.tile(probs, (1000, 1)) + 1e-30, jnp.float32))
  sampling = SamplingConfig(top_k=4)
  want = np.exp(np.asarray(sampling_logprobs(logits[:1], sampling)))[0]
  draw = jax.jit(lambda key: sample(logits, key, sampling))
  tokens, lps = zip(*(draw(jax.random.key(i)) for i in range(200)))
  tokens, lps = np.concatenate(tokens), np.concatenate(lps)
  freq = np.bincount(tokens, minlength=len(probs)) / tokens.size
  assert freq[0] == 0 and freq[2] == 0
  np.testing.assert_array_less(
    np.abs(freq - want), 5 * np.sqrt(want * (1 - want) / tokens.size) + 1e-12
  )
  np.testing.assert_allclose(lps, np.log(want[tokens]), rtol=1e-5)


def test_the_two_level_draw_follows_the_distribution_across_blocks():
  """`draw` over 2,500 columns (blocks of 1,024, the last one partial):
  the mass sits on both sides of each block boundary and in the last
  column; 200k draws land within 5 standard errors, a -inf column is never
  drawn, and each log-prob is log_softmax's to float tolerance."""
  from sao_jax.rollout import sampling

  v = 2500
  probs = np.full(v, 0.1 / (v - 6))
  heavy = {1023: 0.2, 1024: 0.15, 2047: 0.1, 2048: 0.25, 2499: 0.2}
  probs[list(heavy)] = list(heavy.values())
  probs[7] = 0.0  # never drawn
  probs /= probs.sum()
  x = jnp.asarray(np.tile(np.log(probs) + 3.0, (1000, 1)), jnp.float32)  # unnormalised
  go = jax.jit(lambda key: sampling.draw(x, jax.random.uniform(key, (1000, 1))))
  tokens, lps = zip(*(go(jax.random.key(i)) for i in range(200)))
  tokens, lps = np.concatenate(tokens), np.concatenate(lps)
  freq = np.bincount(tokens, minlength=v) / tokens.size
  assert freq[7] == 0
  for t, p in heavy.items():
    p = probs[t]
    assert abs(freq[t] - p) < 5 * np.sqrt(p * (1 - p) / tokens.size), (t, freq[t], p)
  light = np.setdiff1d(np.arange(v), list(heavy) + [7])
  p = probs[light].sum()
  assert abs(freq[light].sum() - p) < 5 * np.sqrt(p * (1 - p) / tokens.size)
  want = np.asarray(jax.nn.log_softmax(x[0]))
  np.testing.assert_allclose(lps, want[tokens], atol=1e-5)


def test_inverse_cdf_never_lands_on_a_masked_token_of_a_large_vocabulary():
  """At V = 152k with top_k = 50, XLA's cumsum steps by an ulp across masked
  tokens; u just past such a step must still give a possible token."""
  from sao_jax.rollout.engine import inverse_cdf

  v = 151_936
  logits = jax.random.normal(jax.random.key(v), (16, v)) * 4
  logp = jax.jit(lambda x: sampling_logprobs(x, SamplingConfig(top_k=50)))(logits)
  cdf = np.asarray(jax.jit(lambda lp: jnp.cumsum(jnp.exp(lp), -1))(logp))
  lp = np.asarray(logp)
  steps = np.argwhere((lp == -np.inf) & (np.diff(cdf, axis=-1, prepend=0) > 0))
  if not steps.size:
    pytest.skip("this XLA's cumsum is exact on these rows: nothing to land on")
  rows, us = [], []
  for r, j in steps[:8]:  # u whose threshold falls inside the masked token's ulp step
    u = np.float32(cdf[r, j - 1] / cdf[r, -1])
    for _ in range(40):
      if cdf[r, j - 1] <= np.float32(u * cdf[r, -1]) < cdf[r, j]:
        rows.append(r)
        us.append(u)
        break
      u = np.nextafter(u, np.float32(1), dtype=np.float32)
  if not rows:
    pytest.skip("no float32 u lands inside a masked token's step here")
  u = np.zeros((16, 1), np.float32)
  u[rows, 0] = us
  tokens = np.asarray(jax.jit(inverse_cdf)(logp, jnp.asarray(u)))
  assert (lp[np.arange(16), tokens] > -np.inf).all()


def test_python_tool_demonstrations_are_valid_and_correct():
  env = PythonTool()
  lengths = []
  for i in range(50):
    task = env.task(i)
    t = demonstration_trajectory(env, task, TOK)
    assert validate(t, TOK.vocab_size, 512) is None
    lengths.append(len(t))
    ep = env.episode(task)
    results = [ep.step(a) for a, _ in env.demonstration(task)]
    assert results[-1].done and results[-1].reward == 1.0
    # The sandbox's real output equals the demonstration's observation.
    assert [r.observation for r in results[:-1]] == [o for _, o in env.demonstration(task)[:-1]]
  assert max(lengths) > 2 * min(lengths)  # long-tailed turn counts
  assert env.task(7) == env.task(7)


def test_driver_survives_hostile_tool_code(params):
  # A generous wall clock, so the 1 s CPU limit is what stops the loop
  # however loaded the machine is (the wall-clock kill has its own test).
  limits = sandbox.SandboxLimits(cpu_seconds=1, wall_seconds=120.0)

  class Hostile(PythonTool):
    def episode(self, task):
      ep = super().episode(task)
      codes = iter(["py while True: pass", "py x = bytearray(2**33)", "py print(1/0)"])

      class Wrapped:
        def step(self, action):
          return ep.step(next(codes, "ans 0"))

      return Wrapped()

  out, _ = run_driver(params, "recompute", n=2, swap_after=99, slots=2, env=Hostile(limits=limits))
  text = TOK.decode(out[0].tokens)
  assert "killed: cpu time limit" in text and "memoryerror" in text.lower().replace(" ", "")


# --- validation ---------------------------------------------------------------


def good():
  return demonstration_trajectory(EchoEnv(), EchoEnv().task(1), TOK)


@pytest.mark.parametrize(
  "mutate,reason",
  [
    (lambda t: setattr(t, "tokens", t.tokens[:-1]), "length_mismatch"),
    (lambda t: t.tokens.__setitem__(0, 999), "token_out_of_vocab"),
    (lambda t: setattr(t, "action_mask", np.zeros_like(t.action_mask)), "no_action_tokens"),
    (
      lambda t: t.rollout_logprobs.__setitem__(np.flatnonzero(t.action_mask)[0], np.nan),
      "nonfinite_rollout_logprobs",
    ),
    (
      lambda t: t.rollout_logprobs.__setitem__(np.flatnonzero(t.action_mask)[0], 0.5),
      "positive_logprob",
    ),
    (lambda t: t.rewards.__setitem__(0, 1.0), "reward_off_action"),
    (lambda t: t.policy_version.__setitem__(0, 3), "bad_policy_version"),
    (lambda t: setattr(t, "action_mask", t.action_mask.astype(np.int32)), "bad_mask_dtype"),
    (lambda t: setattr(t, "finish_reason", "??"), "bad_finish_reason"),
  ],
)
def test_validation_reasons(mutate, reason):
  t = good()
  assert validate(t, TOK.vocab_size, MAX_LEN) is None
  mutate(t)
  assert validate(t, TOK.vocab_size, MAX_LEN) == reason
  assert validate(good(), TOK.vocab_size, 5) == "too_long"


# --- the three environments ----------------------------------------------------

import ml_collections  # noqa: E402

from sao_jax.envs import registry  # noqa: E402
from sao_jax.envs.online_style import OnlineStyle, OnlineStyleConfig, judge  # noqa: E402


# The toys, in the character vocabulary and the raw format. The dataset
# environment needs a file of rows; environments that prompt with messages or
# declare tools need a chat format (tests/envs/test_dataset_env.py and their own).
@pytest.mark.parametrize("name", [n for n in registry.ENVIRONMENTS if n != "dataset"])
def test_environment_demonstrations_and_model_rollouts_are_valid(name, params):
  env = registry.make_env(ml_collections.ConfigDict({"name": name, "kwargs": {}}))
  if not isinstance(env.task(0).prompt, str) or env.task(0).tools:
    pytest.skip(f"{name} needs a chat format")
  for i in range(6):
    task = env.task(i)
    demo = demonstration_trajectory(env, task, TOK)
    assert validate(demo, TOK.vocab_size, 512) is None
    if name != "online_style":  # its reward depends on the current preference
      ep = env.episode(task)
      results = [ep.step(a) for a, _ in env.demonstration(task)]
      assert results[-1].done and results[-1].reward == 1.0, (name, i)
  engine = PolicyEngine(
    CFG,
    params[0],
    sections.Rollout(
      slots=4, max_len=MAX_LEN, max_turn_tokens=12, swap_policy="keep", decode_steps=8
    ),
  )
  out = []
  RolloutDriver(engine, env, TOK, iter(range(8)), out.append).run()
  assert len(out) == 8
  assert all(validate(t, TOK.vocab_size, MAX_LEN) is None for t in out)


def test_online_style_preference_shifts_on_schedule():
  env = OnlineStyle(OnlineStyleConfig(switch_every=3))
  task = env.task(0)
  line = env.demonstration(task, "cute")[0][0]
  assert judge(line, task.meta["topic"]) == (True, "cute")
  rewards = [env.episode(task).step(line).reward for _ in range(12)]
  # Preferred: academic x3, cute x3, chuuni x3, classical x3.
  assert rewards == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0]
  assert judge("cat cat cat dark", "cat")[0] is False  # repetition
  assert judge("hehe dark tea", "tea") == (True, None)  # tie: no style


def test_hf_tokenizer_file(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  vocab = {c: i for i, c in enumerate(["<pad>", "<s>", "</s>", "\n", " "] + list("abc123+"))}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
  path = str(tmp_path / "tokenizer.json")
  tok.save(path)
  cfg = ml_collections.ConfigDict({"name": "python_tool", "tokenizer_path": path})
  hf = registry.make_tokenizer(cfg)
  assert hf.vocab_size == len(vocab) and hf.turn_end_id == vocab["\n"]
  ids = hf.encode("ab 12\n")
  assert ids == [vocab[c] for c in "ab 12\n"]
  assert hf.decode(ids).replace(" ", "") == "ab12\n".replace(" ", "")


# --- the multi-token decode loop ------------------------------------------------


def _prefilled(params, seed, prompts, kv_buckets=None):
  """An engine with `prompts` prefilled into its first slots (one step)."""
  engine = PolicyEngine(
    CFG, params[0], sections.Rollout(slots=4, max_len=MAX_LEN), seed=seed, kv_buckets=kv_buckets
  )
  width = max(len(p) for p in prompts)
  tokens = np.zeros((4, width), np.int32)
  valid = np.zeros((4, width), bool)
  for i, p in enumerate(prompts):
    tokens[i, : len(p)], valid[i, : len(p)] = p, True
  state, first, first_lp, _ = engine.step(engine.init_decode_state(), tokens, valid)
  return engine, state, first, first_lp


@pytest.mark.parametrize("kv_buckets", [None, (16, 32)])
def test_decode_loop_equals_one_step_loop_with_per_slot_stops(params, kv_buckets):
  prompts = [TOK.encode("12 plus 3\n"), TOK.encode("7 times 2 is\n"), TOK.encode("q1\n")]
  budgets = np.array([11, 4, 0, 0], np.int32)  # slot 2 sits out, slot 3 is empty
  stop = TOK.turn_end_id
  # The multi-token loop: one call.
  engine, state, first, _ = _prefilled(params, 5, prompts, kv_buckets)
  state, chunk = engine.decode(state, first, budgets, steps=12, stop_token=stop)
  state, chunk = engine.collect(state, chunk)
  # The one-step loop, same seed: feed each slot until its budget or stop token.
  ref, rstate, rfirst, _ = _prefilled(params, 5, prompts, kv_buckets)
  np.testing.assert_array_equal(first, rfirst)
  pending, alive = rfirst.copy(), budgets > 0
  seq = {b: [] for b in range(4)}
  while alive.any():
    rstate, tok, lp, _ = ref.step(rstate, pending[:, None], alive[:, None])
    for b in np.flatnonzero(alive):
      seq[b].append((int(tok[b]), float(lp[b])))
      pending[b] = tok[b]
      alive[b] = len(seq[b]) < budgets[b] and tok[b] != stop
  for b in range(4):
    assert chunk.counts[b] == len(seq[b]), b
    np.testing.assert_array_equal(chunk.tokens[b, : chunk.counts[b]], [t for t, _ in seq[b]])
    np.testing.assert_allclose(
      chunk.logprobs[b, : chunk.counts[b]], [l for _, l in seq[b]], atol=1e-5
    )
    assert not chunk.tokens[b, chunk.counts[b] :].any()
  # Per-slot stops: a slot ends at its budget or right after the stop token.
  for b in range(2):
    row = list(chunk.tokens[b, : chunk.counts[b]])
    assert chunk.counts[b] == budgets[b] or (row[-1] == stop and stop not in row[:-1])
  # The state moves on the same: lengths, pending tokens, and the rng.
  np.testing.assert_array_equal(np.asarray(state.lengths), np.asarray(rstate.lengths))
  np.testing.assert_array_equal(state.host_lengths, rstate.host_lengths)
  np.testing.assert_array_equal(np.asarray(state.next_tokens)[:2], pending[:2])
  # The key streams advanced alike: by the iterations run, not by `steps`.
  assert int(engine._rng.draws) == int(ref._rng.draws)


def test_decode_stop_token_and_budget_per_slot(params):
  # Stopping on a token the model samples often: every row stops at its own place.
  engine, state, first, _ = _prefilled(params, 1, [TOK.encode("ab\n")] * 4)
  budgets = np.array([40, 40, 40, 3], np.int32)
  common = np.bincount(
    np.asarray(generate_batch(engine, [TOK.encode("ab\n")] * 4, 40)[0]).ravel(),
    minlength=CFG.vocab_size,
  ).argmax()
  state, chunk = engine.decode(state, first, budgets, steps=40, stop_token=int(common))
  _, chunk = engine.collect(state, chunk)
  assert chunk.counts[3] <= 3
  for b in range(4):
    row = list(chunk.tokens[b, : chunk.counts[b]])
    stopped = bool(row) and row[-1] == common
    assert stopped or chunk.counts[b] == budgets[b]
    assert common not in row[:-1]
  assert len(set(chunk.counts.tolist())) > 1  # stops are per slot, not per batch


@pytest.mark.parametrize(
  "moe_impl,slots,lanes", [("dense", 4, 1), ("blocked", 32, 1), ("dense", 4, 2), ("blocked", 32, 2)]
)
def test_generate_batch_logprobs_are_teacher_forced(params, moe_impl, slots, lanes):
  # "blocked" with 32 slots: the decode steps' MoE runs moe.capacity_or_dense;
  # the reference is the dense model, teacher-forced. Two lanes of 2 slots:
  # the first takes two prompts, the second one. Lanes of 16 slots with
  # "blocked": the decode MoE's capacity path at 16 tokens.
  cfg = dataclasses.replace(CFG, moe_impl=moe_impl)
  sampler = LaneSampler(
    PolicyEngine(cfg, params[0], sections.Rollout(slots=slots, max_len=MAX_LEN), seed=2), lanes
  )
  prompts = [TOK.encode("12 plus 3\n"), TOK.encode("q\n"), TOK.encode("7 times 2\n")]
  toks, lps, counts = sampler.generate_batch(prompts, 20)
  assert toks.shape == (3, 20) and (counts == 20).all()
  for p, t, l in zip(prompts, toks, lps):
    seq = np.concatenate([p, t])
    n = len(seq)
    ref, _ = logprobs_fn(
      CFG, params[0], seq[None], np.arange(n)[None], np.ones((1, n), np.int32), 1.0
    )
    np.testing.assert_allclose(np.asarray(ref)[0, len(p) :], l, atol=2e-4)


def test_generate_batch_lanes_sample_as_one_lane_engines_of_their_size(params):
  # Each lane is a one-lane engine of ceil(slots / lanes) slots on its own
  # key stream: lane i's base is fold_in(the engine's next key, i). Five
  # prompts over two lanes: three, then two.
  prompts = [TOK.encode(t) for t in ("12 plus 3\n", "q\n", "7 times 2\n", "ab\n", "9\n")]
  engine = PolicyEngine(CFG, params[0], sections.Rollout(slots=6, max_len=MAX_LEN), seed=4)
  laned = LaneSampler(engine, 2)
  key = engine._rng.key()
  toks, lps, counts = laned.generate_batch(prompts, 12)
  assert toks.shape == (5, 12) and (counts == 12).all()
  for lane, rows in ((0, slice(0, 3)), (1, slice(3, 5))):
    one = PolicyEngine(CFG, params[0], sections.Rollout(slots=3, max_len=MAX_LEN), seed=0)
    one._rng = KeyStream(jax.random.fold_in(key, lane), jnp.int32(0))
    ref_toks, ref_lps, _ = generate_batch(one, prompts[rows], 12)
    np.testing.assert_array_equal(toks[rows], ref_toks)
    np.testing.assert_allclose(lps[rows], ref_lps, atol=1e-6)
  # The lanes draw from different keys: the same prompt in both lanes diverges.
  same = [TOK.encode("ab\n")] * 6
  toks, _, _ = laned.generate_batch(same, 24)
  assert not np.array_equal(toks[:3], toks[3:])
  # A stop token ends rows in either lane; each call takes one draw of the
  # engine's own stream (the lanes draw from theirs).
  common = int(np.bincount(toks.ravel(), minlength=CFG.vocab_size).argmax())
  assert int(engine._rng.draws) == 2
  toks, _, counts = laned.generate_batch(same, 24, stop_token=common)
  assert int(engine._rng.draws) == 3
  assert (counts < 24).any()
  for t, c in zip(toks, counts):
    assert common not in t[: c - 1].tolist()


def test_lane_sampler_rejects_bad_lanes(params):
  engine = PolicyEngine(CFG, params[0], sections.Rollout(slots=2, max_len=MAX_LEN))
  with pytest.raises(ValueError, match="lanes must be between 1 and slots"):
    LaneSampler(engine, 3)
  with pytest.raises(ValueError, match="lanes must be between 1 and slots"):
    LaneSampler(engine, 0)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  sharded = PolicyEngine(CFG, params[0], sections.Rollout(slots=2, max_len=MAX_LEN), mesh=mesh)
  with pytest.raises(ValueError, match="single-device engine"):
    LaneSampler(sharded, 2)


def test_generate_batch_is_a_prefill_step_then_one_decode_loop(params):
  # One lane: generate_batch samples what `step` (the prefill) then `decode`
  # on the same engine stream would, and advances the stream by 1 + the
  # loop's iterations.
  prompts = [TOK.encode("12 plus 3\n"), TOK.encode("q\n"), TOK.encode("7 times 2\n")]
  engine = PolicyEngine(CFG, params[0], sections.Rollout(slots=4, max_len=MAX_LEN), seed=6)
  toks, lps, counts = generate_batch(engine, prompts, 10)
  assert int(engine._rng.draws) == 10
  ref = PolicyEngine(CFG, params[0], sections.Rollout(slots=4, max_len=MAX_LEN), seed=6)
  tokens = np.zeros((4, max(map(len, prompts))), np.int32)
  valid = np.zeros(tokens.shape, bool)
  for i, p in enumerate(prompts):
    tokens[i, : len(p)], valid[i, : len(p)] = p, True
  state, first, first_lp, _ = ref.step(ref.init_decode_state(), tokens, valid)
  state, chunk = ref.decode(state, first, np.array([9, 9, 9, 0], np.int32), steps=9)
  _, chunk = ref.collect(state, chunk)
  np.testing.assert_array_equal(toks[:, 0], first[:3])
  np.testing.assert_array_equal(toks[:, 1:], chunk.tokens[:3])
  np.testing.assert_allclose(lps[:, 0], first_lp[:3], atol=1e-6)
  np.testing.assert_allclose(lps[:, 1:], chunk.logprobs[:3], atol=1e-6)
  assert (counts == 10).all()
  assert int(ref._rng.draws) == 10
