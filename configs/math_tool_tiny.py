"""SAO on math_tool with Qwen3's tokenizer and chat format, the tiny MoE model, on CPU.

    python launch/train.py --config=configs/math_tool_tiny.py --workdir=workdirs/math_tool_tiny

The paper's task shape at toy scale: math word problems with a `python`
tool (the shipped generated set, `sao_jax/envs/math_problems.py`), Qwen3's
151,669-token vocabulary, the qwen3 chat template with thinking on, tool
calls parsed from the sampled ids and run in the sandbox, answers checked
by the math verifier. SFT on the shipped tool-using transcripts -> value
pretraining -> async SAO -> held-out pass@1 on 200 of the 400 held-out rows.

The vocabulary dominates the tiny model's cost (its embedding and output
layers are 19.4M of its parameters; every logit row is 151,669 wide), so
batches and step counts are smaller than sao_tiny.py's, and the head runs
at action tokens only (`data.logits_at_actions`). The whole chain runs, but
after its SFT the tiny model solves too few held-out problems for RL to
find a reward (a run's cost and result:
benchmarks/RESULTS.md#learning-on-cpu).
configs/math_tool_cpu.py (`make train-math`) is the variant that learns:
the head over the task's ids and a curriculum of the shipped set.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.env.name = "math_tool"
  # Short episodes for the tiny model: a tool call or two, then the answer.
  c.env.kwargs = {"max_turns": 4}
  c.env.tokenizer = "qwen3"
  c.env.chat_format = "qwen3"
  c.env.thinking = True
  c.env.max_tool_output_tokens = 64
  # Prompts (system, the tools block, the question) are ~220-245 tokens,
  # a solved episode ~300-390.
  c.rollout.max_len = 512
  c.rollout.max_turn_tokens = 64
  c.data.buckets = (384, 512)
  # The head over 151,669 tokens at action tokens only (a quarter of a row).
  c.data.logits_at_actions = True
  # The logits over 151,669 tokens are chunked in training, and a prompt's
  # prefill meets the head at its last token only (as on the pod).
  c.model.overrides = {"logits_chunk": 128, "prefill_chunk": 256}
  c.sft.steps = 150
  c.sft.batch_size = 16
  c.sft.lr = 3e-3
  c.value_pretrain.steps = 20
  c.value_pretrain.num_trajectories = 64
  c.rl.steps = 60
  c.rl.batch_size = 16
  c.rl.actor_lr = 1e-4
  c.eval.num_tasks = 200
  c.eval.slots = 32
  c.checkpoint.every = 20
  return c
