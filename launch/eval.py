"""pass@1 at temperature 1.0 on held-out tasks, for any checkpoint of a run.

    python launch/eval.py --config=configs/sao_tiny.py --workdir=workdirs/sao_tiny [--step=N]

Prints one JSON line: pass@1, tasks, mean length and turns.
"""

import json

from absl import flags, logging
from ml_collections import config_flags

from sao_jax import configuration, trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  print(json.dumps(trainer.evaluate(_CONFIG.value, _WORKDIR.value, _STEP.value)))


if __name__ == "__main__":
  configuration.run(main)
