"""sao_moe at the paper's context: 131,072 tokens a trajectory.

    # the whole chain: the training slice's steps and one rollout host's engine
    python launch/compile.py --config=configs/sao_moe_128k.py --topology=v5p-256 \
        --rollout_topology=v5p-8

configs/sao_moe.py (Qwen3-30B-A3B, fleet mode, v5p-256 training slice,
rollout hosts of one v5p-8 each) with what a 128K row needs:

- context parallelism: the mesh gains a `context` axis of 2 and the
  "length" logical axis maps onto it (RULES_128K), so each row spans a chip
  pair and the train steps keep sao_moe's tokens per chip; 64 rows of
  131,072 tokens over data x fsdp x expert;
- a paged engine cache, required at this length: per host 64 slots in 2
  groups of 32 share 18,432 pages of 128 positions (9 max_len trajectories
  a group); admission waits for pages, it never fails;
- `decode_steps` 8 and prefill buckets up to 16,384 (wider appends run
  max_len wide);
- weights through checkpoints (`fleet.weights_path = "checkpoint"`): the
  direct path's standby copy does not fit beside the 128K page pool.

How the attention splits over the context pair, why the engine's mesh is
expert 2 x tensor 2, and how the page pool is sized:
docs/design/pod_configs.md. The compiler's figures:
benchmarks/RESULTS.md#pods-compile-and-fit.
"""

from configs import sao_moe

CONTEXT = 131_072
RULES_128K = tuple(
  ("length", "context") if name == "length" else (name, axes) for name, axes in sao_moe.POD_RULES
)


def get_config(arg=None):
  c = sao_moe.get_config(arg)
  c.sharding.mesh = {"data": -1, "fsdp": 8, "expert": 8, "context": 2, "tensor": 1}
  c.sharding.rules = RULES_128K
  c.data.buckets = (8192, 32768, CONTEXT)
  c.rollout.max_len = CONTEXT
  # Rows split 64 ways (data x fsdp x expert), each over a context pair.
  c.sft.batch_size = 64
  c.rl.batch_size = 64
  # One rollout host's engine (docs/design/pod_configs.md): 64 slots in 2 groups of
  # 32, each group's 9,216 pages holding 9 max_len trajectories, 8 tokens a
  # decode call.
  c.rollout.slots = 64
  c.rollout.page_size = 128
  c.rollout.kv_pages = 2 * 9 * CONTEXT // 128  # 18,432 pages: 2,359,296 live tokens
  c.rollout.decode_steps = 8  # rollout.mesh "expert:2,tensor:2": sao_moe's
  c.rollout.prefill_buckets = (8, 16, 32, 64, 128, 256, 1024, 4096, 16384)
  # The direct weight path's standby copy does not fit beside the 128K
  # engine's page pool (docs/design/pod_configs.md): versions travel as checkpoints.
  c.fleet.weights_path = "checkpoint"
  return c
