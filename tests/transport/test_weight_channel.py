"""The weight channel (sao_jax/transport/weight_channel.py): `fleet.weights_path`
names a record; its publisher and follower carry versions from trainer to
rollout, checkpoints behind the direct entry; the config check is the
table's. Trainer and rollout are this process, over loopback.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.config import sections
from sao_jax.data import checkpoint, identity
from sao_jax.transport import fleet, weight_transfer
from sao_jax.transport import weight_channel as wc

HANG_GUARD_S = 120
PARAMS = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones((4,))}


@jax.jit
def _to_bf16(params):  # one function object: the server's snapshot compiles once
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)


def _version(v):
  return jax.tree.map(lambda x: x + v, PARAMS)


def _abstract():
  return jax.eval_shape(lambda: _to_bf16(PARAMS))


def _on_disk(root):
  return sorted(checkpoint.committed_checkpoints(fleet.weights_dir(root)))


def _poll_until(follower, version):
  deadline = time.time() + HANG_GUARD_S
  while True:
    got = follower.poll()
    if got is not None and got[1] == version:
      return got
    assert time.time() < deadline, f"hang guard: no version {version}"
    time.sleep(0.02)


def _same(got, version):
  for k, want in _to_bf16(_version(version)).items():
    assert got[k].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want))


def test_the_table_checks_the_fleet_section():
  with pytest.raises(sections.ConfigError) as e:
    wc.check_fleet_section(sections.Fleet(weights_path="nfs"))
  assert str(e.value).startswith("fleet.weights_path = 'nfs': must be one of ")
  assert all(name in str(e.value) for name in wc.CHANNELS) and "\n" not in str(e.value)
  # The servers' address is the direct entry's rule only.
  with pytest.raises(sections.ConfigError, match="^fleet.transfer_host = 'trainer-0'"):
    wc.check_fleet_section(sections.Fleet(weights_path="direct", transfer_host="trainer-0"))
  wc.check_fleet_section(sections.Fleet(weights_path="checkpoint", transfer_host="trainer-0"))
  wc.check_fleet_section(sections.Fleet(weights_path="direct", transfer_host="127.0.0.1"))


def test_the_checkpoint_channel_writes_every_version(tmp_path):
  root = str(tmp_path)
  f = sections.Fleet(weights_path="checkpoint", keep_versions=3)
  published = identity.Published("run1")
  pub = wc.make_publisher(root, f, 0, _to_bf16, identity=published, meta={"lora_base": "b0"})
  assert pub.describe == "checkpoints" and pub.report() == {}
  follower = wc.make_follower(root, "r0", _abstract(), f, print)
  for v in range(4):
    out = pub.publish(_version(v), v)
    assert set(out) == {"fleet/publish_s", "fleet/fingerprint_s"}
  pub.close(finished=True)
  assert _on_disk(root) == [1, 2, 3]  # every version, the newest keep_versions kept
  params, version, meta = follower.poll()
  assert version == 3 and meta["run_id"] == "run1" and meta["lora_base"] == "b0"
  assert meta["fingerprint"] == identity.fingerprint(_to_bf16(_version(3)))
  _same(params, 3)
  assert wc.follower_counts(follower, f) == {
    "weights_path": "checkpoint",
    "pulls": 0,
    "pull_failures": {},
  }
  follower.close()


def test_the_direct_channel_serves_every_version_and_checkpoints_some(tmp_path):
  """Every version is pulled over the network; every checkpoint_every-th,
  the first and (on a normal finish) the last also go to disk."""
  root = str(tmp_path)
  f = sections.Fleet(
    weights_path="direct",
    transfer_host="127.0.0.1",
    transfer_sockets=2,
    checkpoint_every=2,
    keep_versions=5,
    poll_seconds=0.05,
  )
  pub = wc.make_publisher(
    root,
    f,
    0,
    _to_bf16,
    identity=identity.Published("run1"),
    share=lambda key, make: make(),
    meta={"lora_base": "b0"},
  )
  assert isinstance(pub, wc.DirectPublisher) and pub.describe.startswith("direct from 127.0.0.1:")
  follower = wc.make_follower(root, "r0", _abstract(), f, print)
  try:
    assert set(pub.publish(_version(0), 0)) == {
      "fleet/serve_s",
      "fleet/fingerprint_s",
      "fleet/publish_s",
    }
    params, _, meta = _poll_until(follower, 0)
    # What every version carries besides (a LoRA run's base) comes with it.
    assert (meta["path"], meta["run_id"], meta["lora_base"]) == ("direct", "run1", "b0")
    _same(params, 0)
    for v in (1, 2, 3):
      out = pub.publish(_version(v), v)
      assert ("fleet/publish_s" in out) == (v == 2)
    params, _, meta = _poll_until(follower, 3)
    assert meta["path"] == "direct"
    _same(params, 3)
    counts = wc.follower_counts(follower, f)
    assert counts["weights_path"] == "direct" and counts["pulls"] >= 2
    assert counts["pull_failures"] == {} and counts["fallbacks"] == {}
    assert pub.report()["fleet/pulls_served"] == counts["pulls"]
  finally:
    follower.close()
    pub.close(finished=True)
  assert _on_disk(root) == [0, 2, 3]  # the first, every 2nd and the last (not 1)


def test_a_direct_channel_that_cannot_run_is_checkpoints_said_and_counted(tmp_path, monkeypatch):
  root = str(tmp_path)
  monkeypatch.setattr(weight_transfer, "unavailable", lambda: "no transfer library here")
  f = sections.Fleet(weights_path="direct", checkpoint_every=4)
  pub = wc.make_publisher(root, f, 0, _to_bf16)
  assert pub.describe == "checkpoints (no transfer library here)"
  assert pub.report() == {"fleet/direct_unavailable": 1}
  lines = []
  follower = wc.make_follower(root, "r0", _abstract(), f, lines.append)
  assert lines == ["[rollout r0] weights from checkpoints only: no transfer library here"]
  pub.publish(_version(0), 0)
  pub.publish(_version(1), 1)  # every version goes to disk: no checkpoint_every here
  pub.close(finished=True)
  assert _on_disk(root) == [0, 1]
  params, version, _ = follower.poll()
  assert version == 1
  _same(params, 1)
  counts = wc.follower_counts(follower, f)
  assert (counts["weights_path"], counts["fallbacks"]) == ("direct", {"unavailable": 1})
  follower.close()
