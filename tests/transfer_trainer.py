"""A stand-in trainer process for tests/transport/test_weight_transfer.py: one process
of a `jax.distributed` job (2 CPU devices each) whose params are sharded over
all processes' devices, serving versions through weight_transfer.WeightServer.

    python tests/transfer_trainer.py ROOT PROCESS NUM_PROCESSES PORT NONCE
    python tests/transfer_trainer.py pull ROOT     (a rollout to kill mid-pull)
    python tests/transfer_trainer.py pull ROOT delta   (... mid-delta: it holds
        the newest version first, then pulls the next one's delta)

Publishes version 1, then version v when the file ROOT/go-<v> appears (each
a delta from the one before: `expected` changes a few elements); from
a version whose go file says "stall", it stops answering pull requests (so
that a rollout's pull stays in flight until the test kills this process).
Exits when ROOT/stop appears. `expected(version)` is what it serves.
"""

import os
import sys
import time

import numpy as np

# The trainer run the manifests name (sao_jax/data/identity.py).
RUN_ID = "trainer_run"
SHAPES = {
  "embed": ((16, 8), "bfloat16"),
  "experts": ((4, 8, 6), "bfloat16"),
  "norm": ((8,), "float32"),
  "step": ((), "int32"),
}


def expected(version: int) -> dict:
  """The params of `version` as host arrays (the same in every process):
  version 1 at random, each later one the one before with a sixteenth of
  each leaf's elements redrawn (norm's on even versions only, so some of
  its pieces do not change), "step" the version, and bit patterns a float
  comparison would miss: -0.0 then +0.0, two NaN payloads in turn."""
  import ml_dtypes

  out = {}
  for v in range(1, version + 1):
    rng = np.random.default_rng(v)
    for name, (shape, dtype) in SHAPES.items():
      dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
      values = (rng.standard_normal(shape).astype(np.float32) * 3).astype(dtype)
      if v == 1 or name == "step":
        out[name] = np.full(shape, v, dtype) if name == "step" else values
        continue
      if name == "norm" and v % 2:
        continue
      flat = out[name].reshape(-1).copy()
      where = rng.choice(flat.size, max(flat.size // 16, 1), replace=False)
      flat[where] = values.reshape(-1)[where]
      out[name] = flat.reshape(shape)
    bits = out["embed"].view(np.uint16)  # [16, 8]
    bits[0, 0] = 0x8000 if v % 2 == 0 else 0x0000  # -0.0 / +0.0
    bits[1, 1] = 0x7FC1 if v % 2 == 0 else 0xFFE0  # quiet NaNs of two payloads
  return out


def main(root, process, num_processes, port, nonce):
  import jax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  if num_processes > 1:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process)
  from sao_jax.transport import weight_transfer

  devices = np.array(jax.devices()).reshape(num_processes, -1)  # fsdp across processes
  mesh = Mesh(devices, ("fsdp", "expert"))
  specs = {"embed": P("fsdp", None), "experts": P("expert", None, "fsdp"), "norm": P(), "step": P()}

  def params(version):
    host = expected(version)
    return {
      k: jax.make_array_from_callback(
        host[k].shape, NamedSharding(mesh, specs[k]), lambda idx, k=k: host[k][idx]
      )
      for k in host
    }

  server = weight_transfer.WeightServer(
    root, nonce, host="127.0.0.1", sockets=2, pull_timeout_s=600, thread=False
  )
  server.publish(params(1), 1, run_id=RUN_ID)
  version, stalled = 1, False
  while not os.path.exists(os.path.join(root, "stop")):
    go = os.path.join(root, f"go-{version + 1}")
    if os.path.exists(go):
      with open(go, encoding="utf-8") as f:
        stalled = stalled or f.read().strip() == "stall"
      version += 1
      server.publish(params(version), version, run_id=RUN_ID)
    if not stalled:
      server.serve_requests()
    time.sleep(0.02)
  server.close()


def pull(root, delta=False):
  """A rollout that posts its pull of the newest version, says so, and waits
  (to be SIGKILLed with the pull in flight). `delta`: it first pulls the
  newest version whole and says "held V", then posts the delta pull of the
  next one."""
  import jax
  import jax.numpy as jnp

  from sao_jax.transport import weight_transfer

  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = {
    k: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=device)
    for k, (shape, dtype) in SHAPES.items()
  }
  net = weight_transfer.NetFollower(root, "doomed", abstract, host="127.0.0.1", sockets=2)

  def newer(than):
    while True:
      offer = weight_transfer.newest_offer(root)
      if offer is not None and offer.version > than:
        return offer
      time.sleep(0.02)

  offer = newer(0)
  if delta:
    net.start(offer)
    while net.advance() is None:
      time.sleep(0.02)
    print(f"held {offer.version}", flush=True)
    offer = newer(offer.version)
  net.start(offer)
  assert (net._pull.delta is not None) == delta
  print("pulling", flush=True)
  time.sleep(1000)


if __name__ == "__main__":
  if sys.argv[1] == "pull":
    pull(sys.argv[2], sys.argv[3:] == ["delta"])
  else:
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
