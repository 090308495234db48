"""pass@1 at temperature 1.0 on held-out tasks, for any checkpoint of a run.

    python launch/eval.py --config=configs/sao_tiny.py --workdir=workdirs/sao_tiny \
        [--step=N] [--out=FILE]

Prints one JSON line: pass@1 and its standard error, tasks, samples, mean
length and turns, and "samples_file": the JSONL with one line per sample
(task, prompt id, reward, success, turns, the last step's info such as a
verdict, the action turns and the whole transcript decoded), by default
`<workdir>/eval/checkpoint_<step>.jsonl`.
"""

import json

from absl import flags, logging
from ml_collections import config_flags

from sao_jax import configuration, trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_OUT = flags.DEFINE_string("out", None, "Per-sample JSONL (default: "
                           "<workdir>/eval/checkpoint_<step>.jsonl).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  print(json.dumps(trainer.evaluate(_CONFIG.value, _WORKDIR.value, _STEP.value, _OUT.value)))


if __name__ == "__main__":
  configuration.run(main)
