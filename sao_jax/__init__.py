"""sao-jax: Single-Rollout Asynchronous Optimization (SAO) for agentic RL, in JAX.

Start with `sao_jax.train.trainer.train(config, workdir)` (what launch/train.py
calls), or the pure pieces: `advantages`, `losses`, `train_step`, `models`.
"""

__version__ = "0.1.0"
