"""`rl.actor_frozen`: the actor's parameters a run never moves (e.g. the MoE router).

NeMo-RL's `freeze_moe_router` and Tunix's trainable-parameter masks freeze the
actor's router in RL; here a rule set of regexes does it, checked against the
model so that a rule written for another architecture is refused, not ignored.
"""

import jax
import numpy as np
import pytest
from runs import load_config_module
from test_trainer import CFG, demo_trajs

from sao_jax.algo import optim
from sao_jax.data import packing
from sao_jax.models import config as mcfg
from sao_jax.models import policy, sharding
from sao_jax.train import configuration, factories
from sao_jax.train.train_step import make_sft_step

ROUTER = r"/moe/router$"


def _paths(tree):
  return {
    optim.param_path(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def test_a_frozen_router_stays_bit_identical_while_the_rest_of_the_actor_trains():
  """A step of the actor's optimizer over the tiny MoE with the router frozen
  (the SFT step: the RL step applies the same optimizer to its gradients):
  every router leaf is bit-identical afterwards, the experts and attention
  moved, and Adam holds no moments for the router."""
  p = policy.init_params(CFG, jax.random.key(0))
  tx = optim.make_optimizer(p, 1e-2, rules=optim.freeze_rules((ROUTER,)))
  step = jax.jit(make_sft_step(CFG, tx))
  before = _paths(p)
  params, opt_state, _ = step(p, tx.init(p), packing.pack(demo_trajs(4), 4, (128,)))
  after = _paths(params)
  routers = [n for n in before if n.endswith("/moe/router")]
  assert routers
  for name in routers:
    np.testing.assert_array_equal(after[name], before[name])
  moved = [n for n in before if n not in routers and not np.array_equal(after[n], before[n])]
  assert any("/moe/wi_gate" in n for n in moved) and any("/attn/" in n for n in moved)
  size = lambda t: sum(x.size for x in jax.tree.leaves(t))
  full = optim.make_optimizer(p, 1e-2).init(p)
  assert size(full) - size(opt_state) == 2 * sum(before[n].size for n in routers)  # mu, nu


def test_a_rule_that_matches_no_parameter_is_refused_in_one_line():
  """A router rule on a dense model (or a typo) would freeze nothing silently."""
  dense = jax.eval_shape(lambda: policy.init_params(mcfg.tiny_dense(64), jax.random.key(0)))
  with pytest.raises(
    ValueError,
    match=r"rl.actor_frozen: \['/moe/router\$'\] match no "
    "parameter",
  ):
    optim.check_rules_match(dense, optim.freeze_rules((ROUTER,)), "rl.actor_frozen")
  optim.check_rules_match(
    jax.eval_shape(lambda: policy.init_params(CFG, jax.random.key(0))),
    optim.freeze_rules((ROUTER,)),
    "rl.actor_frozen",
  )


@pytest.mark.parametrize("bad", [("(",), ("",), (3,)])
def test_the_config_refuses_what_is_not_a_tuple_of_regexes(bad):
  c = load_config_module("sao_tiny.py").get_config()
  c.rl.actor_frozen = bad
  with pytest.raises(configuration.ConfigError, match="rl.actor_frozen"):
    configuration.validate(c)


def test_the_programs_freeze_the_router_for_sft_and_rl_alike():
  """build_programs gives SFT and RL one optimizer layout with the router
  frozen, and refuses a dead rule before anything compiles."""
  from sao_jax.config import sections

  c = load_config_module("sao_tiny.py").get_config()
  c.rl.actor_frozen = (ROUTER,)
  typed = sections.load(c)
  model_cfg = factories.build_model_config(typed)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  programs = factories.build_programs(typed, model_cfg, factories.step_config(typed), mesh)
  params = programs.abstract_state.policy
  sft = jax.eval_shape(programs.sft_tx.init, params)
  rl = jax.eval_shape(programs.policy_tx.init, params)
  assert jax.tree.structure(sft) == jax.tree.structure(rl)
  c.rl.actor_frozen = (r"/no_such_param$",)
  with pytest.raises(ValueError, match="rl.actor_frozen"):
    factories.build_programs(sections.load(c), model_cfg, factories.step_config(typed), mesh)
