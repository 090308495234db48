"""SAO's losses and critic in the classic synchronous loop (generate the whole batch, wait, train).

    python launch/train.py --config=configs/sao_sync.py --workdir=workdirs/sao_sync

Everything else as configs/sao_dis.py (same SFT start, same budget), so the
held-out pass@1 of the runs compare directly.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.rl.mode = "sync"
  return c
