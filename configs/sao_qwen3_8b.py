"""SAO on dense Qwen3-8B on one TPU v5p-8 host (4 chips), engine colocated.

    python launch/train.py --config=configs/sao_qwen3_8b.py --workdir=/mnt/sao_qwen3_8b \
        --config.model.hf_dir=/path/to/Qwen3-8B \
        --config.env.tokenizer_path=/path/to/Qwen3-8B/tokenizer.json

The dense family's pod config: `model.hf_dir` gives the architecture and
the initial policy (Qwen/Qwen3-8B's safetensors, bf16 read exactly into
fp32 master weights, one tensor at a time into its shardings); without it
the qwen3_8b preset's shape is initialised randomly (what launch/compile.py
compiles). SFT on the task's demonstrations -> value pretraining -> async
SAO, one process driving the host's 4 chips: the trainer's programs and
the rollout engine share the chips (`rollout.sharded_engine`: the engine's
bf16 params and its paged KV cache laid out on the trainer's mesh).

Layout: FSDP over the 4 chips (params, gradients and Adam moments split
four ways, the batch too); the 36 layers as one scan under full remat,
splash attention, log-probs over 1024-token chunks (the qwen3_8b preset).
The task is math_tool with Qwen3's chat template and thinking on, episodes
up to 8192 tokens. Check it fits with

    python launch/compile.py --config=configs/sao_qwen3_8b.py --topology=v5p-8

(benchmarks/RESULTS.md, "Dense Qwen3 on one chip and one host": the
compiler's per-chip bytes of each program, the engine's added on the
colocated rows). Settings follow the paper where docs/DESIGN.md section 1
gives them (K = 2 critic updates, frozen critic attention, value
pretraining, skip-observation GAE, one rollout per prompt, async); the
learning rates and batch sizes are this project's choices. Not run on a
TPU here: compiled only.
"""

from configs import common

# FSDP over the host's chips; heads, MLP and vocabulary unsplit ("tensor" 1).
RULES = (
    ("batch", ("data", "fsdp")), ("length", None), ("embed", "fsdp"), ("vocab", "tensor"),
    ("heads", "tensor"), ("kv_heads", None), ("head_dim", None), ("mlp", "tensor"),
    ("expert", None), ("layers", None),
)


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.model.preset = "qwen3_8b"
  c.model.hf_dir = ""  # the Qwen3-8B directory (module docstring); "": random init
  c.env.name = "math_tool"
  c.env.kwargs = {"max_turns": 20}
  c.env.tokenizer = "qwen3"
  c.env.chat_format = "qwen3"
  c.env.thinking = True
  c.env.max_tool_output_tokens = 1024
  c.env.sandbox = {"cpu_seconds": 10, "wall_seconds": 30.0, "max_output_chars": 8192}
  c.sharding.mesh = {"data": -1, "fsdp": 4, "tensor": 1}  # data 1 on a v5p-8
  c.sharding.rules = RULES
  c.data.buckets = (2048, 4096, 8192)
  c.data.logits_at_actions = True
  c.sft.steps = 200
  c.sft.batch_size = 16
  c.sft.lr = 1e-5
  c.rollout.max_len = 8192
  c.rollout.max_turn_tokens = 2048
  c.rollout.slots = 32
  c.rollout.sharded_engine = True
  # A paged pool of half the dense cache's positions (pages of 128).
  c.rollout.kv_cache = "paged"
  c.rollout.page_size = 128
  c.rollout.kv_pages = (c.rollout.get_ref("slots") * c.rollout.get_ref("max_len")
                        // c.rollout.get_ref("page_size") // 2)
  c.value_pretrain.steps = 50
  c.value_pretrain.num_trajectories = 512
  c.rl.mode = "async"
  c.rl.steps = 300
  c.rl.batch_size = 16
  c.rl.policy_loss = "ppo_clip"
  c.rl.actor_lr = 1e-6
  c.rl.critic_lr = 5e-6
  c.rl.warmup = 10
  c.rl.eval_every = 50
  c.eval.num_tasks = 500
  c.eval.slots = 32
  c.checkpoint.every = 20
  return c
