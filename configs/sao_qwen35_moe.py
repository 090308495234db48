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
(32,768 tokens a trajectory), fleet mode and hyperparameters, and what its
docstring says about them holds here. What differs:

- The model: the `qwen3_5_35b_a3b` preset (the release's text_config: 40
  layers in 10 blocks of three Gated DeltaNet layers and one gated full
  attention, 256 experts top-8 of 512 and a shared expert, vocabulary
  248,320), scanned as 10 steps of a four-layer block under full remat,
  with sao_moe's pod-scale paths (splash attention, log-probs over
  1024-token chunks, expert-parallel MoE in rounds of 8192 tokens, prefill
  2048 tokens at a time). A multimodal release's checkpoint loads its text
  model (`model.language_model.*`).
- Tokenizer and chat template: Qwen3.5's (`env.tokenizer` and
  `env.chat_format` "qwen3_5": XML tool calls, thinking on), 248,077 tokens
  inside the preset's 248,320 rows.
- The engine (one per v5p host, its own mesh): sao_moe's `rollout.mesh =
  "expert:2,tensor:2"` still works with 2 kv heads, which split over
  "tensor" 2 but not 4 (`layout._kv_axes` refuses tensor:4); the DeltaNet
  layers' 16 key heads split over it too, so each chip holds a quarter of
  every slot's recurrent state. Slots over "expert" (2 groups), 256
  experts 128 a chip, each 512-wide expert 256 wide a chip (a multiple of
  the TPU's 128 lanes). Params are 17.3 GiB a chip in bf16 (expert 4
  would replicate the attention and DeltaNet weights: 19.6 GiB).
- Slots and pages, counted: only the 10 full-attention layers keep a KV
  cache, 2 kv heads of 256 in bf16: 20 KiB a token, a fifth of
  Qwen3-30B-A3B's 96 KiB. Each of the 30 DeltaNet layers keeps per slot
  a delta-rule state [32, 128, 128] fp32 (2 MiB) and a 3-position conv
  window (48 KiB): ~61 MiB a slot, whatever its length. So the engine runs 128
  slots (twice sao_moe's) paging into a pool of half their dense cache:
  16,384 pages of 128 positions, 2 slot groups of 64 with 8,192 pages =
  32 max_len trajectories each; the pool is 10 GiB a chip and the states
  1.9 GiB a chip (12 GiB together, what sao_moe's 64 slots took for KV
  alone was 24 GiB).
- One 32,768-token row a chip: 128 rows for the RL step and value
  pretraining (sao_moe: 256). At two rows a chip value pretraining alone
  needs 105 GiB a chip, so neither it nor the RL step fits; at one row the
  RL step leaves 21% of HBM beside the served snapshots. SFT ran one row a
  chip already.
- Weights reach the rollout hosts on the direct path
  (`fleet.weights_path = "direct"`, sao_moe's): the trainer serves two bf16
  snapshots (+1.5 GiB a trainer chip) and each engine holds a standby copy
  (+17.3 GiB a rollout chip) while the next version arrives; the fit below
  counts both. sao_moe_128k and sao_qwen3_8b send checkpoints because the
  copies did not fit beside them; here they do.

Check it fits with

    python launch/compile.py --config=configs/sao_qwen35_moe.py --topology=v5p-256 \
        --rollout_topology=v5p-8

Per chip of v5p (95.74 GiB), from the TPU compiler (benchmarks/RESULTS.md,
"Qwen3.5-35B-A3B on the pod", where the figures and commands are):
SFT 58.08 GiB (39% to spare), the RL step 73.92 GiB and with two served
snapshots 75.43 (21%); the engine's prefill [128, 32768] 44.06 GiB and
with the standby version 61.36 (36%), decode 30.77, the decode loop 31.21
(48.5 with the standby version, 49%).
Modeled, not measured (the same section): an RL step of 128 x 32,768
tokens is ~17 s at an assumed 40% MFU, counted by layer kind; a version
(69 GB of bf16) reaches a rollout host in 2.8 s at DCN line rate and 19 s
at the TCP rates peers report: a policy lag of 0.16 to 1.1 steps.
Compiled only; not run on a pod.
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
  # pretraining alike: two rows do not fit (module docstring).
  c.rl.batch_size = 128
  # The trainer serves bf16 snapshots that rollout hosts pull (module docstring).
  c.fleet.weights_path = "direct"
  return c
