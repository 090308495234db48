"""How a run stops itself: `StopTraining`, raised where the run cannot go on.

The RL loop and the trajectory sources raise it (a rollout thread that keeps
dying, a source that ran dry); `configuration.run` prints its one line and
exits 1. Its own module so that the sources, below the configuration checks
that look them up, can raise it without importing those checks.
"""


class StopTraining(RuntimeError):
  """A run that stopped itself cleanly (its checkpoints are intact)."""
