"""A fleet rollout process: generation apart from the trainer (rl.mode = "fleet").

    python launch/rollout.py --config=configs/sao_tiny.py --workdir=workdirs/run \\
        --rollout_id=r0 --config.rl.mode=fleet

Same config and workdir (or --config.fleet.root) as the trainer. Intentionally
kept short: flags and signals in, one call into
sao_jax.train.fleet_worker.run_rollout_worker (what the process does). SIGTERM /
SIGINT: stop, rename the open shard, exit 0. SIGKILL loses only the open
shard; start it again with the same --rollout_id and it continues its shard
sequence. One process per --rollout_id: while one runs, a second with its id
exits 1 at start-up with one line (`error: rollout id 'r0' is in use: pid
... on ... holds ...`), the running one's files untouched.
`kill -USR1 <pid>`: every thread's stack on stderr.
"""

import faulthandler
import os
import signal
import sys
import threading

from absl import flags, logging
from ml_collections import config_flags

from sao_jax.train import configuration, fleet_worker

# --config files import the repository's `configs` package, which is not
# installed: this checkout's root joins sys.path, whatever the working directory.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The trainer's run directory.")
_ROLLOUT_ID = flags.DEFINE_string(
  "rollout_id", None, "This process's name in shard names (letters, digits, _)."
)
flags.mark_flags_as_required(["config", "workdir", "rollout_id"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  # Every thread's stack on stderr, to see where a rollout host waits.
  faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
  fleet_worker.run_rollout_worker(_CONFIG.value, _WORKDIR.value, _ROLLOUT_ID.value, stop)


if __name__ == "__main__":
  configuration.run(main)
