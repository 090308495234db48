"""The pure train steps: SFT, value pretraining, and the SAO / baseline RL step.

One RL step on a packed batch (DESIGN.md section 2):

    critic forward (no grad) -> advantages and returns (stop-gradient)
      -> K critic updates on L_V -> one actor update on L_pi

The advantage comes from the critic (skip-observation GAE for SAO, token- or
step-level GAE for the ablations) or from a critic-free baseline computed on
the host and carried in `batch["baseline_advantages"]` (GRPO's group
normalisation, the running mean). The policy loss is DIS or PPO-clip. The
policy version is `state.step`, the number of actor updates applied.

All functions here are pure; `jit_sharded` adds shardings and donation.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax

from sao_jax import advantages as adv
from sao_jax import losses
from sao_jax.models import policy
from sao_jax.models.config import ModelConfig

# The names `rl.advantage` and `rl.policy_loss` take: the records' tables.
ADVANTAGES = tuple(adv.ESTIMATORS)
POLICY_LOSSES = tuple(losses.POLICY_LOSSES)


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # actor updates applied == policy version
  policy: Any
  critic: Any
  policy_opt: Any
  critic_opt: Any


@dataclasses.dataclass(frozen=True)
class StepConfig:
  advantage: str = "value"
  policy_loss: str = "dis"
  eps_low: float = 0.2
  eps_high: float = 0.28
  gamma: float = 1.0
  lam: float = 0.95
  # Lambda of the critic's return targets; None: the same as `lam`.
  critic_lam: float | None = None
  # K critic updates per actor update.
  critic_updates: int = 2
  # Weight of the MoE load-balancing loss, for both models.
  load_balance_coef: float = 0.01
  # Sampling temperature of the rollout (the policy's logits are scaled alike).
  temperature: float = 1.0

  def __post_init__(self):
    adv.estimator(self.advantage)  # unknown names raise, listing the known ones
    losses.policy_loss(self.policy_loss)
    if self.critic_updates < (1 if self.uses_critic else 0):
      raise ValueError("critic_updates must be >= 1 with a value baseline")

  @property
  def estimator(self) -> adv.Estimator:
    return adv.estimator(self.advantage)

  @property
  def uses_critic(self) -> bool:
    return self.estimator.uses_critic


def _model_inputs(batch):
  return batch["tokens"], batch["positions"], batch["segment_ids"]


def group_norms(tree, groups: dict[str, str]) -> dict[str, jax.Array]:
  """Global L2 norm of the leaves whose path matches each regex."""
  flat = [("/".join(str(getattr(k, "key", k)) for k in path), leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]
  out = {}
  for name, rx in groups.items():
    pattern = re.compile(rx)
    sq = [jnp.sum(jnp.square(x.astype(jnp.float32))) for p, x in flat if pattern.search(p)]
    out[name] = jnp.sqrt(sum(sq)) if sq else jnp.zeros(())
  return out


_NORM_GROUPS = {"attention": r"/attn/", "moe_mlp": r"/(moe|mlp)/", "all": r".*"}


def _gae(cfg: StepConfig, values, batch, lam: float):
  return cfg.estimator.gae(batch["rewards"], values, batch["action_mask"], cfg.gamma, lam,
                           segment_ids=batch["segment_ids"])


def compute_advantages(cfg: StepConfig, values, batch):
  """(advantages, returns, value_mask) `[R, L]` for the configured estimator.

  Advantages use `lam`; the critic's targets (returns) use `critic_lam`
  when it differs (lambda-returns closer to Monte Carlo at 1.0, less
  self-bootstrapped). `value_mask` is where the critic is regressed: the
  action tokens, or for token-level GAE every position its recursion reads.
  """
  m, seg = batch["action_mask"], batch["segment_ids"]
  if not cfg.uses_critic:
    a = batch["baseline_advantages"]
    return a, jnp.zeros_like(a), m
  advantages, returns = _gae(cfg, values, batch, cfg.lam)
  if cfg.critic_lam is not None and cfg.critic_lam != cfg.lam:
    _, returns = _gae(cfg, values, batch, cfg.critic_lam)
  value_mask = adv.action_span(m, seg) if cfg.estimator.critic_span else m
  return advantages, returns, value_mask


def _critic_updates(model_cfg, cfg, critic_tx, state, batch, metrics):
  """Critic forward -> advantages/returns -> K critic updates."""
  inputs = _model_inputs(batch)
  m = batch["action_mask"]

  def critic_loss(params, targets):
    v, aux = policy.token_values(model_cfg, params, *inputs)
    if targets is None:
      # The first update's forward is also the one GAE reads (no separate
      # no-grad critic forward): targets from its stop-gradient values.
      targets = compute_advantages(cfg, jax.lax.stop_gradient(v), batch)
      targets = jax.lax.stop_gradient(targets)
    _, returns, value_mask = targets
    loss, vm = losses.value_loss(v, returns, value_mask)
    vm["value_loss"] = loss
    return loss + cfg.load_balance_coef * aux["load_balance_loss"], (vm, targets)

  critic, opt = state.critic, state.critic_opt
  skipped = jnp.zeros((), jnp.int32)
  targets = None  # (advantages, returns, value_mask), from the first update's forward
  for k in range(cfg.critic_updates):
    (_, (vm, targets)), grads = jax.value_and_grad(critic_loss, has_aux=True)(critic, targets)
    grad_norm = None
    if k == 0:  # the fit before this step's updates: what GAE used
      norms = group_norms(grads, _NORM_GROUPS)
      grad_norm = norms["all"]
      metrics.update({f"critic/{n}": x for n, x in vm.items()})
      metrics.update({f"critic/grad_norm_{n}": x for n, x in norms.items()})
    critic, opt, ok = apply_if_finite(critic_tx, grads, opt, critic, vm["value_loss"],
                                      grad_norm)
    skipped = skipped + (1 - ok.astype(jnp.int32))
  metrics["critic/updates_skipped"] = skipped
  advantages = targets[0]
  n = jnp.maximum(m.sum(), 1)
  metrics["advantage_mean"] = jnp.where(m, advantages, 0).sum() / n
  metrics["advantage_abs_mean"] = jnp.where(m, jnp.abs(advantages), 0).sum() / n
  return state.replace(critic=critic, critic_opt=opt), advantages


def make_train_step(model_cfg: ModelConfig, cfg: StepConfig, policy_tx, critic_tx,
                    *, update_actor: bool = True) -> Callable:
  """train_step(state, batch) -> (state, metrics). `update_actor=False` is value pretraining."""

  def train_step(state: TrainState, batch):
    m = batch["action_mask"]
    n = jnp.maximum(m.sum(), 1)
    metrics = {
        "tokens/action": m.sum(), "tokens/all": (batch["segment_ids"] > 0).sum(),
        "reward_per_sequence": batch["rewards"].sum() / jnp.maximum(
            _num_segments(batch["segment_ids"]), 1),
    }
    if cfg.uses_critic:
      state, advantages = _critic_updates(model_cfg, cfg, critic_tx, state, batch, metrics)
    else:
      advantages = batch["baseline_advantages"]
    if not update_actor:
      return state, metrics

    loss_fn = losses.policy_loss(cfg.policy_loss)

    def actor_loss(params):
      logp, aux = policy.token_logprobs(model_cfg, params, *_model_inputs(batch),
                                        cfg.temperature)
      loss, pm = loss_fn(logp, batch["rollout_logprobs"], advantages, m, cfg.eps_low,
                         cfg.eps_high)
      pm["load_balance_loss"] = aux["load_balance_loss"]
      return loss + cfg.load_balance_coef * aux["load_balance_loss"], (loss, pm)

    (_, (pi_loss, pm)), grads = jax.value_and_grad(actor_loss, has_aux=True)(state.policy)
    norms = group_norms(grads, _NORM_GROUPS)
    new_policy, opt, ok = apply_if_finite(policy_tx, grads, state.policy_opt, state.policy,
                                          pi_loss, norms["all"])
    metrics["policy/update_skipped"] = 1 - ok.astype(jnp.int32)
    metrics.update({f"policy/{k}": v for k, v in pm.items()})
    metrics["policy/loss"] = pi_loss
    metrics.update({f"policy/grad_norm_{k}": v for k, v in norms.items()})
    lag = jnp.where(m, state.step - batch["policy_version"], 0)
    metrics["policy_lag/mean"] = lag.sum() / n
    metrics["policy_lag/max"] = lag.max()
    # A skipped update is not a new policy version.
    state = state.replace(step=state.step + ok.astype(state.step.dtype), policy=new_policy,
                          policy_opt=opt)
    return state, metrics

  return train_step


def apply_if_finite(tx, grads, opt_state, params, loss, grad_norm=None):
  """One optimizer update, or none at all if the loss or a gradient is not finite.

  Returns (params, opt_state, ok). When not ok, params and optimizer state
  come back bit-identical: a NaN batch must not poison Adam's moments. The
  selects are elementwise on each leaf, so XLA fuses them into the update
  and a sharded step needs no second copy of its state. `grad_norm`: the
  global norm of `grads` if the caller has it (for its metrics), so it is
  not reduced over every gradient a second time.
  """
  if grad_norm is None:
    grad_norm = optax.tree.norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, new_opt = tx.update(grads, opt_state, params)
  keep = lambda new, old: jnp.where(ok, new, old)
  new_params = optax.apply_updates(params, updates)
  return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt, opt_state), ok


def _num_segments(segment_ids):
  starts = (segment_ids > 0) & (jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0))) != segment_ids)
  return starts.sum()


def make_sft_step(model_cfg: ModelConfig, tx, load_balance_coef: float = 0.01) -> Callable:
  """sft_step(params, opt_state, batch) -> (params, opt_state, metrics): NLL on actions."""

  def sft_step(params, opt_state, batch):
    m = batch["action_mask"]

    def loss_fn(p):
      logp, aux = policy.token_logprobs(model_cfg, p, *_model_inputs(batch))
      nll = -jnp.where(m, logp, 0.0).sum() / jnp.maximum(m.sum(), 1)
      return nll + load_balance_coef * aux["load_balance_loss"], nll

    (_, nll), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    grad_norm = optax.tree.norm(grads)
    params, opt_state, ok = apply_if_finite(tx, grads, opt_state, params, nll, grad_norm)
    return params, opt_state, {"sft/nll": nll, "sft/grad_norm": grad_norm,
                               "sft/update_skipped": 1 - ok.astype(jnp.int32)}

  return sft_step


def jit_sharded(fn, state_shardings, batch_sharding, donate: bool = True):
  """jit with explicit in/out shardings for (state, batch) -> (state, metrics)."""
  return jax.jit(fn, in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, None),
                 donate_argnums=(0,) if donate else ())
