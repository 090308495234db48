"""Exports a LoRA run's actor adapters as a PEFT adapter directory.

    python launch/export_peft.py --config=configs/sao_tiny.py \
        --config.lora.enabled=True --workdir=workdirs/lora --out=exports/lora-adapter \
        [--step=rl:50 | --checkpoint=N] [--base_model=Qwen/Qwen3-8B]

Writes OUT/adapter_config.json and OUT/adapter_model.safetensors (float32),
named by transformers' modules (sao_jax/models/peft_export.py), which
`peft.PeftModel.from_pretrained(model, OUT)` loads onto the base model
(`model.hf_dir`, or the base exported by launch/export.py from a run whose
adapters are zero: its step 0). `--base_model` is recorded as the adapter's
base_model_name_or_path (default: model.hf_dir). MoE experts' adapters go
on transformers' fused expert parameters (peft's `target_parameters`; the
file's rank is then 2r, see sao_jax/models/peft_export.py). Adapters on a
part of a fused tensor (Gated DeltaNet's in_proj_qkv) have no PEFT form:
refused in one line (launch/export.py writes the merged weights instead).
Prints one JSON line: the directory, its modules, fused parameters, rank.
"""

import json
import os
import sys

import jax
from absl import flags, logging
from ml_collections import config_flags

from sao_jax.models import peft_export
from sao_jax.train import configuration, distributed, export
from sao_jax.train import run as run_lib

# --config files import the repository's `configs` package, which is not
# installed: this checkout's root joins sys.path, whatever the working directory.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.")
_OUT = flags.DEFINE_string("out", None, "The adapter directory (created).")
_STEP = flags.DEFINE_string(
  "step", None, "Training step: rl:N (or N), sft:N; default the latest checkpoint."
)
_CHECKPOINT = flags.DEFINE_integer("checkpoint", None, "A checkpoint's number instead.")
_BASE = flags.DEFINE_string(
  "base_model", None, "The base's HF directory or Hub id to record (default model.hf_dir)."
)
flags.mark_flags_as_required(["config", "workdir", "out"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  distributed.initialize(config.distributed)
  number = export.find_checkpoint(config, _WORKDIR.value, _STEP.value, _CHECKPOINT.value)
  run = run_lib.load(config, _WORKDIR.value, number)
  try:
    if run.programs.lora is None:
      raise ValueError(
        "lora.enabled is False: the run trains the whole model; launch/export.py writes it"
      )
    adapters = jax.device_get(run.state.policy)  # replicated: every process holds them
    if distributed.is_primary():
      result = peft_export.export_adapters(
        adapters,
        run.model_cfg,
        run.programs.lora.adapters.actor,
        _OUT.value,
        base_model=_BASE.value or config.model.hf_dir or None,
      )
      print(json.dumps(result))
  except (ValueError, FileNotFoundError) as e:  # one line, no traceback
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  finally:
    run.close()


if __name__ == "__main__":
  configuration.run(main)
