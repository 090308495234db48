"""Multi-host training: one SPMD program over many processes.

On a pod every host runs the same trainer. `jax.distributed.initialize`
(`initialize`) joins the processes into one runtime and the trainer's mesh
spans every device of every host: the jitted steps are one program, the
processes only feed it. Contract:

  * Batches: each host packs only the rows its own devices address
    (`pack_batch`), with the layout computed from the whole batch
    identically on every host, so the global array is exactly the
    single-process batch.
  * Checkpoints are saved and restored collectively; the workdir must be a
    filesystem every host sees.
  * Metrics, progress lines, config.json and summary.json: process 0 only.
  * The in-process engine runs on process 0 over a gathered copy of the
    params (`host_local_copy`), and process 0 shares its result
    (`share_from_primary`); in-process RL is refused with several
    processes (its rollout order is not deterministic).
  * Long waits go through the coordination service (`sync`,
    `share_from_primary`), and the train steps compile ahead, then wait for
    each other (`lockstep`).

Launch (one command per host, same config):

    python launch/train.py --config=configs/sao_tiny.py --workdir=/shared/run \\
      --config.distributed.enabled=True \\
      --config.distributed.coordinator_address=host0:8476 \\
      --config.distributed.num_processes=2 --config.distributed.process_id=$ID

Fields left empty come from the environment (`JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`) or JAX's cluster auto-detection (TPU
pods, SLURM, Open MPI, Kubernetes). Which rows a host holds, and why CPU
processes must stay in step: docs/design/multihost.md.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any, Sequence

import jax
import numpy as np
from absl import flags
from jax._src import distributed as _jax_distributed  # the coordination service client
from jax.sharding import NamedSharding, PartitionSpec

from sao_jax.config import sections
from sao_jax.data import packing

# How long processes wait for process 0's in-process engine work (value
# pretraining's generation, an evaluation) before failing: a hang guard, not a budget.
WAIT_FOR_PRIMARY_S = 6 * 3600

_shared = itertools.count()  # every process shares in the same order: unique keys


def initialize(dist_config) -> bool:
  """Joins this process to the others (`jax.distributed.initialize`).

  Must run before anything touches devices. Fields that are unset
  (coordinator_address "", num_processes 0, process_id -1) fall back to the
  environment, then to JAX's cluster auto-detection.

  Args:
    dist_config: the config's `distributed` section.

  Returns:
    True if this process is now part of a multi-process runtime (or already
    was), False when `dist_config.enabled` is off (single process, no-op).
  """
  sections.Distributed.from_config(dist_config)  # one line on a bad field
  if not dist_config.enabled:
    return False
  if _jax_distributed.global_state.client is not None:  # already joined
    return True
  env = os.environ
  address = dist_config.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
  num = dist_config.num_processes or int(env.get("JAX_NUM_PROCESSES", 0)) or None
  pid = dist_config.process_id
  if pid < 0:
    pid = int(env["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in env else None
  jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
  if jax.default_backend() == "cpu":
    jax.config.update("jax_enable_compilation_cache", False)
  import orbax.checkpoint  # noqa: F401  # defines the flag

  flags.FLAGS["experimental_orbax_use_distributed_barrier"].value = True
  return True


def sync(name: str) -> None:
  """Waits until every process has called `sync(name)` (the n-th call of each).

  A barrier over the coordination service, for points after host work whose
  time differs between processes (environment set-up), so that the next
  device collective starts in step.
  """
  if jax.process_count() == 1:
    return
  _jax_distributed.global_state.client.wait_at_barrier(
    f"sao_jax/sync/{next(_shared)}/{name}", WAIT_FOR_PRIMARY_S * 1000
  )


def lockstep(jitted, name: str):
  """`jitted`, compiled before its first run on each input signature, then `sync`ed.

  Each process compiles the same program at its own pace; without the
  barrier the first to finish would start the program's collectives and
  wait for the others (on CPU, 30 s at most). A single process gets
  `jitted` itself.
  """
  if jax.process_count() == 1:
    return jitted
  compiled = {}

  def call(*args):
    leaves, treedef = jax.tree.flatten(args)
    key = (
      treedef,
      tuple((np.shape(x), getattr(x, "dtype", None), getattr(x, "sharding", None)) for x in leaves),
    )
    if key not in compiled:
      compiled[key] = jitted.lower(*args).compile()
      sync(f"compiled/{name}")
    return compiled[key](*args)

  return call


def is_primary() -> bool:
  """Process 0: the one that writes metrics, progress and run records."""
  return jax.process_index() == 0


def process_rows(sharding: jax.sharding.Sharding, num_rows: int) -> np.ndarray:
  """Sorted indices of the batch rows this process's devices hold.

  In the order `jax.make_array_from_process_local_data` expects them: the
  k-th row of a host's local batch is global row `process_rows(...)[k]`.
  """
  ndim = max(1, len(getattr(sharding, "spec", ())))  # only the leading dim matters
  index_map = sharding.addressable_devices_indices_map((num_rows,) + (1,) * (ndim - 1))
  rows = set()
  for index in index_map.values():
    rows.update(range(*index[0].indices(num_rows)))
  return np.array(sorted(rows), np.int64)


def global_batch(
  batch: dict[str, np.ndarray], sharding: jax.sharding.Sharding, num_rows: int
) -> dict[str, jax.Array]:
  """Global `[num_rows, ...]` arrays from a host's rows of a batch.

  Args:
    batch: numpy arrays holding either this process's rows (in
      `process_rows` order) or the whole batch (every row; this process
      then keeps its own).
    sharding: the batch's sharding on the global mesh.
    num_rows: R, the global batch's row count.
  """
  rows = process_rows(sharding, num_rows)
  out = {}
  for key, value in batch.items():
    if value.shape[0] == num_rows and len(rows) != num_rows:
      value = value[rows]
    if value.shape[0] != len(rows):
      raise ValueError(
        f"batch[{key!r}] has {value.shape[0]} rows; this process holds {len(rows)} of {num_rows}"
      )
    out[key] = jax.make_array_from_process_local_data(
      sharding, value, (num_rows,) + value.shape[1:]
    )
  return out


def pack_batch(
  trajs: Sequence[Any],
  num_rows: int,
  buckets: Sequence[int],
  sharding: jax.sharding.Sharding,
  baseline_advantages: Sequence[float] | None = None,
  action_index: bool = False,
  routing: tuple[int, int] | None = None,
) -> dict[str, jax.Array]:
  """`packing.pack` of the whole batch, with only this process's rows built.

  Every process passes the same `trajs`; the layout is computed from all
  their lengths, so the result is the single-process batch whatever the
  process count.
  """
  rows = process_rows(sharding, num_rows)
  local = packing.pack(
    trajs,
    num_rows,
    buckets,
    baseline_advantages,
    row_ids=rows,
    action_index=action_index,
    routing=routing,
  )
  return global_batch(local, sharding, num_rows)


def host_local_copy(tree, mesh: jax.sharding.Mesh):
  """The whole of a pytree sharded over `mesh`, on this process's first device.

  A collective over every process (each gets its own copy), for host-side
  work that needs whole params: the in-process engine. A tree this process
  can read whole already (a single process's, or a copy made before) is
  returned as it is.
  """
  if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
    return tree
  replicated = NamedSharding(mesh, PartitionSpec())
  full = jax.jit(lambda t: t, out_shardings=replicated)(tree)
  return jax.tree.map(lambda x: x.addressable_data(0), full)


def share_from_primary(name: str, compute):
  """`compute()` on process 0, its JSON-able result returned on every process.

  The others wait (up to WAIT_FOR_PRIMARY_S) on the coordination service's
  key-value store instead of a device collective, so a long computation on
  process 0 cannot trip a collective's timeout. Every process must call it,
  in the same order.
  """
  if jax.process_count() == 1:
    return compute()
  key = f"sao_jax/shared/{next(_shared)}/{name}"
  client = _jax_distributed.global_state.client
  if is_primary():
    try:
      value = compute()
    except BaseException as e:
      client.key_value_set(key, json.dumps({"error": repr(e)}))
      raise
    client.key_value_set(key, json.dumps({"value": value}))
    return value
  shared = json.loads(client.blocking_key_value_get(key, WAIT_FOR_PRIMARY_S * 1000))
  if "error" in shared:
    raise RuntimeError(f"process 0 failed in {name}: {shared['error']}")
  return shared["value"]
