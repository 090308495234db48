"""Classic synchronous GRPO: G=4 samples per prompt, PPO clip, batch barrier.

    python launch/train.py --config=configs/grpo_sync.py --workdir=workdirs/grpo_sync

configs/grpo.py with one change, so the two arms differ only in that.
"""

from configs import grpo


def get_config(arg=None):
  c = grpo.get_config(arg)
  c.rl.mode = "sync"
  return c
