"""SAO in the online-learning simulation: online_style, whose preferred style shifts.

    python launch/train.py --config=configs/sao_online.py --workdir=workdirs/sao_online

One-line answers about a topic; the reward is 1 for a well-formed line in
the style currently preferred, which moves to the next of four styles every
`env.kwargs.switch_every` training episodes (evaluation and value
pretraining read the schedule without advancing it). The SFT start writes
all four styles alike (pass@1 about 0.25); RL must find the preferred one
and re-adapt after every shift. 320 episodes per style = 20 RL steps of 16,
so 240 steps see 12 shifts. Compare with the running-mean and GRPO arms of
`python -m experiments.online`.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.env.name = "online_style"
  # Training episodes per preferred style; the reward of a well-formed line
  # in another style (0: none; experiments/README.md's "online, with partial
  # credit" run sets 0.2 and 640 episodes a style).
  c.env.kwargs = {"switch_every": 320, "quality_credit": 0.0}
  # A line is up to ~40 characters of the character vocabulary.
  c.rollout.max_turn_tokens = 48
  c.rollout.max_len = 128
  c.rl.steps = 240
  # Every step logged: recovery after a shift is read from the curve.
  c.log_every = 1
  return c
