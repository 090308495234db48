"""The batcher's per-request sampling and prefix reuse (rollout/serving.py)."""

import pytest

from sao_jax.rollout import serving


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.5), dict(temperature=float("nan")), dict(temperature=float("inf")),
    dict(temperature="1"), dict(top_p=0.0), dict(top_p=1.5), dict(seed=-1), dict(seed=1.5),
    dict(seed=True), dict(stop_ids=[3]), dict(stop_ids=(-1,)), dict(stop_ids=tuple(range(17))),
    dict(top_logprobs=21), dict(top_logprobs=-1)])
def test_request_sampling_refuses_bad_values_in_one_line(kwargs):
  with pytest.raises(ValueError) as e:
    serving.RequestSampling(**kwargs)
  assert "\n" not in str(e.value) and next(iter(kwargs)) in str(e.value)


def test_request_sampling_defaults_are_the_engine_distribution():
  s = serving.RequestSampling()
  assert (s.temperature, s.top_p, s.seed, s.stop_ids, s.top_logprobs) == (1.0, 1.0, None, (), 0)
  assert serving.RequestSampling(temperature=0).greedy and not s.greedy
