"""Bad configs and bad workdirs: one-line errors naming the field, nothing written."""

import os
import subprocess

import pytest

from sao_jax.train import configuration
from sao_jax.train import trainer

from runs import load_config_module, run, shipped_configs  # pylint: disable=g-bad-import-order


def load_config(name="sao_tiny.py"):
  return load_config_module(name).get_config()


@pytest.mark.parametrize("field,value", [
    ("rollout.slots", 0), ("rollout.slots", -3), ("rollout.max_len", 0),
    ("rollout.temperature", 0.0), ("rollout.env_workers", 0), ("rollout.queue_size", 0),
    ("rollout.top_k", 8), ("rollout.top_p", 0.9), ("rollout.max_turn_tokens", 10_000),
    ("rl.eps_low", 2.0), ("rl.eps_low", 0.0), ("rl.eps_high", -0.1),
    ("rl.critic_updates", -1), ("rl.critic_updates", 0), ("rl.batch_size", 0),
    ("rl.actor_lr", 0.0), ("rl.critic_lr", float("nan")), ("rl.lam", 1.5),
    ("rl.gamma", -0.1), ("rl.steps", -1), ("rl.sync_every", 0),
    ("sft.lr", float("inf")), ("sft.batch_size", 0), ("checkpoint.every", 0),
    ("data.buckets", (256, 128)), ("data.buckets", ()), ("data.buckets", (4, 256)),
    ("sharding.mesh", {"data": 3}), ("sharding.mesh", {"data": -1, "fsdp": -1}),
    ("sharding.mesh", {"data": 0}), ("faults.env_error_every", -1),
])
def test_out_of_range_is_one_line_naming_the_field(field, value, tmp_path):
  c = load_config()
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(configuration.ConfigError) as e:
    configuration.validate(c, num_devices=8)
  message = str(e.value)
  assert message.startswith(field) and "\n" not in message, message
  # The trainer refuses it before writing anything.
  workdir = tmp_path / "run"
  with pytest.raises(configuration.ConfigError):
    trainer.train(c, str(workdir))
  assert not workdir.exists()


def test_every_shipped_config_is_valid_and_locked():
  for name in shipped_configs():
    c = load_config(name)
    configuration.validate(c, num_devices=8 if c.model.preset != "qwen3_30b_a3b" else 128)
    with pytest.raises(AttributeError):
      c.rl.stepz = 3  # a misspelt field cannot be added


@pytest.mark.parametrize("flag,expect", [
    ("--config.rl.stepz=3", "stepz"),
    ("--config.rollout.slots=0", "rollout.slots = 0"),
    ("--config.rl.eps_low=2", "rl.eps_low = 2"),
    ("--config.sharding.mesh={'data': 3}", "sharding.mesh"),
])
def test_launch_prints_one_line_and_writes_nothing(flag, expect, tmp_path):
  workdir = tmp_path / "run"
  proc = run(str(workdir), flag, run_flags=())
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert lines[-1].startswith("error:") and expect in lines[-1], lines[-1]
  assert not workdir.exists()


def test_unwritable_workdir_is_refused_before_training(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(configuration.ConfigError, match="not writable"):
    configuration.check_workdir(str(blocker / "run"), 0.0)
  c = load_config()
  c.sharding.mesh = {"data": 8}
  with pytest.raises(configuration.ConfigError, match="not writable"):
    trainer.train(c, str(blocker / "run"))


def test_too_little_free_space_is_refused(tmp_path):
  with pytest.raises(configuration.ConfigError, match="min_free_gb"):
    configuration.check_workdir(str(tmp_path / "run"), 1e9)


@pytest.fixture
def full_disk(tmp_path):
  """A 256 KiB tmpfs filled to the last byte (needs root and mount)."""
  mnt = tmp_path / "full"
  mnt.mkdir()
  if os.geteuid() != 0 or subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
      capture_output=True).returncode != 0:
    pytest.skip("mounting a small tmpfs needs root")
  try:
    try:
      with open(mnt / "filler", "wb", buffering=0) as f:
        while True:
          f.write(b"\0" * 4096)
    except OSError:
      pass  # full
    yield mnt
  finally:
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_is_refused_before_training(full_disk):
  with pytest.raises(configuration.ConfigError, match="not writable: No space left"):
    configuration.check_workdir(str(full_disk), 0.0)
