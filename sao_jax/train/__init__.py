"""The run: build, stages, the RL loop, trajectory sources, the sharded train step.

The layer that assembles the ones below it (docs/DESIGN.md, "Layers");
`trainer.train` is what launch/train.py calls.
"""
