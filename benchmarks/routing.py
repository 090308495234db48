"""Does the trainer route tokens to the experts the engine routed them to?

    JAX_PLATFORMS=cpu python benchmarks/routing.py [--presets=tiny,small] \
        [--batch=8] [--prompt=48] [--new=48] [--seeds=3] \
        [--config=configs/sao_tiny.py --workdir=RUN]   # a trained policy instead

For each MoE preset, precision and matmul-precision setting, the engine's
sampling pass and the trainer's forward run on the same tokens:

  engine   the serving config (params cast to the compute dtype once,
           `precision.serving_config`), the prompt in one prefill, then one
           token per step against the KV cache (`decoding.extend`'s
           computation, the model applied with a cache, here with its
           intermediates kept), each sampled at temperature 1.
  trainer  the trainer's config (fp32 masters where the preset has them),
           teacher-forced over the whole sequence (`policy.token_logprobs`).

Reported per setting, over `seeds` batches:

  tok%     tokens whose expert set differs in at least one MoE layer,
           split into prompt (prefill) and sampled (decode) tokens;
  dec%     (token, layer) router decisions that differ;
  |dlp|    mean and max |log pi_trainer - log pi_engine| over sampled tokens,
           without and with routing replay (the engine's choices fed to the
           trainer's forward: `Transformer(..., routing=)`);
  tail%    sampled tokens whose ratio exp(dlp) leaves [0.8, 1.28] (the
           clip window of the project's losses), without and with replay;
  cost     the trainer's log-prob program with replay / without: XLA's FLOP
           count (deterministic) and the median of 5 timed calls (noisy on a
           shared machine).

Precision settings: "f32" (params and compute float32), "bf16" (the pod
preset's policy: float32 masters, bfloat16 compute; the engine holds the
bf16 copy); each under jax_default_matmul_precision "default" and "highest"
(on CPU float32 matmuls are already full precision, so a difference there
would be news; on TPU the default is one bf16 pass).

A random-init model's router is nearly uniform, so near-ties (and flips)
are more common than in a trained one; give --config/--workdir to measure
a trained policy (its prompts are still random tokens of its vocabulary).
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from sao_jax.models import config as mcfg
from sao_jax.models import policy, precision, routing
from sao_jax.models.transformer import Transformer, init_cache
from sao_jax.train import steptime

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small"], "Model presets (MoE).")
_VOCAB = flags.DEFINE_integer("vocab", 512, "Vocabulary of the presets.")
_EXPERTS = flags.DEFINE_list(
  "experts",
  ["preset"],
  "Experts as E:k per preset run ('preset': the preset's own; 128:8 is Qwen3-30B-A3B's).",
)
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences a batch.")
_PROMPT = flags.DEFINE_integer("prompt", 48, "Prompt tokens (prefill).")
_NEW = flags.DEFINE_integer("new", 48, "Sampled tokens (decode).")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Batches (and inits) per setting.")
_CONFIG = flags.DEFINE_string("config", None, "A run's config file (with --workdir).")
_WORKDIR = flags.DEFINE_string("workdir", None, "A run whose latest policy to measure.")
_OUT = flags.DEFINE_string("out", None, "Write the rows as JSON here.")

LOW, HIGH = 0.8, 1.28  # the losses' ratio window


def precision_modes(cfg: mcfg.ModelConfig):
  """(name, trainer config) pairs: float32 throughout, fp32 masters + bf16 compute."""
  return [
    ("f32", dataclasses.replace(cfg, param_dtype=jnp.float32, dtype=jnp.float32)),
    ("bf16", dataclasses.replace(cfg, param_dtype=jnp.float32, dtype=jnp.bfloat16)),
  ]


def engine_pass(cfg, params, prompt, new, rng):
  """The engine's tokens, log-probs of its samples and its routing.

  Returns (tokens [B, P+N], logp [B, N] of the sampled tokens, routing
  [M, B, P+N, k] with the never-fed last token's row NONE).
  """
  b, p = prompt.shape
  cache = init_cache(cfg, b, p + new)
  lengths = jnp.zeros((b,), jnp.int32)

  @jax.jit
  def feed(params, cache, tokens, lengths):
    positions = lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
    (logits, aux), state = Transformer(cfg, "lm").apply(
      {"params": params},
      tokens,
      positions,
      jnp.ones_like(tokens),
      cache=cache,
      mutable=["intermediates"],
    )
    r = routing.collect(cfg, state["intermediates"], tokens.shape[0], tokens.shape[1])
    return logits[:, -1], aux["cache"], lengths + tokens.shape[1], r

  logits, cache, lengths, r = feed(params, cache, prompt, lengths)
  rows, sampled, logps = [r], [], []
  for step in range(new):
    key = jax.random.fold_in(rng, step)
    tok = jax.random.categorical(key, logits)[:, None].astype(jnp.int32)
    logps.append(jnp.take_along_axis(jax.nn.log_softmax(logits), tok, -1)[:, 0])
    sampled.append(tok)
    if step < new - 1:
      logits, cache, lengths, r = feed(params, cache, tok, lengths)
      rows.append(r)
  last = jnp.full(rows[0].shape[:2] + (1, cfg.experts_per_token), routing.NONE, jnp.int32)
  return (
    jnp.concatenate([prompt] + sampled, 1),
    jnp.stack(logps, 1),
    jnp.concatenate(rows + [last], 2),
  )


def trainer_logprobs(cfg, params, tokens, replay=None):
  """The trainer's teacher-forced log-probs [B, L] (`policy.token_logprobs`)."""
  b, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length), (b, length))
  logp, _ = policy.token_logprobs(
    cfg, params, tokens, positions, jnp.ones_like(tokens), routing=replay
  )
  return logp


def trainer_routing(cfg, params, tokens):
  """The experts the trainer's own forward picks, [M, B, L, k]."""
  b, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length), (b, length))
  _, state = Transformer(cfg, "hidden").apply(
    {"params": params}, tokens, positions, jnp.ones_like(tokens), mutable=["intermediates"]
  )
  return routing.collect(cfg, state["intermediates"], b, length)


def timed(fn, *args, reps=5):
  """Median seconds of fn(*args) (compiled; blocks on the result)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def measure(name, cfg, params_for, seeds):
  """One row: `params_for(seed)` gives the trainer's params for a batch."""
  p, n = _PROMPT.value, _NEW.value
  acc = {k: [] for k in ("prompt_tok", "sampled_tok", "decisions", "dlp", "dlp_replay")}
  cost = []
  serve_cfg = precision.serving_config(cfg)
  lp_plain = jax.jit(lambda prm, t: trainer_logprobs(cfg, prm, t))
  lp_replay = jax.jit(lambda prm, t, r: trainer_logprobs(cfg, prm, t, r))
  own = jax.jit(lambda prm, t: trainer_routing(cfg, prm, t))
  for seed in range(seeds):
    params = params_for(seed)
    prompt = jax.random.randint(
      jax.random.PRNGKey(1000 + seed), (_BATCH.value, p), 0, cfg.vocab_size, jnp.int32
    )
    tokens, engine_lp, engine_r = engine_pass(
      serve_cfg, precision.cast_for_serving(cfg, params), prompt, n, jax.random.PRNGKey(2000 + seed)
    )
    mine = own(params, tokens)
    fed = engine_r[:, :, :-1]  # every token the engine fed (the last one never is)
    diff = routing.differ(fed, mine[:, :, :-1])  # [M, B, L-1]
    tok = diff.any(0)
    acc["prompt_tok"].append(np.asarray(tok[:, :p]).ravel())
    acc["sampled_tok"].append(np.asarray(tok[:, p:]).ravel())
    acc["decisions"].append(np.asarray(diff).ravel())
    plain = lp_plain(params, tokens)[:, p:]
    replayed = lp_replay(params, tokens, engine_r)[:, p:]
    acc["dlp"].append(np.asarray(plain - engine_lp).ravel())
    acc["dlp_replay"].append(np.asarray(replayed - engine_lp).ravel())
    if seed == 0:
      counted = lambda fn, *a: steptime.cost(fn.lower(*a).compile())["flops"]
      cost.append(
        (
          counted(lp_replay, params, tokens, engine_r) / counted(lp_plain, params, tokens),
          timed(lp_replay, params, tokens, engine_r) / timed(lp_plain, params, tokens),
        )
      )
  cat = {k: np.concatenate(v) for k, v in acc.items()}
  tail = lambda d: float(np.mean((np.exp(d) < LOW) | (np.exp(d) > HIGH)))
  return {
    "setting": name,
    "prompt_tok_differ": float(cat["prompt_tok"].mean()),
    "sampled_tok_differ": float(cat["sampled_tok"].mean()),
    "decisions_differ": float(cat["decisions"].mean()),
    "dlp_mean": float(np.abs(cat["dlp"]).mean()),
    "dlp_max": float(np.abs(cat["dlp"]).max()),
    "dlp_replay_mean": float(np.abs(cat["dlp_replay"]).mean()),
    "dlp_replay_max": float(np.abs(cat["dlp_replay"]).max()),
    "tail": tail(cat["dlp"]),
    "tail_replay": tail(cat["dlp_replay"]),
    "replay_flops_ratio": cost[0][0],
    "replay_time_ratio": cost[0][1],
    "tokens": int(cat["dlp"].size),
  }


def models():
  """(label, trainer base config, params_for(seed, trainer config)) to measure."""
  if _WORKDIR.value:
    import importlib.util
    import os
    import sys

    from ml_collections import config_flags  # noqa: F401

    from sao_jax.train import trainer

    # The config imports the repository's `configs` package (not installed).
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("run_config", _CONFIG.value)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run = trainer.load_run(module.get_config(), _WORKDIR.value)
    trained = run.state.policy
    run.close()
    yield (
      f"{_WORKDIR.value} (trained)",
      run.model_cfg,
      lambda seed, cfg: jax.tree.map(
        lambda x: x.astype(cfg.param_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, trained
      ),
    )
    return
  for preset in _PRESETS.value:
    for experts in _EXPERTS.value:
      base = mcfg.PRESETS[preset](_VOCAB.value)
      if experts != "preset":
        e, k = (int(x) for x in experts.split(":"))
        base = dataclasses.replace(base, num_experts=e, experts_per_token=k)
      yield (
        f"{preset} E{base.num_experts} k{base.experts_per_token} (init)",
        base,
        lambda seed, cfg: policy.init_params(cfg, jax.random.PRNGKey(seed)),
      )


def main(argv):
  del argv
  rows = []
  header = (
    f"{'model':<28} {'setting':<14} {'prompt tok':>10} {'sampled tok':>11} "
    f"{'decisions':>9} {'|dlp| mean/max':>16} {'replay':>16} {'tail':>6} "
    f"{'replay':>6} {'flops':>5} {'time':>5}"
  )
  print(header)
  for label, base, params_for in models():
    for mode, cfg in precision_modes(base):
      for matmul in ("default", "highest"):
        with jax.default_matmul_precision(matmul):
          row = measure(
            f"{mode}/{matmul}", cfg, lambda s, c=cfg, p=params_for: p(s, c), _SEEDS.value
          )
        row["model"] = label
        rows.append(row)
        print(
          f"{label:<28} {row['setting']:<14} {row['prompt_tok_differ']:>10.2%} "
          f"{row['sampled_tok_differ']:>11.2%} {row['decisions_differ']:>9.2%} "
          f"{row['dlp_mean']:>8.1e}/{row['dlp_max']:<7.1e} "
          f"{row['dlp_replay_mean']:>8.1e}/{row['dlp_replay_max']:<7.1e} "
          f"{row['tail']:>6.2%} {row['tail_replay']:>6.2%} {row['replay_flops_ratio']:>5.2f} "
          f"{row['replay_time_ratio']:>5.2f}",
          flush=True,
        )
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
