"""Every config loads, names a valid arm, and states its launch command."""

import os

import jax
import numpy as np
import pytest

from sao_jax.train import factories
from sao_jax.models import policy

from runs import ROOT, load_config_module, shipped_configs  # pylint: disable=g-bad-import-order

CONFIGS = [os.path.join(ROOT, "configs", n) for n in shipped_configs()]


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_is_valid(path):
  module = load_config_module(path)
  name = os.path.basename(path)
  assert f"--config=configs/{name}" in module.__doc__, "docstring must give the launch command"
  c = module.get_config()
  pod = c.model.preset == "qwen3_30b_a3b"
  factories.validate_config(c, num_devices=128 if pod else 8)  # the pod config: 128 chips, a v5p-256
  if pod:
    cfg = factories.build_model_config(c)
    shapes = jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0)))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert 30.3e9 < total < 30.7e9
    assert {r[0] for r in c.sharding.rules} >= {"batch", "embed", "expert", "heads", "vocab"}


def test_ablation_table_arms_all_have_configs():
  names = {os.path.basename(p)[:-3] for p in CONFIGS}
  assert {"sao_tiny", "sao_sync", "grpo", "grpo_dis", "running_mean", "sao_k1",
          "sao_no_freeze", "sao_token_gae", "sao_step_gae_mean", "sao_step_gae_last",
          "sao_moe"} <= names


@pytest.mark.parametrize("field,value,message", [
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
    ("faults.sigkill_after_rl_step", 10**6,
     r"faults.sigkill_after_rl_step = 1000000: must be <= rl.steps"),
])
def test_bad_config_fails_fast(field, value, message):
  c = load_config_module("grpo.py").get_config()
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(ValueError, match=message):
    factories.validate_config(c)


@pytest.mark.parametrize("page_size,kv_pages,message", [
    (24, 0, "rollout.page_size = 24: must be a divisor of rollout.max_len"),
    (16, 8, "rollout.kv_pages = 8: must be 0 or >= rollout.max_len / rollout.page_size"),
])
def test_bad_paged_cache_fails_fast(page_size, kv_pages, message):
  c = load_config_module("sao_tiny.py").get_config()
  c.rollout.kv_cache, c.rollout.page_size, c.rollout.kv_pages = "paged", page_size, kv_pages
  with pytest.raises(ValueError, match=message):
    factories.validate_config(c)
  c.rollout.page_size, c.rollout.kv_pages = 16, 16
  factories.validate_config(c)


@pytest.mark.parametrize("text,value", [
    ("2", 2), ("0.5", 0.5), ("True", True), ("true", True), ("FALSE", False),
    ("(1, 2)", (1, 2)), ("{'a': 1}", {"a": 1}), ("splash", "splash"), ("", "")])
def test_override_values_parse_as_literals_else_text(text, value):
  from sao_jax.train.configuration import parse_literal  # pylint: disable=g-import-not-at-top
  assert parse_literal(text) == value and type(parse_literal(text)) is type(value)


def test_write_json_replaces_whole_and_leaves_no_temporary(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  from sao_jax.data import files  # pylint: disable=g-import-not-at-top
  path = tmp_path / "sub" / "x.json"
  files.write_json(str(path), {"a": 1})
  files.write_json(str(path), {"b": [1, 2]}, indent=2)
  assert json.loads(path.read_text()) == {"b": [1, 2]}
  assert os.listdir(path.parent) == ["x.json"]
