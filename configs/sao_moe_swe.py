"""sao_moe's coding agent: repo_repair at the paper's 300 turns in 128K tokens.

    # every host of the training slice
    python launch/train.py --config=configs/sao_moe_swe.py --workdir=/mnt/shared/sao_moe_swe \
        --config.sft.init_from_hf=/path/to/Qwen3-30B-A3B-SFT
    # every rollout host, each with its own id (same config and overrides)
    python launch/rollout.py --config=configs/sao_moe_swe.py --workdir=/mnt/shared/sao_moe_swe \
        --rollout_id=r0
    # the rollout engine at 128K, compiled for one v5p host on a CPU machine
    python launch/compile.py --config=configs/sao_moe_swe.py --topology=v5p-256 \
        --rollout_topology=v5p-8 --programs=prefill,decode_loop

The paper's coding agent (SWE-Bench Verified through OpenHands: up to 300
interaction turns in 128K tokens) in sao-jax's terms: `env.name =
"repo_repair"` (sao_jax/envs/repo_repair.py: bash in the sandbox, view,
str_replace, create, submit; graded by the hidden tests in a fresh sandbox)
over a user's SWE-bench-style rows (sao_jax/envs/repo_tasks.py: a
repository snapshot directory or tarball per task, problem_statement,
test_command, the test patch's files as `tests`) named by env.kwargs
below: `path` and `heldout_path` are placeholders for the user's rows
(edit them, or pass --config.env.kwargs='{...}' with every key; without a
`path` the run trains on the small generated set the repository ships). A row is graded
by its test command's exit status on this machine's Python, with no
Docker image per repository: README, "Coding agent", says what that is and
is not.

Everything else is configs/sao_moe_128k.py: Qwen3-30B-A3B from an SFT
checkpoint, the 128K mesh (a context axis of 2) on a v5p-256 training
slice, rollout hosts of one v5p-8 each with the paged 64-slot engine,
weights through checkpoints. The environment changes the rollout side
only (what the engine is fed, not its shapes), so the train programs are
sao_moe_128k's; their fit, and the engine's at this config:
benchmarks/RESULTS.md#pods-compile-and-fit.

Tool time: a bash call gets `bash_seconds` (cut to the turn's
env.tool_seconds_per_turn), the hidden tests `test_seconds`; a step's
tools plus the grading run fit in rollout.env_timeout.
"""

from configs import sao_moe_128k

MAX_TURNS = 300


def get_config(arg=None):
  c = sao_moe_128k.get_config(arg)
  c.env.name = "repo_repair"
  c.env.kwargs = {
    "path": "/data/swe_train.jsonl",
    "heldout_path": "/data/swe_heldout.jsonl",
    "max_turns": MAX_TURNS,
    "bash_seconds": 30.0,
    "test_seconds": 120.0,
    "max_output_chars": 16384,
  }
  # A turn's tools (30 s, sao_moe's) plus the grading run (120 s) < 180 s.
  c.rollout.env_timeout = 180.0
  # The paper's context: 300 turns in 131,072 tokens (sao_moe_128k's max_len).
  c.rollout.max_len = sao_moe_128k.CONTEXT
  return c
