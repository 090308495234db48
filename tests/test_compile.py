"""launch/compile.py: the trainer's and the engine's programs compiled for a TPU topology here.

The TPU compiler (libtpu, the `aot` extra that `make test` installs) runs
on this CPU host for a topology it only knows by name (docs/DESIGN.md section
8). These tests compile every program of a reduced config -- the tiny
model under the pod config's sharding rules on a 4-chip v5e mesh -- and
check what the script reports, that a program which cannot fit fails the
run with the compiler's own message, and that a topology the config's mesh
does not match is refused in one line. The script runs in a subprocess, as
it would be run: absl flags, libtpu's initialisation and the exit status
are part of what is tested.

Without libtpu there is nothing to compile with; the tests are then
skipped with a loud reason instead of passing silently.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "compile.py")
PROGRAMS = ("sft", "value", "rl", "prefill", "decode", "decode_loop")
GIB = 2**30

pytestmark = pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None,
  reason="NOT TESTED: libtpu (the TPU compiler) is not installed, so launch/compile.py "
  "cannot compile anything; install the aot extra: pip install -e '.[aot]' (make test does)",
)

# The tiny model with the pod config's rules (fsdp / expert axes) on a mesh
# of 4 chips, small rollout shapes; --rows / --length shrink the batches.
CONFIG = textwrap.dedent('''\
    """Tiny model, configs/sao_moe.py's sharding rules, a 4-chip mesh."""
    from configs import common
    from configs import sao_moe


    def get_config(arg=None):
      c = common.get_config()
      c.sharding.mesh = {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1}
      c.sharding.rules = sao_moe.POD_RULES
      c.rollout.slots = 4
      c.rollout.max_len = 64
      return c
    ''')


def run_compile(tmp_path, *args, timeout=600):
  """(exit status, stdout, stderr, the --out JSON or None) of one launch."""
  config = tmp_path / "tiny_pod.py"
  config.write_text(CONFIG)
  out = tmp_path / "compile.json"
  if out.exists():
    out.unlink()
  cmd = [sys.executable, SCRIPT, f"--config={config}", f"--out={out}", *args]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
  result = json.loads(out.read_text()) if out.exists() else None
  return proc.returncode, proc.stdout, proc.stderr, result


def test_every_program_compiles_and_fits(tmp_path):
  rc, stdout, stderr, result = run_compile(
    tmp_path, "--topology=v5e-4", "--rows=4", "--length=64", "--config.model.overrides.num_layers=1"
  )
  assert rc == 0, stdout[-3000:] + stderr[-3000:]
  # The Cloud TPU name maps to libtpu's, and the config's mesh is laid on it.
  assert result["topology"]["libtpu_name"] == "v5e:2x2"
  assert result["topology"]["devices"] == 4
  assert result["topology"]["device_kind"] == "TPU v5 lite"
  assert result["topology"]["hbm_bytes"] == pytest.approx(15.75 * GIB)
  assert result["mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1}
  assert result["model"]["num_layers"] == 1  # the override reached the model
  assert result["rollout_engine"] == "1 chip"
  assert result["ok"] is True
  assert set(result["programs"]) == set(PROGRAMS)
  # decode_loop: the driver's decode, at the config's rollout.decode_steps (1).
  shapes = {
    "sft": "4x64",
    "value": "4x64",
    "rl": "4x64 K=2",
    "prefill": "4x64, cache 4x64",
    "decode": "4x1, cache 4x64",
    "decode_loop": "4x1 x 1 steps, cache 4x64",
  }
  for name, row in result["programs"].items():
    assert row["status"] == "FITS" and row["fits"], row
    assert row["shape"].startswith(shapes[name]), row
    assert row["compile_s"] > 0
    for k in ("argument_bytes", "output_bytes", "total_bytes"):
      assert row[k] > 0, (name, k)
    # Every program donates its state (train steps) or its cache (engine).
    assert row["alias_bytes"] > 0, name
    assert row["temp_bytes"] >= 0
    assert row["total_bytes"] == (
      row["argument_bytes"]
      + row["output_bytes"]
      - row["alias_bytes"]
      + row["temp_bytes"]
      + row["code_bytes"]
    )
    # The bound: ~0.1M parameters (policy + critic + two Adam moments each,
    # a few MiB) and [4, 64] batches need a few MiB; 256 MiB per chip leaves
    # room for the compiler's scratch and still catches a program that
    # replicates or materialises something it should not.
    assert row["total_bytes"] < 256 * 2**20, (name, row["total_bytes"])
    assert row["headroom"] > 0.9
  # The precision line: the tiny config trains and serves float32, so one
  # version moves the master weights' bytes.
  prec = result["precision"]
  assert (prec["param_dtype"], prec["compute_dtype"], prec["serving_dtype"]) == ("float32",) * 3
  assert prec["version_bytes"] == prec["master_bytes"] > 0
  assert "[compile] precision: float32 master weights" in stdout
  # What crosses chips: the RL step reduces its fsdp-sharded gradients, and
  # in an fp32 program every sum across chips is f32. (Its weight
  # all-gathers are bf16: at default precision the TPU compiler feeds f32
  # matmuls bf16 operands, and gathers them so.)
  coll = result["programs"]["rl"]["collectives"]
  reductions = {op: coll[op] for op in ("all-reduce", "reduce-scatter") if op in coll}
  assert reductions, coll
  for op, by_dtype in reductions.items():
    assert "f32" in by_dtype and {"bf16", "f16"}.isdisjoint(by_dtype), (op, by_dtype)
  for op, by_dtype in coll.items():
    assert all(v["count"] > 0 and v["bytes"] > 0 for v in by_dtype.values()), (op, by_dtype)
  # The engine's KV capacity: a dense cache holds slots x max_len live tokens.
  pool = result["rollout_pool"]
  assert (pool["kind"], pool["live_tokens"], pool["fraction_of_dense"]) == ("dense", 256, 1.0)
  assert pool["groups"] == 1 and pool["max_len_trajectories_per_group"] == 4.0
  assert "rollout KV dense: 256 live tokens, 1.000 of slots x max_len (4 x 64)" in stdout
  # One table row per program, and progress lines while compiling.
  for name in PROGRAMS:
    assert f"[compile] {name}" in stdout
    assert any(
      line.startswith(name) and line.rstrip().endswith("FITS") for line in stdout.splitlines()
    ), name


def test_colocated_engine_is_added_to_the_train_step(tmp_path):
  # rollout.sharded_engine on the trainer's own mesh: the engine's params and
  # cache stay on the chips while the train step runs, and the run says so.
  rc, stdout, stderr, result = run_compile(
    tmp_path,
    "--topology=v5e-4",
    "--programs=rl,decode",
    "--rows=4",
    "--length=64",
    "--config.rollout.sharded_engine=True",
    "--config.model.overrides.num_layers=1",
  )
  assert rc == 0, stdout[-3000:] + stderr[-3000:]
  assert result["rollout_engine"].startswith("mesh ")
  assert set(result["programs"]) == {"rl", "decode", "rl+eng"}
  rl, decode, both = (result["programs"][n] for n in ("rl", "decode", "rl+eng"))
  assert both["computed"] and both["fits"]
  assert both["total_bytes"] == rl["total_bytes"] + decode["argument_bytes"]
  assert both["headroom"] == pytest.approx(1 - both["total_bytes"] / both["hbm_bytes"])
  assert any(line.startswith("rl+eng") for line in stdout.splitlines())
  # A colocated engine swaps in place: no direct path, no double-buffer rows.
  assert not any(n.endswith(("+next", "+snapshot")) for n in result["programs"])


def test_paged_engine_compiles(tmp_path):
  # rollout.kv_cache "paged" on the colocated engine: the pool of pages and
  # the page table; head_dim 128 so the decode step takes the Pallas
  # paged-attention kernel (under shard_map), prefill the gather path.
  rc, stdout, stderr, result = run_compile(
    tmp_path,
    "--topology=v5e-4",
    "--programs=prefill,decode,decode_loop",
    "--config.rollout.sharded_engine=True",
    "--config.rollout.kv_cache=paged",
    "--config.model.overrides.head_dim=128",
    "--config.model.overrides.num_layers=1",
  )
  assert rc == 0, stdout[-3000:] + stderr[-3000:]
  assert set(result["programs"]) == {"prefill", "decode", "decode_loop"}
  for r in result["programs"].values():
    assert (
      r["fits"]
      and ("cache 4x64 paged: 16 pages of 16 = 256 live tokens (1.000 of slots x max_len), mesh")
      in r["shape"]
    )
  # kv_pages 0: the dense size; the 4 slots split over the 4 chips, one a group.
  pool = result["rollout_pool"]
  assert (pool["kind"], pool["pages"], pool["page_size"], pool["live_tokens"]) == (
    "paged",
    16,
    16,
    256,
  )
  assert (pool["groups"], pool["slots_per_group"], pool["live_tokens_per_group"]) == (4, 1, 64)
  assert pool["bytes_per_device"] <= result["programs"]["decode"]["argument_bytes"]


def test_the_rollout_slice_compiles_on_its_own_topology(tmp_path):
  # The trainer's RL step on its 4 chips and the engine on a slice of 8 with
  # a mesh of its own, in one run: 16 slots in 8 groups of 2 paging into a
  # pool of half their dense cache (4 pages a group: one max_len trajectory).
  rc, stdout, stderr, result = run_compile(
    tmp_path,
    "--topology=v5e-4",
    "--rollout_topology=v5e-8",
    "--config.rollout.mesh=data:-1",
    "--programs=rl,decode",
    "--rows=4",
    "--length=64",
    "--config.rollout.sharded_engine=True",
    "--config.rollout.slots=16",
    "--config.rollout.kv_cache=paged",
    "--config.rollout.kv_pages=32",
    "--config.model.overrides.num_layers=1",
  )
  assert rc == 0, stdout[-3000:] + stderr[-3000:]
  assert result["rollout_topology"]["libtpu_name"] == "v5e:2x4"
  assert result["rollout_engine"] == "mesh {'data': 8}"
  rl, decode = result["programs"]["rl"], result["programs"]["decode"]
  assert (rl["topology"], decode["topology"]) == ("v5e:2x2", "v5e:2x4")
  assert "rl+eng" not in result["programs"]  # the engine is not on the trainer's chips
  assert set(result["programs"]) == {"rl", "decode", "decode+next", "rl+snapshot"}
  pool = result["rollout_pool"]
  assert (pool["live_tokens"], pool["dense_tokens"], pool["fraction_of_dense"]) == (512, 1024, 0.5)
  assert (pool["groups"], pool["slots_per_group"], pool["pages_per_group"]) == (8, 2, 4)
  assert pool["max_len_trajectories_per_group"] == 1.0
  assert (
    "rollout KV paged: 32 pages of 16 = 512 live tokens, 0.500 of slots x max_len "
    "(16 x 64), 8 slot groups of 2 slots: 64 a group; 1.00 max_len trajectories a group"
  ) in stdout
  assert "= 512 live tokens (0.500 of slots x max_len)" in decode["shape"]
  assert "rollout KV paged" in result["table"]
  # The direct weight path's plan: a version is the engines' copy, pulled
  # once per engine over its 8 chips, from the trainer's one host.
  transfer = result["transfer"]
  assert transfer["version_bytes"] == result["precision"]["version_bytes"]
  assert transfer["bytes_per_rollout_engine"] == transfer["version_bytes"]
  assert (transfer["destination_devices"], transfer["trainer_hosts"]) == (8, 1)
  assert transfer["max_bytes_per_trainer_host"] == transfer["version_bytes"]
  assert "[compile] transfer: one version " in stdout
  # The direct path's double buffers in the fit: the engine step beside the
  # next version's standby copy, the RL step beside the served snapshots.
  nxt, snap = result["programs"]["decode+next"], result["programs"]["rl+snapshot"]
  assert nxt["computed"] and nxt["fits"] and nxt["topology"] == "v5e:2x4"
  assert nxt["total_bytes"] == decode["total_bytes"] + transfer["standby_bytes_per_rollout_device"]
  assert transfer["standby_bytes_per_rollout_device"] > 0
  assert snap["total_bytes"] == (
    rl["total_bytes"] + 2 * transfer["snapshot_bytes_per_trainer_device"]
  )
  assert snap["headroom"] == pytest.approx(1 - snap["total_bytes"] / snap["hbm_bytes"])
  assert any(line.startswith("rl+snapshot") for line in stdout.splitlines())
  # The RL step's time from its own cost_analysis() at v5e's peak, and a
  # version's seconds into the one 8-chip host: 200 Gbps line rate.
  step, version = result["step_time"], result["version_time"]
  assert step["available"] and step["device"] == "v5e" and step["mfu"] == 0.4
  assert step["flops_per_chip"] > 0 and step["bytes_accessed_per_chip"] > 0
  assert step["seconds"] == pytest.approx(
    max(step["flops_per_chip"] / (0.4 * 197e12), step["bytes_accessed_per_chip"] / 819e9)
  )
  assert step["while_loops"] >= 1 and step["lower_bound"]  # the K critic updates' loop
  assert version["rollout_hosts_per_engine"] == 1
  assert version["bytes_per_rollout_host"] == transfer["bytes_per_rollout_engine"]
  assert version["seconds_line_rate"] == pytest.approx(transfer["version_bytes"] / 25e9)
  assert version["lag_steps_tcp"] == pytest.approx(version["seconds_tcp"] / step["seconds"])
  assert "[compile] step time: RL step " in stdout and "policy lag" in stdout
  # Beside it, the step counted from the model's shape, over the trainer's chips.
  analytic = step["analytic"]
  assert analytic["available"] and analytic["flops"]["total"] > 0
  assert analytic["seconds"] == pytest.approx(
    analytic["flops"]["total"] / result["topology"]["devices"] / (0.4 * 197e12)
  )
  assert version["lag_steps_tcp_analytic"] == pytest.approx(
    version["seconds_tcp"] / analytic["seconds"]
  )
  assert "counted from the model's shape" in stdout


def test_an_engine_whose_slots_do_not_split_is_refused_in_one_line(tmp_path):
  # Colocated on the trainer's 4 chips, 2 slots cannot split 4 ways.
  rc, stdout, stderr, _ = run_compile(
    tmp_path,
    "--topology=v5e-4",
    "--programs=decode",
    "--config.rollout.slots=2",
    "--config.rollout.sharded_engine=True",
    "--config.model.overrides.num_layers=1",
  )
  assert rc == 2, stdout[-2000:] + stderr[-2000:]
  error = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
  assert len(error) == 1 and "Traceback" not in stderr, stderr[-2000:]
  assert "the trainer's mesh (colocated)" in error[0] and "--rollout_topology" in error[0]


def test_what_does_not_fit_fails_the_run_with_the_reason(tmp_path):
  # sft at 2048 rows x 4096 tokens materialises ~270 GB of attention logits
  # per chip: the TPU compiler refuses it. decode (the engine sharded over
  # the 4 chips this time) fits, but not with all of HBM to spare.
  rc, stdout, stderr, result = run_compile(
    tmp_path,
    "--topology=v5e:2x2",
    "--programs=sft,decode",
    "--rows=2048",
    "--length=4096",
    "--min_headroom=1.0",
    "--rollout_mesh=data:4",
  )
  assert rc == 1, stdout[-3000:] + stderr[-3000:]
  assert "error: does not fit v5e:2x2" in stderr
  assert result["ok"] is False and set(result["programs"]) == {"sft", "decode"}
  sft = result["programs"]["sft"]
  assert sft["status"] == "DOES NOT FIT" and not sft["fits"]
  assert "Ran out of memory" in sft["message"], sft["message"]
  assert sft["required_bytes"] > sft["hbm_bytes"]
  assert sft["compiler_hbm_bytes"] == pytest.approx(15.75 * GIB, rel=1e-3)
  decode = result["programs"]["decode"]
  assert result["rollout_engine"] == "mesh {'data': 4}"
  assert decode["status"] == "DOES NOT FIT" and decode["total_bytes"] > 0
  assert "less than --min_headroom=100%" in decode["message"]


def test_a_topology_the_mesh_does_not_fit_is_refused_in_one_line(tmp_path):
  # v5p names count TensorCores: v5p-128 is 64 chips (4x4x4), and the pod
  # config's mesh (fsdp 16 x expert 8) needs a multiple of 128.
  config = os.path.join(ROOT, "configs", "sao_moe.py")
  proc = subprocess.run(
    [sys.executable, SCRIPT, f"--config={config}", "--topology=v5p-128"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
  error = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
  assert len(error) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert "v5p:4x4x4" in error[0] and "64 devices" in error[0] and "two per chip" in error[0]


@pytest.mark.slow  # tests/models/test_action_logits.py checks the head at action tokens on CPU
def test_the_head_at_action_tokens_compiles_at_its_widest(tmp_path):
  """With data.logits_at_actions the RL batch carries action_index at its
  widest (A = L), as the trainer packs it for the head at action tokens."""
  args = (
    "--topology=v5e-4",
    "--rows=4",
    "--length=64",
    "--programs=rl",
    "--config.model.overrides.num_layers=1",
  )
  rows = {}
  for flag in (False, True):
    rc, stdout, stderr, result = run_compile(
      tmp_path, *args, f"--config.data.logits_at_actions={flag}"
    )
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    rows[flag] = result["programs"]["rl"]
    assert rows[flag]["fits"]
  # The same program but for action_index, [4, 64] int32: a chip holds part of it.
  assert 0 < rows[True]["argument_bytes"] - rows[False]["argument_bytes"] <= 4 * 64 * 4


def test_routing_replay_compiles_with_its_batch_and_the_recording_engine(tmp_path):
  """rl.routing_replay: the RL batch carries routing [R, L, M, k] int16 (as
  packing builds it) and the RL step and the recording engine's decode loop
  (which returns the fed tokens' choices) compile and fit."""
  rc, stdout, stderr, result = run_compile(
    tmp_path,
    "--topology=v5e-4",
    "--rows=4",
    "--length=64",
    "--programs=rl,decode_loop",
    "--config.model.overrides.num_layers=1",
    "--config.rl.routing_replay=True",
  )
  assert rc == 0, stdout[-3000:] + stderr[-3000:]
  assert result["programs"]["rl"]["fits"] and result["programs"]["decode_loop"]["fits"]
  # abstract_batch's fields and dtypes: packing's, routing [R, L, M, k] int16.
  from sao_jax.data import packing

  example = packing.pack([], 1, (8,), routing=(1, 2))  # one MoE layer, top-2
  assert example["routing"].shape == (1, 8, 1, 2) and example["routing"].dtype == "int16"
  assert "[compile] rl: compiled" in stdout


def test_a_dense_scanned_model_compiles_on_one_chip(tmp_path):
  """The dense family on a single-chip slice (Colab's v5e-1): libtpu's host
  is set to the slice's one chip, and the dense stack compiles as one scan."""
  config = tmp_path / "tiny_dense.py"
  config.write_text(
    textwrap.dedent('''\
      """A tied dense Qwen3 toy, scanned, on one chip."""
      from configs import common


      def get_config(arg=None):
        c = common.get_config()
        c.model.preset = "tiny_dense"
        c.model.overrides = {"scan_layers": True, "remat": "full"}
        c.sharding.mesh = {"data": 1}
        c.rollout.slots = 4
        c.rollout.max_len = 64
        return c
      ''')
  )
  out = tmp_path / "compile.json"
  proc = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      f"--config={config}",
      f"--out={out}",
      "--topology=v5e-1",
      "--programs=rl,decode",
      "--rows=2",
      "--length=64",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["ok"] and set(result["programs"]) == {"rl", "decode"}
  assert "v5e:1x1" in proc.stdout and "1 x TPU v5 lite" in proc.stdout
  assert all(p["fits"] for p in result["programs"].values())


# Rank 2 on the tiny model's width 64: rank 16 would be a quarter of the width,
# and the adapters of weights the tiny config does not shard are replicated.
LORA = (
  "--config.lora.enabled=True",
  "--config.lora.rank=2",
  "--config.lora.base_dtype=bfloat16",
  "--topology=v5e-4",
  "--rows=4",
  "--length=64",
  "--config.model.overrides.num_layers=1",
)


def _actor_adapters(config) -> int:
  """The actor's adapter parameters under LORA's rank (shapes only)."""
  import jax

  from sao_jax.config import sections
  from sao_jax.models import lora, policy
  from sao_jax.train import factories

  params = jax.eval_shape(
    lambda: policy.init_params(factories.build_model_config(config), jax.random.key(0))
  )
  actor = lora.LoraConfig(2, 32.0, sections.LORA_ACTOR_TARGETS)
  return lora.count(
    jax.eval_shape(lambda p: lora.init_adapters(p, actor, jax.random.key(0)), params)
  )


def _optimizer_bytes_per_chip(config) -> int:
  """The Adam moments a chip holds (shapes only: CPU devices, the config's mesh)."""
  import jax

  from sao_jax.models import sharding
  from sao_jax.train import factories

  model_cfg = factories.build_model_config(config)
  mesh = sharding.make_mesh(dict(config.sharding.mesh), devices=jax.devices()[:4])
  s = factories.build_programs(
    config, model_cfg, factories.step_config(config), mesh
  ).abstract_state
  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for x in jax.tree.leaves((s.policy_opt, s.critic_opt))
  )


def test_a_lora_config_compiles_with_its_bases(tmp_path):
  """With lora.enabled each step takes the frozen bases as its last argument:
  the SFT step compiles with them (tests/test_compile.py's slow LoRA test
  compiles all three), the header and the JSON say LoRA, and the state a chip
  holds is the adapters, its Adam moments a fraction of the full model's.
  Beside the engine's programs a fleet rollout's merge at a swap compiles
  (`aot_programs.merge_program`), and the transfer is the actor's adapters
  in float32, the bytes a LoRA version crosses."""
  rc, stdout, stderr, result = run_compile(tmp_path, *LORA, "--programs=sft,decode")
  assert rc == 0, stdout[-3000:] + stderr[-3000:]
  assert list(result["programs"]) == ["sft", "decode", "merge"]
  assert all(row["fits"] for row in result["programs"].values())
  assert result["programs"]["merge"]["shape"] == "adapters onto the bfloat16 base, mesh {'data': 1}"
  lora_s, res = result["lora"], result["resident"]
  from sao_jax.config import sections

  assert (lora_s["rank"], lora_s["alpha"], lora_s["base_dtype"]) == (2, 32.0, "bfloat16")
  assert tuple(lora_s["actor_targets"]) == sections.LORA_ACTOR_TARGETS
  assert "[compile] trainer: LoRA rank 2 (alpha 32)" in stdout and "bfloat16 base" in stdout
  # The trainer holds the state (adapters, moments) and the bf16 base beside it;
  # the engines serve the merged params in the base's dtype.
  assert res["resident_bytes_per_chip"] == res["state_bytes_per_chip"] + res["base_bytes_per_chip"]
  assert res["base_bytes_per_chip"] > 0
  assert result["precision"]["param_dtype"] == "bfloat16"
  ns: dict = {}
  exec(CONFIG, ns)  # noqa: S102
  config = ns["get_config"]()
  config.model.overrides = {"num_layers": 1}
  full = _optimizer_bytes_per_chip(config)
  assert 0 < res["optimizer_bytes_per_chip"] < full / 4, (res, full)
  assert result["transfer"]["version_bytes"] == 4 * _actor_adapters(config)


@pytest.mark.slow  # its default-run ground: test_a_lora_config_compiles_with_its_bases
def test_every_lora_step_compiles_and_the_shared_trunk_counts_once(tmp_path):
  """sft, value and rl compile with the bases, the engine on the merged params;
  the RL step reads both bases, the critic's trunk being the policy base's
  arrays: passed once, its argument bytes exceed the value step's (the critic
  base) by the policy's own leaves and the batch's extra fields, far less
  than a second copy of the base."""
  rc, stdout, stderr, result = run_compile(tmp_path, *LORA, "--programs=sft,value,rl,decode")
  assert rc == 0, stdout[-3000:] + stderr[-3000:]
  rows = result["programs"]
  assert all(rows[n]["fits"] for n in ("sft", "value", "rl", "decode")), rows
  assert rows["rl"]["alias_bytes"] > 0 and rows["sft"]["alias_bytes"] > 0  # donated state
  extra = rows["rl"]["argument_bytes"] - rows["value"]["argument_bytes"]
  assert 0 < extra < result["resident"]["base_bytes_per_chip"], (extra, result["resident"])
