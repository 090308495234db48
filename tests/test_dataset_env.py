"""The dataset environment over verl-style rows, with the qwen3 format.

A row's completion becomes an SFT transcript whose action tokens are
exactly the assistant turns with their <|im_end|> (the bridges are not);
an episode runs the python tool in the sandbox for a tool call, answers a
malformed call with an error, and scores the final answer with the math
verifier.
"""

import json

import numpy as np
import pytest

from sao_jax.envs import chat, registry
from sao_jax.envs.base import Action
from sao_jax.envs.dataset import DatasetConfig, DatasetEnv
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.envs.tokenizer import Qwen3Tokenizer
from sao_jax.data.prompts import EVAL_OFFSET

TOK = Qwen3Tokenizer()
FMT = chat.make_format("qwen3", TOK)


def _rows(n):
  for i in range(n):
    call = {"name": "python", "arguments": {"code": f"print({i} * 7)"}}
    yield {"data_source": "toy", "prompt": [{"role": "user", "content": f"What is {i} * 7?"}],
           "reward_model": {"ground_truth": str(i * 7)},
           "completion": [{"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "content": str(i * 7)},
                          {"role": "assistant", "content": f"\\boxed{{{i * 7}}}"}]}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  path = tmp_path_factory.mktemp("data") / "train.jsonl"
  lines = [json.dumps(r) for r in _rows(10)] + ["{not json", json.dumps({"prompt": "x"})]
  path.write_text("\n".join(lines) + "\n")
  return DatasetEnv(DatasetConfig(path=str(path), heldout_fraction=0.2, tools=("python",),
                                  system_prompt="Use the python tool."))


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
  assert list(tokens[:len(prompt)]) == prompt and not mask[:len(prompt)].any()


def test_episode_runs_the_tool_answers_errors_and_verifies(env):
  task = env.task(1)
  episode = env.episode(task)
  parsed = FMT.parse_turn(FMT.action_ids({"role": "assistant", "content": "", "tool_calls": [
      {"name": "python", "arguments": {"code": "print(6 * 7)"}}]}))
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
