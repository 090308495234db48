"""math_tool with Qwen3's formats that learns on 2 CPU cores (issue 38).

    make train-math   # = python launch/train.py --config=configs/math_tool_cpu.py --workdir=workdirs/math_tool_cpu

configs/math_tool_tiny.py with the changes that make the tiny model learn
the paper's task shape in minutes: the head over the vocabulary subset the
task uses (`model.vocab_subset = "env"`, sao_jax/envs/head_vocab.py),
so a step no longer pays for 151,669 logits a position.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import math_tool_tiny  # pylint: disable=g-import-not-at-top


def get_config(arg=None):
  del arg
  c = math_tool_tiny.get_config()
  c.model.vocab_subset = "env"
  c.model.overrides = {}
  c.sft.steps = 400
  c.sft.batch_size = 16
  c.sft.lr = 3e-3
  c.value_pretrain.steps = 20
  c.value_pretrain.num_trajectories = 64
  c.rl.steps = 100
  c.rl.batch_size = 16
  c.rl.actor_lr = 1e-4
  c.eval.num_tasks = 200
  c.eval.slots = 32
  c.checkpoint.every = 50
  return c
