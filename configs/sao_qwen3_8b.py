"""SAO on dense Qwen3-8B: a TPU v5p-8 trainer host and v5p-8 rollout hosts.

    # the trainer host
    python launch/train.py --config=configs/sao_qwen3_8b.py --workdir=/mnt/sao_qwen3_8b \
        --config.model.hf_dir=/path/to/Qwen3-8B \
        --config.env.tokenizer_path=/path/to/Qwen3-8B/tokenizer.json
    # every rollout host, each with its own id (same config and overrides)
    python launch/rollout.py --config=configs/sao_qwen3_8b.py --workdir=/mnt/sao_qwen3_8b \
        --rollout_id=r0 --config.model.hf_dir=... --config.env.tokenizer_path=...

The dense family's pod config: `model.hf_dir` gives the architecture and
the initial policy (Qwen/Qwen3-8B's safetensors, bf16 read exactly into
fp32 master weights, one tensor at a time into its shardings); without it
the qwen3_8b preset's shape is initialised randomly (what launch/compile.py
compiles). SFT on the task's demonstrations -> value pretraining -> SAO in
fleet mode: rollout hosts generate with the versions the trainer publishes
(README.md, "Rollout fleet"). The task is math_tool with Qwen3's chat
template and thinking on, episodes up to 8192 tokens.

Layout, from the TPU compiler's figures
(benchmarks/RESULTS.md#pods-compile-and-fit): the trainer's 4 chips split params,
gradients and Adam moments four ways (FSDP; the 36 layers as one scan
under full remat, splash attention, log-probs over 1024-token chunks).
Policy and critic with fp32 masters leave the RL step (two critic updates
and the actor update) room for one 8192-token row a chip and no room for
an engine beside it, so the engines run on hosts of their own, each
spanning its host's 4 chips on `rollout.mesh = "tensor:4"`. Value
pretraining's and evaluation's engine runs on the trainer between steps.
Versions reach the rollout hosts as checkpoints
(`fleet.weights_path = "checkpoint"`): the direct path's served snapshots
would not leave the 10% margin beside the RL step. Check with

    python launch/compile.py --config=configs/sao_qwen3_8b.py --topology=v5p-8 \
        --rollout_topology=v5p-8

Settings follow the paper where docs/DESIGN.md section 1 gives them (K = 2
critic updates, frozen critic attention, value pretraining,
skip-observation GAE, one rollout per prompt, async); the learning rates
and batch sizes are this project's choices. Not run on a TPU here:
compiled only.
"""

from configs import common

# FSDP over the host's chips; heads, MLP and vocabulary unsplit ("tensor" 1).
RULES = (
  ("batch", ("data", "fsdp")),
  ("length", None),
  ("embed", "fsdp"),
  ("vocab", "tensor"),
  ("heads", "tensor"),
  ("kv_heads", None),
  ("head_dim", None),
  ("mlp", "tensor"),
  ("expert", None),
  ("layers", None),
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
  # Each engine spans its host's 4 chips, heads and MLP split over "tensor".
  c.rollout.mesh = "tensor:4"
  # A paged pool of half the dense cache's positions (pages of 128).
  c.rollout.kv_cache = "paged"
  c.rollout.page_size = 128
  c.rollout.kv_pages = (
    c.rollout.get_ref("slots") * c.rollout.get_ref("max_len") // c.rollout.get_ref("page_size") // 2
  )
  c.value_pretrain.steps = 50
  c.value_pretrain.num_trajectories = 512
  # Rollout hosts feed the trainer (launch/rollout.py); one trainer process.
  c.rl.mode = "fleet"
  c.pod.trainer_hosts = 1
  c.pod.rollout_hosts = 2
  c.pod.trainer_resources = {"TPU": 4}
  c.pod.rollout_resources = {"TPU": 4}
  c.pod.tpu_type = "tpu-v5p-slice"
  c.pod.trainer_topology = "2x2x1"
  c.pod.rollout_topology = "2x2x1"
  # Versions travel as checkpoints (module docstring).
  c.fleet.weights_path = "checkpoint"
  c.rl.steps = 300
  # One 8192-token row a chip: what the RL step fits (module docstring).
  c.rl.batch_size = 4
  c.rl.policy_loss = "ppo_clip"
  c.rl.actor_lr = 1e-6
  c.rl.critic_lr = 5e-6
  c.rl.warmup = 10
  c.rl.eval_every = 50
  c.eval.num_tasks = 500
  c.eval.slots = 16
  c.checkpoint.every = 20
  return c
