"""The single-device engine now vs an earlier commit, call by call in one process.

    python benchmarks/engine_step.py [--ref dae3a1e] [--repeats 41] [--out benchmarks/RESULTS.md]

The engine's sampling paths at `configs/sao_tiny.py`'s shape (the tiny MoE
model, random init, `rollout.slots` = 16 slots of `rollout.max_len` = 256,
its sampling config), one CPU device, no mesh given:

  generate_batch  16 prompts of 64 tokens, 128 new tokens each (the plain
                  sampler: one prefill step, one decode loop);
  step            the same prefill, then 127 one-token `step` calls (the
                  driver's path at sao_tiny's `rollout.decode_steps` = 1);
  decode 8        the same prefill, then 16 `decode(steps=8)` + `collect`
                  calls (the driver's path at decode_steps = 8).

`--ref`'s `sao_jax` (a `git archive` of it) is imported next to this tree's
as `sao_jax_ref` (its imports renamed), and both engines run in the same
process, their calls alternating (ref, head, then head, ref, ...), so load
on this shared machine hits both alike. Each pair of calls gives a ratio,
head tokens/s over ref tokens/s (above 1: head faster); the table has the
median ratio over the pairs with its interquartile range, and the best
(least disturbed) call of each side. Tokens are sampled tokens (prefill's
first token included) over wall time.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run with this tree and the renamed ref package importable: only the engine
# API both share (init_decode_state, step, decode, collect, generate_batch)
# is used, and the constructor the package has (the rollout section, or an
# earlier commit's keyword args), both for the same dense engine.
CHILD = r"""
import dataclasses, importlib, importlib.util, json, sys, time
import jax, numpy as np
from configs import sao_tiny  # this tree's (cwd)
from sao_jax.envs import registry

repeats = int(sys.argv[1])
config = sao_tiny.get_config()
tok = registry.make_tokenizer(config.env)
r = config.rollout
slots, prompt, new = r.slots, 64, 128
rng = np.random.default_rng(0)
prompts = [rng.integers(3, tok.vocab_size, prompt).astype(np.int32) for _ in range(slots)]
tokens = np.stack(prompts)
valid = np.ones(tokens.shape, bool)

def paths(pkg):
  mcfg = importlib.import_module(pkg + ".models.config")
  policy = importlib.import_module(pkg + ".models.policy")
  eng = importlib.import_module(pkg + ".rollout.engine")
  cfg = mcfg.PRESETS[config.model.preset](vocab_size=tok.vocab_size)
  overrides = dict(config.model.get("overrides", {}))
  cfg = dataclasses.replace(cfg, **overrides) if overrides else cfg
  params = policy.init_params(cfg, jax.random.key(0))
  where = [m for m in (pkg + ".config.sections", pkg + ".sections")  # layered package or flat tree
           if importlib.util.find_spec(m.rsplit(".", 1)[0]) and importlib.util.find_spec(m)]
  if where:  # takes the rollout section
    sections = importlib.import_module(where[0])
    rollout = sections.Rollout(slots=slots, max_len=r.max_len, kv_cache="dense",
                               temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)
    engine = eng.PolicyEngine(cfg, params, rollout, seed=0)
  else:  # an earlier commit: the engine's own keyword args
    engine = eng.PolicyEngine(cfg, params, slots=slots, max_len=r.max_len, seed=0,
                              sampling=eng.SamplingConfig(r.temperature, r.top_k, r.top_p))

  if importlib.util.find_spec(pkg + ".rollout.batch_sampler"):  # the sampler out of the engine
    sampler = importlib.import_module(pkg + ".rollout.batch_sampler")
    generate = lambda: sampler.generate_batch(engine, prompts, new)
  else:
    generate = lambda: engine.generate_batch(prompts, new)

  def steps():
    state, t, _, _ = engine.step(engine.init_decode_state(), tokens, valid)
    for _ in range(new - 1):
      state, t, _, _ = engine.step(state, t[:, None], np.ones((slots, 1), bool))

  def decode8():
    state, t, _, _ = engine.step(engine.init_decode_state(), tokens, valid)
    budgets = np.full((slots,), 8, np.int32)
    for _ in range(new // 8):
      state, chunk = engine.decode(state, t, budgets, steps=8)
      state, chunk = engine.collect(state, chunk)
      t = np.asarray(state.next_tokens)

  return {"generate_batch": (generate, slots * new), "step": (steps, slots * new),
          "decode 8": (decode8, slots * (1 + new))}

sides = {"ref": paths("sao_jax_ref"), "head": paths("sao_jax")}
for fns in sides.values():  # compile and warm up
  for fn, _ in fns.values():
    fn(); fn()
out = {side: {k: [] for k in fns} for side, fns in sides.items()}
for i in range(repeats):
  for k in sides["ref"]:
    for side in (("ref", "head") if i % 2 == 0 else ("head", "ref")):
      fn, n = sides[side][k]
      t = time.perf_counter()
      fn()
      out[side][k].append(n / (time.perf_counter() - t))
print("RESULT " + json.dumps(out))
"""


def ref_package(ref: str, dest: str) -> None:
  """`ref`'s sao_jax under `dest` as the package `sao_jax_ref`."""
  archive = subprocess.run(
    ["git", "archive", ref, "sao_jax"], cwd=ROOT, capture_output=True, check=True
  ).stdout
  subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
  os.rename(os.path.join(dest, "sao_jax"), os.path.join(dest, "sao_jax_ref"))
  for folder, _, files in os.walk(os.path.join(dest, "sao_jax_ref")):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        with open(path, encoding="utf-8") as f:
          text = f.read()
        with open(path, "w", encoding="utf-8") as f:
          f.write(re.sub(r"\bsao_jax\b", "sao_jax_ref", text))


def main():
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import json

  import numpy as np
  from timing import report

  parser = argparse.ArgumentParser()
  parser.add_argument(
    "--ref",
    default="dae3a1e",
    help="the commit to compare with (default: before the one-layout engine)",
  )
  parser.add_argument("--repeats", type=int, default=41, help="timed call pairs per path")
  parser.add_argument("--out", default=None, help="append the table to this file")
  args = parser.parse_args()
  head = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
  ).stdout.strip()
  with tempfile.TemporaryDirectory() as tmp:
    ref_package(args.ref, tmp)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, tmp]), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a run has
    proc = subprocess.run(
      [sys.executable, "-c", CHILD, str(args.repeats)],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      check=False,
    )
  result = next(
    (json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None
  )
  if result is None:
    raise RuntimeError(f"timing failed:\n{proc.stderr[-3000:]}")
  lines = [
    f"| engine path (sao_tiny, 16 slots, 1 CPU device) | {args.ref} best (tok/s) "
    f"| {head} best (tok/s) | {head} / {args.ref}, median of {args.repeats} pairs "
    "| interquartile range |",
    "|---|---|---|---|---|",
  ]
  for path in result["ref"]:
    ref, new = np.asarray(result["ref"][path]), np.asarray(result["head"][path])
    q1, q2, q3 = np.percentile(new / ref, [25, 50, 75])
    lines.append(f"| {path} | {ref.max():.0f} | {new.max():.0f} | {q2:.3f} | {q1:.3f} - {q3:.3f} |")
  report(lines, args.out)


if __name__ == "__main__":
  main()
