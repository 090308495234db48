"""math_tool: the shipped generated set, its demonstrations, and the whole chain with Qwen3's formats.

The end-to-end test runs the real trainer in-process on configs/math_tool_cpu.py
(`make train-math`'s config with tiny budgets: a tiny model with Qwen3's
tokenizer and its head over the ids the task uses, the qwen3 chat format,
the shipped JSONL set and the math verifier) through SFT on the shipped
solutions, value pretraining, async SAO and evaluation, and checks every
trajectory the run produced, stored or trained on or evaluated: the action
mask is exactly the sampled turns (each closed by its sampled <|im_end|>
unless cut), never the prompt or a bridge.
"""

import json
import os

import numpy as np
import pytest
from runs import load_config_module

from sao_jax.data import store
from sao_jax.data.ingestion import TrajectoryQueue
from sao_jax.envs import chat, math_problems, registry
from sao_jax.envs.base import Action
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.envs.math_tool import MathTool, MathToolConfig
from sao_jax.envs.sandbox import SandboxLimits, run_python
from sao_jax.envs.tokenizer import Qwen3Tokenizer
from sao_jax.train import evaluation, factories, trainer

TOK = Qwen3Tokenizer()
FMT = chat.make_format("qwen3", TOK)
IM_START, IM_END = TOK.special_id("<|im_start|>"), TOK.special_id("<|im_end|>")
GEN_PROMPT = [IM_START] + TOK.encode("assistant\n")


@pytest.fixture(scope="module")
def env():
  return MathTool(MathToolConfig())


def check_transcript(traj, prompt_ids, max_turn_tokens=None):
  """The qwen3 layout of one trajectory, from its ids and masks alone.

  The prompt is the format's render, not actions; every action run follows
  the generation prompt, holds no <|im_end|> but its last token, which is
  the sampled <|im_end|> (a <|im_start|> the policy sampled inside a turn is
  its action: an untrained policy over a 285-id head samples one often; a
  run without the <|im_end|> was cut:
  at the turn limit, and then an unsampled <|im_end|> closes it, or at the
  length cap, and it is the trajectory's last); every non-action run
  between two turns is a bridge: "\\n<|im_start|>user\\n...
  <|im_end|>\\n<|im_start|>assistant\\n". Versions and log-probs are set
  on action tokens only.
  """
  tokens, mask = np.asarray(traj.tokens), np.asarray(traj.action_mask)
  n = len(prompt_ids)
  assert tokens[:n].tolist() == list(prompt_ids) and not mask[:n].any()
  assert tokens[n - len(GEN_PROMPT) : n].tolist() == GEN_PROMPT
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
  runs = list(zip(edges[::2], edges[1::2]))  # [start, end) of each action run
  assert runs and runs[0][0] == n
  assert [s for s, _ in runs] == traj.turn_starts.tolist()
  for k, (s, e) in enumerate(runs):
    turn = tokens[s:e].tolist()
    assert IM_END not in turn[:-1]
    cut = turn[-1] != IM_END  # at the turn limit, or the last turn at max_len
    if cut:
      assert len(turn) == max_turn_tokens or (k == len(runs) - 1 and e == len(tokens)), (
        k,
        len(turn),
      )
    if k + 1 < len(runs):
      bridge = tokens[e : runs[k + 1][0]].tolist()
      if cut:  # the format closes a cut turn, unsampled
        assert bridge[0] == IM_END
        bridge = bridge[1:]
      assert bridge[:2] == [TOK.encode("\n")[0], IM_START] and bridge[-3:] == GEN_PROMPT
      assert bridge[-len(GEN_PROMPT) - 2 : -len(GEN_PROMPT)] == [IM_END, TOK.encode("\n")[0]]
  assert e == len(tokens)  # nothing follows the last turn
  on = mask
  assert (traj.policy_version[on] >= 0).all() and (traj.policy_version[~on] == -1).all()
  assert (traj.rollout_logprobs[~on] == 0).all() and (traj.rollout_logprobs[on] <= 0).all()


def test_shipped_files_are_what_the_generator_writes(tmp_path):
  math_problems.main(["--out_dir", str(tmp_path)])
  for name in ("train.jsonl.gz", "heldout.jsonl.gz"):
    with (
      open(tmp_path / name, "rb") as a,
      open(os.path.join(math_problems.SHIPPED_DIR, name), "rb") as b,
    ):
      assert a.read() == b.read(), f"{name}: regenerate with python -m sao_jax.envs.math_problems"


def test_heldout_questions_are_not_trained_on(env):
  train = {r.messages[0]["content"] for r in env.train_rows}
  assert len(env.train_rows) == 4000 and env.num_eval_tasks == 400
  assert not train & {r.messages[0]["content"] for r in env.heldout_rows}
  assert not env.rejected and not env.repeats


def test_shipped_files_pass_the_datasets_hygiene_checks():
  """No malformed row, no repeated or conflicting prompt (a strict load raises on the
  first), and no held-out question in training: `make train-math` warns of nothing."""
  from sao_jax.data import datasets

  train, _ = datasets.load_rows(math_problems.SHIPPED_TRAIN, strict=True)
  heldout, _ = datasets.load_rows(math_problems.SHIPPED_HELDOUT, strict=True)
  assert (len(train), len(heldout)) == (4000, 400)
  assert datasets.without_heldout(train, heldout)[1] == []


def test_defaults_are_the_papers_setting(env):
  assert env.max_turns == 50 and env.runs_code and env.name == "math_tool"
  task = env.task(3)
  assert task.prompt[0]["role"] == "system" and "\\boxed{}" in task.prompt[0]["content"]
  assert [chat.function_schema(t)["name"] for t in task.tools] == ["python"]
  assert registry.ENVIRONMENTS["math_tool"].runs_code
  with pytest.raises(ValueError, match="max_turn"):
    registry.builtin_kwargs(registry.ENVIRONMENTS["math_tool"], {"max_turn": 3})


def test_demonstrations_use_the_tool_and_its_real_output(env):
  """Every shipped solution's tool output is what the sandbox prints for its code,
  and its last turn's boxed answer is the ground truth (a sample of rows)."""
  rng = np.random.default_rng(0)
  for i in rng.choice(len(env.train_rows), 12, replace=False):
    task = env.demonstration_task(int(i))
    turns = env.demonstration(task)
    assert len(turns) >= 2
    for message, observations in turns[:-1]:
      (call,) = message["tool_calls"]
      out = run_python(call["arguments"]["code"], SandboxLimits())
      assert [o["content"] for o in observations] == [out.observation()]
    verdict = env._verify(turns[-1][0]["content"], task.answer)
    assert verdict.correct, (task.answer, turns[-1][0]["content"])


def test_python_tool_imports_the_standard_library(env):
  code = (
    "import fractions, statistics, re\n"
    "print(fractions.Fraction(1, 3) + fractions.Fraction(1, 6), statistics.median([3, 1, 2]))"
  )
  ids = FMT.action_ids(
    {
      "role": "assistant",
      "content": "",
      "tool_calls": [{"name": "python", "arguments": {"code": code}}],
    }
  )
  parsed = FMT.parse_turn(ids)
  action = Action(
    parsed.text, parsed=parsed, tool_calls=parsed.tool_calls, tool_errors=parsed.errors
  )
  step = env.episode(env.task(0)).step(action)
  assert step.observation[0]["content"].strip() == "1/2 2" and not step.done


def test_demonstration_transcripts_have_the_sampled_layout(env):
  for i in range(40):
    task = env.demonstration_task(i)
    traj = demonstration_trajectory(env, task, TOK, FMT)
    check_transcript(traj, FMT.prompt_ids(task.prompt, task.tools))
    # Each action turn is the assistant message as a thinking Qwen3 samples it.
    turns = env.demonstration(task)
    for (message, _), start in zip(turns, traj.turn_starts):
      ids = FMT.demonstration_ids(message)
      assert traj.tokens[start : start + len(ids)].tolist() == ids
      parsed = FMT.parse_turn(ids)
      assert [c.name for c in parsed.tool_calls] == [
        c["name"] for c in message.get("tool_calls", [])
      ]


def test_demonstration_ids_follow_the_thinking_switch():
  """Thinking on: a turn without reasoning still opens with the empty block Qwen3
  samples; off: the generation prompt holds that block and the turn none."""
  nothink = chat.make_format("qwen3", TOK, enable_thinking=False)
  think, think_end = TOK.special_id("<think>"), TOK.special_id("</think>")
  plain = {"role": "assistant", "content": "\\boxed{3}"}
  assert FMT.demonstration_ids(plain) == (
    [think] + TOK.encode("\n\n") + [think_end] + TOK.encode("\n\n\\boxed{3}") + [IM_END]
  )
  assert FMT.action_ids(plain) == TOK.encode("\\boxed{3}") + [IM_END]  # as given
  reasoned = dict(plain, reasoning_content="3 = 1 + 2")
  assert nothink.demonstration_ids(reasoned) == TOK.encode("\\boxed{3}") + [IM_END]
  assert FMT.demonstration_ids(reasoned) == FMT.action_ids(reasoned)


def _config():
  c = load_config_module("math_tool_cpu.py").get_config()
  c.sharding.mesh = {"data": 8}
  c.sft.steps, c.sft.batch_size = 2, 8
  c.value_pretrain.steps, c.value_pretrain.num_trajectories = 1, 8
  c.rl.steps, c.rl.batch_size = 2, 8
  c.rollout.slots = 8
  c.rollout.max_turn_tokens = 24
  c.eval.num_tasks, c.eval.slots = 8, 8
  c.log_every, c.tensorboard = 1, False
  c.checkpoint.every = 100
  return c


def test_end_to_end_with_qwen3_formats(tmp_path, monkeypatch):
  """SFT on the shipped solutions -> value pretraining -> async SAO -> evaluation,
  with every trajectory of every stage checked."""
  config = _config()
  seen = {"rl": [], "eval": []}
  put = TrajectoryQueue.put

  def record_put(self, traj, block=True):
    seen["rl"].append(traj)
    return put(self, traj, block)

  monkeypatch.setattr(TrajectoryQueue, "put", record_put)
  summarize = evaluation.summarize

  def record_summarize(trajs, **kwargs):
    seen["eval"].extend(trajs)
    return summarize(trajs, **kwargs)

  monkeypatch.setattr(evaluation, "summarize", record_summarize)
  workdir = str(tmp_path / "run")
  summary = trainer.train(config, workdir)
  assert summary["rl_steps"] == 2 and 0.0 <= summary["final_pass@1"] <= 1.0

  math_env = registry.make_env(config.env)
  head_ids = set(factories.build_model_config(config, TOK, math_env).vocab_ids)
  assert head_ids and len(head_ids) < TOK.vocab_size // 100
  stored, dropped = store.read_valid_trajectories(
    [os.path.join(workdir, "trajectories", "value_pretrain.array_record")],
    TOK.vocab_size,
    config.rollout.max_len,
  )
  assert len(stored) == 8 and not dropped
  assert len(seen["rl"]) >= 2 * 8 and len(seen["eval"]) == 2 * 8  # SFT's and the final eval
  for name, trajs in (("stored", stored), ("rl", seen["rl"]), ("eval", seen["eval"])):
    for traj in trajs:
      task = math_env.task(traj.prompt_id)
      try:
        check_transcript(
          traj, FMT.prompt_ids(task.prompt, task.tools), config.rollout.max_turn_tokens
        )
      except AssertionError as e:
        raise AssertionError(
          f"{name} trajectory of task {traj.prompt_id}: {TOK.decode(traj.tokens.tolist())!r}"
        ) from e
      # Sampled ids are Qwen3's, from the head's subset.
      assert set(traj.tokens[traj.action_mask].tolist()) <= head_ids
  for stage in ("sft", "final"):  # tool calls and verdicts are counted
    r = summary["evals"][stage]
    # A rate of the calls written: null (None) when the policy wrote none.
    if r["tool_calls_per_sample"] == 0:
      assert r["valid_tool_calls"] is None
    else:
      assert 0.0 <= r["valid_tool_calls"] <= 1.0
    verdicts = {k: v for k, v in r.items() if k.startswith("verdict_")}
    assert verdicts and abs(sum(verdicts.values()) - 1.0) < 1e-9
    solved = r.get("verdict_exact", 0.0) + r.get("verdict_equivalent", 0.0)
    assert abs(solved - r["pass@1"]) < 1e-9
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  assert {"sft", "value_pretrain", "rl", "eval"} <= {r["stage"] for r in records}
  # The data's load counts are in the RL metrics.
  rl = [r for r in records if r["stage"] == "rl"]
  assert all(r["data/rows_repeats_kept"] == 0 and r["data/rows_duplicate"] == 0 for r in rl)


def test_config_needs_a_chat_format_that_renders_its_tools():
  from sao_jax.train import configuration

  c = _config()
  configuration.validate(c, num_devices=8)
  for chat_format, message in (
    ("raw", "'qwen3', 'qwen3_5' or 'plain'"),
    ("plain", "renders tools"),
  ):
    configuration.set_field(c, "env.chat_format", chat_format)
    with pytest.raises(configuration.ConfigError, match=message) as e:
      configuration.validate(c, num_devices=8)
    assert "\n" not in str(e.value)
  configuration.set_field(c, "env.kwargs", {"tools": ()})  # no tools: plain renders it
  configuration.validate(c, num_devices=8)


def test_python_modules_are_checked_when_the_environment_is_built():
  for modules, message in (
    (("math", "no_such_module_x"), "cannot be imported"),
    ("math", "a tuple of module names"),
  ):
    with pytest.raises(ValueError, match=message):
      MathTool(MathToolConfig(python_modules=modules))


def test_tool_responses_answer_calls_in_the_order_they_were_written(env):
  """Qwen3's tool responses carry no call ids: a malformed call between two
  good ones is answered between their outputs."""
  call, call_end = TOK.special_id("<tool_call>"), TOK.special_id("</tool_call>")

  def body(text):
    return [call] + TOK.encode(text) + [call_end]

  ids = (
    body('\n{"name": "python", "arguments": {"code": "print(1)"}}\n')
    + TOK.encode("\n")
    + body("\n{not json\n")
    + TOK.encode("\n")
    + body('\n{"name": "python", "arguments": {"code": "print(3)"}}\n')
    + [IM_END]
  )
  parsed = FMT.parse_turn(ids)
  assert [type(x).__name__ for x in parsed.sequence] == ["ToolCall", "tuple", "ToolCall"]
  action = Action(
    parsed.text,
    parsed=parsed,
    tool_calls=parsed.tool_calls,
    tool_errors=parsed.errors,
    tool_sequence=parsed.sequence,
  )
  step = env.episode(env.task(0)).step(action)
  contents = [m["content"].strip() for m in step.observation]
  assert contents[0] == "1" and contents[1].startswith("error:") and contents[2] == "3"
  assert step.info["events"] == ["tool_error"]
