"""SAO on Qwen3.5-35B-A3B (34.66B total / ~3B active parameters), on a TPU pod.

    # every host of the training slice
    python launch/train.py --config=configs/sao_qwen35_moe.py --workdir=/mnt/shared/sao_qwen35 \
        --config.sft.init_from_hf=/path/to/Qwen3.5-35B-A3B-SFT \
        --config.env.kwargs='{"path": "/data/train.parquet", "heldout_path": "/data/test.parquet"}'
    # every rollout host, each with its own id (same config and overrides)
    python launch/rollout.py --config=configs/sao_qwen35_moe.py --workdir=/mnt/shared/sao_qwen35 \
        --rollout_id=r0 --config.env.kwargs='{...the same...}'

configs/sao_moe.py with the hybrid model in place of Qwen3-30B-A3B: its
pod, mesh and sharding rules, task (math_tool, up to 50 turns), context
(32,768 tokens a trajectory), fleet mode and hyperparameters hold here.
What differs:

- the model: the `qwen3_5_35b_a3b` preset (40 layers in 10 blocks of three
  Gated DeltaNet layers and one gated full attention, 256 experts top-8
  and a shared expert), scanned as 10 four-layer blocks under full remat,
  with sao_moe's pod-scale paths; a multimodal release's checkpoint loads
  its text model (`model.language_model.*`);
- Qwen3.5's tokenizer and chat template (`env.chat_format` "qwen3_5": XML
  tool calls, thinking on);
- the engine: 128 slots (twice sao_moe's) on sao_moe's `rollout.mesh`,
  paging into a pool of half their dense cache (only the full-attention
  layers keep a KV cache; each DeltaNet layer keeps a fixed-size state a
  slot);
- one 32,768-token row a chip: 128 rows for the RL step and value
  pretraining (sao_moe: 256);
- weights on the direct path (`fleet.weights_path = "direct"`), its
  served snapshots and standby copies counted in the fit.

Check it fits with

    python launch/compile.py --config=configs/sao_qwen35_moe.py --topology=v5p-256 \
        --rollout_topology=v5p-8

Why these choices, counted: docs/design/pod_configs.md; the compiler's
per-chip figures and the modeled step and version times:
benchmarks/RESULTS.md#pods-compile-and-fit. Compiled only; not run on a pod.
"""

from configs import sao_moe


def get_config(arg=None):
  c = sao_moe.get_config(arg)
  c.model.preset = "qwen3_5_35b_a3b"
  # Qwen3.5's tokenizer (offline) and chat template, thinking on.
  c.env.tokenizer = "qwen3_5"
  c.env.chat_format = "qwen3_5"
  # 128 slots on sao_moe's engine mesh (expert 2 x tensor 2), in 2 groups of
  # 64; the pool (sao_moe's reference: half the dense cache) follows.
  c.rollout.slots = 128
  # One 32,768-token row a chip (sao_moe: two), for the RL step and value
  # pretraining alike: two rows do not fit (docs/design/pod_configs.md).
  c.rl.batch_size = 128
  # The trainer serves bf16 snapshots that rollout hosts pull (module docstring).
  c.fleet.weights_path = "direct"
  return c
