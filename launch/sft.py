"""The supervised warm start alone (the paper's SFT baseline).

    python launch/sft.py --config=configs/sao_tiny.py --workdir=workdirs/sao_tiny

Trains the policy on the environment's demonstrations and evaluates it on
held-out tasks. `launch/train.py` on the same workdir then continues with
value pretraining and RL from this warm start instead of redoing it.
"""

import json
import os
import sys

from absl import flags, logging
from ml_collections import config_flags

from sao_jax.train import configuration, distributed, trainer

# --config files import the repository's `configs` package, which is not
# installed: this checkout's root joins sys.path, whatever the working directory.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (resumes from it).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  distributed.initialize(_CONFIG.value.distributed)  # before anything touches devices
  print(json.dumps(trainer.train(_CONFIG.value, _WORKDIR.value, until="value_pretrain")))


if __name__ == "__main__":
  configuration.run(main)
