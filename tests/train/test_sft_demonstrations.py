"""SFT's demonstrations that no packed row can hold are skipped and counted."""

import types

import numpy as np
import pytest

from sao_jax.train import stages


def _run(buckets):
  config = types.SimpleNamespace(data=types.SimpleNamespace(buckets=buckets))
  return types.SimpleNamespace(config=config, meta={})


def test_overlong_demonstrations_are_skipped_and_counted(capsys):
  run = _run((8, 16))
  trajs = [np.zeros(n) for n in (5, 16, 17, 40)]
  kept = stages._fitting_demonstrations(run, trajs, 0)
  assert [len(t) for t in kept] == [5, 16]
  assert run.meta["sft_skipped_too_long"] == 2
  stages._fitting_demonstrations(run, [np.zeros(20)] + trajs[:1], 1)
  assert run.meta["sft_skipped_too_long"] == 3
  assert "skipped 1 demonstrations longer than data.buckets' largest (16 tokens; 3 so far)" in (
    capsys.readouterr().out
  )


def test_a_step_with_no_demonstration_that_fits_is_one_line():
  with pytest.raises(ValueError, match="every demonstration drawn is longer than"):
    stages._fitting_demonstrations(_run((8,)), [np.zeros(9)], 4)
