"""launch/eval.py on HumanEval with Qwen3's tokenizer and chat format: per-sample JSONL.

A fresh tiny run (untrained: its pass@1 is 0) is checkpointed in-process,
then `launch/eval.py` evaluates it on 4 problems, 2 samples each, and must
print pass@1 and write one JSON line per sample whose reward, success and
verdict agree with each other and with the printed pass@1.
"""

import json
import os

import numpy as np
import pytest
from runs import launch, load_config_module

from sao_jax.data.prompts import EVAL_OFFSET
from sao_jax.envs import humaneval
from sao_jax.train import configuration, trainer

# 512 tokens hold a HumanEval prompt in Qwen3's template; 16-token answers
# keep the untrained model's turns short.
FLAGS = {
  "env.name": "humaneval",
  "env.tokenizer": "qwen3",
  "env.chat_format": "qwen3",
  "eval.num_tasks": 4,
  "eval.slots": 4,
  "eval.samples_per_task": 2,
  "rollout.max_len": 512,
  "rollout.max_turn_tokens": 16,
  "data.buckets": (512,),
  "tensorboard": False,
}


# test_eval_sets.py runs launch/eval.py on a checkpoint and its export in the default run.
@pytest.mark.slow
def test_eval_writes_one_json_line_per_sample(tmp_path):
  workdir = str(tmp_path / "run")
  config = load_config_module("sao_tiny.py").get_config()
  for field, value in FLAGS.items():
    configuration.set_field(config, field, value)
  run = trainer.load_run(config, workdir)
  run.save(force=True)
  run.close()

  out_dir = str(tmp_path / "eval")
  flags = [f"--config.{k}={v}" for k, v in FLAGS.items()]
  out = launch(workdir, f"--out={out_dir}", script="eval.py", run_flags=flags)
  result = json.loads(out.strip().splitlines()[-1])
  assert "[eval] checkpoint_1 heldout: pass@1" in out
  assert "[eval] heldout: 0/8 samples" in out and "[eval] heldout: 8/8 samples" in out
  assert result["tasks"] == 4 and result["samples"] == 8
  # HumanEval's rows are clean and its answers are code: no rejections, no maj@k.
  assert result["rows_rejected"] == 0 and not any(k.startswith("maj@") for k in result)
  out_path = os.path.join(out_dir, "heldout", "samples.jsonl")
  assert result["sets"]["heldout"]["samples_file"] == out_path
  with open(os.path.join(out_dir, "heldout", "summary.json"), encoding="utf-8") as f:
    assert json.load(f)["pass@1"] == result["pass@1"]

  with open(out_path, encoding="utf-8") as f:
    lines = [json.loads(line) for line in f]
  assert len(lines) == 8
  assert sorted(r["prompt_id"] for r in lines) == [
    EVAL_OFFSET + i for i in range(4) for _ in range(2)
  ]
  for r in lines:
    assert r["task"] == r["prompt_id"] - EVAL_OFFSET
    assert r["success"] == (r["reward"] >= 1.0) and r["reward"] in (0.0, 1.0)
    assert len(r["actions"]) == r["turns"] >= 1
    assert r["transcript"].startswith("<|im_start|>system\n")
    assert all(a in r["transcript"] for a in r["actions"])
    if r["finish_reason"] == "done":  # graded: the verdict agrees with the reward
      assert r["info"]["verdict"] in humaneval.VERDICTS
      assert r["info"]["task_id"] == f"HumanEval/{r['task']}"
      assert (r["info"]["verdict"] == "passed") == r["success"]
  rates = [np.mean([r["success"] for r in lines if r["task"] == t]) for t in range(4)]
  assert result["pass@1"] == np.mean(rates)
  assert os.path.isdir(os.path.join(workdir, "checkpoints"))
