"""Every config loads, names a valid arm, and states its launch command."""

import os

import jax
import numpy as np
import pytest
from runs import ROOT, load_config_module, shipped_configs

from sao_jax.models import policy
from sao_jax.train import factories

CONFIGS = [os.path.join(ROOT, "configs", n) for n in shipped_configs()]
# The pod presets (their configs validate on 128 chips, a v5p-256) and the
# parameter count each must reproduce: Qwen3-30B-A3B's 30.5B. Qwen3.5-35B-A3B's
# 34.66B is left to launch/compile.py's record (benchmarks/RESULTS.md): its
# abstract init traces the hybrid's forward, ~16 s here.
POD_PARAMS = {"qwen3_30b_a3b": (30.3e9, 30.7e9), "qwen3_5_35b_a3b": None}


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_is_valid(path):
  module = load_config_module(path)
  name = os.path.basename(path)
  assert f"--config=configs/{name}" in module.__doc__, "docstring must give the launch command"
  c = module.get_config()
  pod = c.model.preset in POD_PARAMS
  factories.validate_config(c, num_devices=128 if pod else 8)
  if pod:
    assert {r[0] for r in c.sharding.rules} >= {"batch", "embed", "expert", "heads", "vocab"}
  if POD_PARAMS.get(c.model.preset):
    low, high = POD_PARAMS[c.model.preset]
    cfg = factories.build_model_config(c)
    shapes = jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0)))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert low < total < high


def test_hybrid_pod_engine_splits_its_two_kv_heads_and_counts_the_slot_state():
  """configs/sao_qwen35_moe.py's engine on one v5p host (4 chips, abstract):
  its mesh splits the 2 kv heads over "tensor" 2, "tensor:4" is refused,
  and the pool's bytes a chip are the 10 full-attention layers' pages plus
  every slot's DeltaNet state, counted by hand."""
  from jax.sharding import AbstractMesh

  from sao_jax.config import sections
  from sao_jax.rollout import layout

  c = load_config_module("sao_qwen35_moe.py").get_config()
  cfg = factories.build_model_config(c)
  axes = sections.parse_mesh(c.rollout.mesh)
  mesh = AbstractMesh(tuple(axes.values()), tuple(axes))
  slots, pages, page = c.rollout.slots, c.rollout.kv_pages, c.rollout.page_size
  assert layout.batch_groups(mesh, layout.rollout_rules(mesh)) == 2
  kv = layout.pool_bytes_per_device(cfg, pages, page, mesh)
  with_state = layout.pool_bytes_per_device(cfg, pages, page, mesh, slots=slots)
  # 10 layers x (k, v) x pages x page x 2 kv heads x 256 x bf16, over 4 chips.
  assert kv == 10 * 2 * pages * page * 2 * 256 * 2 // 4
  # 30 layers x slots x a [32, 128, 128] fp32 state, over 4 chips; the conv
  # windows ([3, channels] a layer and slot) add a few percent.
  delta_rule = 30 * slots * 32 * 128 * 128 * 4 // 4
  assert delta_rule < with_state - kv < 1.05 * delta_rule
  tensor4 = AbstractMesh((4,), ("tensor",))
  with pytest.raises(ValueError, match="num_kv_heads 2 does not divide"):
    layout.pool_bytes_per_device(cfg, pages, page, tensor4, slots=slots)


def test_ablation_table_arms_all_have_configs():
  names = {os.path.basename(p)[:-3] for p in CONFIGS}
  assert {
    "sao_tiny",
    "sao_sync",
    "grpo",
    "grpo_dis",
    "running_mean",
    "sao_k1",
    "sao_no_freeze",
    "sao_token_gae",
    "sao_step_gae_mean",
    "sao_step_gae_last",
    "sao_moe",
  } <= names


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("model.preset", "huge", "model.preset"),
    ("rl.mode", "semi", "rl.mode"),
    ("rl.advantage", "gae", "rl.advantage = 'gae': must be one of"),
    ("rl.batch_size", 6, "multiple of"),
    ("data.buckets", (64,), "largest data.buckets"),
    ("rollout.swap_policy", "pause", "swap_policy"),
    ("rollout.kv_cache", "ragged", r"rollout.kv_cache = 'ragged': must be one of"),
    ("rollout.page_size", 0, "rollout.page_size = 0"),
    ("rollout.kv_pages", -1, "rollout.kv_pages = -1"),
    ("env.tool_latency_s", -0.5, r"env.tool_latency_s = -0.5: must be a finite number"),
    # A kill scheduled after the last RL step would never happen.
    (
      "faults.sigkill_after_rl_step",
      10**6,
      r"faults.sigkill_after_rl_step = 1000000: must be <= rl.steps",
    ),
  ],
)
def test_bad_config_fails_fast(field, value, message):
  c = load_config_module("grpo.py").get_config()
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(ValueError, match=message):
    factories.validate_config(c)


@pytest.mark.parametrize(
  "page_size,kv_pages,message",
  [
    (24, 0, "rollout.page_size = 24: must be a divisor of rollout.max_len"),
    (16, 8, "rollout.kv_pages = 8: must be 0 or >= rollout.max_len / rollout.page_size"),
  ],
)
def test_bad_paged_cache_fails_fast(page_size, kv_pages, message):
  c = load_config_module("sao_tiny.py").get_config()
  c.rollout.kv_cache, c.rollout.page_size, c.rollout.kv_pages = "paged", page_size, kv_pages
  with pytest.raises(ValueError, match=message):
    factories.validate_config(c)
  c.rollout.page_size, c.rollout.kv_pages = 16, 16
  factories.validate_config(c)


@pytest.mark.parametrize(
  "text,value",
  [
    ("2", 2),
    ("0.5", 0.5),
    ("True", True),
    ("true", True),
    ("FALSE", False),
    ("(1, 2)", (1, 2)),
    ("{'a': 1}", {"a": 1}),
    ("splash", "splash"),
    ("", ""),
  ],
)
def test_override_values_parse_as_literals_else_text(text, value):
  from sao_jax.train.configuration import parse_literal

  assert parse_literal(text) == value and type(parse_literal(text)) is type(value)


def test_write_json_replaces_whole_and_leaves_no_temporary(tmp_path):
  import json

  from sao_jax.data import files

  path = tmp_path / "sub" / "x.json"
  files.write_json(str(path), {"a": 1})
  files.write_json(str(path), {"b": [1, 2]}, indent=2)
  assert json.loads(path.read_text()) == {"b": [1, 2]}
  assert os.listdir(path.parent) == ["x.json"]
