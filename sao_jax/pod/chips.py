"""The TPU chips a pod is compiled for: topology names, their devices, HBM per chip.

`topology_name` maps a Cloud TPU name (v5p-256, v5e-4) to libtpu's
(v5p:4x4x8, v5e:2x2); `topology_devices` gives that topology's devices
for compiling without the hardware (libtpu compiles for a topology it
only knows by name); `hbm_bytes` is the HBM a device holds programs to,
from the table `HBM_BYTES`. A name or kind it does not know is a
`ConfigError` in one line.
"""

from __future__ import annotations

import re

import numpy as np
from jax.experimental import topologies

from sao_jax.train import configuration

GIB = 2**30

# HBM per device that the TPU compiler holds programs to (its own "available
# HBM" figure), by device kind. libtpu's compile-only devices do not report
# memory (memory_stats() needs an addressable device), so these were read off
# the compiler's out-of-memory message on each kind with libtpu 0.0.42:
# v5p 95 GiB per chip, v5e 16 GiB, v6e 32 GiB, less what the runtime keeps;
# a v4 topology has one device per TensorCore, each with half of the chip's
# 32 GiB.
HBM_BYTES = {
  "TPU v5": 95.74 * GIB,
  "TPU v5p": 95.74 * GIB,
  "TPU v5 lite": 15.75 * GIB,
  "TPU v5e": 15.75 * GIB,
  "TPU v6 lite": 31.25 * GIB,
  "TPU v6e": 31.25 * GIB,
  "TPU v4": 15.25 * GIB,
}

# Cloud TPU generation names -> (libtpu's name, TensorCores per chip, 3-D torus).
_GENERATIONS = {
  "v5p": ("v5p", 2, True),
  "v4": ("v4", 2, True),
  "v5e": ("v5e", 1, False),
  "v5litepod": ("v5e", 1, False),
  "v6e": ("v6e", 1, False),
}


def first_line(msg: str, limit: int = 400) -> str:
  """The line of a compiler's message that says most: the first naming memory, else the first."""
  lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
  pick = next((ln for ln in lines if "memory" in ln.lower()), lines[0] if lines else "")
  return pick[:limit]


def topology_name(name: str) -> str:
  """libtpu's topology name ("v5p:4x4x8") for a Cloud TPU name ("v5p-256") or itself.

  Cloud names count TensorCores for v4 and v5p (two per chip) and chips for
  v5e and v6e. The torus shapes are the standard slice shapes: starting at
  2x2x1 (3-D) or 1x1 (2-D), each doubling doubles the smallest dimension
  (the last one among equals), which gives v5p-128 = 4x4x4, v5p-256 =
  4x4x8, v5e-16 = 4x4, v5e-32 = 4x8.
  """
  if ":" in name:
    return name
  m = re.fullmatch(r"(v5p|v4|v5e|v5litepod|v6e)-(\d+)", name)
  if not m:
    raise configuration.ConfigError(
      f"--topology={name!r}: expected a Cloud TPU name like v5p-256 / v5e-4 / v6e-8, or "
      "libtpu's like v5p:4x4x8 / v5e:2x2"
    )
  gen, cores_per_chip, torus3d = _GENERATIONS[m.group(1)]
  count = int(m.group(2))
  chips = count // cores_per_chip
  smallest = 4 if torus3d else 1
  if count % cores_per_chip or chips < smallest or chips & (chips - 1):
    raise configuration.ConfigError(
      f"--topology={name!r}: {m.group(1)} slices here are {smallest} chips or a power of "
      f"two above ({cores_per_chip} per chip in the name); give libtpu's name (e.g. "
      f"{gen}:4x4x12) for other shapes"
    )
  dims = [2, 2, 1] if torus3d else [1, 1]
  while int(np.prod(dims)) < chips:
    low = min(dims)
    i = max(j for j, d in enumerate(dims) if d == low)
    dims[i] *= 2
  return f"{gen}:{'x'.join(map(str, dims))}"


def topology_devices(name: str):
  """(libtpu's name, the topology's devices) for compiling without the hardware."""
  tname = topology_name(name)
  # libtpu's default host is 2x2x1 chips; a slice smaller than that (a v5e-1
  # or v6e-1, Colab's TPUs) is one host of its own size.
  dims = [int(d) for d in tname.split(":")[1].split("x")]
  kw = (
    {"chips_per_host_bounds": tuple(dims + [1] * (3 - len(dims)))} if int(np.prod(dims)) < 4 else {}
  )
  try:
    topo = topologies.get_topology_desc(platform="tpu", topology_name=tname, **kw)
  except Exception as e:  # noqa: BLE001
    raise configuration.ConfigError(
      f"--topology={name!r} ({tname}): libtpu refused it: {first_line(str(e))}"
    ) from None
  return tname, list(topo.devices)


def hbm_bytes(device) -> float:
  """The HBM a device of this kind holds programs to (`HBM_BYTES`)."""
  kind = device.device_kind
  if kind not in HBM_BYTES:
    raise configuration.ConfigError(
      f"no HBM size known for device kind {kind!r}; add it to HBM_BYTES in sao_jax/pod/chips.py"
    )
  return HBM_BYTES[kind]
