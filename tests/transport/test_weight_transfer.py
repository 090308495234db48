"""The direct weight path (sao_jax/transport/weight_transfer.py): the transfer plan,
and two trainer processes of a `jax.distributed` job serving a rollout in
this process over loopback, bit for bit, whole and as a chain of deltas
(sao_jax/transport/weight_delta.py), with a delta that no longer fits the held
version, a kill mid-pull and the checkpoint fallback. Every wait is on an observable event behind a hang guard.
"""

import collections
import dataclasses
import itertools
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import runs
import transfer_trainer
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sao_jax.data import files, identity
from sao_jax.models import policy, precision
from sao_jax.train import factories, fleet_worker
from sao_jax.transport import fleet
from sao_jax.transport import weight_transfer as wt

HANG_GUARD_S = 300


class FakeDevice:
  """A device of a topology: what `devices_indices_map` and the plan read."""

  def __init__(self, i, process):
    self.id, self.process_index = i, process


def test_plan_moves_each_byte_once_and_spreads_replicas():
  devs = jax.devices()
  src_mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("fsdp", "expert"))
  dst_mesh = Mesh(np.array(devs[4:8]).reshape(2, 2), ("expert", "tensor"))
  leaves = [
    (
      (8, 6),
      jnp.bfloat16,
      NamedSharding(src_mesh, P("fsdp", None)),
      NamedSharding(dst_mesh, P(None, "tensor")),
    ),
    (
      (4, 8),
      jnp.float32,
      NamedSharding(src_mesh, P()),
      NamedSharding(dst_mesh, P("expert", "tensor")),
    ),
  ]
  pieces = wt.source_pieces([(s, d, src) for s, d, src, _ in leaves])
  # Distinct shards only: 2 row halves of the first leaf, 1 copy of the replicated one.
  assert [(p.leaf, p.index) for p in pieces] == [
    (0, ((0, 4), (0, 6))),
    (0, ((4, 8), (0, 6))),
    (1, ((0, 4), (0, 8))),
  ]
  assert wt.check_cover(pieces, [(8, 6), (4, 8)]) is None
  shifted = dataclasses.replace(pieces[1], index=((2, 6), (0, 6)))  # same size, overlapping
  assert "overlap" in wt.check_cover([pieces[0], shifted, pieces[2]], [(8, 6), (4, 8)])
  assert "add up" in wt.check_cover(pieces[1:], [(8, 6), (4, 8)])
  plan = wt.plan(pieces, [(s, dst) for s, _, _, dst in leaves])
  assert sum(p.nbytes for p in plan.pieces) == 8 * 6 * 2 + 4 * 8 * 4
  # Every destination shard is filled from pieces that cover it exactly.
  for (leaf, dev), index in plan.dest_index.items():
    fills = plan.fills[(leaf, dev)]
    assert sum(np.prod([b - a for a, b in o]) for _, o in fills) == np.prod(
      [b - a for a, b in index]
    )
  # Pulled onto a device whose shard holds it, when one exists: none here
  # (every destination shard is a column half), so copies stay local.
  assert plan.local_copy_bytes > 0
  # Replicas over two trainer processes: each serves half of the bytes.
  fake = [FakeDevice(i, i // 2) for i in range(4)]

  class Sharding:
    def __init__(self, rows):
      self.rows = rows

    def devices_indices_map(self, shape):
      n = len(fake) // self.rows
      return {
        d: (slice((i // n) * shape[0] // self.rows, (i // n + 1) * shape[0] // self.rows),)
        for i, d in enumerate(fake)
      }

  replicated = wt.source_pieces([((8,), jnp.float32, Sharding(1))] * 4)
  assert sorted(p.process for p in replicated) == [0, 0, 1, 1]
  rows = wt.source_pieces([((8,), jnp.float32, Sharding(2))])
  assert [(p.index, p.process) for p in rows] == [(((0, 4),), 0), (((4, 8),), 1)]
  report = wt.report(
    [(s, d, src) for s, d, src, _ in leaves], [(s, dst) for s, _, _, dst in leaves], rollout_hosts=3
  )
  assert report["version_bytes"] == 8 * 6 * 2 + 4 * 8 * 4 and report["pieces"] == 3
  assert report["max_bytes_per_trainer_host"] == 3 * report["version_bytes"]


def _wait(what, condition, procs):
  deadline = time.time() + HANG_GUARD_S
  while not condition():
    for i, p in enumerate(procs):
      assert p.poll() is None, f"trainer process {i} exited ({p.returncode}) waiting for {what}"
    assert time.time() < deadline, f"hang guard: no {what}"
    time.sleep(0.02)


def _equal(got, version):
  want = transfer_trainer.expected(version)
  for k, v in want.items():
    g = np.asarray(got[k])
    assert g.dtype == v.dtype and g.shape == v.shape, k
    assert g.tobytes() == v.tobytes(), f"{k} of version {version} differs"


def _tamper_held(net, leaf, now, then):
  """Flips a bit of the rollout's held piece of `leaf` (which holds `now`)
  at an element `then` leaves unchanged: what a lost delta leaves behind."""
  n = sorted(now).index(leaf)
  key = next(k for k in net._held.pieces if k[0] == n)
  piece = net._held.pieces[key]
  window = tuple(slice(a, b) for a, b in key[1])
  same = now[leaf][window].view(np.uint16) == then[leaf][window].view(np.uint16)
  bits = np.asarray(piece).view(np.uint16).copy()
  bits[tuple(np.argwhere(same)[0])] ^= 1
  net._held.pieces[key] = jax.device_put(bits.view(np.asarray(piece).dtype), piece.sharding)


@dataclasses.dataclass
class _Rollout:
  """The rollout of the two-process test: its follower, and what it got."""

  net: wt.NetFollower
  follower: wt.Follower
  procs: list
  logged: list
  got: dict = dataclasses.field(default_factory=dict)

  def poll_until(self, version):
    def ready():
      out = self.follower.poll()
      if out is not None:
        self.got["params"], self.got["version"], self.got["meta"] = out
      return self.got.get("version") == version

    _wait(f"version {version}", ready, self.procs)


def _chain_of_deltas(r: _Rollout, tmp_path, abstract, nonce):
  """Version 1 whole, then 2-4 as deltas, each bit for bit."""
  version_bytes = sum(
    int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in transfer_trainer.SHAPES.values()
  )
  for version in (1, 2, 3, 4):
    if version > 1:
      (tmp_path / f"go-{version}").write_text("go")
    before = r.net.bytes_by_kind["delta"]
    r.poll_until(version)
    # The run id and fingerprint the two trainer processes computed over
    # their shards are the fingerprint of the whole params on this host.
    assert r.got["meta"] == {
      "nonce": nonce,
      "path": "direct",
      "run_id": transfer_trainer.RUN_ID,
      "fingerprint": identity.fingerprint(transfer_trainer.expected(version)),
    }
    _equal(r.got["params"], version)
    assert all(r.got["params"][k].sharding == abstract[k].sharding for k in abstract)
    if version > 1:
      assert 0 < r.net.bytes_by_kind["delta"] - before < version_bytes / 2
  assert r.follower.pulls == 4 and not r.follower.failures
  assert r.follower.pull_counts() == {
    "pulls_by_kind": {"full": 1, "delta": 3},
    "pulled_bytes": {"full": version_bytes, "delta": r.net.bytes_by_kind["delta"]},
  }


def _a_lost_delta(r: _Rollout, tmp_path):
  """A held piece no longer what version 4 was (one bit of an element
  version 5 leaves as it is): the delta's checksum catches it, counted, and
  version 5 is pulled again whole."""
  _tamper_held(r.net, "embed", transfer_trainer.expected(4), transfer_trainer.expected(5))
  (tmp_path / "go-5").write_text("go")
  r.poll_until(5)
  _equal(r.got["params"], 5)
  assert r.follower.failures == {"delta_checksum": 1}
  assert "direct pull failed (delta_checksum)" in r.logged[-1]
  assert "pulled again whole" in r.logged[-1]
  assert r.net.pulls_by_kind == {"full": 2, "delta": 3}


def _a_trainer_killed_mid_delta(r: _Rollout, tmp_path):
  """Version 6 is offered but not served; its delta pull is in flight when
  trainer process 1 dies: discarded, counted, version 5 held."""
  (tmp_path / "go-6").write_text("stall")
  _wait(
    "a pull of version 6",
    lambda: r.follower.poll() is None and r.net.pulling is not None and r.net.pulling.version == 6,
    r.procs,
  )
  assert r.net._pull.delta is not None
  r.procs[1].send_signal(signal.SIGKILL)
  r.procs[1].wait()
  deadline = time.time() + HANG_GUARD_S
  while r.follower.failures["pull_failed"] == 0 and time.time() < deadline:
    assert r.follower.poll() is None
    time.sleep(0.02)
  assert r.follower.failures == {"delta_checksum": 1, "pull_failed": 1}
  assert r.follower.version == 5
  assert r.net.pulling is None and "direct pull failed (pull_failed)" in r.logged[-1]
  _equal(r.got["params"], 5)
  assert r.follower.poll() is None  # a failed offer is not pulled again


def test_two_trainer_processes_to_a_rollout_bit_for_bit(tmp_path):
  root = str(tmp_path)
  port, nonce = runs.free_port(), "run1"
  script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "transfer_trainer.py")
  procs = [
    subprocess.Popen(
      [sys.executable, script, root, str(i), "2", str(port), nonce],
      env=runs.child_env(2, PYTHONPATH=runs.ROOT),
      cwd=runs.ROOT,
      stdout=open(tmp_path / f"p{i}.log", "w", encoding="utf-8"),
      stderr=subprocess.STDOUT,
    )
    for i in range(2)
  ]
  try:
    # The rollout's engine layout: 2 devices, another split than the trainer's.
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    layout = {"embed": P(None, "tensor"), "experts": P("tensor"), "norm": P("tensor"), "step": P()}
    abstract = {
      k: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, layout[k]))
      for k, (shape, dtype) in transfer_trainer.SHAPES.items()
    }
    logged = []
    net = wt.NetFollower(root, "r0", abstract, host="127.0.0.1", sockets=2)
    r = _Rollout(
      net, wt.Follower(fleet.WeightFollower(root, abstract), net, logged.append), procs, logged
    )
    _chain_of_deltas(r, tmp_path, abstract, nonce)
    _a_lost_delta(r, tmp_path)
    _a_trainer_killed_mid_delta(r, tmp_path)
    # The checkpoint path behind it: version 6 on disk is taken (newer).
    pub = fleet.WeightPublisher(root, keep=3, version=6)
    pub.publish(
      {k: jnp.asarray(v) for k, v in transfer_trainer.expected(6).items()}, 6, {"nonce": nonce}
    )
    pub.close()
    r.poll_until(6)
    assert r.follower.last_path == "checkpoint"
    _equal(r.got["params"], 6)
    assert not os.listdir(wt.requests_dir(root))  # the rollout removed its requests
  finally:
    (tmp_path / "stop").write_text("")
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()


def test_a_rollout_killed_mid_delta_leaves_the_trainer_serving(tmp_path):
  """The trainer (this process) serves a rollout version 5 whole and
  registers its delta pull of version 6; the rollout is SIGKILLed with that
  pull posted, and the next rollout (holding nothing) gets version 6 whole."""
  root = str(tmp_path)
  server = wt.WeightServer(root, "run1", host="127.0.0.1", sockets=2, thread=False)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def publish(version):
    server.publish(
      {k: jax.device_put(v, device) for k, v in transfer_trainer.expected(version).items()}, version
    )

  lines = queue.Queue()

  def said(what):  # serving requests until the doomed rollout says `what`
    deadline = time.time() + HANG_GUARD_S
    while True:
      server.serve_requests()
      try:
        line = lines.get(timeout=0.02)
      except queue.Empty:
        assert time.time() < deadline and doomed.poll() is None, f"hang guard: no {what}"
        continue
      assert line.strip() == what
      return

  try:
    publish(5)
    doomed = subprocess.Popen(
      [
        sys.executable,
        os.path.join(os.path.dirname(os.path.dirname(__file__)), "transfer_trainer.py"),
        "pull",
        root,
        "delta",
      ],
      env=runs.child_env(1, PYTHONPATH=runs.ROOT),
      cwd=runs.ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      text=True,
    )
    threading.Thread(target=lambda: [lines.put(x) for x in doomed.stdout], daemon=True).start()
    try:
      said("held 5")
      publish(6)
      said("pulling")  # its delta pull is posted
    finally:
      doomed.kill()
      doomed.wait()
    server.serve_requests()  # registered for the dead puller, if not yet
    assert (server.served, server.served_deltas) == (2, 1)
    abstract = {
      k: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=device)
      for k, (shape, dtype) in transfer_trainer.SHAPES.items()
    }
    net = wt.NetFollower(root, "r1", abstract, host="127.0.0.1", sockets=2)
    follower = wt.Follower(fleet.WeightFollower(root, abstract), net)
    deadline = time.time() + HANG_GUARD_S
    got = None
    while got is None:
      server.serve_requests()
      got = follower.poll()
      assert time.time() < deadline, "hang guard: no version 6"
      time.sleep(0.02)
    assert got[1] == 6 and server.served == 3 and not follower.failures
    assert net.pulls_by_kind == {"full": 1}
    _equal(got[0], 6)
  finally:
    server.close()


def test_the_rollout_worker_generates_while_a_version_is_pulled(tmp_path):
  """A fleet rollout worker (in a thread) on the direct path: its pull of
  version 1 is held back until it has written two more shards, so tokens
  were generated with the pull in flight; then it swaps in the whole version."""
  config = runs.load_config_module("sao_tiny.py").get_config()
  for field, value in (
    ("rl.mode", "fleet"),
    ("rollout.slots", 4),
    ("rollout.max_len", 128),
    ("rollout.max_turn_tokens", 16),
    ("fleet.shard_trajectories", 2),
    ("fleet.shard_seconds", 1.0),
    ("fleet.poll_seconds", 0.05),
    ("fleet.max_unread_shards", 1000),
    ("fleet.transfer_host", "127.0.0.1"),
  ):
    section, name = field.split(".")
    config[section][name] = value
  config.lock()
  workdir = str(tmp_path)
  root = fleet.root_of(config, workdir)
  # Whole versions (version 1 changes every element: its delta would not be
  # sent, and encoding it would only compile programs here).
  server = wt.WeightServer(
    root, "run1", host="127.0.0.1", sockets=2, thread=False, delta_block=None
  )
  lines, out = [], {}
  stop = threading.Event()

  def work():
    try:
      out["counts"] = fleet_worker.run_rollout_worker(config, workdir, "w0", stop, lines.append)
    except BaseException as e:  # noqa: BLE001
      out["error"] = e

  def wait_for(what, condition, serve=False):
    deadline = time.time() + HANG_GUARD_S
    while not condition():
      assert worker.is_alive(), (what, out.get("error"), lines)
      assert time.time() < deadline, f"hang guard: no {what}; {lines}"
      if serve:
        server.serve_requests()
      time.sleep(0.02)

  def shards():
    d = fleet.trajectories_dir(root)
    return [n for n in os.listdir(d) if fleet.parse_shard_name(n)] if os.path.isdir(d) else []

  params = policy.init_params(
    precision.serving_config(factories.build_model_config(config)), jax.random.key(0)
  )
  server.publish(params, 0)
  worker = threading.Thread(target=work, daemon=True)
  worker.start()
  try:
    wait_for("version 0", lambda: any("generating at version 0" in x for x in lines), serve=True)
    server.publish(jax.tree.map(lambda x: x * 0.5, params), 1)
    wait_for("the pull of version 1", lambda: "[rollout w0] pulling version 1" in lines)
    written = len(shards())
    wait_for("two shards during the pull", lambda: len(shards()) >= written + 2)
    wait_for("version 1", lambda: "[rollout w0] weights version 0 -> 1" in lines, serve=True)
    fleet.mark_done(root, 1)
    worker.join(HANG_GUARD_S)
  finally:
    stop.set()
    worker.join(HANG_GUARD_S)
    server.close()
  assert not worker.is_alive() and "error" not in out, (out, lines)
  counts = out["counts"]
  assert (counts["weights_path"], counts["pulls"], counts["version"]) == ("direct", 2, 1)
  assert counts["pull_failures"] == {} and counts["tokens_during_pulls"] > 0


def test_publish_casts_and_copies_in_one_program_and_the_donated_params_stay_served(tmp_path):
  """`publish(params, v, cast)`: the served arrays are `cast(params)` bit for
  bit, in buffers of their own (deleting the trainer's params, as a donating
  step does, leaves them intact), and a second version reuses the program."""
  server = wt.WeightServer(str(tmp_path), "run1", host="127.0.0.1", sockets=1, thread=False)
  try:
    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    cast = jax.jit(
      lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, t)
    )
    shardings = {"w": NamedSharding(mesh, P("fsdp", None)), "step": NamedSharding(mesh, P())}
    misses = []
    for version in (1, 2):
      params = {
        "w": jax.device_put(jax.random.normal(jax.random.key(version), (8, 4)), shardings["w"]),
        "step": jax.device_put(jnp.int32(version), shardings["step"]),
      }
      want = jax.tree.map(np.asarray, cast(params))
      before = wt._snapshot._cache_size()
      server.publish(params, version, cast)
      misses.append(wt._snapshot._cache_size() - before)
      snap = server.snapshot
      jax.tree.map(lambda x: x.delete(), params)  # the next train step donates them
      assert snap["w"].dtype == jnp.bfloat16 and snap["step"].dtype == jnp.int32
      assert snap["w"].sharding.is_equivalent_to(shardings["w"], 2)
      for k, v in want.items():
        assert np.asarray(snap[k]).tobytes() == v.tobytes(), k
    assert misses == [1, 0]
  finally:
    server.close()


# --- check_cover at manifest scale, and manifests from the future -------------------


def _pairwise_check_cover(pieces, shapes):
  """check_cover as it was: every pair of a leaf's pieces compared (the oracle)."""
  per_leaf = {}
  for p in pieces:
    if not 0 <= p.leaf < len(shapes):
      return f"piece of leaf {p.leaf}: there are {len(shapes)} leaves"
    per_leaf.setdefault(p.leaf, []).append(p.index)
  for leaf, shape in enumerate(shapes):
    indices = per_leaf.get(leaf, [])
    if (
      any(
        len(ix) != len(shape) or any(not 0 <= a < b <= n for (a, b), n in zip(ix, shape))
        for ix in indices
      )
      and shape
    ):
      return f"leaf {leaf}: a piece outside its shape {shape}"
    if sum(int(np.prod([b - a for a, b in ix])) for ix in indices) != int(np.prod(shape)) or (
      not shape and len(indices) != 1
    ):
      return f"leaf {leaf}: pieces do not add up to its shape {shape}"
    if not shape or not indices:
      continue
    lo = np.array([[a for a, _ in ix] for ix in indices])
    hi = np.array([[b for _, b in ix] for ix in indices])
    for i in range(len(indices)):  # the first i, then its first partner j > i
      hits = np.nonzero(np.all((lo[i + 1 :] < hi[i]) & (lo[i] < hi[i + 1 :]), axis=1))[0]
      if hits.size:
        return f"leaf {leaf}: pieces {indices[i]} and {indices[i + 1 + hits[0]]} overlap"
  return None


def _random_cover(rng, shape, parts):
  """A grid tiling of `shape` with `parts[d]` random parts per dimension,
  a tenth of its pieces split in two (a tiling that is no grid)."""
  cuts = [
    [0, *sorted(int(x) for x in rng.choice(np.arange(1, n), k - 1, replace=False)), n]
    for n, k in zip(shape, parts)
  ]
  # Each box: its (start, stop) per dimension, one interval of each.
  boxes = itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts])
  out = []
  for box in boxes:
    d = rng.integers(len(box))
    a, b = box[d]
    if b - a > 1 and rng.random() < 0.1:  # split along d
      m = int(rng.integers(a + 1, b))
      out += [box[:d] + ((a, m),) + box[d + 1 :], box[:d] + ((m, b),) + box[d + 1 :]]
    else:
      out.append(box)
  return out


def _perturb(rng, boxes, shape, kind=None):
  """`kind` (default: one at random): nothing, a piece dropped or doubled,
  shifted by one (an overlap and a gap of one volume), grown past the
  shape, or of the wrong rank."""
  boxes = list(boxes)
  kind = kind or rng.choice(["none", "drop", "double", "shift", "shift", "outside", "rank"])
  i = int(rng.integers(len(boxes)))
  d = int(rng.integers(len(shape)))
  (a, b) = boxes[i][d]
  if kind == "drop":
    del boxes[i]
  elif kind == "double":
    boxes.append(boxes[i])
  elif kind == "shift":
    step = 1 if b < shape[d] else -1
    if 0 <= a + step:
      boxes[i] = boxes[i][:d] + ((a + step, b + step),) + boxes[i][d + 1 :]
  elif kind == "outside":
    boxes[i] = boxes[i][:d] + ((a, shape[d] + 1),) + boxes[i][d + 1 :]
  elif kind == "rank":
    boxes[i] = boxes[i][:-1]
  return [boxes[j] for j in rng.permutation(len(boxes))]


def test_check_cover_is_near_linear_and_agrees_with_every_pair_compared(monkeypatch):
  """check_cover's verdict and message equal the pairwise oracle's on random
  covers (grids with some pieces split; a piece dropped, doubled, shifted,
  out of shape or of the wrong rank), small ones and ones of 3,000+ pieces,
  where a pairwise scan takes seconds. Counted, not timed: a right cover of
  n pieces costs O(n) pair comparisons, not n (n - 1) / 2."""
  rng = np.random.default_rng(0)
  verdicts = collections.Counter()
  compared = [0]
  overlap = wt._overlap

  def counted(a, b):
    compared[0] += 1
    return overlap(a, b)

  monkeypatch.setattr(wt, "_overlap", counted)

  def verdict(message):
    return next((k for k in ("overlap", "add up", "outside") if k in (message or "")), "ok")

  def agree(leaves):
    pieces = [
      wt.Piece(leaf, box, 0, 0, 1) for leaf, (_, boxes) in enumerate(leaves) for box in boxes
    ]
    pieces = [pieces[j] for j in rng.permutation(len(pieces))]
    shapes = [shape for shape, _ in leaves]
    want = _pairwise_check_cover(pieces, shapes)
    assert wt.check_cover(pieces, shapes) == want
    verdicts[verdict(want)] += 1
    return verdict(want)

  for _ in range(150):
    rank = int(rng.integers(1, 4))
    shape = tuple(int(n) for n in rng.integers(3, 12, rank))
    parts = [int(rng.integers(1, n + 1)) for n in shape]
    boxes = _perturb(rng, _random_cover(rng, shape, parts), shape)
    agree([(shape, boxes), ((4,), [((0, 2),), ((2, 4),)]), ((), [()])])
  for parts in ((3100,), (60, 55), (16, 16, 12)):
    shape = tuple(3 * p + 7 for p in parts)
    cover = _random_cover(rng, shape, parts)
    assert len(cover) >= 3000
    compared[0] = 0
    assert agree([(shape, cover)]) == "ok"
    assert compared[0] <= 4 * len(cover), compared[0]
    for kind, want in (("shift", "overlap"), ("double", "add up"), ("outside", "outside")):
      assert agree([(shape, _perturb(rng, cover, shape, kind))]) == want
  # Every verdict was reached: a tiling, and each way of failing one.
  assert set(verdicts) == {"ok", "overlap", "add up", "outside"}, verdicts


class FakeNet:
  """What Follower asks of the direct path: its root, the pull in flight
  (none here) and `start`."""

  def __init__(self, root):
    self.root, self.pulling, self.started = root, None, []

  def start(self, offer):
    self.started.append(offer.version)

  def abandon(self):
    pass


class NoCheckpoints:
  def newest(self):
    return None

  def close(self):
    pass


def _manifest(root, version, published):
  files.write_json(
    files.join(wt.transfer_dir(root), wt.manifest_name(version, 0)),
    {
      "version": version,
      "nonce": "run1",
      "process": 0,
      "num_processes": 1,
      "address": "127.0.0.1:1",
      "published": published,
      "leaves": [],
      "pieces": [],
    },
  )


def test_a_manifest_from_the_future_is_ignored_counted_and_logged_once(tmp_path):
  root, now = str(tmp_path), 1.9e9
  _manifest(root, 3, now - 5)
  _manifest(root, 4, now + wt.CLOCK_SKEW_S - 1)  # a little skew: the newest valid one
  _manifest(root, 9, now + 3600)  # an hour ahead: would outrank every real version
  logged, net = [], FakeNet(root)
  follower = wt.Follower(NoCheckpoints(), net, logged.append, clock=lambda: now)
  assert follower.poll() is None and net.started == [4]
  assert follower.poll() is None and net.started == [4]
  assert follower.ignored_manifests == {"from_future": 1}
  assert logged == [
    f"[fleet] ignored the weight manifest {wt.manifest_name(9, 0)}: published "
    f"3600 s after this host's now (more than {wt.CLOCK_SKEW_S:.0f} s of clock "
    "skew); the newest valid version is pulled"
  ]
  assert wt.newest_offer(root, now).version == 4
  # Its time come, it is a version like any.
  later = wt.Follower(NoCheckpoints(), FakeNet(root), clock=lambda: now + 3600)
  later.poll()
  assert later._net.started == [9] and not later.ignored_manifests
