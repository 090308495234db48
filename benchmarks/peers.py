"""sao-jax side by side with Tunix, the JAX peer: training, generation, GAE.

    python3 -m venv .venv-peers
    .venv-peers/bin/pip install -c benchmarks/peers-constraints.txt -e '.[test,peers]'
    nice -n 10 .venv-peers/bin/python benchmarks/peers.py --out benchmarks/RESULTS.md

One process, both libraries on the same jax / flax / optax (the constraints
file pins the project's versions; Tunix 0.1.7 accepts them), every
comparison interleaved (A B A B, median of `--repeats`) so that load on this
shared machine hits both sides alike: read the ratios, not the absolute
figures.

The model is Qwen3-MoE's architecture at a tiny shape (2 layers, d_model
128, 4 heads / 2 kv heads of 32, 4 experts top-2, expert ffn 256, vocab 128
or `--vocab`, fp32), built in both libraries with the same weights: sao-jax's params are
copied leaf by leaf into Tunix's `Qwen3` (`tunix_state_from_sao`), and the
script checks that both produce the same logits before timing anything.

Sections (`--sections`), each at the shapes of `--shapes`:

train: one policy update (forward, backward, adamw, jit, donated state) on
  a batch of B sequences of L tokens (the first quarter prompt, the rest
  completion). Tunix: its registered "ppo" policy loss (`ppo_policy_loss_fn`,
  the function its PPO learner trains with) under `jax.value_and_grad` and
  `optax.adamw`; sao-jax: `make_train_step(advantage="group",
  policy_loss="ppo_clip")`, the whole actor step with its metrics and the
  non-finite guard. Same optimizer, same tokens, same advantages. sao-jax
  runs with its defaults (`moe_impl="dense"`: every token through every
  expert, like Tunix's CPU fallback) and with its fast settings: `"blocked"`
  MoE (top-k FLOPs, exact), plus chunked attention in blocks of a quarter
  of the length, at most 256 (`fast_settings`); with
  `--extra_arms` also the fast settings with bf16 compute; with
  `--moe_block N` also the fast settings with blocks of N rows (an A/B of
  `ModelConfig.moe_block` in the same interleaved run).
generate: B prompts of P tokens, N new tokens each, temperature 1. Tunix:
  `Sampler.__call__` (its prefill then its jitted decode while-loop);
  sao-jax: `PolicyEngine.generate_batch` (one prefill, then the engine's
  jitted multi-token decode loop; log-probs always recorded) with the
  default and with `fast_settings(prefill=True)` (the blocked MoE; at 1024
  tokens also the train rows' chunked attention and a chunked prefill; at
  128 the attention stays the reference), the fast settings again with the slots
  split into `--lanes` engine lanes (default 2: two programs of half the
  slots each, run from two threads, so both cores decode), and with
  `--extra_arms` the engine's one-token `step` per host call. Tokens/s counts
  new tokens. No stop token on either side, so both make B x N tokens.
gae: 256 x 8192, skip-observation GAE (sao-jax, multi-turn action mask) vs
  rlax's unmasked truncated GAE (every token an action) and Tunix's masked
  GAE (`compute_gae_advantages`, which also whitens).

Shapes: "tiny" trains on 32 x 256 and generates for 32 prompts of 64 tokens
plus 64 new; "long" trains on 16 x 1024 and generates for 16 prompts of 768
tokens plus 256 new (16 slots of 1024-token contexts); "vocab" (for
`--vocab 151669`) trains on 8 x 256 and generates for 16 prompts of 240
tokens plus 64 new.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.generate import sampler as tunix_sampler
from tunix.models.qwen3 import model as tunix_qwen3
from tunix.rl import algo_core as tunix_algo
from tunix.rl import common as tunix_common

sys.path.insert(0, os.path.dirname(__file__))
import gae as gae_bench
from timing import time_fns

from sao_jax.algo import advantages as adv
from sao_jax.config import sections
from sao_jax.data import packing
from sao_jax.models import config as mcfg
from sao_jax.models import policy
from sao_jax.rollout.batch_sampler import LaneSampler
from sao_jax.rollout.engine import PolicyEngine
from sao_jax.train import train_step as ts

PAD, EOS = 0, 1  # token ids the data below never contains (Tunix masks pads)
SHAPES = {
  # name: (train rows, train length, generation slots, prompt, new tokens)
  "tiny": (32, 256, 32, 64, 64),
  "long": (16, 1024, 16, 768, 256),
  # For --vocab 151669: a full [B, L, V] fp32 logits tensor is 4.9 GB at
  # 32 x 256, and the peer's training holds several; 8 x 256 fits in 24 GiB.
  "vocab": (8, 256, 16, 240, 64),
}
LR = 1e-5


# The model's vocabulary; `--vocab 151669` measures both sides at Qwen3's,
# where the logits dominate a small model's step.
VOCAB = 128


def sao_config(max_len: int, **overrides) -> mcfg.ModelConfig:
  return mcfg.ModelConfig(
    vocab_size=VOCAB,
    d_model=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    num_experts=4,
    experts_per_token=2,
    moe_d_ff=256,
    max_seq_len=max_len,
    rope_theta=1e6,
    rms_eps=1e-6,
    **overrides,
  )


def tunix_config(cfg: mcfg.ModelConfig) -> tunix_qwen3.ModelConfig:
  return tunix_qwen3.ModelConfig(
    num_layers=cfg.num_layers,
    vocab_size=cfg.vocab_size,
    embed_dim=cfg.d_model,
    hidden_dim=cfg.moe_d_ff,
    num_heads=cfg.num_heads,
    head_dim=cfg.head_dim,
    num_kv_heads=cfg.num_kv_heads,
    rope_theta=int(cfg.rope_theta),
    norm_eps=cfg.rms_eps,
    num_experts=cfg.num_experts,
    num_experts_per_tok=cfg.experts_per_token,
  )


def tunix_state_from_sao(cfg: mcfg.ModelConfig, params) -> dict:
  """sao-jax params -> the nested dict of Tunix `Qwen3` parameter values."""
  layers = {}
  for i in range(cfg.num_layers):
    p = params[f"layer_{i}"]
    layers[i] = {
      "input_layernorm": {"w": p["attn_norm"]["scale"]},
      "post_attention_layernorm": {"w": p["mlp_norm"]["scale"]},
      "attn": {
        "q_proj": {"w": p["attn"]["q"]},
        "k_proj": {"w": p["attn"]["k"]},
        "v_proj": {"w": p["attn"]["v"]},
        "o_proj": {"w": p["attn"]["o"]},
        "q_norm": {"w": p["attn"]["q_norm"]["scale"]},
        "k_norm": {"w": p["attn"]["k_norm"]["scale"]},
      },
      "mlp": {
        "router": {"kernel": p["moe"]["router"]},
        "gate_proj": p["moe"]["wi_gate"],
        "up_proj": p["moe"]["wi_up"],
        "down_proj": p["moe"]["wo"],
      },
    }
  return {
    "embedder": {"input_embedding": params["embed"]},
    "final_norm": {"w": params["final_norm"]["scale"]},
    "lm_head": {"w": params["lm_head"]},
    "layers": layers,
  }


def build_models(max_len: int, seed: int = 0):
  """(sao cfg, sao params, Tunix model) with the same weights."""
  cfg = sao_config(max_len)
  params = policy.init_params(cfg, jax.random.key(seed))
  model = tunix_qwen3.Qwen3(tunix_config(cfg), rngs=nnx.Rngs(seed))
  state = nnx.state(model, nnx.Param)
  values = tunix_state_from_sao(cfg, params)
  flat_state = dict(nnx.to_flat_state(state))
  flat_values = dict(nnx.to_flat_state(nnx.State(values)))
  if set(flat_state) != set(flat_values):
    raise ValueError(f"parameter maps differ: {sorted(set(flat_state) ^ set(flat_values))}")
  for path, var in flat_state.items():
    new, old = jnp.asarray(flat_values[path]), var.get_value()
    if new.shape != old.shape or new.dtype != old.dtype:
      raise ValueError(f"{path}: {new.shape} {new.dtype} vs {old.shape} {old.dtype}")
    var.set_value(new)
  nnx.update(model, state)
  return cfg, params, model


def check_same_logits(cfg, params, model, length: int = 64) -> float:
  """Max |logit difference| of the two models on one random sequence."""
  tokens = jax.random.randint(jax.random.key(3), (2, length), 2, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(length), tokens.shape)
  from sao_jax.models.transformer import Transformer

  ours, _ = Transformer(cfg).apply({"params": params}, tokens, pos, jnp.ones_like(tokens))
  causal = jnp.tril(jnp.ones((length, length), bool))[None].repeat(2, 0)
  theirs, _ = model(tokens, pos, None, causal)
  return float(jnp.abs(ours - theirs).max())


# --- training ------------------------------------------------------------------------


def train_batch(cfg, rows: int, length: int, seed: int = 1):
  """One batch in both libraries' formats: (sao-jax batch, Tunix TrainExample)."""
  rng = np.random.default_rng(seed)
  prompt = length // 4
  tokens = rng.integers(2, cfg.vocab_size, (rows, length)).astype(np.int32)
  action = np.zeros((rows, length), bool)
  action[:, prompt:] = True
  adv_row = rng.normal(size=(rows, 1)).astype(np.float32)
  advantages = np.where(action, adv_row, 0.0).astype(np.float32)
  old_logp = np.where(
    action, -np.log(cfg.vocab_size) + 0.05 * rng.normal(size=action.shape), 0.0
  ).astype(np.float32)
  sao = {
    "tokens": tokens,
    "positions": np.broadcast_to(np.arange(length), tokens.shape),
    "segment_ids": np.ones_like(tokens),
    "action_mask": action,
    "rollout_logprobs": old_logp,
    "rewards": np.zeros_like(advantages),
    "baseline_advantages": advantages,
    "policy_version": np.zeros_like(tokens),
  }
  sao = jax.tree.map(jnp.asarray, sao)
  example = tunix_common.TrainExample(
    prompt_ids=jnp.asarray(tokens[:, :prompt]),
    prompt_mask=jnp.ones((rows, prompt), jnp.int32),
    completion_ids=jnp.asarray(tokens[:, prompt:]),
    completion_mask=jnp.ones((rows, length - prompt), jnp.int32),
    advantages=jnp.asarray(advantages[:, prompt:]),
    ref_per_token_logps=None,
    old_per_token_logps=jnp.asarray(old_logp[:, prompt:]),
  )
  return sao, example


def tunix_train_fn(model, example, eps_low=0.2, eps_high=0.28):
  """A closure running one Tunix PPO policy update per call (state donated)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adamw(LR)
  algo = types.SimpleNamespace(
    epsilon_low=eps_low, epsilon_high=eps_high, entropy_coef=0.0, kl_coef=0.0, epsilon_c=None
  )

  def loss(p, ex):
    m = nnx.merge(graphdef, p, rest)
    return tunix_algo.ppo_policy_loss_fn(m, ex, algo, PAD, EOS)

  @jax.jit
  def init(p):
    return tx.init(p)

  def step(p, opt, ex):
    (value, _), grads = jax.value_and_grad(loss, has_aux=True)(p, ex)
    updates, opt = tx.update(grads, opt, p)
    return optax.apply_updates(p, updates), opt, value

  step = jax.jit(step, donate_argnums=(0, 1))
  holder = [jax.tree.map(jnp.copy, params), None]
  holder[1] = init(holder[0])

  def run():
    holder[0], holder[1], value = step(holder[0], holder[1], example)
    return value

  return run


def sao_train_fn(cfg, params, batch, eps_low=0.2, eps_high=0.28):
  """A closure running one sao-jax actor update per call (state donated)."""
  step_cfg = ts.StepConfig.of(
    advantage="group", policy_loss="ppo_clip", eps_low=eps_low, eps_high=eps_high
  )
  tx = optax.adamw(LR)
  fn = jax.jit(ts.make_train_step(cfg, step_cfg, tx, optax.identity()), donate_argnums=(0,))
  p = jax.tree.map(jnp.copy, params)
  holder = [
    ts.TrainState(
      step=jnp.zeros((), jnp.int32), policy=p, critic={}, policy_opt=tx.init(p), critic_opt=()
    )
  ]

  def run():
    holder[0], metrics = fn(holder[0], batch)
    return metrics["policy/loss"]

  return run


def fast_settings(cfg: mcfg.ModelConfig, length: int, prefill: bool = False) -> mcfg.ModelConfig:
  """sao-jax's fast model settings for sequences of `length` tokens.

  The block-sparse top-k MoE, plus chunked attention (causal key blocks
  skipped) where it pays: training takes blocks of a quarter of the length,
  at most 256, the block size that paid at each measured length
  (benchmarks/RESULTS.md#beside-tunix). Generation chunks
  only at 1024 tokens, where the prompt then also goes through in chunks of
  the block size (`prefill`), so the prefill uses the same blocked
  attention over the cache.
  """
  fast = dataclasses.replace(cfg, moe_impl="blocked")
  if length >= 1024:
    fast = dataclasses.replace(
      fast, attention_impl="chunked", attention_block=256, prefill_chunk=256 if prefill else 0
    )
  elif length >= 256 and not prefill:
    fast = dataclasses.replace(fast, attention_impl="chunked", attention_block=length // 4)
  return fast


def fast_name(fast: mcfg.ModelConfig) -> str:
  """The table label of a `fast_settings` config."""
  if fast.attention_impl == "chunked":
    return f"blocked MoE, chunked attention ({fast.attention_block}-token blocks)"
  return "blocked MoE"


def block_arm(arms: dict, fast: mcfg.ModelConfig, moe_block: int) -> None:
  """Adds the fast settings with blocks of `moe_block` rows to `arms` (0: none)."""
  if moe_block:
    arms[f"the same, MoE blocks of {moe_block}"] = dataclasses.replace(fast, moe_block=moe_block)


def with_action_index(batch: dict) -> dict:
  """`batch` with `action_index` (each row's action positions, then -1), as the
  trainer's batches carry it under `data.logits_at_actions`: the head runs at
  those positions only."""
  action = np.asarray(batch["action_mask"])
  width = packing.action_width(action.sum(axis=1).tolist(), action.shape[1])
  index = np.full((action.shape[0], width), -1, np.int32)
  for r, row in enumerate(action):
    where = np.flatnonzero(row)
    index[r, : len(where)] = where
  return {**batch, "action_index": jnp.asarray(index)}


def head_fns(cfg: mcfg.ModelConfig, rows: int, length: int) -> dict:
  """The LM head alone, forward and backward (the matmul, the log-softmax's
  logsumexp, the gradients of the hidden states and of the head's weight),
  at every position of the batch and at its action positions (3/4): what a
  policy update at this vocabulary cannot do without, whoever runs it."""
  rng = np.random.default_rng(3)
  weight = jnp.asarray(rng.normal(size=(cfg.d_model, cfg.vocab_size)) * 0.02, jnp.float32)

  def loss(w, h):
    return jax.nn.logsumexp(h @ w, axis=-1).sum()

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  out = {}
  for name, n in (
    ("head at every position", rows * length),
    ("head at action positions", rows * (length - length // 4)),
  ):
    h = jnp.asarray(rng.normal(size=(n, cfg.d_model)), jnp.float32)
    out[name] = (lambda h=h: grad(weight, h), 6 * n * cfg.d_model * cfg.vocab_size)
  return out


def train_section(
  shape: str, repeats: int, bf16: bool = False, moe_block: int = 0, action_head: bool = False
):
  rows, length = SHAPES[shape][:2]
  cfg, params, model = build_models(length)
  batch, example = train_batch(cfg, rows, length)
  # sao-jax's model settings: the defaults (dense MoE, every token through
  # every expert as in Tunix's CPU path; reference attention), and the fast
  # settings (`fast_settings`).
  fast = fast_settings(cfg, length)
  arms = {"defaults (dense MoE)": cfg, fast_name(fast): fast}
  if bf16:
    arms["the same, bf16 compute"] = dataclasses.replace(fast, dtype="bfloat16")
  block_arm(arms, fast, moe_block)
  batches = {name: batch for name in arms}
  if action_head:  # the trainer's `data.logits_at_actions`: the head at action tokens
    name = "the same, head at action tokens (`data.logits_at_actions`)"
    arms[name], batches[name] = fast, with_action_index(batch)
  fns = {"tunix": tunix_train_fn(model, example)}
  fns.update({name: sao_train_fn(c, params, batches[name]) for name, c in arms.items()})
  heads = head_fns(cfg, rows, length) if action_head else {}
  fns.update({name: fn for name, (fn, _) in heads.items()})
  sec = time_fns(fns, {k: () for k in fns}, repeats=repeats)
  tps = {k: rows * length / s for k, s in sec.items()}
  out = [
    f"| train: policy update, {rows} x {length}, sao-jax {name} | {tps['tunix']:,.0f} | "
    f"{tps[name]:,.0f} | {tps[name] / tps['tunix']:.2f} |"
    for name in arms
  ]
  # The bound: a policy update that runs the head at the action positions
  # takes at least that head's time, so no such update beats Tunix's by more
  # than Tunix's step over it.
  for name, (_, flops) in heads.items():
    out.append(
      f"| the {name} alone, forward + backward ({flops / 1e9:,.1f} GFLOP, "
      f"{flops / sec[name] / 1e9:,.1f} GFLOP/s): {sec[name] * 1e3:,.0f} ms; "
      f"Tunix's update {sec['tunix'] * 1e3:,.0f} ms | {tps['tunix']:,.0f} | "
      f"{tps[name]:,.0f} (head only) | at most {tps[name] / tps['tunix']:.2f} |"
    )
  return out, tps


# --- generation ----------------------------------------------------------------------


class IdTokenizer:
  """Token ids written as space-separated integers: Tunix's sampler takes strings."""

  def encode(self, text, **unused):
    return [int(t) for t in text.split()]

  def decode(self, ids, **unused):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return 0  # falsy: Tunix adds no BOS

  def eos_id(self):
    return EOS

  def pad_id(self):
    return PAD


def generate_section(
  shape: str, repeats: int, one_step: bool = False, moe_block: int = 0, lanes_arm: int = 2
):
  _, _, slots, prompt, new = SHAPES[shape]
  cfg, params, model = build_models(prompt + new)
  rng = np.random.default_rng(0)
  prompts = rng.integers(2, cfg.vocab_size, (slots, prompt)).astype(np.int32)
  strings = [" ".join(map(str, p)) for p in prompts]
  sampler = tunix_sampler.Sampler(
    model,
    IdTokenizer(),
    tunix_sampler.CacheConfig(
      cache_size=prompt + new,
      num_layers=cfg.num_layers,
      num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
    ),
  )
  # The defaults and the fast settings for generation (`fast_settings`).
  fast = fast_settings(cfg, prompt + new, prefill=True)
  arms = {"defaults (dense MoE)": cfg, fast_name(fast): fast}
  block_arm(arms, fast, moe_block)
  lanes = {name: 1 for name in arms}
  if lanes_arm > 1:  # the fast settings again, the slots split into engine lanes
    name = f"{fast_name(fast)}, {lanes_arm} lanes"
    arms[name], lanes[name] = fast, lanes_arm
  rollout = sections.Rollout(slots=slots, max_len=prompt + new, temperature=1.0)
  engines = {
    name: LaneSampler(PolicyEngine(c, params, rollout), lanes[name]) for name, c in arms.items()
  }
  seeds = iter(range(10**6))

  def tunix():
    # top_p=1.0 selects Tunix's temperature sampling (None would be greedy);
    # an out-of-vocabulary eos never stops a row early.
    out = sampler(
      strings,
      max_generation_steps=new,
      max_prompt_length=prompt,
      temperature=1.0,
      top_p=1.0,
      eos_tokens=[-1],
      seed=next(seeds),
    )
    return out.tokens

  def sao(engine):
    return lambda: engine.generate_batch(list(prompts), new)[0]

  def sao_one_step():
    engine = engines["defaults (dense MoE)"].engine
    state, tok, _, _ = engine.step(
      engine.init_decode_state(), prompts, np.ones(prompts.shape, bool)
    )
    alive = np.ones((slots, 1), bool)
    for _ in range(new - 1):
      state, tok, _, _ = engine.step(state, tok[:, None], alive)
    return tok

  fns = {"tunix": tunix}
  fns.update({name: sao(engine) for name, engine in engines.items()})
  if one_step:
    fns["sao one-step"] = sao_one_step
  sec = time_fns(fns, {k: () for k in fns}, repeats=repeats)
  tps = {k: slots * new / s for k, s in sec.items()}
  lines = [
    f"| generate: {slots} x ({prompt} + {new}), T=1, `generate_batch`, sao-jax {name} | "
    f"{tps['tunix']:,.0f} | {tps[name]:,.0f} | {tps[name] / tps['tunix']:.2f} |"
    for name in arms
  ]
  if one_step:
    lines.append(
      f"| generate: same, defaults, engine `step` per token | {tps['tunix']:,.0f} | "
      f"{tps['sao one-step']:,.0f} | {tps['sao one-step'] / tps['tunix']:.2f} |"
    )
  return lines, tps


# --- GAE -------------------------------------------------------------------------------


def gae_section(repeats: int, b: int = 256, t: int = 8192):
  r, v, m = gae_bench.make_inputs(b, t)
  ours = jax.jit(lambda r, v, m: adv.skip_observation_gae(r, v, m, gae_bench.GAMMA, gae_bench.LAM))
  tunix = lambda r, v, m: tunix_algo.compute_gae_advantages(
    r, v, m.astype(jnp.float32), gae_bench.GAMMA, gae_bench.LAM
  )
  fns = {"sao": ours, "rlax": gae_bench.rlax_gae, "tunix": tunix}
  sec = time_fns(fns, {"sao": (r, v, m), "rlax": (r, v), "tunix": (r, v, m)}, repeats=repeats)
  lines = [
    f"| GAE {b} x {t} (ms): Tunix masked | {sec['tunix'] * 1e3:.1f} | "
    f"{sec['sao'] * 1e3:.1f} | {sec['tunix'] / sec['sao']:.2f} |",
    f"| GAE {b} x {t} (ms): rlax unmasked | {sec['rlax'] * 1e3:.1f} | "
    f"{sec['sao'] * 1e3:.1f} | {sec['rlax'] / sec['sao']:.2f} |",
  ]
  return lines, sec


# --- the table ---------------------------------------------------------------------------

HEADING = "### The latest run: train and generate against Tunix"


def write_section(path: str, body: str) -> None:
  """Replaces this script's table in RESULTS.md (or appends the section).

  Only the text between the heading and the section's first subsection
  (the next heading: the write-ups of earlier runs) is replaced.
  """
  text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
  section = f"{HEADING}\n\n{body.rstrip()}\n"
  pattern = re.compile(re.escape(HEADING) + r".*?(?=^##+ |\Z)", re.S | re.M)
  if pattern.search(text):
    text = pattern.sub(lambda _: section + "\n", text).rstrip() + "\n"
  else:
    text = text.rstrip() + "\n\n" + section
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=None, help="write the table into this RESULTS.md")
  parser.add_argument("--sections", default="train,generate,gae")
  parser.add_argument("--shapes", default="tiny,long")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument(
    "--extra_arms",
    action="store_true",
    help="also bf16 compute (train) and one `step` per token (generate)",
  )
  parser.add_argument(
    "--moe_block",
    type=int,
    default=0,
    help="also the fast settings with MoE blocks of this many rows",
  )
  parser.add_argument(
    "--action_head",
    action="store_true",
    help="also training with the head at action tokens only (the "
    "trainer's `data.logits_at_actions`, the completion's 3/4 of a row)",
  )
  parser.add_argument(
    "--vocab", type=int, default=128, help="the tiny model's vocabulary (151669: Qwen3's)"
  )
  parser.add_argument(
    "--lanes",
    type=int,
    default=2,
    help="also generation with the fast settings in this many engine lanes "
    "(batch_sampler.LaneSampler; 1: no such arm)",
  )
  args = parser.parse_args()
  wanted = args.sections.split(",")
  global VOCAB  # noqa: PLW0603
  VOCAB = args.vocab

  cfg, params, model = build_models(256)
  diff = check_same_logits(cfg, params, model)
  print(f"same weights: max |logit difference| {diff:.2e}", flush=True)
  if diff > 1e-3:
    raise SystemExit("the two models disagree: the weight map is wrong")

  lines = ["| measurement | Tunix 0.1.7 | sao-jax | sao-jax / Tunix |", "|---|---|---|---|"]
  started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

  def record(out):  # the table so far goes to --out after every section
    lines.extend(out)
    print(*out, sep="\n", flush=True)
    if args.out:
      body = (
        "The write-ups of earlier runs follow in the subsections below, the "
        f"latest last. This table: the run of {started}.\n\n"
        "    PYTHONPATH=. .venv-peers/bin/python benchmarks/peers.py "
        f"{' '.join(sys.argv[1:])}\n\n"
        f"Same weights in both (max |logit difference| {diff:.1e}). Train and generate "
        "rows are tokens/s, GAE rows milliseconds; the last column is always sao-jax's "
        "speed over the peer's (above 1: sao-jax faster).\n\n" + "\n".join(lines)
      )
      write_section(args.out, body)

  for shape in args.shapes.split(","):
    if "train" in wanted:
      record(
        train_section(shape, args.repeats, args.extra_arms, args.moe_block, args.action_head)[0]
      )
    if "generate" in wanted:
      record(generate_section(shape, args.repeats, args.extra_arms, args.moe_block, args.lanes)[0])
  if "gae" in wanted:
    record(gae_section(args.repeats)[0])


if __name__ == "__main__":
  main()
