"""Evaluation as the paper runs it: named sets, pass@1 and pass@k with standard errors.

`eval.sets` names the sets (sections.parse_eval_sets; `set_environments`
builds each one's environment); `evaluate_sets` runs `pass_at_1` on each
and writes `<out>/<set>/samples.jsonl` and `<out>/<set>/summary.json`.

Each of the first `num_tasks` held-out tasks of a set is sampled
`samples_per_task` (k) times at `eval.temperature` / `eval.top_p`; a
sample succeeds when its total reward reaches 1, the full reward of every
environment here (a partial credit such as online_style's `quality_credit`
is not a success). pass@1 is the mean over tasks of each task's success
rate, and its standard error is the spread of those per-task rates over
tasks, std / sqrt(num_tasks), so it covers both the choice of tasks and
the sampling (at temperature 1 one sample per task leaves about 2.5 points
of error on 400 tasks; more samples per task shrink the sampling part).
pass@k (k = 2, 4, ... and k itself) is the unbiased estimator
`pass_at_k` averaged over tasks, its standard error the same way.

Per-sample records (`sample_record`) hold what a person checks by reading:
the transcript and each action turn decoded, the reward, the events the
environment reported (e.g. "tool_error") and the last step's `info` (an
environment's verdict, e.g. humaneval's "passed" / "failed" / "timeout"),
which the evaluation's own episode wrapper keeps, since a Trajectory
carries tokens and rewards only.
"""

from __future__ import annotations

import collections
import json

import numpy as np

from sao_jax.config import sections
from sao_jax.data import files
from sao_jax.data import prompts as prompt_data
from sao_jax.envs import base
from sao_jax.envs.base import StepResult


def pass_at_1(config, model_cfg, params, env, tokenizer, *, seed: int,
              samples: list | None = None) -> dict:
  """Samples `eval.samples_per_task` episodes of each of the first `eval.num_tasks`
  held-out tasks of `env` (one set); its `summarize` (pass@1 and pass@k),
  tool-call errors per sample and dropped samples.

  The engine and driver are the run's (`factories.make_engine` /
  `make_driver`: the rollout section, the chat format, the tool-output
  cap) with the eval section's slots, temperature, top_p and decode_steps, one
  episode per prompt and no simulated tool latency. An environment with a finite held-out set
  (`env.num_eval_tasks`, e.g. a dataset's held-out rows) is evaluated on
  at most that many tasks, so no task is counted twice. A `samples` list
  gets one record (`sample_record`) per sampled episode.
  """
  from sao_jax.train import factories  # pylint: disable=g-import-not-at-top
  e = config.eval
  num_tasks, samples_per_task = e.num_tasks, e.samples_per_task
  limit = base.num_eval_tasks(env)
  if limit is not None:
    num_tasks = min(num_tasks, int(limit))
  # One episode per prompt (a GRPO arm's groups are a training matter):
  # samples_per_task repeats the prompt instead.
  engine = factories.make_engine(config, model_cfg, params, seed=seed, slots=e.slots,
                                 temperature=e.temperature, top_p=e.top_p,
                                 decode_steps=e.decode_steps, samples_per_prompt=1)
  trajs, records = [], []
  prompts = [i for i in prompt_data.eval_indices(num_tasks) for _ in range(samples_per_task)]
  driver = factories.make_driver(
      config, engine, _Recording(env), tokenizer, iter(prompts), trajs.append,
      tool_latency_s=0.0,
      on_finish=lambda traj, episode: records.append(sample_record(traj, episode, tokenizer)))
  try:
    driver.run()
  finally:
    driver.stop()
  result = summarize(trajs, ks=pass_ks(samples_per_task))
  result["tool_call_errors"] = (
      float(np.mean([r["events"].get("tool_error", 0) for r in records])) if records else 0.0)
  result.update(call_and_verdict_counts(driver.stats, records))
  if samples is not None:
    samples.extend(records)
  # A prompt that cannot be rendered or does not fit max_len, or an
  # environment fault, leaves no episode: say so, never a silently smaller set.
  result["samples_dropped"] = len(prompts) - len(trajs)
  if result["samples_dropped"]:
    print(f"[eval] warning: {result['samples_dropped']} of {len(prompts)} samples gave no "
          f"episode (faults: {dict(driver.stats.env_faults)}); pass@1 is over the "
          f"{result['tasks']} tasks that did", flush=True)
  return result


def call_and_verdict_counts(stats, records: list) -> dict:
  """The sampled tool calls and the answers' verdicts of one evaluation.

  valid_tool_calls: the fraction of the tool calls the policy wrote that
  parsed and named a declared tool (1.0 when it wrote none), with each
  malformed one counted by reason (`tool_call_error_<reason>`, the
  driver's `DriverStats.tool_call_errors`); `verdict_<reason>`: the
  fraction of episodes whose last step carried that verdict (the math
  verifier's "exact", "equivalent", "mismatch", "no_answer", ...; "none": the episode
  ended without an answer, e.g. at the turn or length budget).
  """
  errors = dict(stats.tool_call_errors)
  written = stats.tool_calls + sum(errors.values())
  out = {"valid_tool_calls": stats.tool_calls / written if written else 1.0,
         "tool_calls_per_sample": written / max(len(records), 1)}
  out.update({f"tool_call_error_{k}": v for k, v in sorted(errors.items())})
  verdicts = collections.Counter(
      str(r["info"].get("verdict", "none")) if isinstance(r["info"], dict) else "none"
      for r in records)
  out.update({f"verdict_{k}": v / max(len(records), 1) for k, v in sorted(verdicts.items())})
  return out


def set_environments(config, run_env) -> dict:
  """name -> environment of each of `eval.sets` (sections.parse_eval_sets).

  "heldout" is `run_env` (the run's frozen environment); a built-in or an
  import string is that environment under its defaults, with the run's
  sandbox; a file of rows is the held-out rows of the run's dataset
  environment (its kwargs, `heldout_path` replaced), or of math_tool's
  when the run's environment is not a dataset one. The run's `env.reward`
  applies to its own held-out tasks only.
  """
  from sao_jax.envs import registry  # pylint: disable=g-import-not-at-top
  config = sections.load(config)
  out = {}
  for name, spec in sections.parse_eval_sets(config.eval.sets):
    if spec == "heldout":
      out[name] = run_env
      continue
    e = config.env.replace(reward="")
    if spec.endswith(sections.EVAL_SET_FILES):
      if e.name in ("dataset", "math_tool"):
        e = e.replace(kwargs=dict(e.kwargs, heldout_path=spec))
      else:
        e = e.replace(name="math_tool", kwargs={"heldout_path": spec})
    else:
      e = e.replace(name=spec, kwargs={})
    out[name] = registry.make_env(e)
  return out


def evaluate_sets(config, model_cfg, params, envs: dict, tokenizer, *, seed: int,
                  out_dir: str | None = None) -> dict:
  """`pass_at_1` on each set of `envs`; with `out_dir`, each set's samples
  (`<out_dir>/<set>/samples.jsonl`) and summary (`<out_dir>/<set>/summary.json`).

  Returns the first set's result with every set's under "sets" (the first
  set's numbers stay where a one-set evaluation has always put them).
  """
  per_set = {}
  for name, env in envs.items():
    samples = []
    result = pass_at_1(config, model_cfg, params, env, tokenizer, seed=seed, samples=samples)
    if out_dir is not None:
      where = files.join(out_dir, name)
      write_samples(files.join(where, "samples.jsonl"), samples)
      result["samples_file"] = files.join(where, "samples.jsonl")
      files.write_json(files.join(where, "summary.json"), dict(result, set=name), indent=2)
    per_set[name] = result
  first = next(iter(per_set.values()))
  return {**first, "sets": per_set}


def table(result: dict) -> str:
  """The per-set table of an `evaluate_sets` result, for the terminal."""
  sets = result.get("sets", {"": result})
  ks = sorted({int(k[5:]) for r in sets.values() for k in r
               if k.startswith("pass@") and not k.endswith("_stderr")})
  head = ["set", "tasks", "samples"] + [f"pass@{k}" for k in ks] + [
      "turns", "tool_err", "truncated"]
  rows = [head]
  for name, r in sets.items():
    rows.append([name, str(r["tasks"]), str(r["samples"])] + [
        f"{r.get(f'pass@{k}', float('nan')):.3f}+-{r.get(f'pass@{k}_stderr', float('nan')):.3f}"
        for k in ks] + [f"{r['mean_turns']:.2f}", f"{r.get('tool_call_errors', 0.0):.2f}",
                        f"{r['truncated']:.2f}"])
  widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


# The full reward of every environment here: an episode that earns it solved its task.
SUCCESS_REWARD = 1.0


def solved(total_reward):
  """Whether an episode's total reward (or an array of them) counts as a success."""
  return total_reward >= SUCCESS_REWARD


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k of a task from n samples with c successes (Chen et al. 2021):

      pass@k = 1 - C(n - c, k) / C(n, k)       (n >= k)

  the chance that k of the n samples drawn without replacement hold a
  success, computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i) to stay exact
  in floating point for large n.
  """
  if not 1 <= k <= n or not 0 <= c <= n:
    raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_ks(samples_per_task: int) -> tuple[int, ...]:
  """The k of pass@k reported for n samples per task: 1, 2, 4, ... and n."""
  ks = {1, samples_per_task}
  k = 2
  while k < samples_per_task:
    ks.add(k)
    k *= 2
  return tuple(sorted(ks))


def _mean_stderr(rates) -> tuple[float, float]:
  rates = np.asarray(rates, np.float64)
  if not len(rates):
    return float("nan"), float("nan")
  stderr = float(rates.std(ddof=1) / np.sqrt(len(rates))) if len(rates) > 1 else float("nan")
  return float(rates.mean()), stderr


def summarize(trajs, ks: tuple[int, ...] = (1,)) -> dict:
  """pass@1 and pass@k with their standard errors over tasks, and the episodes' shape.

  pass@1 is the mean over tasks of each task's success rate (the mean over
  its samples); pass@k (k in `ks`, k > 1) the mean over tasks of
  `pass_at_k`, over the tasks with at least k samples. Each standard error
  is the spread of the per-task values over tasks, std / sqrt(tasks).
  """
  by_task = collections.defaultdict(list)
  for t in trajs:
    by_task[t.prompt_id].append(bool(solved(t.total_reward)))
  rates = [np.mean(v) for v in by_task.values()]
  out = dict(zip(("pass@1", "pass@1_stderr"), _mean_stderr(rates)))
  for k in ks:
    if k > 1:
      per_task = [pass_at_k(len(v), sum(v), k) for v in by_task.values() if len(v) >= k]
      out[f"pass@{k}"], out[f"pass@{k}_stderr"] = _mean_stderr(per_task)
  reasons = collections.Counter(t.finish_reason for t in trajs)
  n = max(len(trajs), 1)
  return {
      **out,
      "tasks": len(rates),
      "samples": len(trajs),
      "mean_length": float(np.mean([len(t) for t in trajs])),
      # Sampled (action) tokens per episode: what a generated-token budget counts.
      "mean_generated": float(np.mean([int(np.sum(t.action_mask)) for t in trajs])),
      "mean_turns": float(np.mean([t.num_turns for t in trajs])),
      # Episodes cut by the length budget (rollout.max_len / max_turn_tokens)
      # and by the turn budget, as fractions of the samples.
      "truncated": reasons["length"] / n,
      "max_turns": reasons["max_turns"] / n,
  }


# --- per-sample records ----------------------------------------------------------


class _RecordingEpisode:
  """An episode that keeps its last step's info, as JSON-safe data."""

  def __init__(self, episode):
    self._episode, self.info = episode, {}
    self.events = collections.Counter()  # info["events"] over the episode's steps

  def step(self, action):
    result = self._episode.step(action)
    if isinstance(result, StepResult):
      self.info = _json_safe(result.info)
      events = self.info.get("events", ()) if isinstance(self.info, dict) else ()
      if isinstance(events, (list, tuple)):
        self.events.update(str(e) for e in events)
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
      "events": dict(getattr(episode, "events", {})),
      "actions": actions,
      "transcript": tokenizer.decode(tokens),
  }


def write_samples(path: str, samples: list) -> None:
  """`samples` as JSONL at `path`, written whole (`files.write_text`): by task, and
  within a task by transcript (the order samples finish in varies from run to
  run; the file does not)."""
  order = sorted(samples, key=lambda r: (r["prompt_id"], r["transcript"]))
  files.write_text(path, "".join(json.dumps(record, ensure_ascii=False) + "\n"
                                 for record in order))
