"""The pure train steps: SFT, value pretraining, and the SAO / baseline RL step.

One RL step on a packed batch (docs/DESIGN.md section 2):

    critic forward (no grad) -> advantages and returns (stop-gradient)
      -> K critic updates on L_V -> one actor update on L_pi

The advantage comes from the critic (skip-observation GAE for SAO, token- or
step-level GAE for the ablations) or from a critic-free baseline computed on
the host and carried in `batch["baseline_advantages"]` (GRPO's group
normalisation, the running mean). The policy loss is a record of
`losses.POLICY_LOSSES` (DIS, PPO-clip and DIS's variants). The policy
version is `state.step`, the number of actor updates applied.

Every actor update also logs how far the batch is from the policy it
trains (`lag_diagnostics`, under `dis/`): per lag bucket the quantiles of
the importance ratio, the approx KL to the rollout policy and the share of
tokens outside DIS's window, and the corrective tokens' share of tokens
and of |r A|. `dis_warnings` turns a record of them into progress lines.

With LoRA (`Adapters`, sao_jax/models/lora.py) the state's policy and
critic are adapter trees: each step takes the frozen bases as one more,
constant argument `bases` = (policy base, critic base), differentiates the
adapters only (the optimizer states hold their moments only) and runs the
forward of `lora.merge(base, adapters)` with each layer merging its own
weights inside its rematerialised block (`policy.token_logprobs`'
`adapters`; sao_jax/models/transformer.py): one layer's merged matrices
and their gradient dL/dW' are live at a time, not a merged copy of the
whole stack. The engine's served params are the whole-tree merge
(`full_policy`), the same values.

All functions here are pure; `jit_sharded` adds shardings and donation.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

import chex
import flax
import jax
import jax.numpy as jnp
import optax

from sao_jax.algo import advantages as adv
from sao_jax.algo import losses
from sao_jax.algo.optim import param_path
from sao_jax.config import sections
from sao_jax.models import lora, policy
from sao_jax.models.config import ModelConfig

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # actor updates applied == policy version
  policy: Any
  critic: Any
  policy_opt: Any
  critic_opt: Any


@dataclasses.dataclass(frozen=True)
class Adapters:
  """LoRA's view of the state: its policy and critic adapt these configs' targets."""

  actor: lora.LoraConfig
  critic: lora.LoraConfig


def full_policy(adapters: Adapters | None, trainable, bases):
  """The actor's full params: `trainable` itself without LoRA, else merged on bases[0]."""
  return trainable if adapters is None else lora.merge(bases[0], trainable, adapters.actor)


def full_critic(adapters: Adapters | None, trainable, bases):
  """The critic's full params: `trainable` itself without LoRA, else merged on bases[1]."""
  return trainable if adapters is None else lora.merge(bases[1], trainable, adapters.critic)


def forward_args(adapters: Adapters | None, trainable, bases, which: str) -> tuple:
  """(params, adapters) for `policy.token_logprobs` / `token_values` in the
  actor's ("policy") or the critic's forward: `trainable` itself without
  LoRA, else its base, with `trainable` the adapters it merges per layer."""
  if adapters is None:
    return trainable, None
  if which == "policy":
    return bases[0], (trainable, adapters.actor)
  return bases[1], (trainable, adapters.critic)


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """What the jitted steps read, as a view of the config: the rl section
  whole (sections.RL: the estimator, the policy loss and its window, GAE's
  gamma and lambdas, K critic updates, the load-balancing weight, the loss
  variants' options) and the rollout's sampling temperature, by which the
  policy's logits are scaled alike. It declares no option and no default
  of its own: `cfg.eps_low` is `cfg.rl.eps_low`."""

  rl: sections.RL
  temperature: float

  def __getattr__(self, name):  # the rl section's fields, read through
    if name == "rl":  # not set yet (copy, unpickling): no recursion
      raise AttributeError(name)
    return getattr(self.rl, name)

  @classmethod
  def of(cls, temperature: float | None = None, **rl_fields) -> "StepConfig":
    """From some rl fields (the rest at the section's defaults) and a
    temperature (the rollout section's default if None): tools and tests."""
    if temperature is None:
      temperature = sections.Rollout().temperature
    return cls(sections.RL(**rl_fields), temperature)

  @property
  def estimator(self) -> adv.Estimator:
    return adv.estimator(self.rl.advantage)

  @property
  def uses_critic(self) -> bool:
    return self.estimator.uses_critic

  def loss_options(self) -> dict:
    """The rl section's values of the options the train step offers every
    policy loss from the config (losses.CONFIG_OPTIONS).
    An offered option the section does not declare is an error, never a
    silent drop."""
    missing = [k for k in losses.CONFIG_OPTIONS if not hasattr(self.rl, k)]
    if missing:
      raise ValueError(
        f"losses.CONFIG_OPTIONS {missing} are not fields of the rl section "
        "(sao_jax/config/sections.py RL): declare each there"
      )
    return {k: getattr(self.rl, k) for k in losses.CONFIG_OPTIONS}


def _model_inputs(batch):
  return batch["tokens"], batch["positions"], batch["segment_ids"]


def group_norms(tree, groups: dict[str, str]) -> dict[str, jax.Array]:
  """Global L2 norm of the leaves whose path matches each regex."""
  flat = [(param_path(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]
  out = {}
  for name, rx in groups.items():
    pattern = re.compile(rx)
    sq = [jnp.sum(jnp.square(x.astype(jnp.float32))) for p, x in flat if pattern.search(p)]
    out[name] = jnp.sqrt(sum(sq)) if sq else jnp.zeros(())
  return out


_NORM_GROUPS = {"attention": r"/attn/", "moe_mlp": r"/(moe|mlp)/", "all": r".*"}


def _gae(cfg: StepConfig, values, batch, lam: float):
  return cfg.estimator.gae(
    batch["rewards"], values, batch["action_mask"], cfg.gamma, lam, segment_ids=batch["segment_ids"]
  )


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


def _critic_updates(model_cfg, cfg, critic_tx, state, batch, metrics, adapters=None, bases=None):
  """Critic forward -> advantages/returns -> K critic updates."""
  inputs = _model_inputs(batch)
  m = batch["action_mask"]

  def critic_loss(params, targets):
    full, adapted = forward_args(adapters, params, bases, "critic")
    v, aux = policy.token_values(model_cfg, full, *inputs, adapters=adapted)
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
    critic, opt, ok = apply_if_finite(critic_tx, grads, opt, critic, vm["value_loss"], grad_norm)
    skipped = skipped + (1 - ok.astype(jnp.int32))
  metrics["critic/updates_skipped"] = skipped
  advantages = targets[0]
  metrics["advantage_mean"] = _mean_or_nan(jnp.where(m, advantages, 0).sum(), m.sum())
  metrics["advantage_abs_mean"] = _mean_or_nan(jnp.where(m, jnp.abs(advantages), 0).sum(), m.sum())
  return state.replace(critic=critic, critic_opt=opt), advantages


# --- DIS under lag: diagnostics -----------------------------------------------------

# Lag buckets (inclusive versions; None: no upper end) and their metric suffixes.
# A lag below 0 (a version ahead of the step: not expected) falls in the first.
LAG_BUCKETS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, None))
# Quantiles of the importance ratio logged per bucket (`ratio_q01_lag1`, ...).
RATIO_QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)


def lag_bucket_name(lo: int, hi: int | None) -> str:
  """ "lag1", "lag3_4", "lag9up"."""
  if hi is None:
    return f"lag{lo}up"
  return f"lag{lo}" if lo == hi else f"lag{lo}_{hi}"


def masked_quantiles(
  x: Array, groups: Array, num_groups: int, quantiles: tuple[float, ...]
) -> Array:
  """Quantiles of `x` within each group, with static shapes. float `[G, Q]`.

  `groups` (int, the shape of `x`) holds each element's group in
  [0, num_groups); any other value leaves the element out. One sort orders
  the elements by (group, x): group g then occupies [start_g, start_g + n_g)
  and its q-quantile is numpy's default "linear" one,

      pos = q (n_g - 1),  lo = floor(pos)
      Q   = x_(lo) + (pos - lo) (x_(lo + 1) - x_(lo)),

  with x_(k) the group's k-th smallest. An empty group's quantiles are NaN.
  """
  x, groups = x.ravel(), groups.ravel()
  groups = jnp.where((groups >= 0) & (groups < num_groups), groups, num_groups)
  _, sorted_x = jax.lax.sort((groups, x), num_keys=2)
  counts = (groups[None, :] == jnp.arange(num_groups)[:, None]).sum(axis=1)  # [G]
  starts = jnp.cumsum(counts) - counts
  q = jnp.asarray(quantiles, x.dtype)[None, :]  # [1, Q]
  pos = q * (jnp.maximum(counts, 1) - 1).astype(x.dtype)[:, None]  # [G, Q]
  lo = jnp.floor(pos)
  frac = pos - lo
  lo = lo.astype(jnp.int32)
  hi = jnp.minimum(lo + 1, jnp.maximum(counts, 1)[:, None] - 1)
  last = x.shape[0] - 1
  x_lo = sorted_x[jnp.clip(starts[:, None] + lo, 0, last)]
  x_hi = sorted_x[jnp.clip(starts[:, None] + hi, 0, last)]
  out = x_lo + frac * (x_hi - x_lo)
  return jnp.where(counts[:, None] > 0, out, jnp.nan)


def lag_diagnostics(
  logp: Array,
  rollout_logp: Array,
  advantages: Array,
  action_mask: Array,
  lag: Array,
  eps_low: float,
  eps_high: float,
) -> dict:
  """How far a batch's action tokens are from the policy being trained, by lag.

  With r_t = exp(logp_t - rollout_logp_t) and DIS's regions
  (`losses.dis_regions`, window (1 - eps_low, 1 + eps_high)), over the
  action tokens (all `[B, T]`; `lag` int, the actor step minus the version
  that sampled the token):

      corrective_token_frac = #corrective / N
      corrective_mass_frac  = sum_corrective |r A| / sum_action |r A|   (NaN if no mass)
      outside_frac          = #(below or above) / N

  and per lag bucket b of LAG_BUCKETS (suffix `lag_bucket_name`):

      tokens_<b>           n_b, the bucket's action tokens
      ratio_qXX_<b>        the RATIO_QUANTILES of r over the bucket (XX = 100 q)
      approx_kl_<b>        mean over the bucket of k3 = r - 1 - log r
      outside_frac_<b>     the bucket's share outside the window

  An empty bucket's ratio quantiles, approx_kl and outside_frac are NaN
  (not 0, which would read as "on-policy"); its tokens is 0. The metrics
  writer logs no number for NaN (null in metrics.jsonl, no point elsewhere).
  Nothing here is differentiated: `logp` is taken as a constant.
  """
  chex.assert_equal_shape([logp, rollout_logp, advantages, action_mask, lag])
  logp = jax.lax.stop_gradient(logp)
  advantages = jax.lax.stop_gradient(advantages)
  log_ratio = losses.log_importance_ratio(logp, rollout_logp, action_mask)
  ratio = jnp.exp(log_ratio)
  below, above, _, corrective = losses.dis_regions(
    ratio, advantages, action_mask, eps_low, eps_high
  )
  outside = below | above
  mass = jnp.where(action_mask, jnp.abs(ratio * advantages), 0.0)
  total_mass = mass.sum()
  out = {
    "corrective_token_frac": _mean_or_nan(corrective.sum(), action_mask.sum()),
    # NaN when there is no mass at all (every A = 0): a share of nothing.
    "corrective_mass_frac": _mean_or_nan(jnp.where(corrective, mass, 0.0).sum(), total_mass),
    "outside_frac": _mean_or_nan(outside.sum(), action_mask.sum()),
  }
  # Bucket index per token: how many upper edges its lag exceeds.
  bucket = sum((lag > hi).astype(jnp.int32) for _, hi in LAG_BUCKETS[:-1])
  bucket = jnp.where(action_mask, bucket, len(LAG_BUCKETS))  # [B, T]
  quantiles = masked_quantiles(ratio, bucket, len(LAG_BUCKETS), RATIO_QUANTILES)
  k3 = ratio - 1.0 - log_ratio
  for b, (lo, hi) in enumerate(LAG_BUCKETS):
    name = lag_bucket_name(lo, hi)
    in_b = bucket == b
    count = in_b.sum()
    denom = jnp.maximum(count, 1).astype(logp.dtype)
    empty = count == 0
    out[f"tokens_{name}"] = count
    out[f"approx_kl_{name}"] = jnp.where(empty, jnp.nan, jnp.where(in_b, k3, 0.0).sum() / denom)
    out[f"outside_frac_{name}"] = jnp.where(empty, jnp.nan, (in_b & outside).sum() / denom)
    for j, q in enumerate(RATIO_QUANTILES):
      out[f"ratio_q{round(100 * q):02d}_{name}"] = quantiles[b, j]
  return out


# Levels above which `dis_warnings` speaks: starting points set above what
# the default queue (lag 4-5) gives in experiments/dis_stability.py's runs
# (their shares: experiments/README.md).
DIS_WARNING_LEVELS = {
  # Share of action tokens outside DIS's window (all lags).
  "outside_frac": 0.10,
  # Corrective tokens' share of the step's |r A|: what DIS drops and PPO clip trains on.
  "corrective_mass_frac": 0.10,
  # Per lag bucket, the k3 approx KL to the rollout policy (nats per token).
  "approx_kl": 0.05,
}


def dis_warnings(metrics: dict, levels: dict | None = None) -> list[str]:
  """One line per DIS diagnostic of a step's record that is above its level.

  `metrics`: a record with `lag_diagnostics`' keys under "dis/" (host
  scalars, e.g. what `MetricsWriter.write` returns). `levels`: overrides of
  DIS_WARNING_LEVELS. Missing keys and NaN (empty buckets) never warn.
  Returns [] when all is well.
  """
  levels = {**DIS_WARNING_LEVELS, **(levels or {})}

  def value(key):
    v = metrics.get(f"dis/{key}")
    try:
      v = float(v)
    except (TypeError, ValueError):
      return None
    return v if math.isfinite(v) else None

  lines = []
  v = value("outside_frac")
  if v is not None and v > levels["outside_frac"]:
    lines.append(
      f"dis: {v:.1%} of action tokens outside the DIS window "
      f"(warning level {levels['outside_frac']:.0%})"
    )
  v = value("corrective_mass_frac")
  if v is not None and v > levels["corrective_mass_frac"]:
    tokens = value("corrective_token_frac")
    share = "" if tokens is None else f" on {tokens:.1%} of the tokens"
    lines.append(
      f"dis: corrective tokens (DIS drops, PPO clip keeps) carry {v:.1%} of "
      f"|r A|{share} (warning level {levels['corrective_mass_frac']:.0%})"
    )
  high = []
  for lo, hi in LAG_BUCKETS:
    name = lag_bucket_name(lo, hi)
    v = value(f"approx_kl_{name}")
    if v is not None and v > levels["approx_kl"]:
      high.append(f"{v:.3g} at {name}")
  if high:
    lines.append(
      f"dis: approx KL to the rollout policy {', '.join(high)} "
      f"(warning level {levels['approx_kl']:.3g})"
    )
  return lines


def make_train_step(
  model_cfg: ModelConfig,
  cfg: StepConfig,
  policy_tx,
  critic_tx,
  *,
  update_actor: bool = True,
  adapters: Adapters | None = None,
) -> Callable:
  """train_step(state, batch, bases=None) -> (state, metrics). `update_actor=False`
  is value pretraining; `adapters`: LoRA, over `bases` (module docstring)."""

  def train_step(state: TrainState, batch, bases=None):
    m = batch["action_mask"]
    metrics = {
      "tokens/action": m.sum(),
      "tokens/all": (batch["segment_ids"] > 0).sum(),
      # NaN (undefined) in a batch without sequences.
      "reward_per_sequence": _mean_or_nan(
        batch["rewards"].sum(), _num_segments(batch["segment_ids"])
      ),
    }
    if cfg.uses_critic:
      state, advantages = _critic_updates(
        model_cfg, cfg, critic_tx, state, batch, metrics, adapters, bases
      )
    else:
      advantages = batch["baseline_advantages"]
    if not update_actor:
      return state, metrics

    loss_fn = losses.policy_loss(cfg.policy_loss)
    options = dict(cfg.loss_options(), segment_ids=batch["segment_ids"])

    # Routing replay (rl.routing_replay): the experts the engine chose for
    # each token, [B, L, M, k] in the batch, [M, B, L, k] for the model.
    replay = batch.get("routing")
    if replay is not None:
      replay = jnp.moveaxis(replay.astype(jnp.int32), 2, 0)

    def actor_loss(params):
      full, adapted = forward_args(adapters, params, bases, "policy")
      logp, aux = policy.token_logprobs(
        model_cfg,
        full,
        *_model_inputs(batch),
        cfg.temperature,
        action_index=batch.get("action_index"),
        routing=replay,
        adapters=adapted,
      )
      loss, pm = losses.call_policy_loss(
        loss_fn,
        logp,
        batch["rollout_logprobs"],
        advantages,
        m,
        cfg.eps_low,
        cfg.eps_high,
        **options,
      )
      pm["load_balance_loss"] = aux["load_balance_loss"]
      return (
        loss + cfg.load_balance_coef * aux["load_balance_loss"],
        (loss, pm, jax.lax.stop_gradient(logp)),
      )

    (_, (pi_loss, pm, logp)), grads = jax.value_and_grad(actor_loss, has_aux=True)(state.policy)
    norms = group_norms(grads, _NORM_GROUPS)
    new_policy, opt, ok = apply_if_finite(
      policy_tx, grads, state.policy_opt, state.policy, pi_loss, norms["all"]
    )
    metrics["policy/update_skipped"] = 1 - ok.astype(jnp.int32)
    metrics.update({f"policy/{k}": v for k, v in pm.items()})
    metrics["policy/loss"] = pi_loss
    metrics.update({f"policy/grad_norm_{k}": v for k, v in norms.items()})
    lag = jnp.where(m, state.step - batch["policy_version"], 0)
    metrics["policy_lag/mean"] = _mean_or_nan(lag.sum(), m.sum())
    metrics["policy_lag/max"] = jnp.where(m.any(), lag.max(), jnp.nan)
    diagnostics = lag_diagnostics(
      logp, batch["rollout_logprobs"], advantages, m, lag, cfg.eps_low, cfg.eps_high
    )
    metrics.update({f"dis/{k}": v for k, v in diagnostics.items()})
    # A skipped update is not a new policy version.
    state = state.replace(
      step=state.step + ok.astype(state.step.dtype), policy=new_policy, policy_opt=opt
    )
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


def _mean_or_nan(total, count):
  """total / count, NaN (undefined: the metrics writer logs no number) when count is 0."""
  return jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.nan)


def _num_segments(segment_ids):
  starts = (segment_ids > 0) & (jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0))) != segment_ids)
  return starts.sum()


def make_sft_step(
  model_cfg: ModelConfig, tx, load_balance_coef: float = 0.01, adapters: Adapters | None = None
) -> Callable:
  """sft_step(params, opt_state, batch, bases=None) -> (params, opt_state, metrics):
  NLL on actions; with `adapters` the params are the actor's adapters over bases[0]."""

  def sft_step(params, opt_state, batch, bases=None):
    m = batch["action_mask"]

    def loss_fn(p):
      full, adapted = forward_args(adapters, p, bases, "policy")
      logp, aux = policy.token_logprobs(
        model_cfg,
        full,
        *_model_inputs(batch),
        action_index=batch.get("action_index"),
        adapters=adapted,
      )
      nll = -jnp.where(m, logp, 0.0).sum() / jnp.maximum(m.sum(), 1)
      return nll + load_balance_coef * aux["load_balance_loss"], nll

    (_, nll), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    grad_norm = optax.tree.norm(grads)
    params, opt_state, ok = apply_if_finite(tx, grads, opt_state, params, nll, grad_norm)
    return (
      params,
      opt_state,
      {"sft/nll": nll, "sft/grad_norm": grad_norm, "sft/update_skipped": 1 - ok.astype(jnp.int32)},
    )

  return sft_step


def jit_sharded(fn, state_shardings, batch_sharding, donate: bool = True, base_shardings=None):
  """jit with explicit in/out shardings for (state, batch) -> (state, metrics);
  with `base_shardings`, (state, batch, bases) (LoRA's frozen bases, not donated)."""
  bases = () if base_shardings is None else (base_shardings,)
  return jax.jit(
    fn,
    in_shardings=(state_shardings, batch_sharding) + bases,
    out_shardings=(state_shardings, None),
    donate_argnums=(0,) if donate else (),
  )
