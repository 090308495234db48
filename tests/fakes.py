"""Fake environments shared by the rollout and engine tests."""

from sao_jax.envs.base import StepResult, Task


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
