"""Export to a Hugging Face Qwen3-MoE directory: the round trip through import, the
streaming bound, the refusals (non-finite values, non-parameter leaves), and an
export from two processes whose params no process holds whole."""

import dataclasses
import json
import os
import socket
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from sao_jax.models import config as model_config
from sao_jax.models import hf_export, hf_import, hf_layout, policy

TINY = model_config.tiny(96)


def _equal(a, b):
  return jax.tree.all(
    jax.tree.map(
      lambda x, y: x.shape == y.shape and bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b
    )
  )


def random_params(cfg, head="lm", seed=0):
  """Random weights in the model's shapes (from `eval_shape`: no init compile)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda s: (0.1 * rng.standard_normal(s.shape)).astype(np.float32),
    jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0), head)),
  )


@pytest.fixture(scope="module")
def params():
  return random_params(TINY)


def test_float32_export_imports_back_exactly_in_several_shards(params, tmp_path):
  stats = hf_export.export_params(
    params, TINY, str(tmp_path / "m"), dtype="float32", shard_bytes=64 * 1024
  )
  out = tmp_path / "m"
  assert len(stats["files"]) > 1 and sorted(os.listdir(out)) == sorted(
    stats["files"] + ["config.json", hf_export.INDEX, "sao_jax_export.json"]
  )
  index = json.loads((out / hf_export.INDEX).read_text())
  assert set(index["weight_map"].values()) == set(stats["files"])
  # Each shard holds what the index says, and no more than the shard size
  # (no single tensor of the tiny model is larger).
  for file in stats["files"]:
    header, _ = hf_import.read_safetensors_header(str(out / file))
    assert {n for n, f in index["weight_map"].items() if f == file} == set(header)
    assert sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values()) <= 64 * 1024
  cfg = hf_import.config_from_hf(str(out))
  assert cfg == TINY
  assert _equal(hf_import.load_hf_checkpoint(str(out), cfg), params)


def test_default_bf16_export_holds_the_rounded_weights_and_nothing_else(params, tmp_path):
  stats = hf_export.export_params(params, TINY, str(tmp_path / "m"))
  out = tmp_path / "m"
  names = set()
  for file in stats["files"]:
    header, _ = hf_import.read_safetensors_header(str(out / file))
    assert {e["dtype"] for e in header.values()} == {"BF16"}
    names |= set(header)
  # Exactly the layout's tensors: no optimizer moment, no stray leaf.
  want = {n for t in hf_layout.top_tensors(TINY) for n in t.hf}
  want |= {
    n for i in range(TINY.num_layers) for t in hf_layout.layer_tensors(TINY, i) for n in t.hf
  }
  assert names == want
  assert stats["bytes"] == 2 * sum(x.size for x in jax.tree.leaves(params))
  assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
  rounded = jax.tree.map(
    lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), params
  )
  assert _equal(hf_import.load_hf_checkpoint(str(out), TINY), rounded)


def test_scanned_sharded_params_stream_one_layer_at_a_time(params, tmp_path):
  """Stacked [n, ...] params are gathered one layer's slice at a time, from any
  sharding: the host never holds a whole stacked leaf."""
  scfg = dataclasses.replace(TINY, scan_layers=True)
  scanned = policy.scan_params(scfg, params)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("expert",))
  spec = lambda x: (
    jax.sharding.PartitionSpec(None, "expert") if x.ndim == 4 else (jax.sharding.PartitionSpec())
  )
  placed = jax.tree.map(
    lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec(x))), scanned
  )
  stats = hf_export.export_params(placed, scfg, str(tmp_path / "m"), dtype="float32")
  largest_stacked = max(x.nbytes for x in jax.tree.leaves(scanned["layers"]))
  largest_slice = max(x.nbytes // x.shape[0] for x in jax.tree.leaves(scanned["layers"]))
  # One float32 slice plus its cast copy, never the stacked leaf.
  assert stats["peak_host_bytes"] == 2 * max(largest_slice, scanned["embed"].nbytes)
  assert largest_slice < largest_stacked
  # The directory is the same as the unscanned export's: import either way.
  assert _equal(hf_import.load_hf_checkpoint(str(tmp_path / "m"), TINY), params)
  assert _equal(hf_import.load_hf_checkpoint(str(tmp_path / "m"), scfg), scanned)


def test_value_model_round_trip(tmp_path):
  critic = random_params(TINY, "value", seed=2)
  hf_export.export_params(
    critic,
    TINY,
    str(tmp_path / "v"),
    dtype="float32",
    head="value",
    notes={"value_head": hf_export.VALUE_HEAD_NOTE},
  )
  config = json.loads((tmp_path / "v" / "config.json").read_text())
  assert config["architectures"] == ["Qwen3MoeForTokenClassification"]
  assert config["num_labels"] == 1
  assert _equal(hf_import.load_hf_checkpoint(str(tmp_path / "v"), TINY, head="value"), critic)


def test_non_finite_values_are_refused_and_leave_no_directory(params, tmp_path):
  bad = jax.tree.map(np.asarray, params)
  bad["layer_1"]["moe"]["wo"] = bad["layer_1"]["moe"]["wo"].copy()
  bad["layer_1"]["moe"]["wo"][2, 3, 4] = np.nan
  with pytest.raises(hf_export.ExportError, match=r"layer_1/moe/wo: 1 non-finite .* params"):
    hf_export.export_params(bad, TINY, str(tmp_path / "m"))
  assert not os.listdir(tmp_path)  # neither m nor m.partial
  # A value the target dtype cannot hold becomes inf in the cast: refused too.
  big = jax.tree.map(np.asarray, params)
  big["embed"] = big["embed"] * 0 + 1e5
  with pytest.raises(hf_export.ExportError, match="embed: .* after the cast to float16"):
    hf_export.export_params(big, TINY, str(tmp_path / "m"), dtype="float16")
  assert not os.listdir(tmp_path)


def test_leaves_that_are_not_model_params_are_refused(params, tmp_path):
  with pytest.raises(hf_export.ExportError, match="not exportable.*mu"):
    hf_export.export_params(dict(params, mu=params["embed"]), TINY, str(tmp_path / "m"))
  with pytest.raises(hf_export.ExportError, match="dtype = 'int8'"):
    hf_export.export_params(params, TINY, str(tmp_path / "m"), dtype="int8")
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("")
  with pytest.raises(hf_export.ExportError, match="not empty"):
    hf_export.export_params(params, TINY, str(tmp_path / "full"))


def export_worker(out, process_id, port):
  """One of two processes (2 CPU devices each): params sharded over all 4 devices,
  so no process can read a whole parameter; both call the export."""
  import jax

  jax.distributed.initialize(
    coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id
  )
  params = random_params(TINY)  # the same values in both processes (seeded)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("expert",))

  def place(x):
    spec = jax.sharding.PartitionSpec("expert" if x.shape[0] % 4 == 0 else None)
    return jax.make_array_from_callback(
      x.shape, jax.sharding.NamedSharding(mesh, spec), lambda index: x[index]
    )

  placed = jax.tree.map(place, params)
  assert not placed["embed"].is_fully_addressable
  stats = hf_export.export_params(placed, TINY, out, dtype="float32")
  # One unit at a time on every process, the largest [4, 64, 64] MoE matrix
  # (float32 and its cast): never the model.
  assert stats["peak_host_bytes"] == 2 * 4 * 64 * 64 * 4


def test_two_processes_export_what_neither_holds_whole(tmp_path):
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    port = sock.getsockname()[1]
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  path = os.pathsep.join(
    [root, os.path.join(root, "tests"), os.path.dirname(os.path.abspath(__file__))]
  )
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=path,
    XLA_FLAGS="--xla_force_host_platform_device_count=2",
  )
  code = (
    "import sys, test_hf_export as t; t.export_worker(sys.argv[1], int(sys.argv[2]), "
    "int(sys.argv[3]))"
  )
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", code, str(tmp_path / "m"), str(i), str(port)],
      env=env,
      cwd=root,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  for p in procs:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
  # Process 0 wrote it; it holds exactly the params.
  assert _equal(hf_import.load_hf_checkpoint(str(tmp_path / "m"), TINY), random_params(TINY))
