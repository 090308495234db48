"""The SAO trainer's entry points: a whole run, a restored run, an evaluation.

`train(config, workdir)` is the whole chain; `launch/train.py` only parses
flags. The pieces, one concept a module:

    sao_jax/factories.py  one factory per object (model config, engine,
                          driver, the jitted programs), from the config
    sao_jax/run.py        `Run`: built from a config without I/O, then opened
                          on a workdir (checkpoints, metrics, restore)
    sao_jax/stages.py     the stages, in order: sft -> value_pretrain -> rl
                          -> done, each a function of a run
    sao_jax/rl_loop.py    the RL stage: one loop over a trajectory source
    sao_jax/sources.py    where trajectories come from: async, sync, fleet

Each stage checkpoints as it goes and a restarted run resumes at the stage
and step of its latest checkpoint.
"""

from __future__ import annotations

import os

import ml_collections

from sao_jax import distributed, files
from sao_jax import run as run_lib
from sao_jax import stages
from sao_jax.evaluation import write_samples
# The factories and the RL loop's pieces under their pre-house names: user
# code, and benchmarks that run the same script in an older tree
# (tiny_step.py --ref), call them here; the project's own code imports
# sao_jax.factories.
from sao_jax.factories import (Programs, build_model_config, build_programs,  # noqa: F401
                               make_driver, make_engine, step_config, validate_config)
from sao_jax.rl_loop import rl_metrics  # noqa: F401
from sao_jax.run import Run
from sao_jax.sources import RolloutCounts  # noqa: F401

STAGES = tuple(stages.STAGES)  # in order


def train(config: ml_collections.ConfigDict, workdir: str, until: str = "done") -> dict:
  """Runs (or resumes) the chain up to stage `until`; the summary when it ends."""
  if until not in STAGES:
    raise ValueError(f"until must be one of {STAGES}, got {until!r}")
  run = run_lib.load(config, workdir)
  # Only training records its config: eval / serve tools load runs from the
  # same workdir and must not overwrite the run's record.
  if distributed.is_primary():
    files.write_text(os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2))
  try:
    while run.meta["stage"] != until:
      stages.STAGES[run.meta["stage"]](run)
    return stages.done(run) if until == "done" else dict(run.meta["evals"])
  finally:
    run.close()


def load_run(config: ml_collections.ConfigDict, workdir: str, step: int | None = None) -> Run:
  """A run restored from `workdir` (fresh if it has no checkpoint), for tools."""
  return run_lib.load(config, workdir, step)


def evaluate(config: ml_collections.ConfigDict, workdir: str, step: int | None = None,
             out: str | None = None) -> dict:
  """pass@1 of the policy in checkpoint `step` (default: the latest) of a run.

  Every sample is also written as one JSON line (`evaluation.sample_record`)
  to `out`, default `<workdir>/eval/checkpoint_<step>.jsonl`, whose path the
  result names as "samples_file".
  """
  run = run_lib.load(config, workdir, step)
  try:
    if run.ckpt.latest_step() is None:
      raise FileNotFoundError(f"no checkpoint under {workdir}")
    name, samples = f"checkpoint_{step or run.ckpt.latest_step()}", []
    result = run.evaluate(name, run.state.policy, samples)
    out = out or os.path.join(workdir, "eval", f"{name}.jsonl")
    if distributed.is_primary():
      write_samples(out, samples)
    return {**result, "samples_file": out}
  finally:
    run.close()
