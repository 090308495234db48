"""The tiny model at Qwen3's vocabulary beside the toys' character vocabulary, side by side.

    python benchmarks/vocab.py [--repeats 5] [--out benchmarks/RESULTS.md]

configs/math_tool_tiny.py trains the tiny MoE model (d_model 64, 2 layers)
with Qwen3's 151,669-token vocabulary: its embedding and LM head are 19.4M
parameters against the trunk's ~0.1M, and every log-prob row is 151,669
logits wide. This times, in one process with the calls interleaved (so
load on this shared machine hits both arms alike; read the ratios):

    rl_step     the trainer's RL step (K = 2 critic updates + the actor
                update, `factories.build_programs`) on one packed batch of
                math_tool's shape: 16 rows x 512 tokens, a quarter of them
                action tokens
    forward     the policy's teacher-forced log-probs alone, and the trunk
                without its head: the head's share of the forward pass
    generate    `batch_sampler.generate_batch`: 16 prompts of 240 tokens
                (math_tool's prompt length), 64 new tokens each

at vocabulary 151,669 (qwen3) and at the character tokenizer's size, same
shapes, same logits chunking (128 tokens, as math_tool_tiny); and at 151,669
with the head at action tokens only (`data.logits_at_actions`, "qwen3+act":
the batch carries `action_index`, the head runs on a quarter of the row);
and with the head over the ids math_tool uses (`model.vocab_subset = "env"`,
"qwen3+subset": 320 columns over the whole shipped set, as configs/math_tool_cpu.py
runs it (285 there, its curriculum's); the batch's
and prompts' ids drawn from the subset), with and without `action_index`.
"""

import argparse
import os
import sys

import jax
import numpy as np
from flax import linen as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import random_trajectory, report, time_fns  # noqa: E402

from configs import math_tool_tiny  # noqa: E402
from sao_jax.config import sections  # noqa: E402
from sao_jax.data import packing  # noqa: E402
from sao_jax.envs.tokenizer import TOKENIZERS  # noqa: E402
from sao_jax.models import policy, sharding  # noqa: E402
from sao_jax.models.transformer import Transformer  # noqa: E402
from sao_jax.rollout.batch_sampler import generate_batch  # noqa: E402
from sao_jax.rollout.engine import PolicyEngine  # noqa: E402
from sao_jax.train import factories  # noqa: E402

ROWS, LENGTH, PROMPT, NEW = 16, 512, 240, 64


def config_for(tokenizer: str):
  c = math_tool_tiny.get_config()
  c.env.tokenizer = tokenizer
  c.env.chat_format = "qwen3" if tokenizer == "qwen3" else "raw"
  c.sharding.mesh = {"data": 1}
  return c


def packed_batch(vocab: int, at_actions: bool, seed: int = 0, ids=()) -> dict:
  """ROWS trajectories of LENGTH tokens: a prompt, then turns and observations
  (their ids drawn from `ids` when given)."""
  rng = np.random.default_rng(seed)
  trajs = [
    random_trajectory(rng, LENGTH, vocab, PROMPT, (30, 60), (15, 40), i) for i in range(ROWS)
  ]
  if ids:
    for t in trajs:
      t.tokens[:] = np.asarray(ids, np.int32)[t.tokens % len(ids)]
  return packing.pack(trajs, ROWS, (LENGTH,), action_index=at_actions)


ARMS = ("char", "qwen3", "qwen3+act", "qwen3+subset", "qwen3+subset+act")


def arm(name: str):
  """(the timed functions, facts) of one arm of ARMS."""
  parts = name.split("+")
  tokenizer, at_actions, subset = parts[0], "act" in parts, "subset" in parts
  config = config_for(tokenizer)
  if subset:
    config.model.vocab_subset = "env"
  tok = TOKENIZERS[tokenizer]()
  model_cfg = factories.build_model_config(config, tok)
  ids = model_cfg.vocab_ids
  mesh = sharding.make_mesh(dict(config.sharding.mesh))
  p = factories.build_programs(config, model_cfg, factories.step_config(config), mesh)
  with jax.set_mesh(mesh):
    state = jax.jit(
      lambda: p.init_state(nn.unbox(p.policy_init()), nn.unbox(p.critic_init())),
      out_shardings=p.state_shardings,
    )()
  batch = packed_batch(tok.vocab_size, at_actions, ids=ids)
  device_batch = {k: jax.device_put(v, p.batch_sharding) for k, v in batch.items()}
  holder = {"state": state}

  def rl_step():
    with jax.set_mesh(mesh):
      holder["state"], m = p.rl_step(holder["state"], device_batch)
    return m

  params = jax.device_get(state.policy)
  args = (batch["tokens"], batch["positions"], batch["segment_ids"])
  index = batch.get("action_index")
  logprobs = jax.jit(
    lambda prm, t, q, s, i: policy.token_logprobs(model_cfg, prm, t, q, s, action_index=i)[0]
  )
  trunk = jax.jit(
    lambda prm, t, q, s: Transformer(model_cfg, "hidden").apply({"params": prm}, t, q, s)[0]
  )
  engine = PolicyEngine(
    model_cfg, params, sections.Rollout(slots=ROWS, max_len=config.rollout.max_len), seed=0
  )
  prompts = [
    list(np.random.default_rng(i).integers(0, tok.vocab_size, PROMPT)) for i in range(ROWS)
  ]
  if ids:
    prompts = [[int(ids[t % len(ids)]) for t in p] for p in prompts]

  def generate():
    return generate_batch(engine, prompts, NEW)[0]

  fns = {
    f"rl_step/{name}": rl_step,
    f"forward/{name}": lambda: logprobs(params, *args, index),
    f"trunk/{name}": lambda: trunk(params, *args),
  }
  if not at_actions:  # the engine does not use action_index
    fns[f"generate/{name}"] = generate
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  return fns, {
    "vocab": tok.vocab_size,
    "params": n_params,
    "head": model_cfg.head_size,
    "actions": int(batch["action_mask"].sum()),
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=None, help="append the table to this file")
  parser.add_argument(
    "--arms", default=",".join(ARMS), help="a comma-separated subset of " + ", ".join(ARMS)
  )
  args = parser.parse_args()
  arms = [a for a in args.arms.split(",") if a]
  unknown = sorted(set(arms) - set(ARMS))
  if unknown or "qwen3" not in arms:
    parser.error(f"--arms: from {ARMS}, qwen3 (the reference) included; not {unknown}")
  fns, facts = {}, {}
  for name in arms:
    f, facts[name] = arm(name)
    fns.update(f)
  t = time_fns(fns, {k: () for k in fns}, repeats=args.repeats)
  q = facts["qwen3"]
  sizes = ", ".join(
    f"{a} {f['params'] / 1e6:.2f}M ({f['head']}-column head)" for a, f in facts.items()
  )
  lines = [
    f"Tiny MoE model, vocabulary {q['vocab']}; policy parameters: {sizes}; "
    f"RL batch {ROWS} x {LENGTH} ({q['actions']} action tokens); generation {ROWS} x "
    f"({PROMPT} prompt + {NEW} new) tokens; median of {args.repeats}, interleaved.",
    "",
    "| program | "
    + " | ".join(f"{a} (ms)" for a in arms)
    + " | "
    + " | ".join(f"{a} / qwen3" for a in arms if a != "qwen3")
    + " |",
    "|---|" + "---|" * (2 * len(arms) - 1),
  ]
  for prog in ("rl_step", "forward", "trunk", "generate"):
    base = t[f"{prog}/qwen3"]
    cells = ["-" if t.get(f"{prog}/{a}") is None else f"{t[f'{prog}/{a}'] * 1e3:.1f}" for a in arms]
    ratios = [
      "-" if t.get(f"{prog}/{a}") is None else f"{t[f'{prog}/{a}'] / base:.3f}"
      for a in arms
      if a != "qwen3"
    ]
    lines.append(f"| {prog} | " + " | ".join(cells + ratios) + " |")
  for a in arms:
    lines.append(
      f"\nThe LM head's share of the {a} forward pass: "
      f"{1 - t[f'trunk/{a}'] / t[f'forward/{a}']:.0%} (1 - trunk / forward)."
    )
  report(lines, args.out)


if __name__ == "__main__":
  main()
