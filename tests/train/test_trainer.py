"""Packing, ingestion, the train step, and the real trainer end to end."""

import dataclasses
import json
import os
import queue
import signal

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from runs import finish, launch, read_metrics

from sao_jax.algo import optim
from sao_jax.data import packing
from sao_jax.data.checkpoint import committed_checkpoints
from sao_jax.data.ingestion import TrajectoryQueue
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.envs.python_tool import PythonTool
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy
from sao_jax.rollout.stats import DriverStats
from sao_jax.train.rl_loop import rl_metrics
from sao_jax.train.sources import RolloutCounts
from sao_jax.train.train_step import StepConfig, TrainState, make_train_step

TOK = CharTokenizer()
ENV = PythonTool()
CFG = mcfg.tiny(vocab_size=TOK.vocab_size)


def demo_trajs(n, start=0):
  out = []
  for i in range(start, start + n):
    t = demonstration_trajectory(ENV, ENV.task(i), TOK)
    # As if sampled: negative log-probs, a version, some failures.
    rng = np.random.default_rng(i)
    t.rollout_logprobs = np.where(t.action_mask, -rng.uniform(0.01, 2.0, len(t)), 0).astype(
      np.float32
    )
    if i % 3 == 0:
      t.rewards[:] = 0.0
    out.append(t)
  return out


def test_pack_layout():
  trajs = demo_trajs(6)
  batch = packing.pack(trajs, rows=3, buckets=(32, 64, 128, 256))
  width = batch["tokens"].shape[1]
  assert batch["tokens"].shape == (3, width) and width in (64, 128, 256)
  for key in packing.FIELDS:
    assert batch[key].shape == (3, width)
  # Every trajectory appears exactly once, contiguously, positions from 0.
  seen = []
  for r in range(3):
    for seg in set(batch["segment_ids"][r].tolist()) - {0}:
      sel = batch["segment_ids"][r] == seg
      toks = batch["tokens"][r, sel]
      np.testing.assert_array_equal(batch["positions"][r, sel], np.arange(sel.sum()))
      seen.append(tuple(toks))
  assert sorted(seen) == sorted(tuple(t.tokens) for t in trajs)
  assert batch["action_mask"].sum() == sum(t.action_mask.sum() for t in trajs)
  assert (batch["policy_version"][~batch["action_mask"]] == -1).all()
  with pytest.raises(ValueError, match="do not fit"):
    packing.pack(trajs, rows=1, buckets=(32,))


def test_ingestion_validates_counts_and_backpressures():
  version = [5]
  q = TrajectoryQueue(2, TOK.vocab_size, 256, lambda: version[0], max_staleness=2)
  good = demo_trajs(3)
  bad = demo_trajs(1)[0]
  bad.tokens = bad.tokens[:-1]
  assert not q.put(bad)
  assert not q.put("not a trajectory")
  stale = demo_trajs(1)[0]
  stale.policy_version[stale.action_mask] = 1
  assert not q.put(stale)
  fresh = [
    dataclasses.replace(t, policy_version=np.where(t.action_mask, 4, -1).astype(np.int32))
    for t in good
  ]
  assert q.put(fresh[0]) and q.put(fresh[1])
  with pytest.raises(queue.Full):
    q.put(fresh[2], block=False)  # bounded: a blocking put would wait here
  assert dict(q.rejected) == {"length_mismatch": 1, "not_numpy": 1, "stale": 1}
  assert q.get(timeout=1).prompt_id == fresh[0].prompt_id


def make_state(step_cfg):
  p = policy.init_params(CFG, jax.random.key(0))
  c = policy.value_params_from_policy(p, policy.init_params(CFG, jax.random.key(1), "value"))
  c = jax.tree.map(jnp.copy, c)
  ptx = optim.make_optimizer(p, 1e-3)
  ctx = optim.make_optimizer(c, 1e-3, rules=optim.CRITIC_FREEZE_RULES)
  state = TrainState(jnp.zeros((), jnp.int32), p, c, ptx.init(p), ctx.init(c))
  return state, make_train_step(CFG, step_cfg, ptx, ctx)


def test_train_step_compiles_once_per_bucket_and_freezes_critic_attention():
  state, step = make_state(StepConfig.of())
  counted = jax.jit(chex.assert_max_traces(step, n=2))
  before = jax.tree.map(np.asarray, state.critic)
  policy_before = jax.tree.map(np.asarray, state.policy)
  for i in range(3):
    for n_traj, buckets in ((4, (128,)), (4, (256,))):
      batch = packing.pack(demo_trajs(n_traj, start=10 * i), 4, buckets)
      state, metrics = counted(state, batch)
  assert int(state.step) == 6
  for k in (
    "policy/loss",
    "critic/value_loss",
    "critic/explained_variance",
    "policy/masked_low_frac",
    "policy/masked_high_frac",
    "policy/ratio_max",
    "policy/grad_norm_attention",
    "policy/grad_norm_moe_mlp",
    "critic/grad_norm_attention",
    "policy_lag/mean",
  ):
    assert np.isfinite(float(metrics[k])), k
  after = jax.tree.map(np.asarray, state.critic)
  labels = optim.partition_labels(before, optim.CRITIC_FREEZE_RULES)
  for (path, b), a, lab in zip(
    jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after), jax.tree.leaves(labels)
  ):
    name = optim.param_path(path)
    if lab == optim.FREEZE:
      np.testing.assert_array_equal(a, b, err_msg=name)
    elif "moe" in name:
      assert np.any(a != b), name
  assert any(
    np.any(a != b) for a, b in zip(jax.tree.leaves(policy_before), jax.tree.leaves(state.policy))
  )


@pytest.mark.parametrize(
  "arm",
  [
    dict(advantage="value", policy_loss="dis"),
    dict(advantage="token_gae", policy_loss="dis"),
    dict(advantage="step_gae_mean", policy_loss="dis"),
    dict(advantage="step_gae_last", policy_loss="dis"),
    dict(advantage="group", policy_loss="ppo_clip", critic_updates=0),
    dict(advantage="group", policy_loss="dis", critic_updates=0),
    dict(advantage="running_mean", policy_loss="dis", critic_updates=0),
  ],
)
def test_every_arm_trains(arm):
  state, step = make_state(StepConfig.of(**arm))
  trajs = demo_trajs(4)
  baseline = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
  batch = packing.pack(trajs, 4, (256,), baseline)
  new, metrics = jax.jit(step)(state, batch)
  assert int(new.step) == 1 and np.isfinite(float(metrics["policy/loss"]))
  uses_critic = StepConfig.of(**arm).uses_critic
  critic_moved = any(
    np.any(np.asarray(a) != np.asarray(b))
    for a, b in zip(jax.tree.leaves(state.critic), jax.tree.leaves(new.critic))
  )
  assert critic_moved == uses_critic


def test_step_config_errors():
  with pytest.raises(ValueError, match="advantage"):
    StepConfig.of(advantage="gae")
  with pytest.raises(ValueError, match="policy_loss"):
    StepConfig.of(policy_loss="ppo")


# --- the real trainer, end to end, on 8 simulated devices --------------------


def test_rl_metrics_are_cumulative_over_driver_restarts():
  """What rl_loop.rl writes each logged step: a dead driver's counts plus the live one's."""
  dead = DriverStats(generated_tokens=100, generate_seconds=2.0, env_wait_seconds=1.0)
  dead.env_faults.update({"env_error": 1})
  dead.tool_call_errors.update({"bad_json": 2, "unknown_tool": 1})
  dead.env_events.update({"verifier_timeout": 1})
  live = DriverStats(generated_tokens=50, generate_seconds=1.0, env_wait_seconds=3.0)
  live.tool_call_errors.update({"bad_json": 1, "unclosed": 4})
  live.env_events.update({"verifier_timeout": 2, "sandbox_oom": 1})
  counts = RolloutCounts().plus(dead).plus(live)
  trajs = demo_trajs(4)
  rewards = np.array([t.total_reward for t in trajs], np.float32)
  m = rl_metrics(
    trajs,
    rewards,
    counts,
    generated_total=1150,
    elapsed=10.0,
    wait=0.5,
    wait_total=2.0,
    train_total=5.0,
    restarts=1,
    updates_skipped=0,
    queue_depth=3,
    rejected={"too_long": 2},
  )
  assert {k: v for k, v in m.items() if k.startswith(("rollout/tool", "rollout/env"))} == {
    "rollout/tool_call_errors": 8,
    "rollout/tool_call_error_bad_json": 3,
    "rollout/tool_call_error_unknown_tool": 1,
    "rollout/tool_call_error_unclosed": 4,
    "rollout/env_event_verifier_timeout": 3,
    "rollout/env_event_sandbox_oom": 1,
    "rollout/env_faults": 1,
    "rollout/env_fault_env_error": 1,
  }
  assert m["rollout/generated_tokens_per_s"] == 15.0
  assert m["rollout/generated_tokens_total"] == 1150
  assert m["time/generate_frac"] == pytest.approx(0.3)
  assert m["time/env_frac"] == pytest.approx(0.4)
  assert m["rollout/reward_mean"] == pytest.approx(0.5)  # demo_trajs fails i % 3 == 0
  assert m["queue/rejected"] == 2 and m["queue/rejected_too_long"] == 2
  # The dead driver's counters are copies: counting on in it changes nothing.
  dead.tool_call_errors["bad_json"] += 10
  assert counts.tool_call_errors["bad_json"] == 3
  # Fleet mode: no generate / env seconds of the rollout processes here.
  fleet_counts = RolloutCounts(7, None, None, tool_call_errors=live.tool_call_errors)
  m = rl_metrics(
    trajs,
    rewards,
    fleet_counts,
    generated_total=7,
    elapsed=1.0,
    wait=0.0,
    wait_total=0.0,
    train_total=1.0,
    restarts=0,
    updates_skipped=0,
    queue_depth=0,
    rejected={},
  )
  assert "time/generate_frac" not in m and "time/env_frac" not in m
  assert m["rollout/tool_call_error_unclosed"] == 4 and m["rollout/tool_call_errors"] == 5


# sync: slow; the default run trains sync mode end to end in
# tests/test_experiments.py's smoke grid (its grpo_sync arm).
@pytest.mark.parametrize("mode", ["async", pytest.param("sync", marks=pytest.mark.slow)])
def test_trainer_runs_and_resumes(tmp_path, mode):
  workdir = str(tmp_path / mode)
  # Any NLL is <= 100: sft.stop_at_nll ends SFT's 6 steps at the first full window.
  out = launch(
    workdir,
    f"--config.rl.mode={mode}",
    "--config.sft.stop_at_nll=100",
    "--config.sft.stop_window=4",
  )
  summary = json.load(open(os.path.join(workdir, "summary.json"), encoding="utf-8"))
  assert summary["rl_steps"] == 6 and summary["sft_pass@1"] is not None
  assert summary["sft_stopped_at"] == 4 and "[sft] stopped at step 4 of 6" in out
  assert [r["step"] for r in read_metrics(workdir, "sft")][-1] == 4
  rl = read_metrics(workdir, "rl")
  assert [r["step"] for r in rl] == list(range(1, 7))
  assert all(np.isfinite(r["policy/loss"]) for r in rl)
  assert "[done]" in out
  # A second launch resumes the finished run instead of starting over.
  out2 = launch(workdir, f"--config.rl.mode={mode}", "--config.rl.steps=8")
  assert "Resumed from checkpoint" in out2
  rl2 = read_metrics(workdir, "rl")
  assert [r["step"] for r in rl2] == list(range(1, 7))  # "done" stays done
  if mode == "async":  # launch/eval.py on the finished run's checkpoint
    out3 = launch(
      workdir, script="eval.py", run_flags=["--config.eval.num_tasks=8", "--config.eval.slots=8"]
    )
    result = json.loads(out3.strip().splitlines()[-1])
    assert result["tasks"] == 8 and 0.0 <= result["pass@1"] <= 1.0
    recorded = json.load(open(os.path.join(workdir, "config.json"), encoding="utf-8"))
    assert recorded["rl"]["steps"] == 8  # the last training launch, not eval's config


@pytest.mark.slow  # the smoke grid's grpo_sync arm runs a group arm end to end by default
def test_group_arm_runs_end_to_end(tmp_path):
  workdir = str(tmp_path / "grpo")
  launch(workdir, "--config.rl.steps=3", config="grpo.py")
  rl = read_metrics(workdir, "rl")
  assert [r["step"] for r in rl] == [1, 2, 3]
  assert "critic/value_loss" not in rl[0] and np.isfinite(rl[0]["policy/clip_frac"])
  assert not any(r["stage"] == "value_pretrain" for r in read_metrics(workdir))


def _committed_rl_steps(workdir):
  """RL steps of the checkpoints that are complete on disk right now."""
  return [
    m["stage_step"]
    for m in committed_checkpoints(os.path.join(workdir, "checkpoints")).values()
    if m["stage"] == "rl"
  ]


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path):
  """SIGKILL mid-RL: the restart resumes from the last complete checkpoint; a
  SIGTERM (a preemption notice) checkpoints the step it lands after.

  The run kills itself with SIGKILL right after RL step 4
  (`faults.sigkill_after_rl_step`), just after that step's asynchronous
  checkpoint save was started, so the kill lands at the same step on any
  machine under any load, most often in the middle of the save; nothing
  here polls or waits on a clock. Every save waits for the previous one:
  the run resumes from the newest checkpoint complete on disk (step 4 if
  its save finished in time, else step 2), at least 4 - 2 x every.
  """
  every, kill_at = 2, 4
  workdir = str(tmp_path / "killed")
  proc = launch(
    workdir,
    "--config.rl.steps=40",
    "--config.log_every=1",
    f"--config.checkpoint.every={every}",
    f"--config.faults.sigkill_after_rl_step={kill_at}",
    wait=False,
  )
  out = finish(proc)
  assert proc.returncode == -signal.SIGKILL, out[-3000:]
  assert f"[faults] SIGKILL after RL step {kill_at}" in out
  killed_at = max(r["step"] for r in read_metrics(workdir, "rl"))
  assert killed_at == kill_at
  # Nothing is written after a SIGKILL: what is committed now was complete
  # at the kill; an interrupted save must not count.
  complete_at_kill = max(_committed_rl_steps(workdir))
  assert killed_at - 2 * every <= complete_at_kill <= killed_at
  # The restart is preempted: SIGTERM after RL step 7 (not a checkpoint step)
  # writes a checkpoint at 7, waits for it and exits 1 (the job did not finish).
  proc = launch(
    workdir,
    "--config.rl.steps=12",
    f"--config.checkpoint.every={every}",
    "--config.faults.sigterm_after_rl_step=7",
    wait=False,
  )
  out = finish(proc)
  assert proc.returncode == 1, out[-3000:]
  assert "Resumed from checkpoint" in out and "stage rl" in out
  resumed_from = int(out.split("stage rl step ")[1].split()[0])
  assert resumed_from == complete_at_kill
  assert "error: preempted (SIGTERM) after RL step 7: checkpoint" in out
  assert max(_committed_rl_steps(workdir)) == 7
  out = launch(workdir, "--config.rl.steps=8")
  assert "stage rl step 7" in out
  rl = read_metrics(workdir, "rl")
  assert max(r["step"] for r in rl) == 8
  assert os.path.exists(os.path.join(workdir, "summary.json"))


def test_a_sigterm_during_sft_checkpoints_that_step_and_stops(tmp_path):
  """A preemption notice in SFT (not at a periodic checkpoint step) writes the
  step's checkpoint, waits for it and exits 1."""
  workdir = str(tmp_path / "sft")
  flags = ("--config.sft.steps=5", "--config.checkpoint.every=100")
  proc = launch(
    workdir, *flags, "--config.faults.sigterm_after_sft_step=3", script="sft.py", wait=False
  )
  out = finish(proc)
  assert proc.returncode == 1, out[-3000:]
  assert "error: preempted (SIGTERM) after SFT step 3: checkpoint 1 written" in out
  saved = committed_checkpoints(os.path.join(workdir, "checkpoints"))
  # The stage and step a restart resumes SFT at (as from a periodic checkpoint).
  assert [(m["stage"], m["stage_step"]) for m in saved.values()] == [("sft", 3)]


def test_sft_stops_when_the_window_mean_nll_reaches_the_target():
  from types import SimpleNamespace

  from sao_jax.train import stages

  run = SimpleNamespace(meta={})
  c = SimpleNamespace(stop_at_nll=0.5, stop_window=3)
  got = [stages._sft_reached_target(run, c, x) for x in (0.1, 0.1, 2.0, 0.6, 0.6, 0.3, 0.2)]
  # Windows: -, -, 2.2/3, 2.7/3, 3.2/3, 1.5/3 = 0.5 (<= target), 1.1/3.
  assert got == [False, False, False, False, False, True, True]
  assert run.meta["sft_recent_nll"] == [0.6, 0.3, 0.2]  # the window, checkpointed in meta
  off = SimpleNamespace(stop_at_nll=0.0, stop_window=3)
  assert not stages._sft_reached_target(SimpleNamespace(meta={}), off, 0.0)
