"""Serving: JetStream's gRPC server over the policy vs the engine in-process.

    python benchmarks/serving.py [--slots 8] [--requests 48] [--new_tokens 64]

What it runs, all on this machine, nothing downloaded:

1. A small sentencepiece model (unigram, `--sp_vocab` pieces, at most the
   policy's vocabulary) trained on generated text, and a ShareGPT-format
   JSON of generated conversations. JetStream's `benchmark_serving.py`
   tokenizes prompts on the client side with it (its "test" tokenizer is
   broken upstream); the server feeds those ids to the policy as they are,
   so the text is meaningless and only the token counts matter.
2. `launch/serve.py` (JetStream's real orchestrator and gRPC server over the
   tiny policy, fresh parameters) in a subprocess.
3. JetStream's own client, `benchmarks/benchmark_serving.py` from the
   google-jetstream wheel, against it: a warm-up round, then every request
   at t=0 (`--request-rate inf`), each asking for up to `--new_tokens`
   tokens. Its saved JSON gives output tokens/s, time to first token and
   time per output token.
4. The engine in-process on the same prompts at the same slots, no server:
   `PolicyEngine.generate_batch` (one prefill and one jitted decode loop per
   wave of `slots` prompts; `--new_tokens` tokens each, no stop token), the
   engine's best case.

The figure is served tokens/s over in-process tokens/s: every served run
is bracketed by in-process runs and divided by their mean; the median over
`--rounds` is reported with every round's ratio.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_WORDS = (
  "add",
  "sum",
  "plus",
  "minus",
  "times",
  "value",
  "tool",
  "call",
  "result",
  "answer",
  "print",
  "list",
  "the",
  "of",
  "and",
  "to",
  "is",
  "what",
  "compute",
  "number",
)


def _sentence(rng: random.Random, n: int) -> str:
  out = []
  for _ in range(n):
    out.append(rng.choice(_WORDS) if rng.random() < 0.7 else str(rng.randint(0, 999)))
  return " ".join(out)


def make_inputs(workdir: str, *, sp_vocab: int, requests: int, seed: int = 0) -> tuple[str, str]:
  """A sentencepiece model and a ShareGPT JSON under `workdir`; their paths."""
  import sentencepiece as spm

  rng = random.Random(seed)
  corpus = [_sentence(rng, rng.randint(5, 30)) for _ in range(2000)]
  prefix = os.path.join(workdir, "sp")
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(corpus),
    model_prefix=prefix,
    vocab_size=sp_vocab,
    model_type="unigram",
    character_coverage=1.0,
    minloglevel=2,
  )
  conversations = [
    {
      "conversations": [
        {"from": "human", "value": _sentence(rng, rng.randint(8, 24))},
        {"from": "gpt", "value": _sentence(rng, rng.randint(30, 60))},
      ]
    }
    for _ in range(requests)
  ]
  data = os.path.join(workdir, "sharegpt.json")
  with open(data, "w", encoding="utf-8") as f:
    json.dump(conversations, f)
  return prefix + ".model", data


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _client_script() -> str:
  import jetstream

  site = os.path.dirname(os.path.dirname(jetstream.__file__))
  path = os.path.join(site, "benchmarks", "benchmark_serving.py")
  if not os.path.exists(path):
    raise SystemExit(
      f"JetStream's benchmark_serving.py is not at {path}: pip install -e '.[jetstream]'"
    )
  return path


class Server:
  """launch/serve.py in a subprocess, up once it says so."""

  def __init__(self, workdir: str, slots: int, extra: list[str]):
    self.port = _free_port()
    self.log = open(os.path.join(workdir, "server.log"), "w", encoding="utf-8")
    self.proc = subprocess.Popen(
      [
        sys.executable,
        os.path.join(ROOT, "launch", "serve.py"),
        f"--config={os.path.join(ROOT, 'configs', 'sao_tiny.py')}",
        f"--workdir={os.path.join(workdir, 'policy')}",
        f"--port={self.port}",
        f"--slots={slots}",
        "--config.tensorboard=False",
        *extra,
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    for line in self.proc.stdout:
      self.log.write(line)
      if "JetStream server on port" in line:
        break
    else:
      raise SystemExit(f"serve.py exited before serving; see {self.log.name}")

  def close(self):
    self.proc.kill()
    self.proc.wait()
    self.log.close()


def run_client(
  port: int,
  tokenizer: str,
  dataset: str,
  requests: int,
  new_tokens: int,
  out_dir: str,
  warmup: bool,
) -> dict:
  """JetStream's benchmark_serving.py against localhost:port; its saved metrics."""
  before = set(glob.glob(os.path.join(out_dir, "*.json")))
  cmd = [
    sys.executable,
    _client_script(),
    "--server=localhost",
    f"--port={port}",
    "--dataset=sharegpt",
    f"--dataset-path={dataset}",
    f"--tokenizer={tokenizer}",
    "--model=sao-tiny",
    f"--num-prompts={requests}",
    f"--max-output-length={new_tokens}",
    "--request-rate=inf",
    "--save-result",
    "--disable-tqdm",
    "--additional-metadata-metrics-to-save={}",
  ]
  if warmup:
    cmd.append("--warmup-first=True")
  proc = subprocess.run(
    cmd,
    cwd=out_dir,
    capture_output=True,
    text=True,
    check=False,
    env=dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3"),
  )
  if proc.returncode:
    raise SystemExit(
      f"benchmark_serving.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
      f"\n{proc.stderr[-3000:]}"
    )
  new = sorted(set(glob.glob(os.path.join(out_dir, "*.json"))) - before, key=os.path.getmtime)
  if not new:
    raise SystemExit(f"benchmark_serving.py wrote no result:\n{proc.stdout[-3000:]}")
  with open(new[-1], encoding="utf-8") as f:
    return json.load(f)["metrics"]


class InProcess:
  """The same policy as the server's (same config and workdir), no server."""

  def __init__(self, work: str, slots: int, serve_flags: list[str], tokenizer: str, dataset: str):
    from configs import sao_tiny
    from sao_jax.train import configuration, factories, trainer

    config = sao_tiny.get_config()
    for flag in serve_flags:  # --config.a.b=value, as serve.py got them
      field, value = flag.removeprefix("--config.").split("=", 1)
      old = configuration.get_field(config, field)
      configuration.set_field(config, field, type(old)(value) if old is not None else value)
    config.tensorboard = False
    run = trainer.load_run(config, os.path.join(work, "policy"))
    # The server's engine (launch/serve.py): the run's rollout section with `slots`.
    self.engine = factories.make_engine(
      config, run.model_cfg, run.state.policy, seed=0, slots=slots
    )
    # The client's prompts, tokenized as it does, in waves of `slots`.
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    with open(dataset, encoding="utf-8") as f:
      prompts = [sp.encode(c["conversations"][0]["value"]) for c in json.load(f)]
    prompts = [q for q in prompts if len(q) >= 4]
    self.waves = [prompts[i : i + slots] for i in range(0, len(prompts), slots)]
    self.compiled = False

  def tokens_per_s(self, new_tokens: int) -> float:
    """Tokens/s of `generate_batch` over the client's prompts, waves of `slots`."""
    from sao_jax.rollout import batch_sampler

    if not self.compiled:
      batch_sampler.generate_batch(self.engine, self.waves[0], new_tokens)
      self.compiled = True
    start = time.perf_counter()
    n = sum(
      int(batch_sampler.generate_batch(self.engine, w, new_tokens)[2].sum()) for w in self.waves
    )
    return n / (time.perf_counter() - start)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--slots", type=int, default=8)
  p.add_argument("--requests", type=int, default=48)
  p.add_argument("--new_tokens", type=int, default=64)
  p.add_argument(
    "--tokens_per_step",
    default="1,8",
    help="comma-separated values of serve.py's --tokens_per_step, one server each",
  )
  p.add_argument("--sp_vocab", type=int, default=64)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument(
    "--serve_flag",
    action="append",
    default=[],
    help="a --config.x=y flag for serve.py and the in-process engine alike",
  )
  p.add_argument("--json", default=None, help="write the figures here")
  args = p.parse_args(argv)
  ks = [int(k) for k in args.tokens_per_step.split(",")]
  served = {k: [] for k in ks}
  local = []
  with tempfile.TemporaryDirectory() as work:
    tokenizer, dataset = make_inputs(work, sp_vocab=args.sp_vocab, requests=args.requests)
    local_engine = InProcess(work, args.slots, args.serve_flag, tokenizer, dataset)
    servers = {}
    try:
      for k in ks:
        servers[k] = Server(
          work, args.slots, [f"--tokens_per_step={k}", "--ignore_eos", *args.serve_flag]
        )
        # JetStream's own warm-up (compiles every prefill bucket the requests use).
        run_client(
          servers[k].port, tokenizer, dataset, args.requests, args.new_tokens, work, warmup=True
        )
      # Each served run is bracketed by in-process runs (local, k1, local, k2, ...,
      # local) and compared with the mean of its two neighbours, so that load
      # drifting on a shared machine hits both sides of each ratio alike.
      local.append(local_engine.tokens_per_s(args.new_tokens))
      for i in range(args.rounds):
        for k in ks:
          res = run_client(
            servers[k].port, tokenizer, dataset, args.requests, args.new_tokens, work, warmup=False
          )
          local.append(local_engine.tokens_per_s(args.new_tokens))
          res["in_process_tokens_per_s"] = (local[-2] + local[-1]) / 2
          res["ratio"] = res["output_throughput"] / res["in_process_tokens_per_s"]
          served[k].append(res)
          print(
            f"[serving] round {i}, tokens_per_step {k}: {res['output_throughput']:.0f} "
            f"tokens/s ({res['total_output_tokens']} tokens, ttft {res['mean_ttft_ms']:.0f} "
            f"ms, tpot {res['mean_tpot_ms']:.1f} ms); in-process around it "
            f"{res['in_process_tokens_per_s']:.0f} tokens/s; ratio {res['ratio']:.2f}",
            flush=True,
          )
    finally:
      for server in servers.values():
        server.close()
  result = {
    "slots": args.slots,
    "requests": args.requests,
    "new_tokens": args.new_tokens,
    "in_process_tokens_per_s": statistics.median(local),
    "served": {},
  }
  for k, rs in served.items():
    result["served"][k] = {
      "tokens_per_s": statistics.median(r["output_throughput"] for r in rs),
      "ratio_median": statistics.median(r["ratio"] for r in rs),
      "ratios": [round(r["ratio"], 3) for r in rs],
      "output_tokens": statistics.median(r["total_output_tokens"] for r in rs),
      "mean_ttft_ms": statistics.median(r["mean_ttft_ms"] for r in rs),
      "mean_tpot_ms": statistics.median(r["mean_tpot_ms"] for r in rs),
    }
  print(json.dumps(result, indent=1))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
