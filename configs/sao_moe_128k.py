"""sao_moe at the paper's context: 131,072 tokens a trajectory.

    # the whole chain: the training slice's steps and one rollout host's engine
    python launch/compile.py --config=configs/sao_moe_128k.py --topology=v5p-256 \
        --rollout_topology=v5p-8

Weights reach the rollout hosts through checkpoints here
(`fleet.weights_path = "checkpoint"`), not sao_moe's direct path: with the
direct path's double buffers counted (benchmarks/RESULTS.md, "The RL step
and a version modeled") the programs fit alone, but "prefill+next" (a
version arriving during a 128K prefill) needs 96.07 of 95.74 GiB a chip
and "rl+snapshot" leaves 8.8%, so that command exited 1. The checkpoint
path holds no second copy, at the cost of policy lag (a version takes
minutes, not seconds); a smaller page pool, pulls held back during long
prefills, or one served snapshot would bring the direct path back, each
at a cost not yet measured.

The train steps keep sao_moe's tokens per chip (65,536) by splitting each
128K row over two chips: the mesh gains a `context` axis of 2 and the
"length" logical axis maps onto it, so every token-wise op (norms, MLP,
MoE, the log-prob head, the losses) works on half a row a chip. Attention
is the one op that needs the whole row: each chip of a context pair keeps
its half of the row's queries and all-gathers the row's keys and values
(small: 4 key heads) inside the splash kernel's shard_map, the kernel
built for two query shards (sao_jax/models/attention.py), so no chip
computes the other's attention; the split is contiguous, so the chip with
the later half does 3/4 of the pair's causal attention work. Batch: 64 rows of 131,072 over data x fsdp x expert = 64
chip pairs. Training slice: v5p-256 (128 chips).

Rollout runs on a slice of its own (rl.mode "fleet", as sao_moe): every
rollout host runs launch/rollout.py, one engine over the host's own 4
chips, so what must fit is one host's engine, compiled above on
`--rollout_topology=v5p-8` (one v5p host, 2x2x1); a rollout slice of N
hosts runs N of them (a v5p-64: 8 engines, 512 slots). The engine's mesh
is expert 2 x tensor 2 (`rollout.mesh`, which launch/rollout.py, evaluation
and launch/compile.py all lay the engine on: slots over "expert", 2 slot
groups of 32): with tensor 4 (the most Qwen3-30B-A3B's 4 kv heads allow)
and no expert axis the experts' width of 768 splits into 192-wide
slices, not a multiple of the TPU's 128 lanes, the compiler copied the
stacked expert weights into a padded layout (12 GiB of temporaries) and
the MoE sorted all 131,072 tokens of a prefill chunk at once (4 GiB
buffers): prefill 86.67 GiB a chip, under 10% headroom. Expert 4 would
pool pages over groups of 16 slots only. Params are 15 GiB a chip here
(data 4, replicated, would be 56.9 GiB before any cache).

At 128K the cache must be paged (a dense [256, 131072] cache per layer is
~3.3 TB): per host 64 slots share a pool of 18,432 pages of 128 positions,
2,359,296 live tokens, 0.281 of the dense 64 x 131,072: 9,216 pages a slot
group, 9 max_len trajectories (54 GiB a chip, 48 KiB a token a chip). The
simulated long-tailed mix of benchmarks/paged_kv.py (lognormal lengths,
median 8K, p99 83K, turns of 8,192 reserved ahead) peaks at 8,793 pages
for 32 slots (0.268 of their dense cache), so no trajectory of that mix
waits; admission waits for pages otherwise, it never fails. decode_steps
8: one host round trip per 8 tokens (per-slot stops end a call early;
benchmarks/RESULTS.md, "The driver: decode_steps").

The prefill compiled is the driver's widest step, [64, 131072]: the
engine pads a step's width up to its prefill buckets (rollout.
prefill_buckets, here 8 ... 256, then 4x apart up to 16,384, then max_len),
so a 2,048-token tool output pads to 4,096 and only a "recompute" weight
swap, which re-feeds whole records, or an append over 16,384 tokens runs
max_len wide; the model runs a step 2,048 tokens at a time
(model.prefill_chunk), so the width sizes the token arrays, not the
activations. Measured by the TPU compiler:
benchmarks/RESULTS.md, "The paper's context".
"""

from configs import sao_moe

CONTEXT = 131_072
RULES_128K = tuple(("length", "context") if name == "length" else (name, axes)
                   for name, axes in sao_moe.POD_RULES)


def get_config(arg=None):
  c = sao_moe.get_config(arg)
  c.sharding.mesh = {"data": -1, "fsdp": 8, "expert": 8, "context": 2, "tensor": 1}
  c.sharding.rules = RULES_128K
  c.data.buckets = (8192, 32768, CONTEXT)
  c.rollout.max_len = CONTEXT
  # Rows split 64 ways (data x fsdp x expert), each over a context pair.
  c.sft.batch_size = 64
  c.rl.batch_size = 64
  # One rollout host's engine (module docstring): 64 slots in 2 groups of
  # 32, each group's 9,216 pages holding 9 max_len trajectories, 8 tokens a
  # decode call.
  c.rollout.slots = 64
  c.rollout.page_size = 128
  c.rollout.kv_pages = 2 * 9 * CONTEXT // 128  # 18,432 pages: 2,359,296 live tokens
  c.rollout.decode_steps = 8  # rollout.mesh "expert:2,tensor:2": sao_moe's
  c.rollout.prefill_buckets = (8, 16, 32, 64, 128, 256, 1024, 4096, 16384)
  # The direct weight path's standby copy does not fit beside the 128K
  # engine's page pool (module docstring): versions travel as checkpoints.
  c.fleet.weights_path = "checkpoint"
  return c
