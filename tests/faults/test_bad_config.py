"""Bad configs and bad workdirs: one-line errors naming the field, nothing written."""

import math
import os
import subprocess

import jax
import pytest
from runs import load_config_module, run, shipped_configs

from sao_jax.train import configuration, trainer


def load_config(name="sao_tiny.py"):
  return load_config_module(name).get_config()


@pytest.mark.parametrize(
  "field,value",
  [
    ("rollout.slots", 0),
    ("rollout.slots", -3),
    ("rollout.max_len", 0),
    ("rollout.temperature", 0.0),
    ("rollout.env_workers", 0),
    ("rollout.queue_size", 0),
    ("rollout.top_k", 8),
    ("rollout.top_p", 0.9),
    ("rollout.max_turn_tokens", 10_000),
    ("rl.eps_low", 2.0),
    ("rl.eps_low", 0.0),
    ("rl.eps_high", -0.1),
    ("rl.critic_updates", -1),
    ("rl.critic_updates", 0),
    ("rl.batch_size", 0),
    ("rl.actor_lr", 0.0),
    ("rl.critic_lr", float("nan")),
    ("rl.lam", 1.5),
    ("rl.gamma", -0.1),
    ("rl.steps", -1),
    ("rl.sync_every", 0),
    ("sft.lr", float("inf")),
    ("sft.batch_size", 0),
    ("checkpoint.every", 0),
    ("data.buckets", (256, 128)),
    ("data.buckets", ()),
    ("data.buckets", (4, 256)),
    ("sharding.mesh", {"data": 3}),
    ("sharding.mesh", {"data": -1, "fsdp": -1}),
    ("sharding.mesh", {"data": 0}),
    ("faults.env_error_every", -1),
  ],
)
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


@pytest.mark.parametrize(
  "overrides,expect",
  [
    ({"num_layers": -1}, "model.overrides.num_layers = -1: must be"),
    ({"d_model": 0}, "model.overrides.d_model = 0: must be"),
    ({"num_heads": 3}, "model.overrides = {'num_heads': 3}: num_heads (3) must be a multiple"),
    ({"dense_layers": (7,)}, "model.overrides = {'dense_layers': (7,)}: dense_layers"),
  ],
)
def test_bad_model_override_is_one_line_naming_it(overrides, expect, tmp_path):
  c = load_config()
  c.model.overrides = overrides
  with pytest.raises(configuration.ConfigError) as e:
    configuration.validate(c, num_devices=8)
  assert str(e.value).startswith(expect) and "\n" not in str(e.value), str(e.value)
  with pytest.raises(configuration.ConfigError):
    trainer.train(c, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


# Every built-in environment with a turn limit, and what else it needs to validate.
TURN_LIMITED = [
  ("python_tool", {}, "raw"),
  ("code_fix", {}, "raw"),
  ("math_tool", {}, "qwen3"),
  ("humaneval", {"tools": ("python",)}, "qwen3"),
  ("repo_repair", {}, "qwen3"),
]


@pytest.mark.parametrize("env,kwargs,chat_format", TURN_LIMITED)
@pytest.mark.parametrize("max_turns", [-1, 0, 10**6, 2.5])
def test_every_environments_max_turns_is_bounded(env, kwargs, chat_format, max_turns):
  c = load_config()
  c.env.name, c.env.chat_format = env, chat_format
  c.env.kwargs = dict(kwargs, max_turns=max_turns)
  c.env.tokenizer = "qwen3" if chat_format == "qwen3" else c.env.tokenizer
  with pytest.raises(configuration.ConfigError) as e:
    configuration.validate(c, num_devices=8)
  assert str(e.value).startswith(
    f"env.kwargs.max_turns = {max_turns!r}: must be an integer in [1, {c.rollout.max_len}]"
  ), str(e.value)
  c.env.kwargs = dict(kwargs, max_turns=c.rollout.max_len)  # the bound itself is valid
  configuration.validate(c, num_devices=8)


@pytest.mark.parametrize(
  "field,value",
  [
    ("rollout.slots", 10**9),
    ("eval.slots", 10**9),
    ("rollout.queue_size", 10**9),
    ("rl.batch_size", 10**9),
    ("sft.batch_size", 10**9),
    ("value_pretrain.num_trajectories", 10**9),
    ("model.overrides", {"d_model": 2**20, "moe_d_ff": 2**16}),  # ~300 TiB of train state
    ("rollout.decode_steps", 10**6),
    ("eval.decode_steps", 10**6),
  ],
)
def test_sizes_beyond_the_machine_are_one_line_before_anything(field, value, tmp_path):
  """Each would end in an allocation the host cannot make (or, today, train
  on): refused from shapes, before the first allocation and the workdir."""
  c = load_config()
  c.sharding.mesh = {"data": 8}
  c.env.allow_unisolated = True  # the run is refused before any code runs
  configuration.set_field(c, field, value)
  workdir = tmp_path / "run"
  with pytest.raises(configuration.ConfigError) as e:
    trainer.train(c, str(workdir))
  message = str(e.value)
  assert message.startswith(f"{field} = ") and "must be" in message, message
  assert "\n" not in message
  assert not workdir.exists()


def test_memory_bound_is_the_last_size_that_fits(monkeypatch):
  """With the host's memory set to 1 GiB, rollout.slots' bound is the slots
  whose KV cache fits beside the train state: the bound passes, one more fails.
  Oracle: the cache of one slot by hand, the state as 8 data-parallel replicas."""
  from sao_jax.config import sections
  from sao_jax.models import sharding
  from sao_jax.train import factories

  c = load_config()
  c.sharding.mesh = {"data": 8}
  typed = sections.load(c)
  model_cfg = factories.build_model_config(typed)
  programs = factories.build_programs(
    typed, model_cfg, factories.step_config(typed), sharding.make_mesh({"data": 8})
  )
  state = 8 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(programs.abstract_state))
  m = model_cfg
  per_slot = m.num_layers * 2 * typed.rollout.max_len * m.num_kv_heads * m.head_dim * 4
  monkeypatch.setattr(configuration, "host_memory_bytes", lambda: 2**30)
  most = (2**30 - state) // per_slot
  for slots, fits in ((most, True), (most + 1, False)):
    checked = typed.replace(rollout=typed.rollout.replace(slots=slots))
    if fits:
      configuration.check_memory(checked, model_cfg, programs.abstract_state)
    else:
      with pytest.raises(
        configuration.ConfigError, match=f"rollout.slots = {slots}: must be <= {most} here"
      ):
        configuration.check_memory(checked, model_cfg, programs.abstract_state)


class _Accelerator:
  """A device as check_memory reads one: its platform and memory statistics."""

  platform = "gpu"

  def __init__(self, limit):
    self.limit = limit

  def memory_stats(self):
    if self.limit is None:
      raise RuntimeError("no memory statistics on this backend")
    return {"bytes_limit": self.limit}


def test_accelerator_memory_is_the_tightest_devices_limit(monkeypatch):
  monkeypatch.setattr(configuration, "host_memory_bytes", lambda: 10**6)
  device_pool, host_pool = configuration.memory_pools({_Accelerator(100): 30, _Accelerator(80): 40})
  capacity, used, spread, _ = device_pool
  assert (capacity - used, used, spread) == (40, 40, 2)  # 80 - 40 left on the second
  assert host_pool[:3] == (10**6, 0, 1)  # the train state is not in host memory
  assert configuration.memory_pools({_Accelerator(None): 1})[0][0] is None  # unknown: no bound


def test_every_shipped_config_is_valid_and_locked():
  for name in shipped_configs():
    c = load_config(name)
    # The pod configs' meshes name their slice (128 chips of a v5p-256).
    fixed = math.prod(v for v in dict(c.sharding.mesh).values() if v > 0)
    configuration.validate(c, num_devices=8 if fixed <= 8 else 128)
    with pytest.raises(AttributeError):
      c.rl.stepz = 3  # a misspelt field cannot be added


@pytest.mark.parametrize(
  "flag,expect",
  [
    ("--config.rl.stepz=3", "stepz"),
    ("--config.rollout.slots=0", "rollout.slots = 0"),
    ("--config.rl.eps_low=2", "rl.eps_low = 2"),
    ("--config.sharding.mesh={'data': 3}", "sharding.mesh"),
  ],
)
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
  if (
    os.geteuid() != 0
    or subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
    ).returncode
    != 0
  ):
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
