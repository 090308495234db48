"""Defaults shared by every config; each config file overrides what it changes."""

import ml_collections

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
  # Multi-host training (sao_jax/distributed.py): one SPMD trainer over many
  # processes. Per-host values go in flags, e.g. --config.distributed.process_id=1.
  c.distributed = ml_collections.ConfigDict()
  # Join the processes (jax.distributed.initialize) before anything else.
  c.distributed.enabled = False
  # Process 0's "host:port"; "": JAX_COORDINATOR_ADDRESS or auto-detection (TPU, SLURM).
  c.distributed.coordinator_address = ""
  # 0: JAX_NUM_PROCESSES or auto-detection.
  c.distributed.num_processes = 0
  # This process's index; -1: JAX_PROCESS_ID or auto-detection.
  c.distributed.process_id = -1

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

  c.data = ml_collections.ConfigDict()
  # Training tasks are indices [0, num_train_tasks); evaluation is disjoint.
  c.data.num_train_tasks = 100_000
  # Packed row lengths; the train step compiles once per bucket.
  c.data.buckets = (64, 128, 256)
  # Compute the policy's vocabulary-wide head at action tokens only (SFT and
  # RL steps; packing.pack's action_index): with a large vocabulary the head
  # is most of a small model's step and most of an agentic row is prompt
  # and tool output. The head's width is bucketed to a multiple of L/8, so
  # up to 8 compiles of the SFT and RL steps per length bucket (in practice
  # one or two); off for the toys' 64-token vocabulary, where it saves nothing.
  c.data.logits_at_actions = False

  c.sharding = ml_collections.ConfigDict()
  # Mesh axis sizes; -1 takes the remaining devices.
  c.sharding.mesh = {"data": -1}
  c.sharding.rules = DATA_PARALLEL_RULES

  c.sft = ml_collections.ConfigDict()
  # Supervised warm start on demonstrations (the paper's SFT baseline).
  # 200 steps leave the tiny model at ~50% pass@1 on python_tool: headroom
  # for RL (300 steps reach ~90%).
  c.sft.steps = 200
  c.sft.batch_size = 32
  c.sft.lr = 3e-3
  c.sft.warmup = 20
  # A Hugging Face safetensors SFT checkpoint to start from instead of SFT.
  c.sft.init_from_hf = ""

  c.value_pretrain = ml_collections.ConfigDict()
  # Critic-only steps on trajectories of the initial policy (cold start fix).
  c.value_pretrain.steps = 50
  # How many such trajectories to generate into the trajectory store.
  c.value_pretrain.num_trajectories = 256

  c.rollout = ml_collections.ConfigDict()
  # Concurrent decode slots of the engine (continuous batching).
  c.rollout.slots = 16
  # Lay the engine's params and KV cache out on the trainer's mesh (slots
  # over the batch axes, kv heads over "tensor"); off: one device holds all.
  c.rollout.sharded_engine = False
  # Max tokens per trajectory (prompt + actions + observations).
  c.rollout.max_len = 256
  # The engine's KV cache: "dense" (every slot owns max_len positions) or
  # "paged" (a pool of fixed-size pages the slots share; admission waits for
  # free pages; sao_jax/rollout/engine.py, "Paged cache").
  # benchmarks/RESULTS.md, "Paged KV cache", has the measurement.
  c.rollout.kv_cache = "dense"
  # Positions a page holds (paged); must divide max_len.
  c.rollout.page_size = 16
  # Pages in the pool (paged); 0: the dense cache's size, slots x max_len /
  # page_size. Fewer pages, less memory: a long-tailed length mix needs
  # pages for its live tokens only. At least max_len / page_size per slot
  # group (one device of a sharded engine's batch axes).
  c.rollout.kv_pages = 0
  # Max tokens per action turn.
  c.rollout.max_turn_tokens = 24
  c.rollout.temperature = 1.0
  c.rollout.top_k = 0
  c.rollout.top_p = 1.0
  # 1 for SAO; G >= 2 for the GRPO arms.
  c.rollout.samples_per_prompt = 1
  # Decode steps per engine call (a jitted loop with per-slot stops; 1: one
  # token per call). benchmarks/RESULTS.md has the measurement.
  c.rollout.decode_steps = 1
  # In-flight slots at a weight swap: recompute, keep or drain. "keep" (the
  # caches stay; every recorded log-prob is still the exact probability its
  # token was sampled with) costs the least per swap, but with it and 8
  # decode steps the CPU main job's rollout outran training, the queue
  # filled, policy lag rose from ~2 to ~4.7 versions and that run collapsed
  # (reward 0 from step 40); recompute + 1 step recovered as before
  # (benchmarks/RESULTS.md, "The main job with the faster rollout defaults").
  c.rollout.swap_policy = "recompute"
  # Environment worker threads (sandbox processes run in parallel).
  c.rollout.env_workers = 4
  # Seconds an environment step may take before its episode ends with
  # reward 0 ("env_timeout"); the sandbox's own wall clock is shorter.
  c.rollout.env_timeout = 60.0
  # Bounded ingestion queue (backpressure on the rollout thread).
  c.rollout.queue_size = 64
  # Drop trajectories lagging the policy by more versions than this; None: off (SAO).
  c.rollout.max_staleness = None

  c.rl = ml_collections.ConfigDict()
  # async (SAO) or sync (generate the whole batch, wait, train) in one
  # process; fleet: rollout in separate processes (see c.fleet below).
  c.rl.mode = "async"
  c.rl.steps = 150
  # Trajectories per train step (packed into this many rows).
  c.rl.batch_size = 16
  # value (skip-observation GAE), token_gae, step_gae_mean, step_gae_last, group, running_mean.
  c.rl.advantage = "value"
  # dis (the paper's) or ppo_clip. Measured at tiny scale (experiments/README.md):
  # SAO with DIS collapsed in 3 of 10 runs, SAO with PPO clip in 0 of 5.
  # Variants (issue 27): dis_rollout_kl, dis_corrective, dis_seq_geo, cispo.
  c.rl.policy_loss = "dis"
  c.rl.eps_low = 0.2
  c.rl.eps_high = 0.28
  # Options of DIS's variants (sao_jax/losses.py; each ignored by the other losses).
  # dis_rollout_kl: beta of its k3 penalty on KL(rollout policy || current), per action token.
  c.rl.rollout_kl_coef = 0.1
  # dis_corrective: which out-of-window corrective tokens it keeps, "low" (A > 0
  # below the window; their weight r < 1 - eps_low is bounded) or "high" (A < 0
  # above it; r unbounded, as under PPO clip).
  c.rl.corrective_side = "low"
  # dis_seq_geo: a whole sequence is masked when its geometric mean ratio
  # exp(mean log r) leaves (1 - geo_eps_low, 1 + geo_eps_high).
  c.rl.geo_eps_low = 0.05
  c.rl.geo_eps_high = 0.05
  c.rl.gamma = 1.0
  c.rl.lam = 0.95
  # Lambda of the critic's return targets (None: rl.lam). 1.0 regresses the
  # critic on Monte Carlo returns instead of its own bootstrapped estimates.
  c.rl.critic_lam = ml_collections.config_dict.placeholder(float)
  # K critic updates per actor update.
  c.rl.critic_updates = 2
  # Freeze the critic's attention (and embeddings); train MoE/MLP and head.
  c.rl.freeze_critic_attention = True
  c.rl.actor_lr = 3e-4
  c.rl.critic_lr = 1e-3
  c.rl.warmup = 5
  c.rl.clip_norm = 1.0
  c.rl.load_balance_coef = 0.01
  # Push params to the rollout engine every this many actor updates.
  c.rl.sync_every = 1
  # Stop RL once this many tokens have been generated by the policy, counted
  # over every stage that generates (value-pretraining rollouts included,
  # evaluation not); 0: off, rl.steps alone ends the run. Equal budgets
  # across arms (experiments/) are equal numbers of generated tokens.
  c.rl.max_generated_tokens = 0
  # GRPO arms: divide the group-centred reward by the group's std (GRPO as
  # published); False: R - mean_G, in reward units like SAO's advantages.
  c.rl.group_std_normalize = True
  # Window W of the running-mean baseline arm.
  c.rl.running_mean_window = 64
  # Held-out evaluation every this many RL steps (0: only at the ends).
  c.rl.eval_every = 0
  # A non-finite loss or gradient skips that update (params unchanged); this
  # many in a row stop the run cleanly, its last checkpoint intact.
  c.rl.max_nonfinite_updates = 3
  # Times a dead rollout thread is restarted (fresh engine, current params)
  # before the run stops with the thread's error.
  c.rl.max_rollout_restarts = 3

  # rl.mode = "fleet": rollout processes (launch/rollout.py) apart from the
  # trainer, trajectories and weights through shared storage (sao_jax/fleet.py).
  c.fleet = ml_collections.ConfigDict()
  # The shared directory (local, NFS, a gcsfuse mount); "": <workdir>/fleet.
  c.fleet.root = ""
  # A rollout closes (renames) its shard after this many trajectories...
  c.fleet.shard_trajectories = 16
  # ...or when its first trajectory is this many seconds old.
  c.fleet.shard_seconds = 10.0
  # Published weight versions kept on disk (older ones are pruned).
  c.fleet.keep_versions = 3
  # Seconds between polls for new shards (trainer) and new versions (rollouts).
  c.fleet.poll_seconds = 0.5
  # A rollout with this many closed shards the trainer has not consumed
  # waits (backpressure, like rollout.queue_size in-process).
  c.fleet.max_unread_shards = 8

  c.eval = ml_collections.ConfigDict()
  # Held-out tasks for pass@1 at temperature 1.0.
  c.eval.num_tasks = 400
  c.eval.slots = 32
  c.eval.temperature = 1.0
  # Episodes sampled per held-out task; pass@1 averages them and reports its
  # standard error over tasks (more samples cut the sampling noise).
  c.eval.samples_per_task = 1

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 25
  c.checkpoint.keep = 2
  # Refuse to start with less free space than this under the workdir.
  c.checkpoint.min_free_gb = 1.0

  # Fault injection for the fault suite and soak runs (sao_jax/faults.py):
  # every n-th event fails on purpose; 0 is off, the default everywhere else.
  c.faults = ml_collections.ConfigDict()
  # Every n-th environment step raises.
  c.faults.env_error_every = 0
  # Every n-th environment step returns garbage (not a StepResult).
  c.faults.env_garbage_every = 0
  # Every n-th finished trajectory is corrupted before the ingestion queue.
  c.faults.malformed_every = 0
  # Every n-th RL batch gets a NaN reward after validation (a non-finite update).
  c.faults.nonfinite_every = 0
  # From this RL step on every batch is non-finite (0: never): the run must stop.
  c.faults.nonfinite_from_step = 0
  # The rollout thread dies after every n-th trajectory it emits.
  c.faults.rollout_crash_every = 0
  # The trainer SIGKILLs itself once this RL step is done (0: never), its
  # checkpoint save possibly still in flight: a kill at a known step.
  c.faults.sigkill_after_rl_step = 0

  # Unknown fields are errors: a config file that sets a misspelt field fails
  # when it loads, instead of running with the default.
  c.lock()
  return c
