"""pass@1 on held-out tasks, with its standard error.

Each of the first `num_tasks` held-out tasks is sampled `samples_per_task`
times; a sample succeeds when its total reward reaches 1, the full reward
of every environment here (a partial credit such as online_style's
`quality_credit` is not a success). pass@1 is the mean over
tasks of each task's success rate, and its standard error is the spread of
those per-task rates over tasks, std / sqrt(num_tasks), so it covers both
the choice of tasks and the sampling (at temperature 1 one sample per task
leaves about 2.5 points of error on 400 tasks; more samples per task shrink
the sampling part).

Per-sample records (`pass_at_1(samples=[])`, written as JSONL by
`launch/eval.py`) hold what a person checks by reading: the transcript and
each action turn decoded, the reward, and the last step's `info` (an
environment's verdict, e.g. humaneval's "passed" / "failed" / "timeout"),
which the evaluation's own episode wrapper keeps, since a Trajectory
carries tokens and rewards only.
"""

from __future__ import annotations

import collections
import json

import numpy as np

from sao_jax import files
from sao_jax.data import prompts as prompt_data
from sao_jax.envs.base import StepResult


def pass_at_1(config, model_cfg, params, env, tokenizer, *, seed: int,
              samples: list | None = None) -> dict:
  """Samples `eval.samples_per_task` episodes of each of the first `eval.num_tasks`
  held-out tasks of `config`.

  The engine and driver are the run's (`factories.make_engine` /
  `make_driver`: the rollout section, the chat format, the tool-output
  cap) with the eval section's slots, temperature and decode_steps, one
  episode per prompt and no simulated tool latency. An environment with a finite held-out set
  (`env.num_eval_tasks`, e.g. a dataset's held-out rows) is evaluated on
  at most that many tasks, so no task is counted twice. A `samples` list
  gets one record (`sample_record`) per sampled episode.
  """
  from sao_jax import factories  # pylint: disable=g-import-not-at-top
  e = config.eval
  num_tasks, samples_per_task = e.num_tasks, e.samples_per_task
  limit = getattr(env, "num_eval_tasks", None)
  if limit is not None:
    num_tasks = min(num_tasks, int(limit))
  # One episode per prompt (a GRPO arm's groups are a training matter):
  # samples_per_task repeats the prompt instead.
  engine = factories.make_engine(config, model_cfg, params, seed=seed, slots=e.slots,
                                 temperature=e.temperature, decode_steps=e.decode_steps,
                                 samples_per_prompt=1)
  trajs = []
  prompts = [i for i in prompt_data.eval_indices(num_tasks) for _ in range(samples_per_task)]
  options = {}
  if samples is not None:
    env = _Recording(env)
    options["on_finish"] = lambda traj, episode: samples.append(
        sample_record(traj, episode, tokenizer))
  driver = factories.make_driver(config, engine, env, tokenizer, iter(prompts), trajs.append,
                                 tool_latency_s=0.0, **options)
  try:
    driver.run()
  finally:
    driver.stop()
  result = summarize(trajs)
  # A prompt that cannot be rendered or does not fit max_len, or an
  # environment fault, leaves no episode: say so, never a silently smaller set.
  result["samples_dropped"] = len(prompts) - len(trajs)
  if result["samples_dropped"]:
    print(f"[eval] warning: {result['samples_dropped']} of {len(prompts)} samples gave no "
          f"episode (faults: {dict(driver.stats.env_faults)}); pass@1 is over the "
          f"{result['tasks']} tasks that did", flush=True)
  return result


# The full reward of every environment here: an episode that earns it solved its task.
SUCCESS_REWARD = 1.0


def solved(total_reward):
  """Whether an episode's total reward (or an array of them) counts as a success."""
  return total_reward >= SUCCESS_REWARD


def summarize(trajs) -> dict:
  """pass@1, its standard error over tasks, and episode shape of sampled episodes."""
  by_task = collections.defaultdict(list)
  for t in trajs:
    by_task[t.prompt_id].append(float(solved(t.total_reward)))
  rates = np.array([np.mean(v) for v in by_task.values()])
  stderr = float(rates.std(ddof=1) / np.sqrt(len(rates))) if len(rates) > 1 else float("nan")
  return {
      "pass@1": float(rates.mean()),
      "pass@1_stderr": stderr,
      "tasks": len(rates),
      "samples": len(trajs),
      "mean_length": float(np.mean([len(t) for t in trajs])),
      # Sampled (action) tokens per episode: what a generated-token budget counts.
      "mean_generated": float(np.mean([int(np.sum(t.action_mask)) for t in trajs])),
      "mean_turns": float(np.mean([t.num_turns for t in trajs])),
  }


# --- per-sample records ----------------------------------------------------------


class _RecordingEpisode:
  """An episode that keeps its last step's info, as JSON-safe data."""

  def __init__(self, episode):
    self._episode, self.info = episode, {}

  def step(self, action):
    result = self._episode.step(action)
    if isinstance(result, StepResult):
      self.info = _json_safe(result.info)
    return result


class _Recording:
  """`env` with every episode wrapped in a `_RecordingEpisode`."""

  def __init__(self, env):
    self._env = env

  def __getattr__(self, attr):  # name, max_turns, task, num_eval_tasks, ...
    return getattr(self._env, attr)

  def episode(self, task):
    return _RecordingEpisode(self._env.episode(task))


def _json_safe(info) -> dict:
  try:
    return json.loads(json.dumps(info, default=repr))
  except (TypeError, ValueError, RecursionError):
    return {"unserializable": repr(type(info))}


def sample_record(traj, episode, tokenizer) -> dict:
  """One sampled episode as plain data: what `launch/eval.py` writes per line."""
  tokens = traj.tokens.tolist()
  actions = []
  for start in traj.turn_starts.tolist():
    end = start
    while end < len(tokens) and traj.action_mask[end]:
      end += 1
    actions.append(tokenizer.decode(tokens[start:end]))
  return {
      "task": traj.prompt_id - prompt_data.EVAL_OFFSET,
      "prompt_id": traj.prompt_id,
      "reward": traj.total_reward,
      "success": bool(solved(traj.total_reward)),
      "turns": traj.num_turns,
      "finish_reason": traj.finish_reason,
      "info": getattr(episode, "info", {}),
      "actions": actions,
      "transcript": tokenizer.decode(tokens),
  }


def write_samples(path: str, samples: list) -> None:
  """`samples` as JSONL at `path` (by task), written whole (`files.write_text`)."""
  files.write_text(path, "".join(json.dumps(record, ensure_ascii=False) + "\n"
                                 for record in sorted(samples, key=lambda r: r["prompt_id"])))
