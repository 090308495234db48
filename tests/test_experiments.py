"""experiments/: the statistics against oracles, every finding's arms valid, one smoke grid end to end."""

import dataclasses
import json
import os
import subprocess

import numpy as np
import pytest

from experiments import (
  dis_stability,
  gae_ablations,
  headline,
  lora_rl,
  lr_by_lag,
  lr_sweep,
  online,
  rollout_backend,
  routing_replay,
  runner,
  stability,
  stats,
  system,
  value_ablations,
)
from sao_jax.train import configuration

FINDINGS = (
  headline,
  stability,
  value_ablations,
  gae_ablations,
  online,
  system,
  lr_sweep,
  dis_stability,
  lr_by_lag,
  routing_replay,
  rollout_backend,
  lora_rl,
)


@pytest.mark.parametrize("module", FINDINGS, ids=lambda m: m.FINDING.name)
def test_every_arm_is_a_valid_config_and_the_reference_is_an_arm(module):
  f = module.FINDING
  assert f.arm(f.reference)
  assert len({a.name for a in f.arms}) == len(f.arms)
  for arm in f.arms:
    configuration.validate(
      runner.load_config(arm.config, {**f.overrides, **arm.overrides}), num_devices=8
    )


def test_arms_differing_only_in_rl_share_one_sft_start_and_others_do_not():
  key = lambda name, o=None: runner.sft_key(runner.load_config(name, o or {}))
  assert key("sao_tiny") == key("grpo") == key("grpo_sync") == key("running_mean")
  assert key("sao_tiny") != key("sao_tiny", {"seed": 1})
  # The rollout backend serves RL's tokens: both backends start from one SFT checkpoint.
  assert key("sao_tiny") == key("sao_tiny", {"rollout.backend": "vllm"})
  # A simulated tool wait delays environment steps, nothing the SFT start learns.
  assert key("sao_tiny") == key("sao_tiny", {"env.tool_latency_s": 0.1})
  # The critic optimizer's layout differs: a checkpoint of one cannot seed the other.
  assert key("sao_tiny") != key("sao_no_freeze")
  assert key("sao_tiny") != key("sao_online")


def test_bootstrap_ci_matches_a_numpy_loop_and_covers_the_mean():
  diffs = [0.05, 0.02, 0.08, -0.01, 0.04]
  lo, hi = stats.bootstrap_ci(diffs, samples=4000, seed=3)
  rng = np.random.default_rng(3)
  idx = rng.integers(0, 5, (4000, 5))
  means = [np.mean([diffs[i] for i in row]) for row in idx]
  assert (lo, hi) == pytest.approx(tuple(np.quantile(means, [0.025, 0.975])))
  assert lo < np.mean(diffs) < hi
  assert lo >= min(diffs) and hi <= max(diffs)
  assert np.isnan(stats.bootstrap_ci([0.1])[0])  # one seed: no interval


def _fake_run(sft, final, steps=10):
  return {
    "sft_pass@1": sft,
    "final_pass@1": final,
    "gain": final - sft,
    "final_stderr": 0.02,
    "rl_steps": steps,
    "generated_tokens": 1000,
    "wall_s": 5.0,
    "evals": [],
    "lag_mean": 1.0,
    "lag_max": 3.0,
    "curves": {
      "step": list(range(1, steps + 1)),
      "rollout/reward_mean": list(np.linspace(sft, final, steps)),
      "rollout/generated_tokens_total": list(range(100, 100 * steps + 1, 100)),
      "policy_lag/mean": [1.0] * steps,
    },
  }


def test_aggregate_pairs_arms_by_seed_and_writes_table_and_plot(tmp_path):
  f = headline.FINDING
  runs = {
    "sao": {0: _fake_run(0.4, 0.6), 1: _fake_run(0.5, 0.7), 2: _fake_run(0.45, 0.65)},
    "grpo": {0: _fake_run(0.4, 0.5), 1: _fake_run(0.5, 0.55)},
  }  # seed 2 unfinished
  result = runner.aggregate(f, runs)
  assert set(result["arms"]) == {"sao", "grpo"}
  sao = result["arms"]["sao"]
  assert sao["final_pass@1"]["mean"] == pytest.approx(0.65)
  assert sao["final_pass@1"]["std"] == pytest.approx(np.std([0.6, 0.7, 0.65], ddof=1))
  vs = result["arms"]["grpo"]["vs_reference"]
  assert vs["paired_seeds"] == [0, 1] and vs["per_seed"] == pytest.approx([-0.1, -0.15])
  assert vs["mean_diff"] == pytest.approx(-0.125)
  # Two seeds: the t-interval (t_0.975,1 = 12.7) spans 0, and p is 0.5.
  assert not vs["excludes_zero"] and vs["t_ci95"][0] < 0 < vs["t_ci95"][1]
  assert vs["sign_flip_p"] == pytest.approx(0.5) and vs["n"] == 2
  assert "vs_reference" not in sao
  assert "| SAO | 3 |" in runner.table(result)
  assert runner.table(result).splitlines()[2].endswith("| 1.00 / 3 |")  # policy lag
  runner.plot(f, runs, result, str(tmp_path / "r.png"))
  assert (tmp_path / "r.png").stat().st_size > 1000


def test_online_recovery_counts_steps_after_each_shift():
  f = online.FINDING
  period = 320 // 16  # steps per style in configs/sao_online.py
  steps = np.arange(1, 3 * period + 1)
  # Reward 0.9 before each shift, 0 for the 5 steps after it, then 0.9 again:
  # the 3-step centred mean first reaches 80% of 0.9 at the 7th step.
  reward = np.where((steps - 1) % period < 5, 0.0, 0.9)
  reward[:period] = 0.9
  run = {"curves": {"step": steps.tolist(), "rollout/reward_mean": reward.tolist()}}
  # A run stuck at reward 0 after the first shift: only that shift counts.
  stuck = np.where(steps <= period, 0.9, 0.0)
  stuck_run = {"curves": {"step": steps.tolist(), "rollout/reward_mean": stuck.tolist()}}
  res = online.steps_to_recover(f, {"sao": {0: run, 1: stuck_run}})["steps_to_recover_80pct"]
  out = res["sao"]
  assert out["per_seed"][0] == [7, 7] and out["per_seed"][1] == [None]
  assert out["shifts_assessable"] == 3 and out["shifts_not_recovered"] == 1
  assert out["mean_steps_to_recover"] == 7
  assert out["reward_after_first_shift"][1] == 0.0
  assert out["reward_after_first_shift"][0] == pytest.approx(0.9 * (2 * period - 10) / (2 * period))


def test_online_analysis_reads_the_schedule_of_the_runs_set_overrides(tmp_path):
  # `--set env.kwargs.switch_every=640` (40 steps a style): the analysis must
  # cut the curve at the runs' shifts, not at the config file's.
  seen = {}

  def analyze(finding, runs):
    seen["overrides"] = finding.overrides
    return online.steps_to_recover(finding, runs)

  f = dataclasses.replace(online.FINDING, analyze=analyze)
  result = runner.run_finding(
    f,
    seeds=[0],
    aggregate_only=True,
    workdir=str(tmp_path / "w"),
    results=str(tmp_path / "r"),
    extra_overrides={"env.kwargs.switch_every": 640},
  )
  assert seen["overrides"]["env.kwargs.switch_every"] == 640
  assert result["overrides"]["env.kwargs.switch_every"] == 640
  steps = np.arange(1, 81)
  reward = np.where((steps > 40) & (steps <= 45), 0.0, 0.9)  # one shift, at step 40
  run = {"curves": {"step": steps.tolist(), "rollout/reward_mean": reward.tolist()}}
  out = online.steps_to_recover(
    dataclasses.replace(online.FINDING, overrides=seen["overrides"]), {"sao": {0: run}}
  )
  assert out["steps_to_recover_80pct"]["sao"]["per_seed"][0] == [7]


def test_online_recovery_reads_each_runs_schedule_and_success_not_partial_credit():
  # A run's own config.json says 40 steps a style (--aggregate_only without
  # the --set that ran it), and with quality_credit 0.2 a policy stuck on the
  # old style keeps a mean reward of ~0.2: only the full-reward share
  # (rollout/success_frac) says whether it re-adapted.
  config = runner.load_config(
    "sao_online", {"env.kwargs.switch_every": 640, "env.kwargs.quality_credit": 0.2}
  ).to_dict()
  steps = np.arange(1, 121)  # shifts at 40 and 80
  success = np.where(steps <= 40, 0.9, 0.0)  # never re-adapts
  reward = np.where(steps <= 40, 0.92, 0.2)  # the credit of the old style's lines
  stuck = {
    "config": config,
    "curves": {
      "step": steps.tolist(),
      "rollout/reward_mean": reward.tolist(),
      "rollout/success_frac": success.tolist(),
    },
  }
  out = online.steps_to_recover(online.FINDING, {"sao": {0: stuck}})["steps_to_recover_80pct"]
  # Only the shift at 40 follows a learned style, and it is not regained (on
  # the mean reward the shift at 80 would count and "recover" at once).
  assert out["sao"]["per_seed"][0] == [None]
  assert out["sao"]["mean_reward_after_first_shift"] == 0.0


def test_system_target_is_relative_to_each_seeds_sft_start():
  def run(sft, evals, idle):
    rec = _fake_run(sft, evals[-1][1])
    rec["evals"] = [{"time": t, "eval/pass@1": p} for t, p in evals]
    rec["curves"]["trainer/idle_fraction"] = [0.5, idle]
    return rec

  runs = {
    "sao": {
      0: run(0.2, [(10.0, 0.22), (20.0, 0.26), (30.0, 0.3)], 0.1),
      1: run(0.5, [(12.0, 0.52), (24.0, 0.54)], 0.3),
    }
  }
  out = system.time_to_target(system.FINDING, runs)["by_arm"]["sao"]
  # Seed 0 reaches 0.25 at its second evaluation; seed 1 never reaches 0.55.
  assert out["seconds_to_target"] == {0: 20.0, 1: None}
  assert out["mean_seconds_to_target"] == 20.0 and out["seeds_reaching_target"] == 1
  assert out["final_idle_fraction"] == {0: 0.1, 1: 0.3}
  assert out["mean_idle_fraction"] == pytest.approx(0.2)
  assert out["wall_s"] == {0: 5.0, 1: 5.0}


def test_smoke_grid_end_to_end(tmp_path):
  """Shared SFT start, copied per arm, token budget, collection, JSON + PNG."""
  result = runner.main(
    headline.FINDING,
    [
      "--smoke",
      "--in_process",
      "--arms",
      "sao,grpo_sync",
      "--workdir",
      str(tmp_path / "w"),
      "--results",
      str(tmp_path / "r"),
    ],
  )
  assert set(result["arms"]) == {"sao", "grpo_sync"}
  sft_dirs = os.listdir(tmp_path / "w" / "sft")
  assert len(sft_dirs) == 1  # one SFT start served both arms
  for arm in ("sao", "grpo_sync"):
    rdir = runner.run_dir(str(tmp_path / "w"), headline.FINDING, headline.FINDING.arm(arm), 0)
    summary = json.load(open(os.path.join(rdir, "summary.json"), encoding="utf-8"))
    plan = json.load(open(os.path.join(rdir, "runner.json"), encoding="utf-8"))
    # Both arms start from the same SFT evaluation; each stops at its budget
    # (or the step ceiling).
    assert summary["sft_pass@1"] == result["arms"]["sao"]["sft_pass@1"]["per_seed"][0]
    assert (
      summary["generated_tokens"] >= plan["budget_tokens"]
      or summary["rl_steps"] == runner.SMOKE_BUDGET_STEPS
    )
    # Each run records the commit it ran on, and results.json carries it per seed.
    assert plan["commit"] == runner.git_commit()
  saved = json.load(open(tmp_path / "r" / "results.json", encoding="utf-8"))
  assert saved["smoke"] and "vs_reference" in saved["arms"]["grpo_sync"]
  assert saved["commits"]["sao"] == {"0": runner.git_commit() or "unrecorded"}
  assert "t_ci95" in saved["arms"]["grpo_sync"]["vs_reference"]
  assert (tmp_path / "r" / "results.png").exists()


def test_a_run_held_by_another_runner_is_skipped_not_run_twice(tmp_path):
  import fcntl

  def launch(*args):
    raise AssertionError(f"launched {args}")

  f = headline.FINDING
  rdir = runner.run_dir(str(tmp_path), f, f.arm("sao"), 0)
  os.makedirs(os.path.dirname(rdir))
  with open(rdir + ".lock", "w", encoding="utf-8") as held:
    fcntl.flock(held, fcntl.LOCK_EX)
    assert runner.run_arm(launch, str(tmp_path), f, f.arm("sao"), 0, 3, {}) == rdir


def test_a_grid_extended_in_a_new_checkout_carries_the_committed_runs_over(tmp_path):
  # Seeds 0-1 finished in an earlier checkout: only their results.json is
  # left. Seed 2 has its run directory here. Aggregating seeds 0-2 must use
  # all three, and a results.json of another budget must not be used.
  f = dataclasses.replace(headline.FINDING, budget_steps=20)
  results = tmp_path / "r"
  results.mkdir()
  earlier = {
    "smoke": False,
    "budget_steps": 20,
    "overrides": dict(f.overrides),
    "runs": {
      "sao": {"0": _fake_run(0.4, 0.6), "1": _fake_run(0.5, 0.7)},
      "grpo": {"0": _fake_run(0.4, 0.5)},
    },
  }
  (results / "results.json").write_text(json.dumps(earlier), encoding="utf-8")
  rdir = runner.run_dir(str(tmp_path / "w"), f, f.arm("sao"), 2)
  os.makedirs(rdir)
  summary = {
    "sft_pass@1": 0.3,
    "final_pass@1": 0.45,
    "rl_steps": 20,
    "evals": {"final": {"pass@1_stderr": 0.02}},
  }
  (open(os.path.join(rdir, "summary.json"), "w", encoding="utf-8")).write(json.dumps(summary))
  args = dict(
    seeds=range(3), aggregate_only=True, workdir=str(tmp_path / "w"), results=str(results)
  )
  result = runner.run_finding(f, budget_steps=20, **args)
  assert result["arms"]["sao"]["final_pass@1"]["per_seed"] == pytest.approx([0.6, 0.7, 0.45])
  assert result["arms"]["grpo"]["seeds"] == [0]
  assert sorted(result["carried_over"]) == ["grpo/seed_0", "sao/seed_0", "sao/seed_1"]
  # What it wrote keeps the carried runs, so a further extension finds them.
  again = runner.run_finding(f, budget_steps=20, **args)
  assert again["arms"]["sao"]["final_pass@1"]["per_seed"] == pytest.approx([0.6, 0.7, 0.45])
  # Another reference arm: the pairs are taken against it.
  vs_grpo = runner.run_finding(f, budget_steps=20, reference="grpo", **args)
  assert vs_grpo["reference"] == "grpo"
  assert vs_grpo["arms"]["sao"]["vs_reference"]["per_seed"] == pytest.approx([0.1])
  with pytest.raises(KeyError):
    runner.run_finding(f, budget_steps=20, reference="nope", **args)
  # Seed 2 alone (`--first_seed 2 --seeds 1`): seeds 0-1 stay in the file.
  alone = runner.run_finding(f, budget_steps=20, **dict(args, seeds=range(2, 3)))
  assert alone["arms"]["sao"]["final_pass@1"]["per_seed"] == pytest.approx([0.6, 0.7, 0.45])
  saved = json.loads((results / "results.json").read_text(encoding="utf-8"))
  assert sorted(saved["runs"]["sao"]) == ["0", "1", "2"] and list(saved["runs"]["grpo"]) == ["0"]
  # Another budget: the committed runs are not comparable and are not used.
  other = runner.run_finding(f, budget_steps=40, **args)
  assert other["arms"]["sao"]["seeds"] == [2] and not other["carried_over"]


def test_headline_reward_by_quarter_says_whether_a_curve_still_rises():
  flat = _fake_run(0.4, 0.6, steps=40)
  flat["curves"]["rollout/reward_mean"] = [0.2] * 10 + [0.5] * 10 + [0.6] * 20
  rising = _fake_run(0.4, 0.6, steps=40)
  rising["curves"]["rollout/reward_mean"] = list(np.linspace(0.0, 0.8, 40))
  out = headline.reward_by_quarter(headline.FINDING, {"sao": {0: flat, 1: rising}})
  sao = out["training_reward_by_quarter"]["sao"]
  assert sao["reward_by_quarter"][0] == pytest.approx([0.2, 0.5, 0.6, 0.6])
  assert sao["last_minus_third_quarter"][0] == pytest.approx(0.0)
  assert sao["last_minus_third_quarter"][1] == pytest.approx(0.8 * 10 / 39)
  assert sao["mean_last_minus_third"] == pytest.approx(0.4 * 10 / 39)


def test_lr_sweep_arms_differ_only_in_actor_lr_and_compare_each_at_its_best():
  f = lr_sweep.FINDING
  common = runner.load_config("sao_tiny", {})
  assert common.rl.actor_lr == lr_sweep.DEFAULT_LR
  key = lambda arm: runner.sft_key(runner.load_config(arm.config, arm.overrides))
  assert len({key(a) for a in f.arms}) == 1  # one SFT start per seed for all six
  assert sorted(runner.load_config(a.config, a.overrides).rl.actor_lr for a in f.arms) == sorted(
    lr_sweep.LRS * 2 + (1e-3,)
  )
  assert (
    runner.load_config("sao_tiny", f.arm("sao_ppo_lr1e-03").overrides).rl.policy_loss == "ppo_clip"
  )
  # SAO is best at 1e-4 (one collapse at 1e-3), GRPO at 1e-3.
  finals = {
    "sao_lr1e-04": (0.62, 0.60, 0.58),
    "sao": (0.55, 0.50, 0.60),
    "sao_lr1e-03": (0.50, 0.0, 0.55),
    "grpo_sync_lr1e-04": (0.45, 0.45, 0.45),
    "grpo_sync": (0.50, 0.52, 0.48),
    "grpo_sync_lr1e-03": (0.56, 0.57, 0.58),
    "sao_ppo_lr1e-03": (0.60, 0.50, 0.55),
  }
  runs = {arm: {s: _fake_run(0.4, v) for s, v in enumerate(vals)} for arm, vals in finals.items()}
  out = lr_sweep.best_lr_comparison(f, runs)["lr_sweep"]
  assert out["sao"]["best_lr"] == 1e-4 and out["grpo_sync"]["best_lr"] == 1e-3
  assert out["sao"]["by_lr"]["0.001"]["collapsed"] == 1
  assert out["sao"]["by_lr"]["0.0003"] == {
    "arm": "sao",
    "mean_final": pytest.approx(0.55),
    "collapsed": 0,
    "seeds": 3,
  }
  best = out["best_vs_best"]
  assert best["arms"] == ["sao_lr1e-04", "grpo_sync_lr1e-03"]
  assert best["per_seed"] == pytest.approx([0.06, 0.03, 0.0])
  assert best["ci95"][0] <= best["mean_diff"] <= best["ci95"][1] and not best["excludes_zero"]
  pair = out["sao_ppo_lr1e-03_vs_sao_lr1e-03"]
  assert pair["per_seed"] == pytest.approx([0.10, 0.50, 0.0])


def test_dis_stability_clopper_pearson_matches_known_intervals():
  cp = dis_stability.clopper_pearson
  assert cp(0, 8) == pytest.approx((0.0, 0.3694), abs=1e-4)  # 1 - 0.025 ** (1 / 8)
  assert cp(8, 8) == pytest.approx((0.6306, 1.0), abs=1e-4)
  assert cp(3, 10) == pytest.approx((0.0667, 0.6525), abs=1e-4)
  # The defining tails: P(X >= k | lo) = P(X <= k | hi) = 2.5%.
  from scipy import stats

  lo, hi = cp(9, 34)
  assert stats.binom.sf(8, 34, lo) == pytest.approx(0.025)
  assert stats.binom.cdf(9, 34, hi) == pytest.approx(0.025)
  assert cp(0, 0) == (0.0, 1.0)
  with pytest.raises(ValueError):
    cp(3, 2)


def test_dis_stability_arms_share_one_sft_start_and_differ_in_what_they_say():
  f = dis_stability.FINDING
  assert (f.seeds, f.budget_steps, f.reference) == (8, 150, "grpo_sync")
  names = [a.name for a in f.arms]
  assert names[:3] == ["sao_sync", "dis_q64", "ppo_q64"]
  assert names.index("dis_stale") < names.index("grpo_sync") < names.index("cispo_stale")
  key = lambda arm: runner.sft_key(runner.load_config(arm.config, arm.overrides))
  assert len({key(a) for a in f.arms}) == 1
  cfg = lambda name: runner.load_config(f.arm(name).config, f.arm(name).overrides)
  assert cfg("sao_sync").rl.mode == "sync" and cfg("grpo_sync").rl.mode == "sync"
  for stem, _, _ in dis_stability.ASYNC_ARMS:
    for lag in ("q64", "stale"):
      c = cfg(f"{stem}_{lag}")
      assert c.rl.mode == "async" and c.rollout.queue_size == 64
      assert c.rl.advantage == "value" and c.rollout.samples_per_prompt == 1
      stale = lag == "stale"
      assert (c.rollout.slots, c.rl.sync_every) == ((48, 4) if stale else (16, 1))
  assert (cfg("dis_wide_q64").rl.eps_low, cfg("dis_wide_q64").rl.eps_high) == (0.5, 4.0)
  assert cfg("ppo_stale").rl.policy_loss == "ppo_clip"
  assert cfg("dis_kl_q64").rl.policy_loss == "dis_rollout_kl"
  assert cfg("cispo_q64").rl.policy_loss == "cispo_two_sided"
  # What these arms ran: k3 with a token mean, not the loss's k2 / sequence default.
  assert (
    cfg("dis_kl_stale").rl.rollout_kl_estimator,
    cfg("dis_kl_stale").rl.rollout_kl_reduction,
  ) == ("k3", "token")
  assert all(a in names and b in names for a, b in dis_stability.CONTRASTS)


def test_dis_stability_counts_collapses_relative_to_the_sft_start(tmp_path):
  collapsed = dis_stability.collapsed
  assert collapsed(_fake_run(0.4, 0.0)) and collapsed(_fake_run(0.4, 0.099))
  assert not collapsed(_fake_run(0.4, 0.1)) and not collapsed(_fake_run(0.2, 0.06))
  assert not collapsed(_fake_run(0.0, 0.0))  # an SFT start at 0 cannot collapse
  assert collapsed({"final_pass@1": 0.1}) is None
  f = dis_stability.FINDING
  dis = {s: _fake_run(0.4, v) for s, v in enumerate((0.0, 0.5, 0.01, 0.6, 0.45))}
  for rec in dis.values():
    steps = len(rec["curves"]["step"])
    rec["curves"].update(
      {
        "policy/approx_kl": [0.01] * (steps - 1) + [0.05],
        "dis/tokens_lag0": [10] * steps,
        "dis/tokens_lag1": [30] * steps,
      }
    )
    rec["curves"].update(
      {f"dis/tokens_{b}": [0] * steps for b in ("lag2", "lag3_4", "lag5_8", "lag9up")}
    )
    rec["curves"]["dis/ratio_q99_lag1"] = [1.5] * steps
  grpo = {s: _fake_run(0.4, 0.5) for s in range(4)}  # seed 4 unfinished
  out = dis_stability.collapse_rates(
    f, {"dis_q64": dis, "grpo_sync": grpo, "ppo_q64": {0: _fake_run(0.4, 0.5)}}
  )
  rec = out["by_arm"]["dis_q64"]
  assert (rec["runs"], rec["collapses"], rec["collapsed_seeds"]) == (5, 2, [0, 2])
  assert rec["rate"] == 0.4
  assert rec["ci95"] == pytest.approx(list(dis_stability.clopper_pearson(2, 5)))
  assert rec["final_over_sft"][2] == pytest.approx(0.025)
  assert rec["vs_reference"]["paired_seeds"] == [0, 1, 2, 3]
  assert rec["vs_reference"]["mean_diff"] == pytest.approx((-0.5 + 0 - 0.49 + 0.1) / 4)
  assert out["by_arm"]["grpo_sync"]["vs_reference"] is None
  assert rec["lag_mean"] == 1.0
  diag = rec["lag_diagnostics"]
  assert diag["policy/approx_kl"]["max"] == pytest.approx(0.05)
  assert diag["by_lag"]["lag0"]["token_share"] == pytest.approx(0.25)
  assert diag["by_lag"]["lag1"]["ratio_q99"]["mean"] == pytest.approx(1.5)
  assert "ratio_q99" not in diag["by_lag"].get("lag2", {})  # empty buckets: nothing logged
  assert out["contrasts"]["dis_q64_vs_ppo_q64"]["collapses"] == [2, 0]
  md = out["markdown"].splitlines()
  row = next(line for line in md if line.startswith("| async SAO, DIS (0.2, 0.28), queue 64 |"))
  assert "| 5 | 2 | 40% | [0.05, 0.85] |" in row and "| 1.00 |" in row
  assert next(line for line in md if line.startswith("| sync GRPO")).endswith(
    "| reference | 1.00 |"
  )
  # The runner writes the table into results.md as markdown, the rest as JSON.
  result = runner.run_finding(
    f, seeds=range(5), aggregate_only=True, workdir=str(tmp_path / "w"), results=str(tmp_path / "r")
  )
  text = (tmp_path / "r" / "results.md").read_text(encoding="utf-8")
  assert "| arm | runs | collapses | rate | 95% CI |" in text
  assert '"markdown"' not in text and result["analysis"]["by_arm"] == {}


@pytest.mark.slow  # test_smoke_grid_end_to_end runs the same runner end to end
def test_dis_stability_smoke_grid(tmp_path):
  """One seed, 3 steps of one async arm: its lag diagnostics reach the analysis and results.md.

  (One arm keeps it short; the grid's other arms differ only in config
  fields, which the arm test above validates.)
  """
  result = runner.main(
    dis_stability.FINDING,
    [
      "--smoke",
      "--in_process",
      "--arms",
      "dis_stale",
      "--workdir",
      str(tmp_path / "w"),
      "--results",
      str(tmp_path / "r"),
    ],
  )
  assert set(result["arms"]) == {"dis_stale"}
  rec = result["analysis"]["by_arm"]["dis_stale"]
  assert rec["runs"] == 1 and rec["collapses"] in (0, 1) and rec["lag_mean"] is not None
  diag = rec["lag_diagnostics"]
  assert "dis/outside_frac" in diag and "lag0" in diag["by_lag"]
  text = (tmp_path / "r" / "results.md").read_text(encoding="utf-8")
  assert "| async SAO, DIS (0.2, 0.28), forced lag (48 slots, sync every 4) | 1 |" in text


def test_check_commits_refuses_an_arm_whose_seeds_ran_on_two_commits():
  runs = {
    "sao": {0: dict(_fake_run(0.4, 0.6), commit="aaa"), 1: dict(_fake_run(0.4, 0.6), commit="aaa")},
    "grpo": {
      0: dict(_fake_run(0.4, 0.5), commit="aaa"),
      1: dict(_fake_run(0.4, 0.5), commit="bbb"),
    },
    "old": {0: _fake_run(0.4, 0.5), 1: dict(_fake_run(0.4, 0.5), commit="ccc")},
  }
  with pytest.raises(ValueError, match="grpo: seed 0 aaa, seed 1 bbb"):
    runner.check_commits(runs)
  out = runner.check_commits(runs, allow_mixed=True)
  assert out["grpo"] == {0: "aaa", 1: "bbb"}
  # A record from before commits were recorded is never a second commit.
  assert out["old"] == {0: "unrecorded", 1: "ccc"}
  del runs["grpo"]
  assert runner.check_commits(runs)["sao"] == {0: "aaa", 1: "aaa"}
  assert runner.git_commit() is None or len(runner.git_commit().split("-")[0]) == 40
  # A dirty checkout of one commit is named as such, not as the same 12 digits twice.
  head = "f" * 40
  runs = {
    "sao": {
      0: dict(_fake_run(0.4, 0.6), commit=head),
      1: dict(_fake_run(0.4, 0.6), commit=head + "-dirty"),
    }
  }
  with pytest.raises(ValueError, match=f"seed 0 {head[:12]}, seed 1 {head[:12]}-dirty"):
    runner.check_commits(runs)


def test_git_commit_is_not_dirty_for_results_written_by_another_finding(tmp_path):
  repo = tmp_path / "repo"
  (repo / "experiments" / "results").mkdir(parents=True)
  (repo / "code.py").write_text("x = 1\n")
  (repo / "experiments" / "results" / "r.json").write_text("{}\n")
  git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
  for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
    subprocess.run(git + args, check=True, capture_output=True)
  clean = runner.git_commit(str(repo))
  assert clean is not None and not clean.endswith("-dirty")
  (repo / "experiments" / "results" / "r.json").write_text('{"seed": 1}\n')
  assert runner.git_commit(str(repo)) == clean
  (repo / "code.py").write_text("x = 2\n")
  assert runner.git_commit(str(repo)) == clean + "-dirty"


def test_restat_adds_the_new_statistics_to_old_results_and_keeps_their_values(tmp_path):
  from experiments import restat

  f = headline.FINDING
  runs = {
    "sao": {s: _fake_run(0.4, v) for s, v in enumerate((0.6, 0.7, 0.65))},
    "grpo": {s: _fake_run(0.4, v) for s, v in enumerate((0.5, 0.55, 0.66))},
  }
  result = runner.aggregate(f, runs)
  # An earlier results.json: a bootstrap interval only.
  old_vs = {
    k: result["arms"]["grpo"]["vs_reference"][k]
    for k in ("paired_seeds", "mean_diff", "per_seed", "ci95", "excludes_zero")
  }
  result["arms"]["grpo"]["vs_reference"] = dict(old_vs)
  result["runs"] = {a: {str(s): r for s, r in by.items()} for a, by in runs.items()}
  os.makedirs(tmp_path / "headline")
  with open(tmp_path / "headline" / "results.json", "w", encoding="utf-8") as fh:
    json.dump(result, fh)
  text = restat.main(["--results", str(tmp_path), "--update"])
  # sao - grpo: +0.1, +0.15, -0.01 (2 of 3 ahead): p = 0.5 by enumeration.
  lo, hi = stats.t_interval([0.1, 0.15, -0.01])
  assert "| sao - grpo | 3 | +0.080 |" in text and f"[{lo:+.3f}, {hi:+.3f}]" in text
  assert "| 0.5 | 2 of 3 |" in text
  assert (tmp_path / "STATS.md").read_text(encoding="utf-8") == text
  with open(tmp_path / "headline" / "results.json", encoding="utf-8") as fh:
    vs = json.load(fh)["arms"]["grpo"]["vs_reference"]
  assert all(vs[k] == v for k, v in old_vs.items() if k != "excludes_zero")
  assert vs["t_ci95"] == pytest.approx([-hi, -lo]) and vs["sign_flip_p"] == pytest.approx(0.5)
  assert vs["bootstrap_excludes_zero"] == old_vs["excludes_zero"] and not vs["excludes_zero"]
  assert "[t: " in (tmp_path / "headline" / "results.md").read_text(encoding="utf-8")
  # A one-arm finding (math_cpu's shape): final minus SFT within each seed.
  os.makedirs(tmp_path / "math_cpu")
  with open(tmp_path / "math_cpu" / "results.json", "w", encoding="utf-8") as fh:
    json.dump(
      {"seeds": [{"seed": s, "sft": 0.4, "final": f} for s, f in enumerate((0.5, 0.6, 0.05))]}, fh
    )
  text = restat.main(["--results", str(tmp_path)])
  assert "## math_cpu" in text and "| 3 | 1 of 3 | -0.017 |" in text and "| 2 of 3 |" in text


def test_lr_by_lag_reruns_the_forced_lag_pair_at_1e4_and_pairs_ppo_minus_dis(monkeypatch):
  f = lr_by_lag.FINDING
  cfg = lambda name: runner.load_config(f.arm(name).config, f.arm(name).overrides)
  dis, ppo = cfg("dis_stale_lr1e4"), cfg("ppo_stale_lr1e4")
  earlier = dis_stability.FINDING
  for new, old in ((dis, "dis_stale"), (ppo, "ppo_stale")):
    ref = runner.load_config(earlier.arm(old).config, earlier.arm(old).overrides)
    assert new.rl.actor_lr == 1e-4 != ref.rl.actor_lr
    assert (new.rollout.slots, new.rl.sync_every, new.rl.policy_loss) == (
      ref.rollout.slots,
      ref.rl.sync_every,
      ref.rl.policy_loss,
    )
    assert runner.sft_key(new) == runner.sft_key(ref)  # the same SFT starts
  moving = lambda sft, final, kl: {
    **_fake_run(sft, final),
    "curves": {**_fake_run(sft, final)["curves"], "policy/approx_kl": [kl] * 10},
  }
  runs = {
    "dis_stale_lr1e4": {s: moving(0.4, 0.40 + 0.01 * s, 1e-3) for s in range(4)},
    "ppo_stale_lr1e4": {s: moving(0.4, 0.45 + 0.01 * s, 5e-4) for s in range(4)},
  }
  got = lr_by_lag.by_lr(f, runs)["1e-4"]
  assert got["ppo_minus_dis"]["mean_diff"] == pytest.approx(0.05)
  assert got["ppo_minus_dis"]["wins"] == 4 and got["collapses"] == [0, 0]
  assert got["movement"]["dis"]["policy/approx_kl"] == pytest.approx(1e-3)
  assert "1e-4 (this finding)" in lr_by_lag.by_lr(f, runs)["markdown"]
  # The two lrs' gaps compared unpaired: 3e-4's +0.15 (+-) against 1e-4's +0.05.
  earlier = {
    "dis_stale": {s: _fake_run(0.4, 0.30 + 0.01 * s) for s in range(4)},
    "ppo_stale": {s: _fake_run(0.4, 0.45 + 0.01 * s + 0.01 * (s % 2)) for s in range(4)},
  }
  monkeypatch.setattr(lr_by_lag, "_earlier_3e4", lambda: earlier)
  out = lr_by_lag.by_lr(f, runs)
  across = out["gap_3e4_minus_1e4"]
  assert across["diff"] == pytest.approx(0.105) and across["excludes_zero"]
  assert (across["n_a"], across["n_b"]) == (4, 4)
  assert "The gap at 3e-4 minus the gap at 1e-4" in out["markdown"]


def test_math_cpu_pairs_each_seeds_sft_and_rl_and_skips_finished_seeds(tmp_path):
  from experiments import math_cpu

  results, workdir = str(tmp_path / "results"), str(tmp_path / "work")
  for seed, (sft, final) in enumerate(((0.50, 0.60), (0.40, 0.44), (0.55, 0.54))):
    rdir = os.path.join(workdir, f"seed_{seed}")
    os.makedirs(rdir)
    evals = {
      "sft": {
        "pass@1": sft,
        "valid_tool_calls": 0.9,
        "verdict_exact": sft,
        "verdict_mismatch": 1 - sft,
        "tool_call_error_unclosed": 2,
      },
      "final": {
        "pass@1": final,
        "valid_tool_calls": 1.0,
        "verdict_exact": final,
        "verdict_mismatch": 1 - final,
      },
    }
    with open(os.path.join(rdir, "summary.json"), "w", encoding="utf-8") as f:
      json.dump({"evals": evals, "rl_steps": 3, "generated_tokens": 10}, f)
    # A finished run is read, not launched (no train.py runs here).
    rec = math_cpu.run_seed(seed, workdir, results, [])
    assert rec["sft"]["verdicts"] == {"exact": sft, "mismatch": 1 - sft}
    assert abs(rec["change"] - (final - sft)) < 1e-12 and rec["wall_s"] is None
  assert math_cpu.run_seed(0, workdir, results, [])["sft"]["tool_call_errors"] == {"unclosed": 2}
  agg = math_cpu.aggregate(results)
  changes = [0.10, 0.04, -0.01]
  assert [s["seed"] for s in agg["seeds"]] == [0, 1, 2]
  np.testing.assert_allclose(agg["mean_change"], np.mean(changes))
  np.testing.assert_allclose(agg["change_t_interval"], stats.t_interval(changes))
  assert agg["change_sign_flip_p"] == stats.sign_flip_p(changes)
  assert os.path.exists(os.path.join(results, "results.json"))
  assert "| mean | 0.483 | 0.527 | +0.043" in math_cpu.markdown(agg)
  # A seed recorded on another commit is refused unless told.
  path = os.path.join(results, "seed_2", "results.json")
  with open(path, encoding="utf-8") as f:
    rec = json.load(f)
  rec["commit"] = "0" * 40
  with open(path, "w", encoding="utf-8") as f:
    json.dump(rec, f)
  with pytest.raises(ValueError, match="seed 2 000000000000"):
    math_cpu.aggregate(results)
  assert math_cpu.aggregate(results, allow_mixed_commits=True)["commits"][2] == "0" * 40


def test_routing_replay_arms_differ_in_replay_alone_and_report_lag0_tails():
  f = routing_replay.FINDING
  cfg = lambda name: runner.load_config(f.arm(name).config, f.arm(name).overrides)
  plain, replay = cfg("plain"), cfg("replay")
  assert (plain.rl.routing_replay, replay.rl.routing_replay) == (False, True)
  assert plain.model.compute_dtype == "bfloat16" and plain.model.overrides["num_experts"] == 32
  assert runner.sft_key(plain) == runner.sft_key(replay)  # one SFT start per seed

  def run(final, q99):
    r = _fake_run(0.4, final)
    n = len(r["curves"]["step"])
    r["curves"].update(
      {
        "dis/ratio_q99_lag0": [q99] * (n - 1) + [2 * q99],
        "dis/ratio_q01_lag0": [0.9] * n,
        "dis/approx_kl_lag0": [1e-3] * n,
        "dis/outside_frac": [0.01] * n,
      }
    )
    return r

  runs = {
    "plain": {s: run(0.40, 1.5) for s in range(3)},
    "replay": {s: run(0.45 + 0.01 * s, 1.1) for s in range(3)},
  }
  got = routing_replay.by_replay(f, runs)
  assert got["replay"]["vs_plain"]["mean_diff"] == pytest.approx(0.06)
  assert got["plain"]["vs_plain"] is None and got["plain"]["collapses"] == 0
  lag0 = got["plain"]["diagnostics"]["by_lag"]["lag0"]["ratio_q99"]
  assert lag0["max"] == pytest.approx(3.0) and lag0["mean"] == pytest.approx(1.5 * 11 / 10)
  assert "1.6500 / 3.0000" in got["markdown"] and "routing replay" in got["markdown"]


def test_an_arm_starting_from_the_sft_policy_gets_a_fresh_run_not_a_copy(tmp_path):
  """Arm(start="policy") (lora_rl's LoRA arm): the seed's SFT runs without the
  arm's overrides (shared with the copying arm), and the arm's run starts
  empty with sft.init_from_run = that SFT run and sft.steps = 0."""
  calls = []

  def launch(script, config, overrides, workdir):
    calls.append((script, dict(overrides), workdir))
    os.makedirs(workdir, exist_ok=True)
    if script == "sft.py":
      os.makedirs(os.path.join(workdir, "checkpoints"))
      rec = {"stage": "eval", "step": 0, "eval/mean_generated": 10.0, "eval/pass@1": 0.5}
      with open(os.path.join(workdir, "metrics.jsonl"), "w", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
    return 1.0

  f = lora_rl.FINDING
  for arm in ("lora", "full"):  # the LoRA arm first: it must not shape the SFT run
    runner.run_arm(launch, str(tmp_path), f, f.arm(arm), 0, 3, {})
  (sft, sft_overrides, sft_dir), (_, lora, lora_dir), (_, full, full_dir) = calls
  assert sft == "sft.py" and "lora.enabled" not in sft_overrides
  assert lora["lora.enabled"] is True and lora["sft.init_from_run"] == sft_dir
  assert lora["sft.steps"] == 0 and not os.path.exists(os.path.join(lora_dir, "checkpoints"))
  assert "sft.init_from_run" not in full and os.path.isdir(os.path.join(full_dir, "checkpoints"))
  with pytest.raises(ValueError, match="start"):
    runner.Arm("x", "sao_tiny", start="resume")
