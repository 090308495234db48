"""Optimizers, with parameter freezing by regex rules (config data).

`optax.masked(opt, trainable)` alone does NOT freeze the other leaves: it
passes their raw gradients through unchanged and `optax.apply_updates` then
moves them. Freezing here uses `optax.multi_transform` with
`optax.set_to_zero()` on the frozen partition: their updates are exactly 0
(params stay bit-identical) and the inner optimizer never sees them, so no
Adam moments are allocated for them.
"""

from __future__ import annotations

import re
from typing import Sequence

import jax
import optax

TRAIN, FREEZE = "train", "freeze"

# The paper's critic: attention (and its pre-norm) and embeddings frozen;
# MoE / MLP, their norms, the final norm and the value head train. First
# matching rule wins; every parameter must match one. "layers/..." are the
# stacked parameters of scanned layers (ModelConfig.scan_layers),
# "layers/sub_r/..." those of a periodic hybrid's scan. "attn" is every
# token mixer: softmax attention and Gated DeltaNet alike.
CRITIC_FREEZE_RULES = (
  (r"^(layer_\d+|layers(/sub_\d+)?)/(attn|attn_norm)/", FREEZE),
  (r"^embed$", FREEZE),
  (r".*", TRAIN),
)
TRAIN_ALL_RULES = ((r".*", TRAIN),)


def param_path(path) -> str:
  """A pytree key path as "a/b/0": dict keys, attribute names, sequence indices.

  The one spelling of a parameter's path: freezing rules, sharding lookups,
  gradient-norm groups and checkpoint import all match against it.
  """
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def partition_labels(params, rules: Sequence[tuple[str, str]]):
  """A pytree of labels ("train" / "freeze"): the first rule whose regex matches."""
  compiled = [(re.compile(rx), label) for rx, label in rules]
  for _, label in rules:
    if label not in (TRAIN, FREEZE):
      raise ValueError(f"Unknown label {label!r}; use {TRAIN!r} or {FREEZE!r}.")

  def label(path, _):
    name = param_path(path)
    for rx, lab in compiled:
      if rx.search(name):
        return lab
    raise ValueError(
      f"Parameter {name!r} matches no freezing rule; end the rules "
      "with a catch-all like ('.*', 'train')."
    )

  return jax.tree_util.tree_map_with_path(label, params)


def freeze_rules(patterns: Sequence[str]) -> tuple[tuple[str, str], ...]:
  """Rules that freeze the parameters matching any of `patterns`, train the rest."""
  return tuple((rx, FREEZE) for rx in patterns) + TRAIN_ALL_RULES


def check_rules_match(params, rules: Sequence[tuple[str, str]], what: str) -> None:
  """Every rule but the catch-all matches at least one parameter path.

  A rule that matches nothing is a typo or a rule written for another
  architecture (a router regex on a dense model): it would freeze nothing
  and say nothing, so it is refused in one line.
  """
  names = [param_path(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  dead = [rx for rx, _ in rules if rx != ".*" and not any(re.search(rx, n) for n in names)]
  if dead:
    raise ValueError(f"{what}: {dead} match no parameter; parameter paths look like {names[:3]}.")


def make_optimizer(
  params,
  learning_rate: float | optax.Schedule,
  *,
  rules: Sequence[tuple[str, str]] = TRAIN_ALL_RULES,
  weight_decay: float = 0.0,
  clip_norm: float | None = 1.0,
  b1: float = 0.9,
  b2: float = 0.95,
) -> optax.GradientTransformation:
  """AdamW (+ global-norm clipping over trainable leaves), frozen leaves fixed."""
  train = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
  train.append(optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay))
  return optax.multi_transform(
    {TRAIN: optax.chain(*train), FREEZE: optax.set_to_zero()}, partition_labels(params, rules)
  )


# Where the cosine of `warmup_cosine` ends, as a fraction of its peak.
END_FRACTION = 0.1


def warmup_cosine(
  peak: float, warmup_steps: int, total_steps: int, end_fraction: float = END_FRACTION
) -> optax.Schedule:
  """Linear warmup to `peak`, cosine decay to `end_fraction * peak`."""
  return optax.warmup_cosine_decay_schedule(
    0.0,
    peak,
    max(warmup_steps, 1),
    max(total_steps, warmup_steps + 1),
    end_value=peak * end_fraction,
  )
