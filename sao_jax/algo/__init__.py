"""The pure math of SAO: advantage estimators, policy and value losses, optimizers.

The lowest layer (docs/DESIGN.md, "Layers"): jittable functions of arrays
and records of hyperparameters, importing nothing else of sao_jax.
"""
