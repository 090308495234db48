"""Classic synchronous GRPO: G=4 samples per prompt, PPO clip, batch barrier.

    python launch/train.py --config=configs/grpo_sync.py --workdir=workdirs/grpo_sync

configs/grpo.py with one change, so the two arms differ only in that.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import grpo  # pylint: disable=g-import-not-at-top


def get_config(arg=None):
  c = grpo.get_config(arg)
  c.rl.mode = 'sync'
  return c
