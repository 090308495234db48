"""sao_moe at the paper's context: 131,072 tokens a trajectory (issue 28).

    python launch/compile.py --config=configs/sao_moe_128k.py --topology=v5p-256 \
        --programs=sft,value,rl

The train steps keep sao_moe's tokens per chip (65,536) by splitting each
128K row over two chips: the mesh gains a `context` axis of 2 and the
"length" logical axis maps onto it, so every token-wise op (norms, MLP,
MoE, the log-prob head, the losses) works on half a row a chip. Attention
is the one op that needs the whole row: the splash kernel runs under
shard_map with length unsplit, so XLA gathers the row's q, k and v within
each context pair (K and V are small: 4 key heads) and both chips of the
pair compute the row's attention (2x attention FLOPs; memory stays O(L)
in the kernel). Batch: 64 rows of 131,072 over data x fsdp x expert = 64
chip pairs. Measured by the TPU compiler: benchmarks/RESULTS.md, "The
paper's context". The rollout engine at this length needs the paged KV
cache (a dense [256, 131072] cache per layer is ~3.3 TB).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import sao_moe  # pylint: disable=g-import-not-at-top

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
  return c
