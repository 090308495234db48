"""The RL stage: one loop over a trajectory source, whatever the source is.

Each step takes a batch from the source (sao_jax/train/sources.py: async, sync or
fleet), computes the estimator's host-side baseline if it has one, packs,
runs the jitted RL step (sao_jax/train/train_step.py), publishes weights every
`rl.sync_every` updates, writes the metrics and checkpoints (the source's
state included). It stops at `rl.steps` or when the budget of generated
tokens (`rl.max_generated_tokens`, counted over every stage) is spent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import flax.linen as nn
import jax
import numpy as np

from sao_jax.data import packing
from sao_jax.train import distributed, preemption, sources, stopping
from sao_jax.train.evaluation import solved
from sao_jax.train.metrics import progress
from sao_jax.train.run import Run, wait
from sao_jax.train.train_step import dis_warnings

# What the progress line shows of an RL step's metrics.
PROGRESS_KEYS = {
  "rollout/reward_mean": "reward",
  "policy/loss": "pi_loss",
  "critic/explained_variance": "expl_var",
  "policy/masked_low_frac": "dis_low",
  "policy/masked_high_frac": "dis_high",
  "policy/clip_frac": "clipped",
  "policy/clip_low_frac": "clip_low",
  "policy/clip_high_frac": "clip_high",
  "policy_lag/mean": "lag",
  "trainer/idle_fraction": "idle",
  "queue/rejected": "rejected",
}


def rl_metrics(
  trajs,
  rewards: np.ndarray,
  counts: sources.RolloutCounts,
  *,
  generated_total: int,
  elapsed: float,
  wait: float,
  wait_total: float,
  train_total: float,
  restarts: int,
  updates_skipped: int,
  queue_depth: int,
  rejected: dict,
) -> dict:
  """The rollout, queue and time metrics of one RL step (the train step's are apart).

  Counters are cumulative over the launch, so a plot of one shows its rate;
  each counter with reasons is written as a total and one metric per reason
  seen. `rejected` is one copy of the source's rejections, so that the total
  and its reasons agree.
  """
  per_s = lambda x: x / max(elapsed, 1e-6)
  m = {
    "rollout/reward_mean": float(rewards.mean()),
    # Episodes with the full reward (pass@1's rule): differs from the
    # mean reward where an environment gives partial credit.
    "rollout/success_frac": float(solved(rewards).mean()),
    "rollout/length_mean": float(np.mean([len(t) for t in trajs])),
    "rollout/turns_mean": float(np.mean([t.num_turns for t in trajs])),
    "rollout/generated_tokens_per_s": per_s(counts.generated_tokens),
    "rollout/generated_tokens_total": generated_total,
    "rollout/restarts": restarts,
    "policy/updates_skipped_total": updates_skipped,
    "rollout/env_faults": sum(counts.env_faults.values()),
    "rollout/tool_call_errors": sum(counts.tool_call_errors.values()),
    "queue/depth": queue_depth,
    "queue/rejected": sum(rejected.values()),
    "trainer/idle_fraction": per_s(wait_total),
    "trainer/batch_wait_s": wait,
    # Wall-clock split: the trainer thread trains or waits for data; the
    # rollout thread (async: at the same time) generates or waits on
    # environment steps with no slot to decode.
    "time/train_frac": per_s(train_total),
    "time/wait_frac": per_s(wait_total),
  }
  if counts.generate_seconds is not None:
    m["time/generate_frac"] = per_s(counts.generate_seconds)
  if counts.env_wait_seconds is not None:
    m["time/env_frac"] = per_s(counts.env_wait_seconds)
  m.update({f"rollout/env_fault_{k}": v for k, v in counts.env_faults.items()})
  m.update({f"rollout/tool_call_error_{k}": v for k, v in counts.tool_call_errors.items()})
  m.update({f"rollout/env_event_{k}": v for k, v in counts.env_events.items()})
  m.update({f"queue/rejected_{k}": v for k, v in rejected.items()})
  return m


@dataclasses.dataclass
class _Clock:
  """Where the trainer thread's time goes: waiting for data or training."""

  start: float = dataclasses.field(default_factory=time.time)
  wait_total: float = 0.0
  train_total: float = 0.0
  last_wait: float = 0.0

  @contextlib.contextmanager
  def waiting(self):
    t0 = time.time()
    yield
    self.last_wait = time.time() - t0
    self.wait_total += self.last_wait

  @contextlib.contextmanager
  def training(self):
    t0 = time.time()
    yield
    self.train_total += time.time() - t0

  @property
  def elapsed(self) -> float:
    return time.time() - self.start


@dataclasses.dataclass
class _SkipGuard:
  """Counts skipped (non-finite) updates; a run of them stops the run."""

  limit: int
  last_checkpoint: object  # () -> int | None
  run_length: int = 0  # consecutive skipped actor updates
  total: int = 0

  def record(self, skipped: bool, step: int) -> None:
    # Skipped updates leave params and version unchanged; a run of them
    # means the run has diverged: stop before writing anything more.
    self.run_length = self.run_length + 1 if skipped else 0
    self.total += int(skipped)
    if self.run_length >= self.limit:
      raise stopping.StopTraining(
        f"{self.run_length} consecutive RL steps had a non-finite loss or gradient "
        f"(rl.max_nonfinite_updates = {self.limit}), last at step {step}; "
        f"params were not updated by them and the last checkpoint "
        f"({self.last_checkpoint()}) is intact"
      )
    if skipped:
      print(f"[rl] step {step}: non-finite loss or gradient, update skipped", flush=True)


def _train_step(run: Run, batch) -> dict:
  with jax.set_mesh(run.mesh), nn.logical_axis_rules(run.rules):
    run.state, m = run.rl_step(run.state, batch)
    wait(run.state)
  return dict(jax.device_get(m))


def _log(run: Run, step: int, m: dict, force: bool) -> None:
  c = run.config.rl
  if step % run.config.log_every == 0 or step == c.steps or force:
    rec = run.metrics.write(step, m, "rl")
    progress("rl", step, c.steps, rec, PROGRESS_KEYS)
    if distributed.is_primary():  # DIS diagnostics past their warning levels
      for line in dis_warnings(rec):
        print(f"[rl] {step}/{c.steps} warning: {line}", flush=True)


def _checkpoint(run: Run, source: sources.TrajectorySource, baseline_state) -> None:
  run.meta["source"] = source.state()
  # Under the estimator's own name: a resume with another rl.advantage
  # starts that estimator afresh instead of misreading this one's state.
  run.meta["estimator_state"] = (
    {}
    if baseline_state is None
    else {run.config.rl.advantage: [np.asarray(x).tolist() for x in baseline_state]}
  )
  run.save()


def rl(run: Run) -> None:
  c, config = run.config.rl, run.config
  # A critic-free estimator's host state (the running mean's window), checkpointed.
  estimator = run.step_cfg.estimator
  baseline_state = run.meta["estimator_state"].get(c.advantage)
  if baseline_state is None and estimator.init_state is not None:
    baseline_state = estimator.init_state(c)
  source = sources.make_source(run, run.meta.get("source"))
  clock, skips = _Clock(), _SkipGuard(c.max_nonfinite_updates, run.ckpt.latest_step)
  # Tokens generated before this launch: value pretraining's and, after a
  # resume, the RL tokens up to the checkpoint (rl.max_generated_tokens).
  tokens_before = run.meta.get("generated_tokens", 0)
  budget = c.max_generated_tokens
  finished = False
  with preemption.Notice() as notice:
    try:
      for step in range(run.meta["stage_step"] + 1, c.steps + 1):
        with clock.waiting():
          trajs = source.take(c.batch_size)
        rewards = np.array([t.total_reward for t in trajs], np.float32)
        baseline = None
        if estimator.baseline is not None:
          group_ids = np.asarray([t.group_id for t in trajs], np.int32)
          baseline_state, baseline = estimator.baseline(baseline_state, rewards, group_ids, c)
        batch = packing.pack(
          trajs,
          c.batch_size,
          config.data.buckets,
          baseline,
          action_index=config.data.logits_at_actions,
          routing=run.routing_shape and run.routing_shape[:2],
        )
        with clock.training():
          m = _train_step(run, run.put_batch(run.faults.poison_batch(step, batch)))
        skips.record(bool(m["policy/update_skipped"]), step)
        if step % c.sync_every == 0 and not m["policy/update_skipped"]:
          m.update(source.publish(sources.published_policy(run), int(run.state.step)))
        run.meta["stage_step"] = step
        report = source.report()
        run.meta["generated_tokens"] = tokens_before + report.counts.generated_tokens
        budget_spent = bool(budget) and run.meta["generated_tokens"] >= budget
        m.update(report.extra)
        m.update(
          rl_metrics(
            trajs,
            rewards,
            report.counts,
            generated_total=run.meta["generated_tokens"],
            elapsed=clock.elapsed,
            wait=clock.last_wait,
            wait_total=clock.wait_total,
            train_total=clock.train_total,
            restarts=report.restarts,
            updates_skipped=skips.total,
            queue_depth=report.queue_depth,
            rejected=report.rejected,
          )
        )
        # What the environment left out of its data at load (the dataset env's
        # duplicates, conflicts, held-out overlap, ...), constant over the run.
        m.update({f"data/rows_{k}": v for k, v in getattr(run.env, "data_counts", {}).items()})
        # Read after the source's counts: an injection is counted before its
        # rejection, so injected_malformed >= queue/rejected at every step.
        if run.faults.active:
          m.update({f"faults/injected_{k}": v for k, v in run.faults.counts().items()})
        _log(run, step, m, force=budget_spent)
        if c.eval_every and step % c.eval_every == 0 and step < c.steps:
          run.evaluate(f"rl_step_{step}", run.policy_params())
        periodic = step % config.checkpoint.every == 0
        if periodic:
          _checkpoint(run, source, baseline_state)
        run.faults.after_rl_step(step)
        # Every step: multi-host processes agree on the step.
        preemption.stop_if_noticed(
          notice,
          "RL",
          step,
          run,
          None if periodic else functools.partial(_checkpoint, run, source, baseline_state),
        )
        if budget_spent:
          print(
            f"[rl] generated-token budget spent ({run.meta['generated_tokens']} >= "
            f"{budget}) at step {step}",
            flush=True,
          )
          break
      finished = True
    finally:
      source.close(finished)
  run.meta["source"] = source.state()
  run.advance("done")
