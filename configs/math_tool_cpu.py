"""math_tool with Qwen3's formats that learns on 2 CPU cores.

    make train-math   # = python launch/train.py --config=configs/math_tool_cpu.py --workdir=workdirs/math_tool_cpu
    python -m experiments.math_cpu --seeds 3   # over seeds (experiments/math_cpu.py)

configs/math_tool_tiny.py (the tiny MoE model, Qwen3's tokenizer and chat
template with thinking on, the python tool in the sandbox, the math
verifier, the whole shipped set) with what makes the tiny model learn it:

  * the head over the ids the task uses (`model.vocab_subset = "env"`,
    sao_jax/envs/head_vocab.py): 320 columns instead of 151,669, so a step
    does not pay for the whole vocabulary (0.16M policy parameters, not 19.5M);
  * SFT until the mean training NLL of 25 steps is 0.04 (`sft.stop_at_nll`,
    at most 800 steps): the seeds learn the task at very different speeds,
    and a fixed step count leaves some where RL has nothing to add;
  * RL with the CPU default's PPO clip at actor lr 3e-4, 150 steps.

`:curriculum` (`--config=configs/math_tool_cpu.py:curriculum`) trains on
four of the nine families (FAMILIES below) instead of the whole set.

What SFT and RL give over seeds: benchmarks/RESULTS.md#learning-on-cpu.
"""

from configs import math_tool_tiny

# The curriculum: the shipped set's word problems whose code takes the
# question's small numbers in order (math_problems.py: change, savings,
# power; sharing, a third of whose solutions take two tool calls), in
# training and held out alike (161 held-out rows).
FAMILIES = ("change", "sharing", "savings", "power")


def get_config(arg=None):
  """`arg` "curriculum": the four families of FAMILIES instead of the whole set."""
  if arg not in (None, "", "curriculum"):
    raise ValueError(f"math_tool_cpu takes no argument or 'curriculum', not {arg!r}")
  c = math_tool_tiny.get_config()
  c.env.kwargs = {"max_turns": 4, "families": FAMILIES if arg == "curriculum" else ()}
  # The head over the ids the task uses (320 of 151,669 over the whole set, 285
  # with the curriculum), at every position: cheap enough at that width.
  c.model.vocab_subset = "env"
  c.model.overrides = {}
  c.data.logits_at_actions = False
  # SFT until the mean training NLL of 25 steps is 0.04 (at most 800 steps):
  # seeds learn this task at very different speeds, and a fixed step count
  # leaves some near the ceiling, where RL has nothing left to add.
  c.sft.steps = 800
  c.sft.stop_at_nll = 0.04
  c.sft.stop_window = 25
  c.sft.batch_size = 16
  c.sft.lr = 3e-3
  c.value_pretrain.steps = 20
  c.value_pretrain.num_trajectories = 64
  # The CPU default's loss and learning rate (configs/sao_tiny.py).
  c.rl.policy_loss = "ppo_clip"
  c.rl.steps = 150
  c.rl.batch_size = 16
  c.rl.actor_lr = 3e-4
  c.eval.num_tasks = 200
  c.eval.slots = 32
  c.checkpoint.every = 50
  c.log_every = 25
  return c
