"""LoRA vs full fine-tuning: trained parameters and bytes, from shapes alone.

    python benchmarks/lora_sizes.py [--rank=16] [--presets=qwen3_8b,qwen3_30b_a3b]

Pure arithmetic over `jax.eval_shape` of the presets' params and of the
adapters `sao_jax/models/lora.py` draws for the `lora` section's default
targets (nothing is allocated or compiled). Per preset:

  params          the policy's parameters
  actor / critic  the adapters' parameters (the critic's: its MoE / MLP
                  adapters, the SFT policy's carried ones and its value head)
  state GiB       the train state a checkpoint holds (TrainState): full
                  = fp32 policy + critic + Adam's two moments for what each
                  trains (the critic's attention and embeddings frozen);
                  LoRA = the adapters + their moments (fp32)
  resident GiB    what the trainer holds: the state, plus with LoRA the
                  frozen base (bf16 with lora.base_dtype = "bfloat16"; the
                  critic's trunk is the same arrays)
  step GiB        LoRA's temporaries in a step, at most: the merged
                  targeted matrices and dL/dW' at them (both in the base's
                  dtype, here bf16): the merge trades these for Adam's
                  moments and fp32 masters of the whole model
  version GiB     one policy version as sent today (bf16 merged params,
                  both ways) and as adapters alone (fp32), which a
                  sender of adapters would move instead

Each row is the whole model (divide by the chips that hold its shards).
"""

import argparse
import math

import jax

from sao_jax.algo import optim
from sao_jax.config import sections
from sao_jax.models import config as model_config
from sao_jax.models import lora, policy

GIB = 2**30


def _count(tree, rules=None) -> tuple[int, int]:
  """(all elements, elements a rule set trains) of an abstract tree."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  total = sum(math.prod(x.shape) for _, x in leaves)
  if rules is None:
    return total, total
  labels = jax.tree.leaves(optim.partition_labels(tree, rules))
  trained = sum(math.prod(x.shape) for (_, x), lab in zip(leaves, labels) if lab == optim.TRAIN)
  return total, trained


def sizes(preset: str, rank: int) -> dict:
  cfg = model_config.PRESETS[preset]()
  shape = lambda head: jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0), head))
  pol, crit = shape("lm"), shape("value")
  c = sections.Lora()
  actor = lora.LoraConfig(rank, 2.0 * rank, c.actor_targets)
  critic = lora.LoraConfig(
    rank, 2.0 * rank, c.critic_targets + c.actor_targets, whole=c.critic_whole
  )
  a = jax.eval_shape(lambda p: lora.init_adapters(p, actor, jax.random.key(0)), pol)
  b = jax.eval_shape(lambda p: lora.init_adapters(p, critic, jax.random.key(0)), crit)
  n_pol, _ = _count(pol)
  n_crit, crit_trained = _count(crit, optim.CRITIC_FREEZE_RULES)
  n_a, _ = _count(a)
  n_b, b_trained = _count(b, lora.optimizer_rules(b, c.critic_targets + c.critic_whole))
  full_state = 4 * n_pol + 8 * n_pol + 4 * n_crit + 8 * crit_trained
  lora_state = 12 * n_a + 4 * n_b + 8 * b_trained
  kinds = lora.plan(pol, actor)
  targeted = sum(
    math.prod(x.shape)
    for k, x in jax.tree_util.tree_flatten_with_path(pol)[0]
    if kinds.get(optim.param_path(k)) == "adapter"
  )
  head = n_crit - n_pol + (math.prod(pol["lm_head"].shape) if "lm_head" in pol else 0)
  return {
    "preset": preset,
    "params": n_pol,
    "actor": n_a,
    "critic": n_b,
    "critic_trained": b_trained,
    "full_state": full_state,
    "lora_state": lora_state,
    "lora_resident_bf16": lora_state + 2 * (n_pol + head),
    "lora_resident_fp32": lora_state + 4 * (n_pol + head),
    "step_bf16": 4 * targeted,
    "version_full": 2 * n_pol,
    "version_adapters": 4 * n_a,
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--presets", default="qwen3_1_7b,qwen3_8b,qwen3_30b_a3b")
  args = parser.parse_args()
  print(f"rank {args.rank}, alpha {2 * args.rank}, the lora section's default targets\n")
  print(
    "| preset | params | actor adapters | critic adapters (trained) | state GiB full / "
    "LoRA | resident GiB full / LoRA bf16 base / LoRA fp32 base | step GiB | version GiB "
    "full bf16 / adapters fp32 |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for preset in args.presets.split(","):
    s = sizes(preset, args.rank)
    g = lambda k, s=s: s[k] / GIB
    print(
      f"| {preset} | {s['params'] / 1e9:.2f} B | {s['actor'] / 1e6:.1f} M "
      f"({s['actor'] / s['params']:.2%}) | {s['critic'] / 1e6:.1f} M "
      f"({s['critic_trained'] / 1e6:.1f} M) | {g('full_state'):.1f} / {g('lora_state'):.2f} "
      f"| {g('full_state'):.1f} / {g('lora_resident_bf16'):.1f} / "
      f"{g('lora_resident_fp32'):.1f} | {g('step_bf16'):.1f} | {g('version_full'):.2f} / "
      f"{g('version_adapters'):.3f} |"
    )


if __name__ == "__main__":
  main()
