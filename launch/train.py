"""Trains SAO (or a baseline arm): python launch/train.py --config=configs/sao_tiny.py.

Intentionally kept short: flags in, one call into sao_jax.train.trainer.
Override any field: --config.rl.steps=200 --config.rollout.max_staleness=4.
Multi-host: the same command on every host, with
--config.distributed.enabled=True and the coordinator / process fields
(sao_jax/train/distributed.py; README "Multi-host training").
"""

import os
import sys

from absl import flags, logging
from ml_collections import config_flags

from sao_jax.train import configuration, distributed, trainer

# --config files import the repository's `configs` package, which is not
# installed: this checkout's root joins sys.path, whatever the working directory.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Run directory, a POSIX path or gs://BUCKET/run (resumes from it)."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  distributed.initialize(_CONFIG.value.distributed)  # before anything touches devices
  trainer.train(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  configuration.run(main)
