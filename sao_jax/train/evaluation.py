"""Evaluation as the paper runs it: named sets, pass@1, pass@k and maj@k with standard errors.

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
`pass_at_k` averaged over tasks, its standard error the same way; maj@k
(`majority_vote`) where the environment extracts answers; pass@1 per
source where the rows name several (`by_source`).

Nothing about the data is hidden: with `eval.strict` (the default) a set
that lost rows at load fails before sampling (`check_rows`); otherwise
their counts are in the result ("rows_rejected"). A set mostly cut by the
length budget is warned about and flagged (`flag_truncation`). Undefined
statistics are None (null in JSON, never NaN: `finite_json`), and each
set prints its progress (samples, rate, ETA) while it samples.

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
import os

import numpy as np

from sao_jax.config import sections
from sao_jax.data import files
from sao_jax.data import prompts as prompt_data
from sao_jax.envs import base
from sao_jax.envs.base import StepResult
from sao_jax.train import metrics


def pass_at_1(
  config,
  model_cfg,
  params,
  env,
  tokenizer,
  *,
  seed: int,
  samples: list | None = None,
  name: str = "",
) -> dict:
  """Samples `eval.samples_per_task` episodes of each of the first `eval.num_tasks`
  held-out tasks of `env` (one set); its `summarize` (pass@1 and pass@k),
  tool-call errors per sample and dropped samples.

  The engine and driver are the run's (`factories.make_engine` /
  `make_driver`: the rollout section, the chat format, the tool-output
  cap) with the eval section's slots, temperature, top_p and decode_steps, one
  episode per prompt and no simulated tool latency. An environment with a finite held-out set
  (`env.num_eval_tasks`, e.g. a dataset's held-out rows) is evaluated on
  at most that many tasks, so no task is counted twice. A `samples` list
  gets one record (`sample_record`) per sampled episode. Progress lines
  (`metrics.CountProgress`, labelled `name`) show the samples done, their
  rate and the ETA.
  """
  from sao_jax.train import factories

  e = config.eval
  num_tasks, samples_per_task = e.num_tasks, e.samples_per_task
  limit = base.num_eval_tasks(env)
  if limit is not None:
    num_tasks = min(num_tasks, int(limit))
  # One episode per prompt (a GRPO arm's groups are a training matter):
  # samples_per_task repeats the prompt instead.
  engine = factories.make_engine(
    config,
    model_cfg,
    params,
    seed=seed,
    slots=e.slots,
    temperature=e.temperature,
    top_p=e.top_p,
    decode_steps=e.decode_steps,
    samples_per_prompt=1,
  )
  trajs, records = [], []
  prompts = [i for i in prompt_data.eval_indices(num_tasks) for _ in range(samples_per_task)]
  meter = metrics.CountProgress(f"[eval] {name or getattr(env, 'name', 'set')}", len(prompts))

  def finish(traj, episode):
    records.append(sample_record(traj, episode, tokenizer))
    meter.tick()

  driver = factories.make_driver(
    config,
    engine,
    _Recording(env),
    tokenizer,
    iter(prompts),
    trajs.append,
    tool_latency_s=0.0,
    on_finish=finish,
  )
  meter.start()
  try:
    driver.run()
  finally:
    driver.stop()
  result = summarize(trajs, ks=pass_ks(samples_per_task))
  result["tool_call_errors"] = (
    float(np.mean([r["events"].get("tool_error", 0) for r in records])) if records else 0.0
  )
  result.update(call_and_verdict_counts(driver.stats, records))
  result.update(majority_vote(records, samples_per_task))
  sources = by_source(records)
  if sources:
    result["sources"] = sources
  if samples is not None:
    samples.extend(records)
  # A prompt that cannot be rendered or does not fit max_len, or an
  # environment fault, leaves no episode: say so, never a silently smaller set.
  result["samples_dropped"] = len(prompts) - len(trajs)
  if result["samples_dropped"]:
    print(
      f"[eval] warning: {result['samples_dropped']} of {len(prompts)} samples gave no "
      f"episode (faults: {dict(driver.stats.env_faults)}); pass@1 is over the "
      f"{result['tasks']} tasks that did",
      flush=True,
    )
  return result


def call_and_verdict_counts(stats, records: list) -> dict:
  """The sampled tool calls and the answers' verdicts of one evaluation.

  The tool calls are those written in the chat format's tool-call syntax
  (an environment with its own action protocol, such as python_tool's
  `py ...` lines, has none). valid_tool_calls: the fraction of them that
  parsed and named a declared tool, null when the policy wrote none (no
  rate to report: never 1.0 beside tool_calls_per_sample 0.0), with each
  malformed one counted by reason (`tool_call_error_<reason>`, the
  driver's `DriverStats.tool_call_errors`); `verdict_<reason>`: the
  fraction of episodes whose last step carried that verdict (the math
  verifier's "exact", "equivalent", "mismatch", "no_answer", ...; "none": the episode
  ended without an answer, e.g. at the turn or length budget).
  """
  errors = dict(stats.tool_call_errors)
  written = stats.tool_calls + sum(errors.values())
  out = {
    "valid_tool_calls": stats.tool_calls / written if written else None,
    "tool_calls_per_sample": written / max(len(records), 1),
  }
  out.update({f"tool_call_error_{k}": v for k, v in sorted(errors.items())})
  verdicts = collections.Counter(
    str(r["info"].get("verdict", "none")) if isinstance(r["info"], dict) else "none"
    for r in records
  )
  out.update({f"verdict_{k}": v / max(len(records), 1) for k, v in sorted(verdicts.items())})
  return out


def set_environments(config, run_env) -> dict:
  """name -> environment of each of `eval.sets` (sections.parse_eval_sets).

  "heldout" is `run_env` (the run's frozen environment); a built-in or an
  import string is that environment under its defaults, with the run's
  sandbox; a file of rows is the held-out rows of the run's dataset
  environment (its kwargs, `heldout_path` replaced), or of math_tool's
  when the run's environment is not a dataset one. The run's `env.reward`
  applies to its own held-out tasks only. With `eval.strict` (the default)
  a set with a rejected row (`set_rejections`) is a ConfigError naming the
  counts, before anything is sampled.
  """
  from sao_jax.envs import registry

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
  if config.eval.strict:
    for name, env in out.items():
      check_rows(name, set_rejections(env))
  return out


def set_rejections(env) -> list[tuple[str, str]]:
  """The rows of `env`'s held-out set rejected when it loaded, as (where, reason).

  An environment that reads rows (dataset, math_tool, repo_repair) keeps
  every rejection in `rejected`; the set's are those read from the file its
  held-out tasks come from: `heldout_path`, or `path` when the held-out
  rows are a fraction of it (any of its rejected rows might have been
  one). Training rows dropped because they are held out are not the set's.
  [] for an environment without rows.
  """
  rejected = list(getattr(env, "rejected", None) or ())
  config = getattr(env, "config", None)
  source = getattr(config, "heldout_path", "") or getattr(config, "path", "")
  if not source:
    return rejected
  return [(where, reason) for where, reason in rejected if str(where).startswith(f"{source}:")]


def rejection_counts(rejected: list[tuple[str, str]]) -> dict:
  """ "rows_rejected" and its nonzero kinds ("rows_rejected_<kind>", datasets.hygiene_counts)."""
  from sao_jax.data import datasets

  kinds = {f"rows_rejected_{k}": n for k, n in datasets.hygiene_counts(rejected).items() if n}
  return {"rows_rejected": len(rejected), **kinds}


def check_rows(name: str, rejected: list[tuple[str, str]]) -> None:
  """Raises ConfigError (one line, with the counts and the first) if the set `name`
  lost any row at load."""
  if not rejected:
    return
  counts = rejection_counts(rejected)
  kinds = ", ".join(
    f"{n} {k[len('rows_rejected_') :]}" for k, n in counts.items() if k != "rows_rejected"
  )
  where, reason = rejected[0]
  raise sections.ConfigError(
    f"eval set {name!r}: {len(rejected)} rows rejected ({kinds}; first: {where}: {reason}); "
    "an evaluation of the rest would not be the set's: fix the rows, or set "
    "eval.strict=False to evaluate the rest with the counts reported"
  )


def check_policy_dir(hf_dir: str) -> None:
  """Raises ConfigError (one line) unless `hf_dir` holds a policy to evaluate: its
  config.json exists and names no `...ForTokenClassification` architecture
  (launch/export.py's OUT-value, the critic, has no language-model head)."""
  path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(path):
    raise sections.ConfigError(
      f"--hf_dir {hf_dir}: no config.json there (an HF model "
      "directory, as launch/export.py writes, is needed)"
    )
  try:
    with open(path, encoding="utf-8") as f:
      architectures = json.load(f).get("architectures") or []
  except (OSError, ValueError, AttributeError) as e:
    raise sections.ConfigError(
      f"--hf_dir {hf_dir}: config.json is not a JSON object ({e})"
    ) from None
  value = [a for a in architectures if str(a).endswith("ForTokenClassification")]
  if value:
    policy = hf_dir.rstrip("/")
    policy = policy[: -len("-value")] if policy.endswith("-value") else "the policy's directory"
    raise sections.ConfigError(
      f"--hf_dir {hf_dir}: a value model ({value[0]}, launch/export.py's critic export), "
      f"not a policy: it has no language-model head to sample from; evaluate {policy}"
    )


def evaluate_sets(
  config, model_cfg, params, envs: dict, tokenizer, *, seed: int, out_dir: str | None = None
) -> dict:
  """`pass_at_1` on each set of `envs`; with `out_dir`, each set's samples
  (`<out_dir>/<set>/samples.jsonl`) and summary (`<out_dir>/<set>/summary.json`).

  Returns the first set's result with every set's under "sets" (the first
  set's numbers stay where a one-set evaluation has always put them). Each
  set's result counts the rows it lost at load ("rows_rejected", by kind;
  nonzero only with eval.strict off) and flags a set whose samples mostly
  hit the length budget ("mostly_truncated").
  """
  per_set = {}
  for name, env in envs.items():
    samples = []
    rejected = set_rejections(env)
    if sections.load(config).eval.strict:  # set_environments checked; envs may come from elsewhere
      check_rows(name, rejected)
    result = pass_at_1(
      config, model_cfg, params, env, tokenizer, seed=seed, samples=samples, name=name
    )
    result.update(rejection_counts(rejected))
    result["mostly_truncated"] = flag_truncation(name, result)
    if out_dir is not None:
      where = files.join(out_dir, name)
      write_samples(files.join(where, "samples.jsonl"), samples)
      result["samples_file"] = files.join(where, "samples.jsonl")
      files.write_json(
        files.join(where, "summary.json"),
        finite_json(dict(result, set=name)),
        indent=2,
        allow_nan=False,
      )
    per_set[name] = result
  first = next(iter(per_set.values()))
  return {**first, "sets": per_set}


def finite_json(value):
  """`value` with every non-finite float (NaN, inf) made None, in nested dicts and
  lists: strict JSON, which `json.dumps(allow_nan=False)` then guarantees. The
  statistics here are None where undefined already; this keeps any other
  number's NaN (an environment's info) out of summary.json too."""
  if isinstance(value, float):
    return value if np.isfinite(value) else None
  if isinstance(value, dict):
    return {k: finite_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [finite_json(v) for v in value]
  return value


# Above this fraction of samples cut by the length budget, a set's pass@k
# measures the budget more than the policy.
MOSTLY_TRUNCATED = 0.5


def flag_truncation(name: str, result: dict) -> bool:
  """Whether more than MOSTLY_TRUNCATED of a set's samples hit the length budget;
  if so, says so in one warning line."""
  if result.get("truncated", 0.0) <= MOSTLY_TRUNCATED:
    return False
  print(
    f"[eval] warning: set {name!r}: {result['truncated']:.0%} of its {result['samples']} "
    "samples hit the length budget (rollout.max_len / max_turn_tokens); its pass@k "
    "measures the budget, not the policy: raise the budget",
    flush=True,
  )
  return True


def table(result: dict) -> str:
  """The per-set table of an `evaluate_sets` result, for the terminal: pass@k and
  maj@k (each +- its standard error, "-" where undefined), the rows rejected
  at load, and under a set with sources, one row per source ("set/source").
  A set flagged `mostly_truncated` has "!" after its truncated fraction."""
  sets = result.get("sets", {"": result})
  cols = sorted(
    {
      k
      for r in sets.values()
      for k in r
      if k.startswith(("pass@", "maj@")) and not k.endswith("_stderr")
    },
    key=lambda k: (k[0] == "m", int(k.split("@")[1])),
  )
  head = ["set", "tasks", "samples"] + cols + ["turns", "tool_err", "truncated", "rejected"]
  rows = [head]
  for name, r in sets.items():
    rows.append(_table_row(name, r, cols))
    for source, sr in r.get("sources", {}).items():
      rows.append(_table_row(f"{name}/{source}", sr, cols))
  widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def fmt_number(v, digits: int = 3) -> str:
  """`v` to `digits` places, "-" for None or a non-finite float (an undefined statistic)."""
  return "-" if v is None or (isinstance(v, float) and not np.isfinite(v)) else f"{v:.{digits}f}"


def _table_row(name: str, r: dict, cols: list) -> list[str]:
  row = [name, str(r["tasks"]), str(r["samples"])]
  row += [
    f"{fmt_number(r.get(k))}+-{fmt_number(r.get(f'{k}_stderr'))}" if k in r else "" for k in cols
  ]
  if "mean_turns" not in r:  # a source's row: pass@1 only
    return row + ["", "", "", ""]
  return row + [
    fmt_number(r["mean_turns"], 2),
    fmt_number(r.get("tool_call_errors", 0.0), 2),
    fmt_number(r["truncated"], 2) + ("!" if r.get("mostly_truncated") else ""),
    str(r.get("rows_rejected", 0)),
  ]


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


def _mean_stderr(rates) -> tuple[float | None, float | None]:
  """The mean and its standard error over tasks; None where undefined (no
  task; one task's spread), so that no NaN reaches a JSON file."""
  rates = np.asarray(rates, np.float64)
  if not len(rates):
    return None, None
  stderr = float(rates.std(ddof=1) / np.sqrt(len(rates))) if len(rates) > 1 else None
  return float(rates.mean()), stderr


def _mean(values) -> float | None:
  return float(np.mean(values)) if len(values) else None


def summarize(trajs, ks: tuple[int, ...] = (1,)) -> dict:
  """pass@1 and pass@k with their standard errors over tasks, and the episodes' shape.

  pass@1 is the mean over tasks of each task's success rate (the mean over
  its samples); pass@k (k in `ks`, k > 1) the mean over tasks of
  `pass_at_k`, over the tasks with at least k samples. Each standard error
  is the spread of the per-task values over tasks, std / sqrt(tasks). A
  statistic with nothing to average over (a standard error of one task, a
  mean over no samples) is None, written as null.
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
    "mean_length": _mean([len(t) for t in trajs]),
    # Sampled (action) tokens per episode: what a generated-token budget counts.
    "mean_generated": _mean([int(np.sum(t.action_mask)) for t in trajs]),
    "mean_turns": _mean([t.num_turns for t in trajs]),
    # Episodes cut by the length budget (rollout.max_len / max_turn_tokens)
    # and by the turn budget, as fractions of the samples.
    "truncated": reasons["length"] / n,
    "max_turns": reasons["max_turns"] / n,
  }


def majority_vote(records: list, samples_per_task: int) -> dict:
  """maj@n (n = `samples_per_task`) with its standard error over tasks, or {}.

  Each task's samples vote with their extracted answers (`sample_record`'s
  "answer", runs of whitespace made one space; a sample without one does
  not vote); the task scores the success of the most voted answer, a tie
  scoring the mean over the tied answers (the expected score of a random
  tie-break), and 0 when no sample answered. Reported only where it means
  something: n > 1 and the environment extracts answers (dataset and
  math_tool rows do; code environments do not). A task with samples
  dropped votes with those it has.
  """
  if samples_per_task < 2 or all(r.get("answer") is None for r in records):
    return {}
  by_task = collections.defaultdict(list)
  for r in records:
    by_task[r["prompt_id"]].append(r)
  mean, stderr = _mean_stderr([_majority_score(v) for v in by_task.values()])
  return {f"maj@{samples_per_task}": mean, f"maj@{samples_per_task}_stderr": stderr}


def _majority_score(samples: list) -> float:
  outcomes = collections.defaultdict(list)  # answer -> successes of the samples giving it
  for r in samples:
    if r.get("answer") is not None:
      outcomes[" ".join(str(r["answer"]).split())].append(bool(r["success"]))
  if not outcomes:
    return 0.0
  top = max(len(v) for v in outcomes.values())
  return float(np.mean([np.mean(v) for v in outcomes.values() if len(v) == top]))


def by_source(records: list) -> dict:
  """source -> {tasks, samples, pass@1, pass@1_stderr} of the samples whose rows
  name a `data_source`, when they name more than one ({} otherwise: one
  source's numbers are the set's)."""
  groups = collections.defaultdict(lambda: collections.defaultdict(list))
  for r in records:
    if r.get("source") is not None:
      groups[r["source"]][r["prompt_id"]].append(bool(r["success"]))
  if len(groups) < 2:
    return {}
  out = {}
  for source in sorted(groups):
    rates = [np.mean(v) for v in groups[source].values()]
    mean, stderr = _mean_stderr(rates)
    out[source] = {
      "tasks": len(rates),
      "samples": sum(len(v) for v in groups[source].values()),
      "pass@1": mean,
      "pass@1_stderr": stderr,
    }
  return out


# --- per-sample records ----------------------------------------------------------


class _RecordingEpisode:
  """An episode that keeps its last step's info, as JSON-safe data, and its
  task's source (a dataset row's `data_source`)."""

  def __init__(self, episode, task=None):
    self._episode, self.info = episode, {}
    meta = getattr(task, "meta", None)
    source = meta.get("data_source") if isinstance(meta, dict) else None
    self.source = str(source) if source not in (None, "") else None
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
    return _RecordingEpisode(self._env.episode(task), task)


def _json_safe(info) -> dict:
  try:
    return json.loads(json.dumps(info, default=repr))
  except (TypeError, ValueError, RecursionError):
    return {"unserializable": repr(type(info))}


def sample_record(traj, episode, tokenizer) -> dict:
  """One sampled episode as plain data: what `launch/eval.py` writes per line."""
  tokens = traj.tokens.tolist()
  info = getattr(episode, "info", {})
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
    # The answer the environment extracted (dataset / math_tool), for maj@k.
    "answer": info.get("answer") if isinstance(info, dict) else None,
    "source": getattr(episode, "source", None),
    "info": info,
    "events": dict(getattr(episode, "events", {})),
    "actions": actions,
    "transcript": tokenizer.decode(tokens),
  }


def write_samples(path: str, samples: list) -> None:
  """`samples` as JSONL at `path`, written whole (`files.write_text`): by task, and
  within a task by transcript (the order samples finish in varies from run to
  run; the file does not)."""
  order = sorted(samples, key=lambda r: (r["prompt_id"], r["transcript"]))
  files.write_text(path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in order))
