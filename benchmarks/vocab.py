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
    generate    `PolicyEngine.generate_batch`: 16 prompts of 240 tokens
                (math_tool's prompt length), 64 new tokens each

at vocabulary 151,669 (qwen3) and at the character tokenizer's size, same
shapes, same logits chunking (128 tokens, as math_tool_tiny); and at 151,669
with the head at action tokens only (`data.logits_at_actions`, "qwen3+act":
the batch carries `action_index`, the head runs on a quarter of the row).
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
from timing import random_trajectory, report, time_fns  # pylint: disable=g-import-not-at-top,wrong-import-position
sys.path.insert(0, os.path.join(ROOT, "configs"))
import math_tool_tiny  # pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax import factories, sections, sharding  # pylint: disable=wrong-import-position
from sao_jax.data import packing  # pylint: disable=wrong-import-position
from sao_jax.envs.tokenizer import TOKENIZERS  # pylint: disable=wrong-import-position
from sao_jax.models import policy  # pylint: disable=wrong-import-position
from sao_jax.models.transformer import Transformer  # pylint: disable=wrong-import-position
from sao_jax.rollout.engine import PolicyEngine  # pylint: disable=wrong-import-position

ROWS, LENGTH, PROMPT, NEW = 16, 512, 240, 64


def config_for(tokenizer: str):
  c = math_tool_tiny.get_config()
  c.env.tokenizer = tokenizer
  c.env.chat_format = "qwen3" if tokenizer == "qwen3" else "raw"
  c.sharding.mesh = {"data": 1}
  return c


def packed_batch(vocab: int, at_actions: bool, seed: int = 0) -> dict:
  """ROWS trajectories of LENGTH tokens: a prompt, then turns and observations."""
  rng = np.random.default_rng(seed)
  trajs = [random_trajectory(rng, LENGTH, vocab, PROMPT, (30, 60), (15, 40), i)
           for i in range(ROWS)]
  return packing.pack(trajs, ROWS, (LENGTH,), action_index=at_actions)


def arm(name: str):
  """(the timed functions, facts) of one arm: "char", "qwen3" or "qwen3+act"."""
  tokenizer, at_actions = name.split("+")[0], name.endswith("+act")
  config = config_for(tokenizer)
  tok = TOKENIZERS[tokenizer]()
  model_cfg = factories.build_model_config(config, tok)
  mesh = sharding.make_mesh(dict(config.sharding.mesh))
  p = factories.build_programs(config, model_cfg, factories.step_config(config), mesh)
  with jax.set_mesh(mesh):
    state = jax.jit(lambda: p.init_state(nn.unbox(p.policy_init()), nn.unbox(p.critic_init())),
                    out_shardings=p.state_shardings)()
  batch = packed_batch(tok.vocab_size, at_actions)
  device_batch = {k: jax.device_put(v, p.batch_sharding) for k, v in batch.items()}
  holder = {"state": state}

  def rl_step():
    with jax.set_mesh(mesh):
      holder["state"], m = p.rl_step(holder["state"], device_batch)
    return m

  params = jax.device_get(state.policy)
  args = (batch["tokens"], batch["positions"], batch["segment_ids"])
  index = batch.get("action_index")
  logprobs = jax.jit(lambda prm, t, q, s, i: policy.token_logprobs(
      model_cfg, prm, t, q, s, action_index=i)[0])
  trunk = jax.jit(lambda prm, t, q, s: Transformer(model_cfg, "hidden").apply(
      {"params": prm}, t, q, s)[0])
  engine = PolicyEngine(model_cfg, params,
                        sections.Rollout(slots=ROWS, max_len=config.rollout.max_len), seed=0)
  prompts = [list(np.random.default_rng(i).integers(0, tok.vocab_size, PROMPT)) for i in range(ROWS)]

  def generate():
    return engine.generate_batch(prompts, NEW)[0]

  fns = {f"rl_step/{name}": rl_step,
         f"forward/{name}": lambda: logprobs(params, *args, index),
         f"trunk/{name}": lambda: trunk(params, *args)}
  if not at_actions:  # the engine does not use action_index
    fns[f"generate/{name}"] = generate
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  return fns, {"vocab": tok.vocab_size, "params": n_params,
               "actions": int(batch["action_mask"].sum())}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=None, help="append the table to this file")
  args = parser.parse_args()
  fns, facts = {}, {}
  for name in ("char", "qwen3", "qwen3+act"):
    f, facts[name] = arm(name)
    fns.update(f)
  t = time_fns(fns, {k: () for k in fns}, repeats=args.repeats)
  q, c = facts["qwen3"], facts["char"]
  lines = [
      f"Tiny MoE model, vocabulary {c['vocab']} (char) vs {q['vocab']} (qwen3): "
      f"{c['params'] / 1e6:.2f}M vs {q['params'] / 1e6:.2f}M policy parameters; "
      f"RL batch {ROWS} x {LENGTH} ({q['actions']} action tokens); generation {ROWS} x "
      f"({PROMPT} prompt + {NEW} new) tokens; median of {args.repeats}, interleaved.",
      "", "| program | char (ms) | qwen3 (ms) | qwen3+act (ms) | qwen3 / char | "
      "qwen3+act / qwen3 |", "|---|---|---|---|---|---|"]
  for prog in ("rl_step", "forward", "trunk", "generate"):
    a, b = t[f"{prog}/char"], t[f"{prog}/qwen3"]
    c = t.get(f"{prog}/qwen3+act")
    act = ("-", "-") if c is None else (f"{c * 1e3:.1f}", f"{c / b:.2f}")
    lines.append(f"| {prog} | {a * 1e3:.1f} | {b * 1e3:.1f} | {act[0]} | {b / a:.2f} | "
                 f"{act[1]} |")
  head = 1 - t["trunk/qwen3"] / t["forward/qwen3"]
  lines += ["", f"The LM head's share of the qwen3 forward pass: {head:.0%} "
            f"(1 - trunk / forward)."]
  report(lines, args.out)


if __name__ == "__main__":
  main()
