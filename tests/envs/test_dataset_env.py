"""The dataset environment over verl-style rows, with the qwen3 format.

A row's completion becomes an SFT transcript whose action tokens are
exactly the assistant turns with their <|im_end|> (the bridges are not);
an episode runs the python tool in the sandbox for a tool call, answers a
malformed call with an error, and scores the final answer with the math
verifier.
"""

import json
import time

import numpy as np
import pytest

from sao_jax.config import sections
from sao_jax.data.prompts import EVAL_OFFSET
from sao_jax.envs import chat, registry
from sao_jax.envs.base import Action
from sao_jax.envs.dataset import DatasetConfig, DatasetEnv, ToolBudget, ToolMeter, answer_tool_calls
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.envs.tokenizer import Qwen3Tokenizer

TOK = Qwen3Tokenizer()
FMT = chat.make_format("qwen3", TOK)


def _rows(n):
  for i in range(n):
    call = {"name": "python", "arguments": {"code": f"print({i} * 7)"}}
    yield {
      "data_source": "toy",
      "prompt": [{"role": "user", "content": f"What is {i} * 7?"}],
      "reward_model": {"ground_truth": str(i * 7)},
      "completion": [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(i * 7)},
        {"role": "assistant", "content": f"\\boxed{{{i * 7}}}"},
      ],
    }


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  path = tmp_path_factory.mktemp("data") / "train.jsonl"
  lines = [json.dumps(r) for r in _rows(10)] + ["{not json", json.dumps({"prompt": "x"})]
  path.write_text("\n".join(lines) + "\n")
  return DatasetEnv(
    DatasetConfig(
      path=str(path), heldout_fraction=0.2, tools=("python",), system_prompt="Use the python tool."
    )
  )


def test_bad_rows_are_rejected_with_file_line_and_reason(env):
  assert len(env.rejected) == 2
  assert [w.rsplit(":", 1)[1] for w, _ in env.rejected] == ["11", "12"]
  assert len(env.train_rows) + len(env.heldout_rows) == 10 and env.num_eval_tasks == 2
  held = {r.where for r in env.heldout_rows}
  assert not held & {env.task(i).meta["where"] for i in range(len(env.train_rows))}
  assert env.task(EVAL_OFFSET).meta["where"] in held


def test_demonstration_masks_are_the_assistant_turns_with_im_end(env):
  task = env.demonstration_task(0)
  traj = demonstration_trajectory(env, task, TOK, FMT)
  im_end, im_start = TOK.special_id("<|im_end|>"), TOK.special_id("<|im_start|>")
  tokens, mask = traj.tokens, traj.action_mask
  # Every action turn ends with a sampled <|im_end|>; no scaffold token is an action.
  ends = np.flatnonzero(mask & (tokens == im_end))
  assert len(ends) == 2 and mask[-1] and tokens[-1] == im_end
  assert not mask[tokens == im_start].any()
  assert TOK.special_id("<tool_call>") in tokens[mask]
  assert TOK.special_id("<tool_response>") in tokens[~mask]
  # The prompt is rendered once, as the official template renders it.
  assert task.prompt[0] == {"role": "system", "content": "Use the python tool."}
  prompt = FMT.render(list(task.prompt), task.tools, add_generation_prompt=True)
  assert list(tokens[: len(prompt)]) == prompt and not mask[: len(prompt)].any()


def test_episode_runs_the_tool_answers_errors_and_verifies(env):
  task = env.task(1)
  episode = env.episode(task)
  parsed = FMT.parse_turn(
    FMT.action_ids(
      {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "python", "arguments": {"code": "print(6 * 7)"}}],
      }
    )
  )
  step = episode.step(Action(parsed.text, parsed=parsed, tool_calls=parsed.tool_calls))
  assert not step.done and [m["role"] for m in step.observation] == ["tool"]
  assert step.observation[0]["content"].strip() == "42"
  step = episode.step(Action("bad", tool_errors=(("bad_json", "bad JSON in the call"),)))
  assert not step.done and step.observation[0]["content"].startswith("error:")
  answer = FMT.parse_turn(TOK.encode(f"so \\boxed{{{task.answer}}}") + [TOK.turn_end_id])
  step = episode.step(Action(answer.text, parsed=answer))
  assert step.done and step.reward == 1.0 and step.info["verdict"] == "exact"


def test_registry_builds_the_dataset_env_and_refuses_unknown_kwargs(env, tmp_path):
  with pytest.raises(ValueError, match="not options of 'dataset'"):
    registry.builtin_kwargs(registry.ENVIRONMENTS["dataset"], {"paht": "x"})


def _calls_action(*codes):
  return Action("calls", tool_calls=tuple(chat.ToolCall("python", {"code": c}) for c in codes))


def test_tool_budget_refuses_calls_past_the_count_and_the_time():
  # Calls past the per-turn count are answered with an error, never run.
  ran = []

  def call_tool(name, arguments, seconds=None):
    ran.append((name, arguments["code"], seconds))
    return "ok"

  meter = ToolMeter(ToolBudget(calls_per_turn=3))
  messages, events = answer_tool_calls(_calls_action(*"abcde"), call_tool, meter)
  assert [c for _, c, _ in ran] == ["a", "b", "c"] and all(s is None for *_, s in ran)
  assert [m["content"] for m in messages][:3] == ["ok"] * 3
  assert all("at most 3 tool calls per turn" in m["content"] for m in messages[3:])
  assert len(messages) == 5 and events == ["tool_budget_calls"]

  # A tool that uses all the time it is given: the turn's budget is spent by
  # the first call, whatever the machine's load, so the rest are refused.
  def sleepy(name, arguments, seconds=None):
    del name, arguments
    ran.append(seconds)
    time.sleep(seconds)
    return "slept"

  ran.clear()
  meter = ToolMeter(ToolBudget(seconds_per_turn=0.2, seconds_per_episode=0.5))
  messages, events = answer_tool_calls(_calls_action("x", "y", "z"), sleepy, meter)
  assert ran == [0.2] and events == ["tool_budget_time"]
  assert [m["content"] for m in messages][0] == "slept"
  assert all("tool time is spent" in m["content"] for m in messages[1:])
  # The next turn has 0.2 s again, but the episode only what is left of 0.5 s.
  messages, events = answer_tool_calls(_calls_action("x"), sleepy, meter)
  assert ran[1] <= 0.2 and events == []
  answer_tool_calls(_calls_action("x"), sleepy, meter)
  messages, events = answer_tool_calls(_calls_action("x"), sleepy, meter)
  assert events == ["tool_budget_time"] and meter.episode_seconds >= 0.5


def test_a_sleeping_python_call_is_cut_to_the_turns_tool_time(env):
  # Six sleeping calls in one turn under the sandbox's 3 s wall clock: the
  # first is cut to the turn's 1 s, the other five are not run.
  c = sections.Env.defaults()
  c.update(
    name="dataset",
    tool_seconds_per_turn=1.0,
    allow_unisolated=True,
    kwargs={"path": env.config.path, "tools": ("python",)},
  )
  episode_env = registry.make_env(c)
  assert episode_env.tool_budget == ToolBudget(8, 1.0, 0.0)  # env config's, via the registry
  step = episode_env.episode(episode_env.task(0)).step(
    _calls_action(*["import time\ntime.sleep(30)"] * 6)
  )
  contents = [m["content"] for m in step.observation]
  assert "wall-clock limit 1s" in contents[0], contents[0]
  assert all("tool time is spent" in c for c in contents[1:]) and len(contents) == 6
  assert step.info["events"] == ["tool_budget_time"]
