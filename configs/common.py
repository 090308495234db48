"""Defaults shared by every config; each config file overrides what it changes.

The sections built from records of sao_jax/sections.py (distributed, data,
sft, value_pretrain, rollout, rl, fleet, eval, checkpoint, faults) take
their defaults from there, where every field is documented and checked;
model, env and sharding are documented here.
"""

import ml_collections

from sao_jax import sections

# Logical axis -> mesh axis rules (sao_jax/sharding.py). Data parallel on a
# single host; the pod config shards further.
DATA_PARALLEL_RULES = (
    ("batch", "data"), ("length", None), ("embed", None), ("vocab", None),
    ("heads", None), ("kv_heads", None), ("head_dim", None), ("mlp", None),
    ("expert", None), ("layers", None),
)


def get_config():
  c = ml_collections.ConfigDict()
  # Seeds model init, prompt order, sampling.
  c.seed = 0
  # Steps between metrics lines / JSONL records.
  c.log_every = 10
  # Write TensorBoard event files beside metrics.jsonl.
  c.tensorboard = True
  # The typed sections (sao_jax/sections.py) hold each field's default, its
  # documentation and its check; read them there.
  c.distributed = sections.Distributed.defaults()

  c.model = ml_collections.ConfigDict()
  # A preset in sao_jax/models/config.py: tiny, small, qwen3_30b_a3b.
  c.model.preset = "tiny"
  # Field overrides of the preset, e.g. {"num_layers": 3}.
  c.model.overrides = {}
  # Size the tiny / small presets' vocabulary to the tokenizer's.
  c.model.vocab_from_tokenizer = True
  # Activation / matmul dtype: "float32", or "bfloat16" for bf16 compute with
  # fp32 master weights (params and optimizer state stay in the preset's
  # param_dtype). "": the preset's own dtype.
  c.model.compute_dtype = ""

  c.env = ml_collections.ConfigDict()
  # A built-in environment (python_tool, code_fix, online_style, dataset) or
  # a user's factory as an import string, "my_pkg.my_env:make_env" or
  # "path/to/my_env.py:make_env" (sao_jax/envs/registry.py).
  c.env.name = "python_tool"
  # Keyword arguments of the built-in's config dataclass, or of the factory.
  c.env.kwargs = {}
  # "": the environment's own reward; "pkg.module:fn": fn(task, response,
  # info) -> float replaces it (run in the trainer-side process, never in
  # the sandbox).
  c.env.reward = ""
  # Tokenizer by name: "char" (the toys' character vocabulary) or "qwen3"
  # (Qwen3's, offline); env.tokenizer_path, if set, takes precedence.
  c.env.tokenizer = "char"
  # How prompts, turn ends and observations become tokens (sao_jax/envs/chat.py):
  # "raw" (the toys' text format), "plain", or "qwen3" (Qwen3's chat template).
  c.env.chat_format = "raw"
  # qwen3: thinking on (the model may write <think>...</think>) or off (the
  # generation prompt carries an empty think block, as Qwen3 defines it).
  c.env.thinking = True
  # Tool output (observation messages) is cut to this many tokens, with a
  # visible marker; 0: no cap.
  c.env.max_tool_output_tokens = 512
  # Sandbox limits (sao_jax/envs/sandbox.py SandboxLimits fields).
  c.env.sandbox = {"cpu_seconds": 1, "wall_seconds": 3.0}
  # Simulated tool latency: seconds slept in every RL environment step (an
  # agentic tool call's wait; benchmarks/loop.py). 0: none.
  c.env.tool_latency_s = 0.0
  # A user's tokenizer.json (with its tokenizer_config.json beside it for
  # the special tokens); empty: env.tokenizer.
  c.env.tokenizer_path = ""
  # Run model-written code even where the sandbox cannot isolate it (no
  # root: no network namespace, chroot, uid drop, process cleanup). Off:
  # such a run refuses to start and says what is missing.
  c.env.allow_unisolated = False

  c.data = sections.Data.defaults()

  c.sharding = ml_collections.ConfigDict()
  # Mesh axis sizes; -1 takes the remaining devices.
  c.sharding.mesh = {"data": -1}
  c.sharding.rules = DATA_PARALLEL_RULES

  c.sft = sections.SFT.defaults()
  c.value_pretrain = sections.ValuePretrain.defaults()
  c.rollout = sections.Rollout.defaults()
  c.rl = sections.RL.defaults()
  c.fleet = sections.Fleet.defaults()
  c.eval = sections.Eval.defaults()
  c.checkpoint = sections.Checkpoint.defaults()
  c.faults = sections.Faults.defaults()

  # Unknown fields are errors: a config file that sets a misspelt field fails
  # when it loads, instead of running with the default.
  c.lock()
  return c
