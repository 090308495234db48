"""Evaluation as the paper runs it: pass@k's unbiased estimator, named sets, and one
evaluation of two sets on a checkpoint and on its exported HF directory."""

import itertools
import json
import os

import numpy as np
import pytest
from runs import load_config_module

from sao_jax.config import sections
from sao_jax.train import configuration, evaluation, trainer


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_success(n):
  """Oracle: every k-subset of n samples (c of them successes) enumerated."""
  for c in range(n + 1):
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
      subsets = list(itertools.combinations(outcomes, k))
      want = sum(any(s) for s in subsets) / len(subsets)
      assert evaluation.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
  assert evaluation.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
  with pytest.raises(ValueError, match="1 <= k <= n"):
    evaluation.pass_at_k(2, 1, 3)


def test_summary_reports_pass_at_k_and_its_stderr_over_tasks():
  from test_eval_data import T

  # 3 tasks x 4 samples: 1, 2 and 0 successes; two samples cut by the length budget.
  wins = {0: [1, 0, 0, 0], 1: [1, 1, 0, 0], 2: [0, 0, 0, 0]}
  trajs = [
    T(p, float(w), "length" if (p, i) in ((2, 0), (2, 1)) else "done")
    for p, ws in wins.items()
    for i, w in enumerate(ws)
  ]
  r = evaluation.summarize(trajs, ks=evaluation.pass_ks(4))
  assert evaluation.pass_ks(4) == (1, 2, 4) and evaluation.pass_ks(6) == (1, 2, 4, 6)
  per_task_2 = [1 - 3 / 6, 1 - 1 / 6, 0.0]  # 1 - C(n-c,2)/C(4,2)
  assert r["pass@1"] == pytest.approx(np.mean([0.25, 0.5, 0]))
  assert r["pass@2"] == pytest.approx(np.mean(per_task_2))
  assert r["pass@2_stderr"] == pytest.approx(np.std(per_task_2, ddof=1) / np.sqrt(3))
  assert r["pass@4"] == pytest.approx(2 / 3)
  assert r["truncated"] == pytest.approx(2 / 12) and r["mean_turns"] == 2


def test_eval_sets_are_checked(tmp_path):
  rows = tmp_path / "aime.jsonl"
  rows.write_text("")
  assert sections.parse_eval_sets(()) == [("heldout", "heldout")]
  assert sections.parse_eval_sets((str(rows), "he=humaneval")) == [
    ("aime", str(rows)),
    ("he", "humaneval"),
  ]
  for sets, match in (
    (("a=heldout", "a=code_fix"), "'a' appears twice"),
    (("x=nope.jsonl",), "no file 'nope.jsonl'"),
    (("a b=heldout",), "is not 1-64 letters"),
  ):
    with pytest.raises(sections.ConfigError, match="eval.sets = .*" + match):
      sections.Eval(sets=sets)
  with pytest.raises(sections.ConfigError, match=r"eval.top_p = 0: must be in \(0, 1\]"):
    sections.Eval(top_p=0)
  config = load_config_module("sao_tiny.py").get_config()
  configuration.set_field(config, "eval.sets", ("no_such_env",))  # the envs layer's name check
  with pytest.raises(sections.ConfigError, match="eval.sets = .*not a built-in environment"):
    configuration.validate(config, num_devices=8)
  # raw format: chat sets refused
  configuration.set_field(config, "eval.sets", ("heldout", "humaneval"))
  with pytest.raises(sections.ConfigError, match="eval.sets = .*'humaneval'.*not 'raw'"):
    configuration.validate(config, num_devices=8)


def test_two_sets_on_a_checkpoint_and_on_its_export(tmp_path):
  """k = 2 samples of 2 tasks of two sets, from a checkpoint and from its export
  as an HF directory: every set's summary.json and samples are written. (The
  samples themselves are not compared: which slot's random stream serves which
  episode follows the environments' timing.)"""
  config = load_config_module("sao_tiny.py").get_config()
  for field, value in {
    "eval.sets": ("heldout", "fix=code_fix"),
    "eval.samples_per_task": 2,
    "eval.num_tasks": 2,
    "eval.slots": 4,
    "tensorboard": False,
    "rollout.max_len": 96,
    "data.buckets": (96,),
  }.items():
    configuration.set_field(config, field, value)
  workdir = str(tmp_path / "run")
  run = trainer.load_run(config, workdir)
  run.save(force=True)
  run.close()
  # --step is a training step, as export takes it; one not there lists what is.
  with pytest.raises(
    FileNotFoundError,
    match=r"no checkpoint of rl step 50 .*there are: "
    r"checkpoint \d+ \(sft step 0\)",
  ):
    trainer.evaluate(config, workdir, step="rl:50")
  ckpt = trainer.evaluate(config, workdir, step="sft:0")
  assert os.path.basename(ckpt["out"]).startswith("checkpoint_")
  assert list(ckpt["sets"]) == ["heldout", "fix"]
  assert ckpt["pass@1"] == ckpt["sets"]["heldout"]["pass@1"]
  for name, r in ckpt["sets"].items():
    assert r["tasks"] == 2 and r["samples"] == 4 and "pass@2_stderr" in r
    with open(os.path.join(ckpt["out"], name, "summary.json"), encoding="utf-8") as f:
      assert json.load(f)["set"] == name
  exported = trainer.export(config, workdir, str(tmp_path / "hf"), dtype="float32", value_out=None)
  assert list(exported) == ["policy"]
  configuration.set_field(config, "eval.sets", ("heldout",))  # one set is enough here
  hf = trainer.evaluate(config, workdir, hf_dir=str(tmp_path / "hf"))
  assert hf["out"].endswith(os.path.join("eval", "hf_hf")) and list(hf["sets"]) == ["heldout"]
  for r in (ckpt, hf):
    for name in r["sets"]:
      with open(os.path.join(r["out"], name, "samples.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
      assert sorted(x["task"] for x in records) == [0, 0, 1, 1]
      assert r["sets"][name]["pass@1"] == np.mean([x["success"] for x in records])
  assert "pass@2" in evaluation.table(hf).splitlines()[0]


def test_a_file_set_is_held_out_rows_of_the_runs_dataset_environment(tmp_path):
  """math_tool run: a file of rows keeps the run's tools, verifier and turn budget
  (its kwargs), with the file as the held-out split; "heldout" is the run's env."""
  from sao_jax.data.prompts import EVAL_OFFSET

  rows = tmp_path / "aime_mini.jsonl"
  rows.write_text(
    "".join(
      json.dumps(
        {
          "prompt": [{"role": "user", "content": f"{i} + 1?"}],
          "reward_model": {"ground_truth": str(i + 1)},
        }
      )
      + "\n"
      for i in range(3)
    )
  )
  config = load_config_module("math_tool_tiny.py").get_config()
  configuration.set_field(config, "eval.sets", (str(rows), "he=humaneval", "heldout"))
  configuration.validate(config, num_devices=8)
  run_env = object()
  envs = evaluation.set_environments(config, run_env)
  assert list(envs) == ["aime_mini", "he", "heldout"] and envs["heldout"] is run_env
  aime = envs["aime_mini"]
  assert aime.num_eval_tasks == 3 and aime.max_turns == 4  # the run's max_turns
  task = aime.task(EVAL_OFFSET + 2)
  assert task.prompt[-1]["content"] == "2 + 1?" and task.answer == "3"
  assert [t["function"]["name"] for t in task.tools] == ["python"]
  assert envs["he"].num_eval_tasks == 164


def test_recorded_episodes_count_the_events_the_environment_reports():
  from sao_jax.envs.base import StepResult

  class Episode:
    def __init__(self):
      self.infos = [
        {"events": ["tool_error"]},
        {"events": []},
        {"events": ["tool_error", "verifier_timeout"]},
      ]

    def step(self, action):
      return StepResult("obs", 0.0, False, self.infos.pop(0))

  class Env:
    name = "fake"

    def episode(self, task):
      return Episode()

  episode = evaluation._Recording(Env()).episode(None)
  for _ in range(3):
    episode.step("a")
  assert dict(episode.events) == {"tool_error": 2, "verifier_timeout": 1}
  assert episode.info == {"events": ["tool_error", "verifier_timeout"]}
