"""Export time and size: `hf_export.export_params` on the model presets.

    python benchmarks/export.py [--out=/tmp/sao_export_bench]

Random float32 weights in each preset's shapes (the exporter reads values,
not their training), exported as bf16 safetensors (the default) with 5 GiB
shards; prints one line per preset: parameters, bytes written, files,
the largest unit held on the host at once, seconds and MB/s. The Qwen3
vocabulary rows show the embedding-dominated case of a real tokenizer.
"""

import argparse
import json
import os
import shutil
import time

import jax
import numpy as np

from sao_jax.models import config as model_config
from sao_jax.models import hf_export, policy


def random_params(cfg, seed=0):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda s: (0.02 * rng.standard_normal(s.shape)).astype(np.float32),
    jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0))),
  )


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="/tmp/sao_export_bench")
  args = parser.parse_args()
  cases = {
    "tiny (char vocab 68)": model_config.tiny(68),
    "small (char vocab 68)": model_config.small(68),
    "tiny (Qwen3 vocab 151669)": model_config.tiny(151_669),
    "small (Qwen3 vocab 151669)": model_config.small(151_669),
  }
  for name, cfg in cases.items():
    params = random_params(cfg)
    n = sum(x.size for x in jax.tree.leaves(params))
    out = os.path.join(args.out, "m")
    shutil.rmtree(args.out, ignore_errors=True)
    start = time.perf_counter()
    stats = hf_export.export_params(params, cfg, out)
    seconds = time.perf_counter() - start
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(
      json.dumps(
        {
          "preset": name,
          "params": n,
          "dir_bytes": size,
          "files": len(stats["files"]),
          "peak_host_bytes": stats["peak_host_bytes"],
          "seconds": round(seconds, 3),
          "MB_per_s": round(size / seconds / 1e6, 1),
        }
      )
    )
  shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
  main()
