"""SFT -> SAO on repo_repair with Qwen3's tokenizer and chat format, the tiny MoE model, on CPU.

    python launch/train.py --config=configs/repo_repair_tiny.py --workdir=workdirs/repo_repair_tiny

The paper's coding-agent chain at toy scale: the shipped generated bugs
(`sao_jax/envs/repo_tasks.py`: 149 training, 36 held-out tasks in functions
never trained on), the five tools (bash in the sandbox, view, str_replace,
create, submit), graded by the hidden tests in a fresh sandbox. SFT on the
demonstrations (view the lines, str_replace the reverse edit, submit) ->
value pretraining -> async SAO -> held-out resolve rate (pass@1).

A prompt (system, the tools block, the problem with its failing test, the
file list) is ~630-730 tokens and a demonstrated episode ~830-1020, so the
context is 1280 tokens; a turn may take 192 (a str_replace of a few lines is
up to ~150) and a tool answer 256. The paper's setting is `sao_moe`'s 300
turns in 128K tokens; 6 turns here.
"""

from configs import common


def get_config(arg=None):
  del arg
  c = common.get_config()
  c.env.name = "repo_repair"
  c.env.kwargs = {
    "max_turns": 6,
    "bash_seconds": 5.0,
    "test_seconds": 20.0,
    "max_output_chars": 1000,
  }
  c.env.tokenizer = "qwen3"
  c.env.chat_format = "qwen3"
  c.env.thinking = False
  c.env.max_tool_output_tokens = 256
  c.env.tool_calls_per_turn = 4
  c.rollout.max_len = 1280
  c.rollout.max_turn_tokens = 192
  c.data.buckets = (1024, 1280)
  c.data.logits_at_actions = True
  c.model.overrides = {"logits_chunk": 128, "prefill_chunk": 256, "max_seq_len": 1280}
  c.sft.steps = 80
  c.sft.batch_size = 8
  c.sft.lr = 3e-3
  c.value_pretrain.steps = 10
  c.value_pretrain.num_trajectories = 16
  c.rl.steps = 8
  c.rl.batch_size = 8
  c.rl.actor_lr = 1e-4
  c.eval.num_tasks = 36
  c.eval.slots = 12
  c.checkpoint.every = 20
  return c
