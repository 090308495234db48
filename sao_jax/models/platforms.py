"""platforms: keep an installed TPU runtime (libtpu) from starting on a host with no TPU.

`make test` installs the `aot` extra (libtpu, for launch/compile.py's
ahead-of-time TPU compiles) into the same venv as everything else. With
libtpu importable, JAX tries the TPU backend first in every program: on a
machine without a TPU chip that prints a screen of TPU start-up errors
("unexpected worker hostname ...") and writes /tmp/tpu_logs, before
falling back to the CPU. `keep_tpu_off_cpu_hosts`, run when `sao_jax` is
imported (before JAX reads its platform setting), sets JAX_PLATFORMS=cpu
when all of these hold:

    JAX_PLATFORMS is not set          (the user's choice always wins)
    libtpu is installed               (otherwise JAX never touches a TPU)
    no TPU chip on the PCI bus        (JAX's own test: Google's vendor id 0x1ae0)
    no NVIDIA GPU device node         (a GPU host keeps JAX's default order)

On a TPU VM, a GPU host, or with JAX_PLATFORMS set, nothing changes. The
variable is set in the environment, so the processes a run starts (Ray
workers, fleet hosts, the sandbox) inherit it. launch/compile.py sets
JAX_PLATFORMS=cpu itself and loads libtpu's compiler directly.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

_GOOGLE_PCI_VENDOR = "0x1ae0"
_NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def tpu_chips_present(pci_root: str = "/sys/bus/pci/devices") -> bool:
  """Whether a Google PCI device (a TPU chip) is attached: what JAX's
  `hardware_utils` reads, without importing JAX."""
  for vendor in glob.glob(os.path.join(pci_root, "*", "vendor")):
    try:
      with open(vendor, encoding="ascii") as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def keep_tpu_off_cpu_hosts(
  environ=None,
  *,
  libtpu_installed: bool | None = None,
  tpu_present: bool | None = None,
  gpu_present: bool | None = None,
) -> bool:
  """Sets JAX_PLATFORMS=cpu in `environ` (default os.environ) by the rule of the
  module docstring; returns whether it did. The keyword arguments replace the
  host probes (tests)."""
  environ = os.environ if environ is None else environ
  if "JAX_PLATFORMS" in environ:
    return False
  if libtpu_installed is None:
    libtpu_installed = importlib.util.find_spec("libtpu") is not None
  if not libtpu_installed:
    return False
  if tpu_present is None:
    tpu_present = tpu_chips_present()
  if gpu_present is None:
    gpu_present = any(os.path.exists(d) for d in _NVIDIA_DEVICES)
  if tpu_present or gpu_present:
    return False
  environ["JAX_PLATFORMS"] = "cpu"
  jax = sys.modules.get("jax") if environ is os.environ else None
  if jax is not None:  # imported before sao_jax: its flag already read the environment
    jax.config.update("jax_platforms", "cpu")
  return True
