"""SAO on python_tool with the tiny MoE model: the CPU default.

    python launch/train.py --config=configs/sao_tiny.py --workdir=workdirs/sao_tiny

SFT warm start -> value pretraining -> async SAO -> held-out pass@1, on 2 CPU
cores. Results of a run are in benchmarks/RESULTS.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import common  # pylint: disable=g-import-not-at-top


def get_config(arg=None):
  del arg
  return common.get_config()
