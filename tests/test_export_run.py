"""Exporting a run: which checkpoint a step names, what a failed export leaves (nothing),
and a head over a vocabulary subset written over the whole vocabulary.

The subset head is checked against transformers: the exported model's logits
at the covered ids equal sao-jax's subset logits (inputs with uncovered ids
included, which both read through the shared embedding row), each uncovered
id's logit is the covered ones' mean (so greedy decoding never picks one),
and `generate` with the exported generation_config.json never samples one.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import math_tool_cpu
from sao_jax.envs import hf_tokenizer_export
from sao_jax.models import config as model_config
from sao_jax.models import hf_export, policy
from sao_jax.models.transformer import Transformer
from sao_jax.train import export as export_lib

torch = pytest.importorskip("torch", reason="the 'parity' extra (make test installs it)")
transformers = pytest.importorskip("transformers")


def _checkpoints(workdir, metas):
  """Fake committed checkpoints: checkpoints/<n>/meta/metadata, as orbax leaves them."""
  for n, meta in metas.items():
    os.makedirs(workdir / "checkpoints" / str(n) / "meta")
    (workdir / "checkpoints" / str(n) / "meta" / "metadata").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def config():
  return math_tool_cpu.get_config()  # sft.steps 800, rl.steps 150


def test_a_step_is_a_training_step_and_a_missing_one_lists_what_there_is(tmp_path, config):
  _checkpoints(
    tmp_path,
    {
      3: {"stage": "sft", "stage_step": 50},
      4: {"stage": "value_pretrain", "stage_step": 0, "sft_stopped_at": 120},
      5: {"stage": "value_pretrain", "stage_step": 20, "sft_stopped_at": 120},
      6: {"stage": "rl", "stage_step": 50},
      7: {"stage": "done", "stage_step": 0},
    },
  )
  find = lambda **kw: export_lib.find_checkpoint(config, str(tmp_path), **kw)
  assert find() == 7
  assert find(step="rl:50") == find(step="50") == find(step=50) == 6
  assert find(step="sft:50") == 3
  # SFT stopped at 120; value pretraining leaves the policy there: the newest holds it.
  assert find(step="sft:120") == 5
  assert find(step="rl:150") == 7  # the end of RL (config.rl.steps)
  assert find(checkpoint=4) == 4
  with pytest.raises(
    FileNotFoundError,
    match=r"no checkpoint of rl step 60 under .*there are: "
    r"checkpoint 3 \(sft step 50\), checkpoint 4 \(sft step 120\), .*"
    r"checkpoint 6 \(rl step 50\), checkpoint 7 \(rl step 150\)",
  ):
    find(step="rl:60")
  with pytest.raises(
    FileNotFoundError,
    match=r"checkpoint 9 is not under .*there are: "
    r"checkpoint 3 \(sft step 50\)",
  ):
    find(checkpoint=9)
  with pytest.raises(hf_export.ExportError, match="not both"):
    find(step="rl:50", checkpoint=6)
  with pytest.raises(hf_export.ExportError, match=r"'value:3'"):
    find(step="value:3")


def test_exporting_a_missing_workdir_creates_nothing(tmp_path, config):
  workdir, out = tmp_path / "no_such_run", tmp_path / "hf"
  with pytest.raises(FileNotFoundError, match="no run at .*no_such_run"):
    export_lib.export(config, str(workdir), str(out), step="rl:10")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no checkpoint under"):
    export_lib.export(config, str(tmp_path / "empty"), str(out))
  assert sorted(os.listdir(tmp_path)) == ["empty"]
  assert not os.listdir(tmp_path / "empty")


# --- a head over a vocabulary subset ---------------------------------------------------

SUBSET = (0, 3, 4, 9, 17, 30, 31, 50, 64, 90)  # 10 of 96 ids


@pytest.fixture(scope="module")
def subset_export(tmp_path_factory):
  """A tiny MoE policy whose head covers SUBSET, exported over the whole vocabulary."""
  cfg = dataclasses.replace(model_config.tiny(96), vocab_ids=SUBSET)
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda s: (0.3 * rng.standard_normal(s.shape)).astype(np.float32),
    jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0))),
  )
  full, full_cfg, record = hf_export.full_vocabulary(params, cfg)
  out = tmp_path_factory.mktemp("subset") / "hf"
  generation = hf_tokenizer_export.suppressing(
    b'{"eos_token_id": 3, "do_sample": true}', record["outside_ids"]
  )
  hf_export.export_params(
    full, full_cfg, str(out), dtype="float32", extra_files={"generation_config.json": generation}
  )
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  return cfg, params, record, model.eval()


def test_a_subset_heads_export_gives_sao_jaxs_logits_and_never_picks_an_outside_id(subset_export):
  cfg, params, record, model = subset_export
  assert record["ids"] == list(SUBSET) and len(record["outside_ids"]) == 96 - len(SUBSET)
  tokens = np.random.default_rng(1).integers(0, 96, (2, 12))  # mostly uncovered ids
  pos = jnp.broadcast_to(jnp.arange(12), tokens.shape)
  ours = np.asarray(
    Transformer(cfg).apply(
      {"params": params}, jnp.asarray(tokens, jnp.int32), pos, jnp.ones_like(pos)
    )[0]
  )  # [B, L, S]
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()  # [B, L, 96]
  np.testing.assert_allclose(theirs[..., list(SUBSET)], ours, atol=1e-4, rtol=1e-4)
  outside = theirs[..., record["outside_ids"]]
  np.testing.assert_allclose(
    outside, np.broadcast_to(ours.mean(-1, keepdims=True), outside.shape), atol=1e-4
  )
  assert set(theirs.argmax(-1).ravel()) <= set(SUBSET)
  # Sampling at temperature 1: the exported generation_config suppresses them.
  torch.manual_seed(0)
  with torch.no_grad():
    sampled = model.generate(
      torch.tensor(tokens[:1, :4]), max_new_tokens=48, do_sample=True, min_new_tokens=48
    )[0, 4:].tolist()
  assert len(sampled) == 48 and set(sampled) <= set(SUBSET)


@pytest.mark.slow  # builds the math_tool run and Qwen3's tokenizer files
def test_a_math_tool_cpu_checkpoint_exports_a_directory_transformers_serves(tmp_path, config):
  """configs/math_tool_cpu.py (a head over 320 ids, Qwen3's tokenizer and template):
  its checkpoint exports; transformers loads model and tokenizer from the directory
  alone, renders the run's prompt as the run does, and its logits at the covered
  ids are the run's."""
  from sao_jax.envs import base
  from sao_jax.train import trainer

  workdir, out = str(tmp_path / "run"), str(tmp_path / "hf")
  run = trainer.load_run(config, workdir)
  run.save(force=True)
  task = run.env.task(0)
  prompt = run.format.prompt_ids(task.prompt, base.task_tools(task))
  cfg, params = run.model_cfg, run.state.policy
  run.close()
  trainer.export(config, workdir, out, "sft:0", dtype="float32", value_out=None)
  assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(
    os.listdir(out)
  )
  tok = transformers.AutoTokenizer.from_pretrained(out)
  messages = (
    task.prompt if not isinstance(task.prompt, str) else [{"role": "user", "content": task.prompt}]
  )
  rendered = tok.apply_chat_template(
    messages, tools=list(base.task_tools(task)) or None, add_generation_prompt=True, tokenize=True
  )
  assert list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered) == prompt
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert model.generation_config.suppress_tokens and model.generation_config.eos_token_id == [
    151645,
    151643,
  ]
  tokens = np.asarray([prompt[:64]])
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  pos = jnp.arange(tokens.shape[1])[None]
  ours = np.asarray(
    Transformer(cfg).apply(
      {"params": params}, jnp.asarray(tokens, jnp.int32), pos, jnp.ones_like(pos)
    )[0]
  )
  np.testing.assert_allclose(theirs[..., list(cfg.vocab_ids)], ours, atol=1e-4, rtol=1e-4)
  record = json.loads(open(os.path.join(out, "sao_jax_export.json")).read())
  assert record["vocab_subset"]["ids"] == list(cfg.vocab_ids)
  assert record["training_step"] == "sft:0" and record["checkpoint"] == 1
