"""Defaults shared by every config; each config file overrides what it changes.

Every section is built from its record in sao_jax/config/sections.py (model, env,
sharding, distributed, data, sft, value_pretrain, rollout, rl, fleet, pod, eval,
logging, checkpoint, faults), where each field is documented and checked.
"""

from sao_jax.config import sections

# The default logical-axis rules (data parallel), under the name tests use.
DATA_PARALLEL_RULES = sections.DATA_PARALLEL_RULES


def get_config():
  # The top-level fields: seed, log_every, tensorboard (sections.TopLevel).
  c = sections.TopLevel.defaults()
  # The typed sections (sao_jax/config/sections.py) hold each field's default, its
  # documentation and its check; read them there.
  c.distributed = sections.Distributed.defaults()

  c.model = sections.Model.defaults()
  c.env = sections.Env.defaults()
  c.data = sections.Data.defaults()
  c.sharding = sections.Sharding.defaults()
  c.sft = sections.SFT.defaults()
  c.value_pretrain = sections.ValuePretrain.defaults()
  c.rollout = sections.Rollout.defaults()
  c.rl = sections.RL.defaults()
  c.fleet = sections.Fleet.defaults()
  c.pod = sections.Pod.defaults()
  c.eval = sections.Eval.defaults()
  c.logging = sections.Logging.defaults()
  c.checkpoint = sections.Checkpoint.defaults()
  c.faults = sections.Faults.defaults()
  c.lora = sections.Lora.defaults()

  # Unknown fields are errors: a config file that sets a misspelt field fails
  # when it loads, instead of running with the default.
  c.lock()
  return c
