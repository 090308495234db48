"""Evaluates a checkpoint of a run, or an HF directory, on `eval.sets` as the paper does.

    python launch/eval.py --config=configs/sao_tiny.py --workdir=workdirs/sao_tiny \
        [--step=rl:N | --checkpoint=N | --hf_dir=DIR] [--out=DIR] \
        [--config.eval.sets="('heldout','python_tool')"] [--config.eval.samples_per_task=4]

Samples `eval.samples_per_task` (k) episodes of each task of each set at
`eval.temperature` / `eval.top_p` (1.0 / 1.0 by default, the paper's) under
the config's turn and length budgets, printing each set's progress (samples
done, rate, ETA) every 10 s. Prints the per-set table (pass@1, pass@k and,
where the environment extracts answers, maj@k, each +- its standard error
over tasks; mean turns, tool-call errors per sample, the fraction cut by the
length budget, rows rejected at load; one more row per source where a set's
rows name several `data_source`s) and one JSON line: the first set's
numbers, every set's under "sets", and "out". Each set's samples (task,
prompt id, reward, success, turns, the extracted answer, the row's source,
events, the last step's info, the action turns and the whole transcript
decoded) and summary go to `OUT/<set>/samples.jsonl` and
`OUT/<set>/summary.json`, by default `<workdir>/eval/checkpoint_<number>`
(`hf_<name>` for --hf_dir). `--hf_dir` evaluates an HF Qwen3-MoE directory
(launch/export.py's, or a Hub release) with the run's tokenizer and chat
format.

The data cannot hide: with `eval.strict` (the default) a set that lost any
row at load (malformed, duplicate or conflicting rows) stops the evaluation
with one line naming the counts and the first; `--config.eval.strict=False`
evaluates the rows left and reports `rows_rejected` (and by kind) in the
table and summary.json. A set whose samples mostly hit the length budget
gets a warning and `"mostly_truncated": true`. The JSON is strict: an
undefined statistic (the standard error over one task, a mean over no
samples, valid_tool_calls when no tool call was written) is null, never NaN.
"""

import json
import os
import sys

from absl import flags, logging
from ml_collections import config_flags

from sao_jax.models import hf_export
from sao_jax.train import configuration, distributed, evaluation, trainer

# --config files import the repository's `configs` package, which is not
# installed: this checkout's root joins sys.path, whatever the working directory.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.")
_STEP = flags.DEFINE_string(
  "step",
  None,
  'A training step: "rl:50" (or 50) after 50 RL '
  'steps, "sft:200" after 200 SFT steps (default: the latest), '
  "as launch/export.py takes it.",
)
_CHECKPOINT = flags.DEFINE_integer(
  "checkpoint", None, "A checkpoint's number (checkpoints/<N>) instead of --step."
)
_HF_DIR = flags.DEFINE_string(
  "hf_dir", None, "Evaluate this HF Qwen3-MoE directory instead of a checkpoint."
)
_OUT = flags.DEFINE_string(
  "out",
  None,
  "Directory of the per-set samples and summaries (default: <workdir>/eval/checkpoint_<number>).",
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  distributed.initialize(_CONFIG.value.distributed)
  try:
    if _HF_DIR.value is not None:
      evaluation.check_policy_dir(_HF_DIR.value)  # before the run loads: one line
    result = trainer.evaluate(
      _CONFIG.value,
      _WORKDIR.value,
      _STEP.value,
      _OUT.value,
      hf_dir=_HF_DIR.value,
      checkpoint=_CHECKPOINT.value,
    )
  except (FileNotFoundError, configuration.ConfigError, hf_export.ExportError) as e:
    # No checkpoint, no such HF directory or a value model's, a set that lost rows
    # (eval.strict): one line.
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  if distributed.is_primary():
    print(evaluation.table(result), flush=True)
    print(json.dumps(evaluation.finite_json(result), allow_nan=False))


if __name__ == "__main__":
  configuration.run(main)
