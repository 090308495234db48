"""SAO on a real small dense Qwen3 (Qwen3-0.6B) on one accelerator: math_tool.

    python launch/train.py --config=configs/qwen3_colab.py:/path/to/Qwen3-0.6B \
        --workdir=workdirs/qwen3_colab

The argument is a Hugging Face model directory (what
`huggingface_hub.snapshot_download("Qwen/Qwen3-0.6B")` returns;
notebooks/qwen3_colab.ipynb downloads it in a cell): the architecture comes
from its config.json (`model.hf_dir`, sao_jax/models/families.py), the
initial policy from its safetensors (bf16 read exactly into fp32 master
weights), the tokenizer from its tokenizer.json (`env.tokenizer_path`),
the chat format is Qwen3's (the notebook checks it renders as the
checkpoint's own chat template). Without an argument the model is the
qwen3_0_6b preset's shape, randomly initialised: what launch/compile.py
compiles.

A Qwen3.5 / 3.6 directory works the same way (the hybrid family: Gated
DeltaNet and gated full attention; its multimodal releases load their text
model): the chat format is then Qwen3.5's ("qwen3_5"), and the preset
still only says how the model runs (tests/train/test_qwen3_5_run.py runs
the chain on a tiny Qwen3.5-MoE).

The chain: SFT on the shipped tool-using transcripts (the format: a python
tool call, its output, a \\boxed{} answer) -> value pretraining of the
critic (initialised from the SFT trunk, its attention frozen) -> async SAO
with the engine colocated -> held-out pass@1. Thinking off: episodes of a
few hundred tokens.

Memory: fp32 masters and Adam for the policy and the critic. It fits a
TPU v6e-1 with the engine on the same chip, and not a v5e-1 (the RL step);
the TPU compiler's per-chip figures:
benchmarks/RESULTS.md#pods-compile-and-fit. GPUs were not compiled for.
"""

import os

from configs import common
from sao_jax.models import families


def get_config(arg=None):
  """`arg`: the HF model directory (empty: the preset's shape, random weights)."""
  c = common.get_config()
  # How the model runs (fp32 masters, bf16 compute, one scan over the 28
  # layers with full remat, chunked log-probs and prefill); the
  # architecture comes from the directory.
  c.model.preset = "qwen3_0_6b"
  # Log-probs over 128-token chunks: a chunk's logits are [rows, 128, 151936]
  # fp32 (1.2 GB at 16 rows); the preset's 1024 would be the whole row here.
  c.model.overrides = {"logits_chunk": 128}
  c.env.chat_format = "qwen3"
  if arg:
    c.model.hf_dir = arg
    c.env.tokenizer_path = os.path.join(arg, "tokenizer.json")
    # A Qwen3.5 / 3.6 checkpoint (the hybrid family) speaks Qwen3.5's format.
    if families.config_kwargs(arg)["family"].startswith("qwen3_5"):
      c.env.chat_format = "qwen3_5"
  else:
    c.env.tokenizer = "qwen3"
  c.env.name = "math_tool"
  c.env.kwargs = {"max_turns": 4}
  c.env.thinking = False
  c.env.max_tool_output_tokens = 128
  # Prompts (system, the tools block, the question) are ~220-245 tokens; a
  # tool call, its output and the answer a few hundred more.
  c.rollout.max_len = 1024
  c.rollout.max_turn_tokens = 256
  c.rollout.slots = 16
  c.data.buckets = (512, 1024)
  # The 151,936-wide head at action tokens only.
  c.data.logits_at_actions = True
  # SFT teaches the task's tool-call format to a model that already chats.
  c.sft.steps = 60
  c.sft.batch_size = 8
  c.sft.lr = 1e-5
  c.sft.warmup = 10
  c.value_pretrain.steps = 20
  c.value_pretrain.num_trajectories = 64
  c.rl.steps = 60
  c.rl.batch_size = 16
  c.rl.policy_loss = "ppo_clip"
  c.rl.actor_lr = 1e-6
  c.rl.critic_lr = 5e-6
  c.rl.warmup = 5
  c.eval.num_tasks = 200
  c.eval.slots = 32
  c.checkpoint.every = 20
  c.log_every = 5
  return c
