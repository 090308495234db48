"""An installed libtpu stays out of a CPU host's JAX programs (sao_jax/models/platforms.py)."""

import importlib.util
import os
import subprocess
import sys

import pytest

from sao_jax.models import platforms

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
  "env, libtpu, tpu, gpu, want",
  [
    ({}, True, False, False, "cpu"),  # make test's venv on a CPU machine
    ({"JAX_PLATFORMS": "tpu"}, True, False, False, "tpu"),  # the user's choice wins
    ({"JAX_PLATFORMS": ""}, True, False, False, ""),
    ({}, False, False, False, None),  # no libtpu: JAX never tries a TPU
    ({}, True, True, False, None),  # a TPU VM
    ({}, True, False, True, None),  # a GPU host keeps JAX's default order
  ],
)
def test_cpu_is_chosen_only_where_libtpu_would_fail(env, libtpu, tpu, gpu, want):
  environ = dict(env)
  changed = platforms.keep_tpu_off_cpu_hosts(
    environ, libtpu_installed=libtpu, tpu_present=tpu, gpu_present=gpu
  )
  assert environ.get("JAX_PLATFORMS") == want and changed == (want == "cpu" and not env)


def test_a_google_pci_device_is_a_tpu(tmp_path):
  for i, vendor in enumerate(("0x8086", "0x10de")):
    (tmp_path / f"0000:00:0{i}.0").mkdir()
    (tmp_path / f"0000:00:0{i}.0" / "vendor").write_text(vendor + "\n")
  assert not platforms.tpu_chips_present(str(tmp_path))
  (tmp_path / "0000:00:05.0").mkdir()
  (tmp_path / "0000:00:05.0" / "vendor").write_text("0x1ae0\n")
  assert platforms.tpu_chips_present(str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="no libtpu installed")
@pytest.mark.skipif(platforms.tpu_chips_present(), reason="this host has a TPU")
def test_a_program_started_like_the_launchers_prints_no_tpu_error(tmp_path):
  """`import sao_jax` then JAX, as launch/*.py do, with JAX_PLATFORMS unset:
  no TPU start-up error on stderr and no libtpu log (TPU_LOG_DIR points
  libtpu's logs, had it started, into tmp_path)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env.update(TPU_LOG_DIR=str(tmp_path / "tpu_logs"), PYTHONPATH=ROOT)
  out = subprocess.run(
    [sys.executable, "-c", "import sao_jax, jax; print(jax.devices())"],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  assert "CpuDevice" in out.stdout
  assert "TPU" not in out.stderr and "libtpu" not in out.stderr, out.stderr[-2000:]
  assert not (tmp_path / "tpu_logs").exists()
