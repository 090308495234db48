"""The RL progress line shows what the configured policy loss removed from the gradient."""

import pytest

from sao_jax.train import metrics, rl_loop


@pytest.mark.parametrize(
  "loss_metrics,shown",
  [
    ({"policy/clip_frac": 0.03125}, "clipped=0.03125"),  # ppo_clip
    (
      {"policy/masked_low_frac": 0.05, "policy/masked_high_frac": 0.01},
      "dis_low=0.05  dis_high=0.01",
    ),  # dis
    (
      {"policy/clip_low_frac": 0.02, "policy/clip_high_frac": 0.0},
      "clip_low=0.02  clip_high=0",
    ),  # cispo
  ],
)
def test_the_rl_line_names_each_losss_removed_fraction(capsys, loss_metrics, shown):
  rec = {"rollout/reward_mean": 0.5, "policy/loss": -0.01, **loss_metrics}
  metrics.progress("rl_progress_test", 1, 10, rec, rl_loop.PROGRESS_KEYS)
  line = capsys.readouterr().out.strip()
  assert line.startswith("[rl_progress_test] 1/10  reward=0.5  pi_loss=-0.01")
  assert shown in line
