"""sao_tiny with 32 experts, top-4: the trained policy benchmarks/routing.py measures.

python launch/train.py --config=benchmarks/routing_config.py --workdir=/tmp/routing_run
python benchmarks/routing.py --config=benchmarks/routing_config.py --workdir=/tmp/routing_run
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.rl.policy_loss = "ppo_clip"
  c.model.overrides = {"num_experts": 32, "experts_per_token": 4}
  return c
