"""Fakes shared by the tests: a fast environment and random model params."""

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.envs.base import StepResult, Task
from sao_jax.models import policy


class EchoEnv:
  """A fast fake environment: 2-4 turns, observations of varying length."""

  name, max_turns = "echo", 4

  def task(self, i):
    return Task(i, f"q{i % 10}\n", None, {"turns": 2 + i % 3})

  def episode(self, task):
    env_turns = task.meta["turns"]

    class Ep:
      n = 0

      def step(self, action):
        self.n += 1
        done = self.n >= env_turns
        return StepResult("" if done else ">" + "ab" * self.n + "\n", float(done), done)

    return Ep()

  def demonstration(self, task):
    return [("x", ">ab\n"), ("y", "")]


def random_params(cfg, scale: float, seed: int = 0):
  """Random params of `cfg`'s shapes, drawn on the host (no init compile):
  weights N(0, scale^2), norms 1 + N(0, 0.2^2) so their gradients and
  mapping are exercised."""
  shapes = jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    x = rng.normal(size=leaf.shape).astype(np.float32)
    return jnp.asarray(1.0 + 0.2 * x if "norm" in jax.tree_util.keystr(path) else scale * x)

  return jax.tree_util.tree_map_with_path(draw, shapes)
