"""Run identity (sao_jax/data/identity.py): the params fingerprint, the run id,
what a trajectory carries through the store, and the trainer's verdict."""

import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sao_jax.data import identity, ingestion, store
from sao_jax.data.trajectory import Trajectory, checked

VOCAB, MAX_LEN = 32, 64


def params(scale=1.0):
  rng = np.random.default_rng(0)
  return {
    "layer": {
      "w": (rng.normal(size=(16, 32)) * scale).astype(jnp.bfloat16),
      "b": np.zeros((32,), np.float32),
    },
    "embed": rng.normal(size=(40, 8)).astype(np.float32),
    "step": np.int32(3),
  }


def traj(versions=(2, 2, 3), **fields) -> Trajectory:
  """P P a a a: action tokens sampled at `versions`."""
  mask = np.array([0, 0, 1, 1, 1], bool)
  version = np.full(5, -1, np.int32)
  version[2:] = versions
  return Trajectory(
    tokens=np.arange(1, 6, dtype=np.int32),
    action_mask=mask,
    rollout_logprobs=np.where(mask, -0.5, 0).astype(np.float32),
    policy_version=version,
    rewards=np.zeros(5, np.float32),
    turn_starts=np.array([2], np.int32),
    prompt_id=1,
    **fields,
  )


# --- the fingerprint ---------------------------------------------------------------


def test_fingerprint_names_the_values_not_the_layout():
  p = params()
  fp = identity.fingerprint(p)
  assert identity.FINGERPRINT.match(fp) and identity.fingerprint(params()) == fp
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  sharded = jax.tree.map(
    lambda x: jax.device_put(
      x, NamedSharding(mesh, P("data", "model") if np.ndim(x) == 2 else P())
    ),
    p,
  )
  assert identity.fingerprint(sharded) == fp
  # Another model's params, one sampled element changed, a sign of zero
  # (a bit pattern arithmetic would lose), a dtype, a tree path: all others.
  others = [
    params(scale=2.0),
    dict(p, embed=np.where(np.arange(40)[:, None] == 0, 9.0, p["embed"]).astype(np.float32)),
    dict(p, layer=dict(p["layer"], b=-p["layer"]["b"])),
    dict(p, embed=p["embed"].astype(jnp.bfloat16)),
    {"other": p["layer"], "embed": p["embed"], "step": p["step"]},
  ]
  fps = {identity.fingerprint(o) for o in others}
  assert len(fps) == len(others) and fp not in fps


def test_fingerprint_of_a_sharded_leaf_never_gathers_it():
  """Each device reads the sampled elements it holds; only the samples are
  all-reduced (no all-gather of the leaf, temporaries of sample size)."""
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  x = jax.device_put(jnp.ones((64, 1024, 4), jnp.bfloat16), NamedSharding(mesh, P("data", "model")))
  sampler = identity._sampler((x.shape,), NamedSharding(mesh, P()))
  compiled = sampler.lower([x]).compile()
  hlo = compiled.as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo and "all-reduce" in hlo
  assert compiled.memory_analysis().temp_size_in_bytes <= 64 * identity.SAMPLES


# --- the run id ----------------------------------------------------------------------


def test_run_id_is_made_once_and_kept_in_the_workdir(tmp_path):
  first = identity.run_id(str(tmp_path))
  assert identity.RUN_ID.match(first)
  assert (tmp_path / identity.RUN_ID_FILE).read_text().strip() == first
  assert identity.run_id(str(tmp_path)) == first  # a resumed run
  assert identity.run_id(str(tmp_path / "other")) != first


# --- what a trajectory carries -----------------------------------------------------------


def test_identity_round_trips_through_the_store_and_old_records_have_none():
  t = traj(run_id="abc", fingerprints={2: "0" * 16, 3: "f" * 16})
  back = store.deserialize(store.serialize(t), MAX_LEN)
  canon, reason = checked(back, VOCAB, MAX_LEN)
  assert (
    reason is None and canon.run_id == "abc" and canon.fingerprints == {2: "0" * 16, 3: "f" * 16}
  )
  # A record written before identities existed: its header has neither field.
  members = dict(np.load(io.BytesIO(store.serialize(traj()))))
  header = json.loads(members["header"].tobytes())
  assert header.pop("run_id") == "" and header.pop("fingerprints") == {}
  members["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
  buf = io.BytesIO()
  np.savez(buf, **members)
  canon, reason = checked(store.deserialize(buf.getvalue(), MAX_LEN), VOCAB, MAX_LEN)
  assert reason is None and canon.run_id == "" and canon.fingerprints == {}


def test_rollout_ledger_stamps_versions_and_drops_an_ambiguous_one():
  ledger = identity.Ledger()
  ledger.note(2, {"run_id": "run", "fingerprint": "a" * 16})
  ledger.note(3, {"run_id": "run", "fingerprint": "b" * 16})
  ledger.note(4, {"nonce": "no identity"})
  t = ledger.stamp(traj((2, 3, 4)))
  assert t.run_id == "run" and t.fingerprints == {2: "a" * 16, 3: "b" * 16}
  # Version 3 republished with other params while an episode sampled it.
  tokens = identity.Tokens()
  tokens.add(2, ledger.get(2))
  tokens.add(3, ledger.get(3))
  ledger.note(3, {"run_id": "run", "fingerprint": "c" * 16})
  tokens.add(3, ledger.get(3))
  assert tokens.fields() == {"run_id": "run", "fingerprints": {2: "a" * 16}}


@pytest.mark.parametrize(
  "fields, reason",
  [
    ({"run_id": "run", "fingerprints": {2: "a" * 16, 3: "b" * 16}}, None),
    ({}, "missing_run_id"),
    ({"run_id": "another", "fingerprints": {2: "a" * 16, 3: "b" * 16}}, "other_run"),
    ({"run_id": "run", "fingerprints": {2: "a" * 16}}, "missing_fingerprint"),
    ({"run_id": "run", "fingerprints": {2: "a" * 16, 3: "c" * 16}}, "other_params"),
  ],
)
def test_trainer_refuses_another_run_or_other_params(fields, reason):
  published = identity.Published("run", {2: "a" * 16, 3: "b" * 16})
  canon, got, _ = ingestion.check(traj(**fields), VOCAB, MAX_LEN, 3, identity=published)
  assert got == reason and (canon is None) == (reason is not None)
  # Without the trainer's identity (in-process, offline) nothing is checked.
  assert ingestion.check(traj(**fields), VOCAB, MAX_LEN, 3)[1] is None


def test_published_state_drops_the_discarded_future_and_bounds_itself():
  published = identity.Published("run")
  for v in range(identity.KEEP_VERSIONS + 5):
    published.note(v, f"{v:016x}")
  state = published.state()
  assert len(state["fingerprints"]) == identity.KEEP_VERSIONS
  assert (
    identity.Published("run").check(traj((2, 2, 2), run_id="run", fingerprints={2: "0" * 16}))
    == "unpublished_version"
  )
  back = identity.Published.restore("run", state, version=100)
  assert back.identity(100).fingerprint == f"{100:016x}"
  with pytest.raises(KeyError):
    back.identity(101)
  assert back.check(traj((2, 2, 2), run_id="run", fingerprints={2: f"{2:016x}"})) == (
    "unpublished_version"
  )  # pruned: KEEP_VERSIONS newer ones were published
  assert dataclasses.asdict(identity.of_meta(published.identity(7).meta())) == {
    "run_id": "run",
    "fingerprint": f"{7:016x}",
  }
