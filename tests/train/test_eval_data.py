"""Evaluation that cannot hide bad data: strict sets, no NaN in JSON, truncation
flagged, maj@k, a per-source breakdown, null tool-call rates, progress lines."""

import io
import json

import numpy as np
import pytest
from runs import load_config_module

from sao_jax.config import sections
from sao_jax.data.prompts import EVAL_OFFSET
from sao_jax.rollout.stats import DriverStats
from sao_jax.train import configuration, evaluation, metrics


class T:  # the fields summarize reads (test_eval_sets.py uses it too)
  def __init__(self, prompt_id, reward, finish_reason="done"):
    self.prompt_id, self.total_reward, self.num_turns = prompt_id, reward, 2
    self.action_mask, self.finish_reason = np.array([0, 1], bool), finish_reason

  def __len__(self):
    return 2


def _rows(path, n_good, n_bad):
  good = [
    json.dumps(
      {
        "prompt": [{"role": "user", "content": f"{i} + 1?"}],
        "reward_model": {"ground_truth": str(i + 1)},
        "data_source": "toy",
      }
    )
    for i in range(n_good)
  ]
  path.write_text(
    "\n".join(good + ["{not json"] * (n_bad - 1) + [json.dumps({"prompt": []})] * min(n_bad, 1))
    + "\n"
  )
  return str(path)


def test_a_set_that_lost_rows_fails_in_one_line_unless_strict_is_off(tmp_path):
  """3 of 4 rows malformed: the evaluation stops before sampling (rather than run
  on the one row left and exit 0); strict off, the counts are the set's."""
  bad = _rows(tmp_path / "aime.jsonl", 1, 3)
  clean = _rows(tmp_path / "clean.jsonl", 2, 0)
  config = load_config_module("math_tool_tiny.py").get_config()
  configuration.set_field(config, "eval.sets", (bad, clean))
  assert sections.load(config).eval.strict  # the default
  with pytest.raises(sections.ConfigError) as e:
    evaluation.set_environments(config, object())
  line = str(e.value)
  assert "\n" not in line and "eval set 'aime': 3 rows rejected (1 empty_prompt, 2 other;" in line
  assert "aime.jsonl:2: bad JSON" in line and "eval.strict=False" in line
  configuration.set_field(config, "eval.strict", False)
  envs = evaluation.set_environments(config, object())
  assert evaluation.rejection_counts(evaluation.set_rejections(envs["aime"])) == {
    "rows_rejected": 3,
    "rows_rejected_empty_prompt": 1,
    "rows_rejected_other": 2,
  }
  assert evaluation.set_rejections(envs["clean"]) == []  # the training file's are not its
  # The row's extracted answer is in the last step's info (maj@k votes with it).
  episode = envs["aime"].episode(envs["aime"].task(EVAL_OFFSET))
  info = episode.step("So it is \\boxed{ 1 }.").info
  assert info["answer"] == "1" and info["correct"]


def test_one_task_writes_null_not_nan(tmp_path):
  r = evaluation.summarize([T(0, 1.0)], ks=(1,))
  assert r["pass@1"] == 1.0 and r["pass@1_stderr"] is None
  empty = evaluation.summarize([], ks=(1, 2))
  assert empty["pass@1"] is None and empty["mean_turns"] is None
  text = json.dumps(
    evaluation.finite_json({**r, "x": [float("nan"), {"y": float("inf")}]}), allow_nan=False
  )
  assert json.loads(text)["x"] == [None, {"y": None}] and "NaN" not in text
  assert "1.000+--" in evaluation.table({**r, "mostly_truncated": False}).replace(" ", "")


def test_a_mostly_truncated_set_is_flagged(capsys):
  r = evaluation.summarize([T(0, 0.0, "length"), T(1, 0.0, "length")])
  assert evaluation.flag_truncation("long", r) is True
  assert "[eval] warning: set 'long': 100% of its 2 samples hit the length budget" in (
    capsys.readouterr().out
  )
  assert evaluation.flag_truncation("ok", evaluation.summarize([T(0, 0.0)])) is False
  assert capsys.readouterr().out == ""
  assert "1.00!" in evaluation.table({**r, "mostly_truncated": True})


def _record(task, answer, success, source=None):
  return {"prompt_id": EVAL_OFFSET + task, "answer": answer, "success": success, "source": source}


def test_majority_vote_scores_the_most_voted_answer():
  records = [
    # task 0: "7" twice (right), "8" once: 1
    _record(0, "7", True),
    _record(0, " 7 ", True),
    _record(0, "8", False),
    # task 1: "3" once (wrong) beside no answers: 0, though one sample was right...
    _record(1, "3", False),
    _record(1, None, False),
    _record(1, None, True),
    # task 2: a tie of "1" (right) and "2" (wrong): the expected score, 0.5
    _record(2, "1", True),
    _record(2, "2", False),
    _record(2, None, False),
    # task 3: no answers: 0
    _record(3, None, False),
    _record(3, None, False),
    _record(3, None, False),
  ]
  r = evaluation.majority_vote(records, 3)
  scores = [1.0, 0.0, 0.5, 0.0]
  assert r["maj@3"] == pytest.approx(np.mean(scores))
  assert r["maj@3_stderr"] == pytest.approx(np.std(scores, ddof=1) / 2)
  assert evaluation.majority_vote(records, 1) == {}  # one sample: maj@1 is pass@1
  assert evaluation.majority_vote([_record(0, None, True)] * 2, 2) == {}  # no answers at all


def test_rows_with_sources_are_broken_down_by_source():
  records = [
    _record(0, None, True, "gsm8k"),
    _record(0, None, False, "gsm8k"),
    _record(1, None, True, "aime"),
    _record(2, None, False, "aime"),
  ]
  r = evaluation.by_source(records)
  assert list(r) == ["aime", "gsm8k"]
  assert r["aime"] == {"tasks": 2, "samples": 2, "pass@1": 0.5, "pass@1_stderr": pytest.approx(0.5)}
  assert r["gsm8k"]["pass@1"] == 0.5 and r["gsm8k"]["pass@1_stderr"] is None
  assert evaluation.by_source(records[:2]) == {}  # one source: the set's own numbers
  set_result = {**evaluation.summarize([T(0, 1.0), T(1, 0.0)]), "sources": r}
  lines = evaluation.table(set_result).splitlines()
  assert lines[2].startswith("/aime ") and lines[3].startswith("/gsm8k ")


def test_no_tool_call_written_has_no_valid_rate():
  """python_tool's actions are its own protocol: no chat-format tool call, so
  valid_tool_calls is null, not 1.0 beside tool_calls_per_sample 0.0."""
  r = evaluation.call_and_verdict_counts(DriverStats(), [{"info": {}}, {"info": {}}])
  assert r["valid_tool_calls"] is None and r["tool_calls_per_sample"] == 0.0
  stats = DriverStats()
  stats.tool_calls = 3
  stats.tool_call_errors.update({"bad_json": 1})
  r = evaluation.call_and_verdict_counts(stats, [{"info": {}}, {"info": {}}])
  assert r["valid_tool_calls"] == 0.75 and r["tool_calls_per_sample"] == 2.0


def test_progress_lines_show_rate_and_eta():
  now = [0.0]
  out = io.StringIO()
  meter = metrics.CountProgress("[eval] heldout", 5, every_s=10.0, clock=lambda: now[0], out=out)
  meter.start()
  for t in (100.0, 101.0, 111.0, 112.0, 113.0):  # the first sample after a 100 s compile
    now[0] = t
    meter.tick()
  assert out.getvalue().splitlines() == [
    "[eval] heldout: 0/5 samples",
    "[eval] heldout: 1/5 samples",
    "[eval] heldout: 3/5 samples  0.182 samples/s  eta 0m11s",
    "[eval] heldout: 5/5 samples  0.308 samples/s  took 0m13s",
  ]


def test_a_value_export_given_as_hf_dir_is_one_line(tmp_path):
  """launch/eval.py --hf_dir=OUT-value (the critic: no language-model head) ends in one
  line naming the policy directory, before any run loads (it was a traceback)."""
  import runs

  value_dir = tmp_path / "hf-value"
  value_dir.mkdir()
  (value_dir / "config.json").write_text(
    json.dumps(
      {
        "architectures": ["Qwen3MoeForTokenClassification"],
        "model_type": "qwen3_moe",
        "num_labels": 1,
      }
    )
  )
  with pytest.raises(sections.ConfigError, match=f"evaluate {tmp_path / 'hf'}$"):
    evaluation.check_policy_dir(str(value_dir))
  with pytest.raises(sections.ConfigError, match="no config.json"):
    evaluation.check_policy_dir(str(tmp_path))
  out = runs.launch(
    str(tmp_path / "run"),
    f"--hf_dir={value_dir}",
    script="eval.py",
    run_flags=[],
    check=False,
    devices=1,
  )
  assert out.strip().splitlines() == [
    f"error: --hf_dir {value_dir}: a value model (Qwen3MoeForTokenClassification, "
    f"launch/export.py's critic export), not a policy: it has no language-model head to "
    f"sample from; evaluate {tmp_path / 'hf'}"
  ], out[-3000:]
  assert not (tmp_path / "run").exists()
