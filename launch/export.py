"""Exports a run's policy (and value model) as Hugging Face directories of its family.

    python launch/export.py --config=configs/sao_tiny.py --workdir=workdirs/sao_tiny \
        --out=exports/sao_tiny [--step=rl:50 | --checkpoint=N] [--dtype=bfloat16] \
        [--shard_gb=5] [--novalue]

Writes OUT, which `vllm serve OUT`, SGLang, lm-eval and transformers load
with no other argument: config.json (with bos / eos / pad ids),
model-0000x-of-0000y.safetensors, the index, the run's tokenizer
(tokenizer.json and tokenizer_config.json with the chat template; Qwen3's
and Qwen3.5's built offline), generation_config.json, and
sao_jax_export.json naming the checkpoint; and OUT-value (the critic as a
one-label ...ForTokenClassification, its value head as `score`), bf16 by
default. A head over a vocabulary subset is written over the whole
vocabulary (sao_jax/models/hf_export.py `full_vocabulary`). `--step` is a
training step (`rl:50` or `50`: after 50 RL steps; `sft:200`),
`--checkpoint` a checkpoint's number (checkpoints/N); neither: the latest.
A missing step lists the checkpoints there are; nothing is written on an
error. Multi-host: the same command on every host (the gathers are
collective; process 0 writes, one parameter at a time). Prints one JSON
line: per directory its files, tensors, bytes, peak host bytes and seconds.
"""

import json
import os
import sys

from absl import flags, logging
from ml_collections import config_flags

from sao_jax.models import hf_export
from sao_jax.train import configuration, distributed, export

# --config files import the repository's `configs` package, which is not
# installed: this checkout's root joins sys.path, whatever the working directory.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.")
_OUT = flags.DEFINE_string("out", None, "The policy's HF directory (new or empty).")
_STEP = flags.DEFINE_string(
  "step",
  None,
  "Training step: rl:N (or N) after N RL steps, "
  "sft:N after N SFT steps (default: the latest checkpoint).",
)
_CHECKPOINT = flags.DEFINE_integer(
  "checkpoint", None, "A checkpoint's number (checkpoints/N), instead of --step."
)
_DTYPE = flags.DEFINE_enum(
  "dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Tensor dtype in the files."
)
_SHARD_GB = flags.DEFINE_float("shard_gb", 5.0, "Most GiB of tensors per safetensors file.")
_VALUE = flags.DEFINE_bool("value", True, "Also export the value model to OUT-value.")
flags.mark_flags_as_required(["config", "workdir", "out"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  distributed.initialize(_CONFIG.value.distributed)
  try:
    result = export.export(
      _CONFIG.value,
      _WORKDIR.value,
      _OUT.value,
      _STEP.value,
      checkpoint=_CHECKPOINT.value,
      dtype=_DTYPE.value,
      shard_bytes=max(1, int(_SHARD_GB.value * 2**30)),
      value_out="" if _VALUE.value else None,
    )
  except (hf_export.ExportError, FileNotFoundError) as e:  # one line, no traceback
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  if distributed.is_primary():
    print(
      json.dumps(
        {
          k: v
          if "skipped" in v
          else {f: v[f] for f in ("dir", "tensors", "bytes", "peak_host_bytes", "seconds")}
          | {"files": len(v["files"])}
          for k, v in result.items()
        }
      )
    )


if __name__ == "__main__":
  configuration.run(main)
