"""sao-jax: Single-Rollout Asynchronous Optimization (SAO) for agentic RL, in JAX.

Start with `sao_jax.train.trainer.train(config, workdir)` (what launch/train.py
calls), or the pure pieces: `advantages`, `losses`, `train_step`, `models`.
"""

__version__ = "0.1.0"

# Before anything imports JAX: an installed libtpu must not start (and print
# its errors) on a host without a TPU (sao_jax/models/platforms.py).
from sao_jax.models import platforms as _platforms

_platforms.keep_tpu_off_cpu_hosts()
