"""The stages of a run, in order; each a function of a built, opened run.

    sft             supervised warm start on the environment's demonstrations
    value_pretrain  the critic (initialised from the SFT policy) regresses
                    returns of trajectories the initial policy generated,
                    read back from the trajectory store
    rl              SAO or a baseline arm over a trajectory source
                    (sao_jax/train/rl_loop.py, sao_jax/train/sources.py)
    done            final evaluation written to <workdir>/summary.json

Each stage checkpoints as it goes and ends with `run.advance(next stage)`, so
a restarted run resumes at the stage and step of its latest checkpoint.

With LoRA (config section `lora`) every stage trains adapters: the state's
policy and critic are adapter trees over frozen bases (`run.bases`), and
whatever needs the model whole (evaluation, the rollout engine, the value
store's generation) reads `run.policy_params()`, the merged params. The
critic starts from the SFT policy as in full fine-tuning: its base trunk is
the policy's base and its adapters carry the SFT policy's over
(`lora.carry_over`), so the merged critic trunk is the SFT policy's.
"""

from __future__ import annotations

import functools
import resource
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.data import files, store
from sao_jax.envs import base
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.models import hf_import, lora, policy
from sao_jax.train import distributed, preemption
from sao_jax.train.metrics import progress
from sao_jax.train.rl_loop import rl
from sao_jax.train.run import Run, wait


def _sft_reached_target(run: Run, c, nll: float) -> bool:
  """Whether the mean NLL of SFT's last `c.stop_window` steps is <= `c.stop_at_nll` (> 0).

  The window lives in run.meta, so a resumed SFT keeps the steps its
  checkpoint saw.
  """
  if c.stop_at_nll <= 0:
    return False
  recent = run.meta.setdefault("sft_recent_nll", [])
  recent.append(nll)
  del recent[: -c.stop_window]
  return len(recent) == c.stop_window and sum(recent) / len(recent) <= c.stop_at_nll


def _fitting_demonstrations(run: Run, trajs: list, step: int) -> list:
  """The demonstrations a packed row holds; longer ones (a dataset row's long
  solution in a small tokenizer's ids) are skipped and counted in run.meta
  ("sft_skipped_too_long"), never a crash. A step with none left is an error."""
  longest = max(run.config.data.buckets)
  kept = [t for t in trajs if len(t) <= longest]
  skipped = len(trajs) - len(kept)
  if skipped:
    total = run.meta["sft_skipped_too_long"] = run.meta.get("sft_skipped_too_long", 0) + skipped
    print(
      f"[sft] step {step + 1}: skipped {skipped} demonstrations longer than "
      f"data.buckets' largest ({longest} tokens; {total} so far)",
      flush=True,
    )
  if not kept:
    raise ValueError(
      f"SFT step {step + 1}: every demonstration drawn is longer than "
      f"data.buckets' largest ({longest} tokens): raise data.buckets and "
      "rollout.max_len"
    )
  return kept


def _save_sft(run: Run, policy_params, opt) -> None:
  run.state = run.state.replace(policy=policy_params, policy_opt=opt)
  run.save()


def _sft_steps(run: Run, policy_params, opt, steps: int):
  """SFT from the checkpointed step to `steps` (or the NLL target); the
  params and optimizer state. A SIGTERM checkpoints the step and stops."""
  c, config = run.config.sft, run.config
  with preemption.Notice() as notice:
    for step in range(run.meta["stage_step"], steps):
      # Demonstrations of training tasks; the step index seeds the draw, so a
      # resumed SFT sees the same data it would have. An environment whose tasks do
      # not all have a demonstration (a dataset's rows without a solution) maps the
      # draw onto those that do (`demonstration_task`).
      idx = np.random.default_rng([config.seed, 2, step]).integers(
        0, config.data.num_train_tasks, c.batch_size
      )
      tasks = [base.demonstration_task(run.env, int(i)) for i in idx]
      trajs = _fitting_demonstrations(
        run, [demonstration_trajectory(run.env, t, run.tok, run.format) for t in tasks], step
      )
      batch = run.pack(trajs, c.batch_size)
      with jax.set_mesh(run.mesh), nn.logical_axis_rules(run.rules):  # activation constraints
        policy_params, opt, m = run.sft_step(policy_params, opt, batch)
      wait(policy_params)
      run.meta["stage_step"] = step + 1
      stop = _sft_reached_target(run, c, float(m["sft/nll"]))
      if (step + 1) % config.log_every == 0 or step + 1 == steps or stop:
        rec = run.metrics.write(step + 1, m, "sft")
        progress("sft", step + 1, steps, rec, {"sft/nll": "nll"})
      if stop:
        print(
          f"[sft] stopped at step {step + 1} of {steps}: mean nll of the last "
          f"{c.stop_window} steps <= sft.stop_at_nll {c.stop_at_nll:g}",
          flush=True,
        )
        run.meta["sft_stopped_at"] = step + 1
        break
      save = functools.partial(_save_sft, run, policy_params, opt)
      periodic = (step + 1) % config.checkpoint.every == 0
      if periodic:
        save()
      run.faults.after_sft_step(step + 1)
      preemption.stop_if_noticed(notice, "SFT", step + 1, run, None if periodic else save)
  return policy_params, opt


def sft(run: Run) -> None:
  c = run.config.sft
  shardings = run.programs.state_shardings
  policy_params, opt = run.state.policy, run.state.policy_opt
  steps = c.steps
  if c.init_from_hf:  # start from an existing SFT checkpoint instead
    policy_params = hf_import.load_hf_checkpoint(
      c.init_from_hf, run.model_cfg, run.programs.policy_shardings
    )
    steps = 0
  elif run.meta["stage_step"] == 0:  # a fresh SFT: the optimizer starts empty
    opt = jax.jit(run.programs.sft_tx.init, out_shardings=shardings.policy_opt)(policy_params)
  policy_params, opt = _sft_steps(run, policy_params, opt, steps)
  # RL's actor optimizer starts fresh; the critic starts from the SFT trunk.
  if run.programs.lora is None:
    critic = policy.value_params_from_policy(policy_params, run.state.critic)
  else:  # the same trunk: the policy's base, the policy's adapters carried over
    critic = lora.carry_over(policy_params, run.state.critic)
  # A real copy: the trunk must not alias the policy's (donated) buffers.
  critic = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings.critic)(critic)
  run.state = run.state.replace(
    policy=policy_params,
    policy_opt=jax.jit(run.programs.policy_tx.init, out_shardings=shardings.policy_opt)(
      policy_params
    ),
    critic=critic,
    critic_opt=jax.jit(run.programs.critic_tx.init, out_shardings=shardings.critic_opt)(critic),
  )
  run.evaluate("sft", run.policy_params())
  run.advance("value_pretrain")


def _store_initial_rollouts(run: Run, shard: str, num_trajectories: int) -> int:
  """Trajectories of the current policy into the store at `shard`; tokens generated.

  By process 0 of a multi-host run; every process then reads the store back.
  """
  params = distributed.host_local_copy(run.policy_params(), run.mesh)

  def generate() -> int:
    engine = run.engine(params, version=0)
    with store.TrajectoryWriter(shard) as writer:
      # One sample per prompt from a policy that never changes: no weight
      # swaps to wait for, so several tokens per decode call.
      driver = run.driver(
        engine,
        run.frozen_env,
        iter(range(10**9, 10**9 + num_trajectories)),
        writer.write,
        engine.rollout.replace(samples_per_prompt=1, decode_steps=8),
      )
      driver.run()
      driver.stop()
    return driver.stats.generated_tokens

  return distributed.share_from_primary("value_pretrain_store", generate)


def value_pretrain(run: Run) -> None:
  c, config = run.config.value_pretrain, run.config
  if c.steps == 0 or not run.step_cfg.uses_critic:
    return run.advance("rl")
  shard = files.join(run.workdir, "trajectories", "value_pretrain.array_record")
  if not run.meta.get("value_store_done"):
    generated = _store_initial_rollouts(run, shard, c.num_trajectories)
    # Budgets count every token the policy generates, warm-up included.
    run.meta["generated_tokens"] = run.meta.get("generated_tokens", 0) + generated
    run.meta["value_store_done"] = True
    print(
      f"[value_pretrain] stored {c.num_trajectories} trajectories of the SFT policy", flush=True
    )
  # Read back through the same validation as the ingestion queue: a record
  # damaged on disk is dropped with a counted reason, never trained on.
  data, dropped = store.read_valid_trajectories(
    [shard], run.tok.vocab_size, config.rollout.max_len, shuffle_seed=config.seed
  )
  if dropped:
    print(
      f"[value_pretrain] dropped {sum(dropped.values())} stored records: {dict(dropped)}",
      flush=True,
    )
  b = config.rl.batch_size
  with preemption.Notice() as notice:
    for step in range(run.meta["stage_step"], c.steps):
      trajs = [data[(step * b + j) % len(data)] for j in range(b)]
      batch = run.pack(trajs, b, policy_head=False)
      with jax.set_mesh(run.mesh), nn.logical_axis_rules(run.rules):
        run.state, m = run.value_step(run.state, batch)
        wait(run.state)
      run.meta["stage_step"] = step + 1
      m = dict(m, **{f"value_pretrain/rejected_{k}": v for k, v in dropped.items()})
      if (step + 1) % config.log_every == 0 or step + 1 == c.steps:
        rec = run.metrics.write(step + 1, m, "value_pretrain")
        progress(
          "value_pretrain",
          step + 1,
          c.steps,
          rec,
          {"critic/value_loss": "value_loss", "critic/explained_variance": "expl_var"},
        )
      periodic = (step + 1) % config.checkpoint.every == 0
      if periodic:
        run.save()
      preemption.stop_if_noticed(
        notice, "value pretraining", step + 1, run, None if periodic else run.save
      )
  return run.advance("rl")


def done(run: Run) -> dict:
  """The final evaluation; writes <workdir>/summary.json (a finished run's mark)."""
  final = run.evaluate("final", run.policy_params())
  summary = {
    "sft_pass@1": run.meta["evals"].get("sft", {}).get("pass@1"),
    "final_pass@1": final["pass@1"],
    "evals": run.meta["evals"],
    "rl_steps": int(run.state.step),
    # The step sft.stop_at_nll stopped SFT at (None: it ran every step).
    "sft_stopped_at": run.meta.get("sft_stopped_at"),
    "generated_tokens": run.meta.get("generated_tokens", 0),
    # What training held: the state's logical size (trained params and their
    # optimizer moments, a replicated array counted once; with LoRA the
    # adapters', not the frozen base's) and this launch's peak host memory (the
    # process's resident set; Linux reports KiB).
    "state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(run.state))),
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
  }
  if distributed.is_primary():
    # Written whole: a summary.json that exists marks a finished run (experiments/).
    files.write_json(files.join(run.workdir, "summary.json"), summary, indent=2)
  print(f"[done] pass@1 SFT {summary['sft_pass@1']} -> final {summary['final_pass@1']}", flush=True)
  run.save(force=True)
  return summary


# The stage a checkpoint names -> the function that runs it. Every stage but
# "done" ends by advancing to the next.
STAGES: dict[str, Callable[[Run], object]] = {
  "sft": sft,
  "value_pretrain": value_pretrain,
  "rl": rl,
  "done": done,
}
