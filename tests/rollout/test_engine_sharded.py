"""The sharded rollout engine against the single-device one (8 simulated CPU devices).

The single-device engine is the oracle: on every mesh the sharded engine must
sample the same tokens with the same log-probs, step for step, through
prefill, decode, a weight swap and re-admitted slots; the driver's recorded
log-probs must equal teacher forcing under their versions; and the cache,
per-slot state and params must really be laid out as the engine says.

Every engine here has the same shapes (slots, max_len, width and kv
buckets), so the step programs repeat across tests and the persistent
compile cache (tests/conftest.py) serves them after the first compile.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import EchoEnv
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sao_jax.config import sections
from sao_jax.data.trajectory import validate
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy, sharding
from sao_jax.rollout import engine as eng
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine

TOK = CharTokenizer()
# Two kv heads: they split over tensor=2.
CFG = dataclasses.replace(mcfg.tiny(vocab_size=TOK.vocab_size), num_kv_heads=2)
SLOTS, MAX_LEN, KV = 8, 64, 32
ROLLOUT = sections.Rollout(slots=SLOTS, max_len=MAX_LEN, prefill_buckets=(8,))
# Widths 8 / 1 / 64 and a kv bucket of 32: steps attend over the cache
# prefix [0, 32) until some slot grows past it, then over all of it.
ENGINE_KW = dict(kv_buckets=(KV,), seed=5)
MESHES = {"data4_tensor2": {"data": 4, "tensor": 2}, "data8": {"data": 8}}
# Like a trainer's: embeddings fsdp-style over "data", so every weight sync
# really moves data between layouts.
TRAINER_RULES = (
  ("batch", "data"),
  ("length", None),
  ("embed", "data"),
  ("vocab", None),
  ("heads", None),
  ("kv_heads", None),
  ("head_dim", None),
  ("mlp", None),
  ("expert", None),
  ("layers", None),
)

logprobs_fn = jax.jit(policy.token_logprobs, static_argnums=(0, 5))


def mesh_and_rules(name):
  mesh = sharding.make_mesh(MESHES[name])
  if "tensor" not in mesh.axis_names:
    return mesh, None  # the engine's default: rollout_rules(mesh)
  # The 61-token vocabulary does not divide over tensor=2: keep it whole.
  return mesh, tuple((k, None if k == "vocab" else v) for k, v in eng.rollout_rules(mesh))


def sharded_engine(name, params):
  mesh, rules = mesh_and_rules(name)
  return PolicyEngine(CFG, params, ROLLOUT, mesh=mesh, rules=rules, **ENGINE_KW)


def trainer_copy(params, mesh):
  """`params` as the trainer holds them: in its own state shardings."""
  boxed = jax.eval_shape(lambda: policy.init_params(CFG, jax.random.key(0), boxed=True))
  # A copy first: device_put may keep the source's buffers as shards, and the
  # tests delete these (as donation would) while the fixture must survive.
  return jax.device_put(
    jax.tree.map(jnp.copy, params), sharding.logical_shardings(boxed, mesh, TRAINER_RULES)
  )


@pytest.fixture(scope="module")
def params():
  # One jitted program (persistently cached) rather than many eager ops.
  @jax.jit
  def init(key):
    p0 = policy.init_params(CFG, key)
    return p0, jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), p0)

  p0, p1 = init(jax.random.key(0))
  return {0: p0, 1: p1}


# --- a scripted run: the same inputs into every engine ---------------------------------


def scripted_run(engine, params1, inputs=None):
  """Drives `engine` through prefill, decode, a swap and re-admission.

  With `inputs=None` the decode steps feed the engine's own samples and the
  inputs are recorded; given the recorded `inputs`, they are replayed (equal
  outputs mean the replaying engine would have fed the same tokens itself).

  Returns:
    (inputs, outputs): per step (tokens, valid) and (tokens, log-probs,
    version) of the rows that had valid tokens; and the final state.
  """
  rng = np.random.default_rng(0)
  record = inputs is None
  inputs = [] if record else list(inputs)
  outputs = []
  state = engine.init_decode_state()
  last = None

  def run(tokens, valid):
    nonlocal state, last
    if not record:
      tokens, valid = inputs[len(outputs)]
    else:
      inputs.append((tokens, valid))
    state, tok, logp, version = engine.step(state, tokens, valid)
    rows = valid.any(1)
    outputs.append((tok[rows], logp[rows], version))
    last = tok

  def decode(rows=None):
    valid = np.zeros((SLOTS, 1), bool)
    valid[slice(None) if rows is None else rows] = True
    run(last[:, None].astype(np.int32), valid)

  def prompts(rows):
    tokens = rng.integers(1, TOK.vocab_size, (SLOTS, 8)).astype(np.int32)
    n = rng.integers(2, 9, SLOTS)
    valid = (np.arange(8)[None] < n[:, None]) & np.isin(np.arange(SLOTS), rows)[:, None]
    run(tokens, valid)

  prompts(np.arange(SLOTS))
  for _ in range(5):
    decode()
  engine.update_params(params1, 1)
  state = engine.reset_slots(state, np.isin(np.arange(SLOTS), [0, 3]))
  prompts([0, 3])  # re-admitted slots prefill while the others wait
  decode(np.array([0, 1, 3, 5]))  # a partial batch: rows without tokens stay put
  for _ in range(22):  # past the kv bucket: the longest slot ends at 8 + 5 + 23 > 32
    decode()
  return inputs, outputs, state


@pytest.fixture(scope="module")
def reference(params):
  engine = PolicyEngine(CFG, params[0], ROLLOUT, **ENGINE_KW)
  inputs, outputs, state = scripted_run(engine, params[1])
  assert state.host_lengths.max() > KV  # both the kv-32 and the full-cache programs ran
  return inputs, outputs


@pytest.mark.parametrize("name", sorted(MESHES))
def test_sharded_engine_samples_what_the_single_device_engine_samples(name, params, reference):
  engine = sharded_engine(name, params[0])
  inputs, expected = reference
  trainer_params = trainer_copy(params[1], engine.mesh)
  _, got, state = scripted_run(engine, trainer_params, inputs)
  assert len(got) == len(expected) == 30
  for step, ((tok, logp, version), (tok0, logp0, version0)) in enumerate(zip(got, expected)):
    np.testing.assert_array_equal(tok, tok0, err_msg=f"step {step}")
    # Equal up to float reassociation across devices (tensor-parallel sums).
    np.testing.assert_allclose(logp, logp0, atol=1e-5, err_msg=f"step {step}")
    assert version == version0
  np.testing.assert_array_equal(np.asarray(state.lengths), state.host_lengths)


@pytest.mark.parametrize("name", [None] + sorted(MESHES))
def test_paged_engine_samples_what_the_dense_engine_samples(name, params, reference):
  # The paged cache (pages of 8: the kv bucket of 32 is the table's first 4
  # columns), on one device and sharded (slots and the pool's pages over
  # the batch axes, one page group a device): the dense single-device
  # engine's samples, step for step. Re-admitted slots take freed pages.
  placement = {} if name is None else dict(zip(("mesh", "rules"), mesh_and_rules(name)))
  paged = ROLLOUT.replace(kv_cache="paged", page_size=8)
  engine = PolicyEngine(CFG, params[0], paged, **placement, **ENGINE_KW)
  inputs, expected = reference
  _, got, state = scripted_run(engine, params[1], inputs)
  for step, ((tok, logp, version), (tok0, logp0, version0)) in enumerate(zip(got, expected)):
    np.testing.assert_array_equal(tok, tok0, err_msg=f"step {step}")
    np.testing.assert_allclose(logp, logp0, atol=1e-5, err_msg=f"step {step}")
    assert version == version0
  pages = state.pages
  pages.check()
  assert pages.groups == (1 if name is None else engine.mesh.shape["data"])
  for b in range(SLOTS):  # each slot holds exactly the pages of its length
    assert pages.held(b) == pages.pages_for(state.host_lengths[b])
  if name is not None:  # the pool's pages and the table really split over "data"
    leaf = jax.tree.leaves(state.cache)[0]
    assert leaf.sharding.spec[1] == "data"
    assert state.page_table.sharding.spec[0] == "data"
    # A pool that holds one trajectory (all the rollout section checks) but
    # not one a slot group: the engine refuses it.
    with pytest.raises(ValueError, match="fewer than one max_len trajectory"):
      PolicyEngine(CFG, params[0], paged.replace(kv_pages=MAX_LEN // 8), **placement, **ENGINE_KW)


def stacked(params, scfg):
  """Unscanned params in the layout of `scfg` (scan_layers): the scanned layers'
  parameters stacked on a leading axis, the same weights."""
  names = jax.eval_shape(lambda: policy.init_params(scfg, jax.random.key(0)))
  first = len(scfg.dense_layers)
  return {
    k: (
      jax.tree.map(
        lambda *xs: jnp.stack(xs), *[params[f"layer_{i}"] for i in range(first, scfg.num_layers)]
      )
      if k == "layers"
      else params[k]
    )
    for k in names
  }


@pytest.mark.skipif(
  "scan_layers" not in {f.name for f in dataclasses.fields(mcfg.ModelConfig)},
  reason="this model version has no scanned layers",
)
def test_scanned_layers_stacked_cache_matches_the_unscanned_reference(params, reference):
  """Scanned layers stack the cache as [layers, B, S, KVH, hd]: the same
  engine code shards it by its ndim and samples what the unscanned
  single-device engine samples."""
  scfg = dataclasses.replace(CFG, scan_layers=True)
  mesh, rules = mesh_and_rules("data4_tensor2")
  engine = PolicyEngine(
    scfg, stacked(params[0], scfg), ROLLOUT, mesh=mesh, rules=rules, **ENGINE_KW
  )
  stacked_leaves = [x for x in jax.tree.leaves(engine.init_decode_state().cache) if x.ndim == 5]
  assert stacked_leaves
  for leaf in stacked_leaves:
    assert leaf.sharding.is_equivalent_to(
      NamedSharding(mesh, P(None, "data", None, "tensor", None)), 5
    )
  inputs, expected = reference
  _, got, _ = scripted_run(engine, stacked(params[1], scfg), inputs)
  for step, ((tok, logp, version), (tok0, logp0, version0)) in enumerate(zip(got, expected)):
    np.testing.assert_array_equal(tok, tok0, err_msg=f"step {step}")
    np.testing.assert_allclose(logp, logp0, atol=1e-5, err_msg=f"step {step}")
    assert version == version0


# --- layouts ------------------------------------------------------------------------


def test_cache_state_and_params_are_sharded(params):
  engine = sharded_engine("data4_tensor2", params[0])
  state = engine.init_decode_state()
  kvh, hd = CFG.num_kv_heads, CFG.head_dim
  leaves = jax.tree.leaves(state.cache)
  assert len(leaves) == 2 * CFG.num_layers

  def check(state):
    for leaf in jax.tree.leaves(state.cache):
      assert leaf.shape[-4:] == (SLOTS, MAX_LEN, kvh, hd)
      assert leaf.sharding.is_equivalent_to(
        NamedSharding(engine.mesh, P(*[None] * (leaf.ndim - 4), "data", None, "tensor", None)),
        leaf.ndim,
      )
      assert {s.data.shape[-4:] for s in leaf.addressable_shards} == {
        (SLOTS // 4, MAX_LEN, kvh // 2, hd)
      }
    for vec in (state.lengths, state.next_tokens):
      assert vec.sharding.is_equivalent_to(NamedSharding(engine.mesh, P("data")), 1)

  check(state)
  # Sizing: an eighth of the cache per device, as the shards say.
  shard_bytes = sum(
    s.data.nbytes
    for leaf in leaves
    for s in leaf.addressable_shards
    if s.device == jax.devices()[0]
  )
  total = sum(leaf.nbytes for leaf in leaves)
  assert (
    shard_bytes
    == total // 8
    == eng.cache_bytes_per_device(CFG, SLOTS, MAX_LEN, engine.mesh, engine.rules)
  )
  assert eng.cache_bytes_per_device(CFG, SLOTS, MAX_LEN) == total
  # The step's outputs keep the layout (its inputs were donated).
  state, *_ = engine.step(state, np.ones((SLOTS, 8), np.int32), np.ones((SLOTS, 8), bool))
  check(engine.reset_slots(state, np.arange(SLOTS) < 2))
  # Params follow the rules: q heads over tensor, the (fsdp) embed axis whole.
  qs = [
    x
    for path, x in jax.tree_util.tree_leaves_with_path(engine.params)
    if jax.tree_util.keystr(path).endswith("['attn']['q']")
  ]  # [..., embed, heads, hd]
  assert qs
  for q in qs:
    assert q.sharding.is_equivalent_to(
      NamedSharding(engine.mesh, P(*[None] * (q.ndim - 2), "tensor", None)), q.ndim
    )
  with pytest.raises(ValueError, match="slots do not divide"):
    PolicyEngine(
      CFG, params[0], ROLLOUT.replace(slots=6), mesh=engine.mesh, rules=engine.rules, **ENGINE_KW
    )


def test_without_a_mesh_the_engine_is_the_same_layout_on_one_device(params):
  """One layout: no mesh is a mesh of one device (the first local one, or
  `device`), with the same shardings, programs and decode state."""
  for device in (None, jax.devices()[1]):
    engine = PolicyEngine(CFG, params[0], ROLLOUT, device=device, **ENGINE_KW)
    assert engine.mesh.devices.tolist() == [device or jax.local_devices()[0]]
    assert engine.mesh.axis_names == ("data",) and engine.programs.mesh is engine.mesh
    state = engine.init_decode_state()
    for x in jax.tree.leaves((engine.params, state.cache, state.lengths, state.next_tokens)):
      assert isinstance(x.sharding, NamedSharding) and x.sharding.mesh == engine.mesh
      assert x.devices() == {engine.mesh.devices.flat[0]}
  with pytest.raises(ValueError, match="a device or a mesh"):
    PolicyEngine(CFG, params[0], ROLLOUT, device=jax.devices()[0], mesh=engine.mesh, **ENGINE_KW)


def test_update_params_reshards_a_trainer_layout_into_a_private_copy(params):
  engine = sharded_engine("data4_tensor2", params[0])
  trainer_params = trainer_copy(params[1], engine.mesh)
  moved = jax.tree.map(
    lambda t, e: not t.sharding.is_equivalent_to(e, t.ndim), trainer_params, engine.param_shardings
  )
  assert any(jax.tree.leaves(moved))  # the layouts really differ
  engine.update_params(trainer_params, 7)
  assert engine.version == 7
  for got, want, p in zip(
    jax.tree.leaves(engine.params),
    jax.tree.leaves(engine.param_shardings),
    jax.tree.leaves(params[1]),
  ):
    assert got.sharding.is_equivalent_to(want, got.ndim)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(p))
  # A private copy even where both layouts agree: the trainer donates its
  # buffers to the next step right after the sync.
  same = jax.device_put(jax.tree.map(jnp.copy, params[1]), engine.param_shardings)
  copy = engine.load_params(same)
  for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(copy)):
    assert {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}.isdisjoint(
      s.data.unsafe_buffer_pointer() for s in b.addressable_shards
    )
  for x in jax.tree.leaves((trainer_params, same)):
    x.delete()  # as donation would
  state, tok, logp, version = engine.step(
    engine.init_decode_state(), np.ones((SLOTS, 8), np.int32), np.ones((SLOTS, 8), bool)
  )
  assert version == 7 and np.isfinite(logp).all() and tok.shape == (SLOTS,)


# --- the driver's oracle ------------------------------------------------------------------


def teacher_forced(params, trajs):
  """log pi(x_t | x_<t) `[N, MAX_LEN]` of each trajectory, padded (one compile)."""
  tokens = np.zeros((len(trajs), MAX_LEN), np.int32)
  segments = np.zeros((len(trajs), MAX_LEN), np.int32)
  for i, t in enumerate(trajs):
    tokens[i, : len(t)] = t.tokens
    segments[i, : len(t)] = 1
  positions = np.broadcast_to(np.arange(MAX_LEN), tokens.shape)
  lp, _ = logprobs_fn(CFG, params, tokens, positions, segments, 1.0)
  return np.asarray(lp)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_driver_logprobs_equal_teacher_forced_with_sharded_engine(name, params):
  engine = sharded_engine(name, params[0])
  out = []
  driver = RolloutDriver(
    engine,
    EchoEnv(),
    TOK,
    iter(range(1000)),
    None,
    ROLLOUT.replace(max_turn_tokens=6, swap_policy="recompute", decode_steps=8),
  )

  def emit(t):
    out.append(t)
    if len(out) == 3:  # from the trainer's layout, mid-run
      driver.update_params(trainer_copy(params[1], engine.mesh), 1)

  driver._emit = emit
  driver.run(max_trajectories=12)
  assert len(out) >= 12 and driver.stats.param_swaps == 1  # a pass may finish several
  assert all(validate(t, TOK.vocab_size, MAX_LEN) is None for t in out)
  assert any(t.num_turns >= 3 for t in out)
  assert any({0, 1} <= set(t.policy_version[t.action_mask].tolist()) for t in out)
  checked = 0
  for version in (0, 1):
    lp = teacher_forced(params[version], out)
    for i, t in enumerate(out):
      sel = t.action_mask & (t.policy_version == version)
      np.testing.assert_allclose(lp[i, : len(t)][sel], t.rollout_logprobs[sel], atol=2e-4)
      checked += int(sel.sum())
  assert checked > 100


def test_cache_bytes_for_the_pod_config():
  """Qwen3-30B-A3B, 256 slots x 32768 positions in bf16: 48 layers x 2 x 4 kv
  heads x 128 x 2 bytes = 96 KiB a token, 768 GiB in all, split over slots
  and kv heads by the mesh (abstract devices: no memory is touched)."""
  cfg = mcfg.qwen3_30b_a3b()
  total = 256 * 32768 * 48 * 2 * 4 * 128 * 2
  assert eng.cache_bytes_per_device(cfg, 256, 32768) == total
  mesh = sharding.make_mesh({"data": 4, "tensor": 2})
  assert eng.cache_bytes_per_device(cfg, 256, 32768, mesh) == total // 8
  mesh = sharding.make_mesh({"data": 8})
  rules = tuple((k, None if k == "batch" else v) for k, v in eng.rollout_rules(mesh))
  assert eng.cache_bytes_per_device(cfg, 256, 32768, mesh, rules) == total  # replicated slots
  # sao_moe's 128-chip mesh, abstractly: slots over data x fsdp x expert.
  pod = AbstractMesh((1, 16, 8, 1), ("data", "fsdp", "expert", "tensor"))
  assert eng.cache_bytes_per_device(cfg, 256, 32768, pod) == total // 128 == 6 * 2**30


# --- the programs launch/compile.py lowers ---------------------------------------------


def _abstract(tree):
  return jax.tree.map(
    lambda x: (
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
    ),
    tree,
  )


@pytest.mark.parametrize("name", [None, "data4_tensor2"])
def test_compile_lowers_the_programs_the_engine_runs(name, params):
  """launch/compile.py lowers `engine.programs` at `step_args` / `decode_args`
  (abstract params, no engine). Lowered at the arguments a real engine
  passes, the one-token step and the driver's decode loop must give the
  same program text, shardings included; otherwise the AOT report would
  size a different program than the one that runs."""
  if name is None:
    engine = PolicyEngine(CFG, params[0], ROLLOUT, **ENGINE_KW)
  else:
    engine = sharded_engine(name, params[0])
  progs = engine.programs
  abstract_params = jax.eval_shape(lambda: policy.init_params(CFG, jax.random.key(0)))
  state = engine.init_decode_state()
  # Host arrays as jit places them: on the in_shardings (sharded), the device (not).
  vec_sh = state.lengths.sharding
  tok_sh = vec_sh if name is None else engine.shardings.tokens
  vec = jax.device_put(np.zeros((SLOTS,), np.int32), vec_sh)
  stream = engine._rng
  real = _abstract((engine.params, state.cache, state.lengths, vec, vec, stream))
  step_real = _abstract(
    (
      engine.params,
      state.cache,
      state.lengths,
      jax.device_put(np.zeros((SLOTS, 1), np.int32), tok_sh),
      jax.device_put(np.ones((SLOTS, 1), bool), tok_sh),
      jax.device_put(jax.random.key(0), stream.base.sharding),
    )
  )
  with progs.context():
    loop = progs.decode(None, 3, -1)
    assert "while" in loop.lower(*real).as_text()
    assert loop.lower(*real).as_text() == loop.lower(*progs.decode_args(abstract_params)).as_text()
    step = progs.step(None)
    assert (
      step.lower(*step_real).as_text() == step.lower(*progs.step_args(abstract_params, 1)).as_text()
    )


def test_the_hybrids_recurrent_state_shards_and_samples_what_one_device_samples():
  """The Qwen3.5-style toy (tiny_hybrid, scanned in blocks of two layers):
  a paged engine on data 4 x tensor 2 holds each DeltaNet layer's per-slot
  state with slots over "data" and heads over "tensor", beside the pool,
  and samples what the single-device dense engine samples through prefill,
  decode, a swap and re-admitted slots (whose state starts from zeros)."""
  hcfg = dataclasses.replace(mcfg.tiny_hybrid(TOK.vocab_size), scan_layers=True)
  p0 = policy.init_params(hcfg, jax.random.key(0))
  p1 = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), p0)
  inputs, expected, _ = scripted_run(PolicyEngine(hcfg, p0, ROLLOUT, **ENGINE_KW), p1)
  mesh, rules = mesh_and_rules("data4_tensor2")
  engine = PolicyEngine(
    hcfg, p0, ROLLOUT.replace(kv_cache="paged", page_size=8), mesh=mesh, rules=rules, **ENGINE_KW
  )
  cache = engine.init_decode_state().cache["layers"]["sub_0"]
  assert cache["state"].shape == (hcfg.scan_steps, SLOTS, 4, 16, 16)
  assert cache["state"].sharding.is_equivalent_to(
    NamedSharding(mesh, P(None, "data", "tensor", None, None)), 5
  )
  assert cache["conv_q"].sharding.is_equivalent_to(
    NamedSharding(mesh, P(None, "data", None, "tensor", None)), 5
  )
  _, got, _ = scripted_run(engine, p1, inputs)
  for step, ((tok, logp, version), (tok0, logp0, version0)) in enumerate(zip(got, expected)):
    np.testing.assert_array_equal(tok, tok0, err_msg=f"step {step}")
    np.testing.assert_allclose(logp, logp0, atol=1e-5, err_msg=f"step {step}")
    assert version == version0
