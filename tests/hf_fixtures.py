"""A tiny random dense Qwen3 checkpoint as a user's download looks, made offline.

    python tests/hf_fixtures.py OUT_DIR

writes what `huggingface_hub.snapshot_download("Qwen/Qwen3-0.6B")` gives,
at toy size: config.json and model.safetensors from transformers'
`Qwen3ForCausalLM.save_pretrained` (random weights, tied embeddings like
the small releases), a byte-level BPE tokenizer.json trained on the
shipped math_tool set with Qwen3's control tokens as added tokens, and a
tokenizer_config.json carrying Qwen3's chat template
(tests/fixtures/qwen3_chat_template.jinja) and eos / pad tokens. Needs the
`parity` extra (torch, transformers). notebooks/qwen3_colab.ipynb runs on
it in CI (tests/test_notebooks.py); nothing is downloaded.
"""

import gzip
import json
import os
import sys

from sao_jax.envs import math_problems

CONTROL = (
  "<|endoftext|>",
  "<|im_start|>",
  "<|im_end|>",
  "<tool_call>",
  "</tool_call>",
  "<tool_response>",
  "</tool_response>",
  "<think>",
  "</think>",
)
TEMPLATE = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "fixtures", "qwen3_chat_template.jinja"
)


def _corpus():
  """The shipped training rows' text: questions, tool code and outputs, answers."""
  with gzip.open(math_problems.SHIPPED_TRAIN, "rt", encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      yield json.dumps(row, ensure_ascii=False)


def write_tokenizer(out: str, vocab_size: int = 640) -> int:
  """tokenizer.json + tokenizer_config.json in `out`; the vocabulary's size."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(CONTROL),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(_corpus(), trainer)
  tok.save(os.path.join(out, "tokenizer.json"))
  with open(TEMPLATE, encoding="utf-8") as f:
    template = f.read()
  config = {
    "tokenizer_class": "Qwen2Tokenizer",
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "chat_template": template,
    "model_max_length": 2048,
  }
  with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  return tok.get_vocab_size(with_added_tokens=True)


def write_tiny_qwen3(out: str, seed: int = 0) -> str:
  """The tiny checkpoint and its tokenizer in `out` (created); returns `out`."""
  import torch
  import transformers

  os.makedirs(out, exist_ok=True)
  vocab = write_tokenizer(out)
  cfg = transformers.Qwen3Config(
    vocab_size=-(-vocab // 64) * 64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    eos_token_id=None,
    bos_token_id=None,
  )
  torch.manual_seed(seed)
  model = transformers.Qwen3ForCausalLM(cfg)
  model.to(torch.bfloat16).save_pretrained(out)  # the releases store bf16
  return out


def write_tiny_qwen3_5(out: str, seed: int = 0, moe: bool = True) -> str:
  """A tiny random Qwen3.5 (the hybrid: [Gated DeltaNet, gated full
  attention] x 2; with `moe` routed experts plus a shared one, else dense
  MLPs), as `Qwen3_5MoeForCausalLM` / `Qwen3_5ForCausalLM.save_pretrained`
  writes it in bf16, with the same tokenizer files; returns `out`."""
  import torch
  import transformers

  os.makedirs(out, exist_ok=True)
  vocab = write_tokenizer(out)
  shape = dict(
    vocab_size=-(-vocab // 64) * 64,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["linear_attention", "full_attention"] * 2,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
  )
  torch.manual_seed(seed)
  if moe:
    model = transformers.Qwen3_5MoeForCausalLM(
      transformers.Qwen3_5MoeTextConfig(
        **shape,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
      )
    )
  else:
    model = transformers.Qwen3_5ForCausalLM(
      transformers.Qwen3_5TextConfig(**shape, intermediate_size=128)
    )
  model.to(torch.bfloat16).save_pretrained(out)
  return out


if __name__ == "__main__":
  print(
    {"qwen3": write_tiny_qwen3, "qwen3_5": write_tiny_qwen3_5}[
      sys.argv[2] if len(sys.argv) > 2 else "qwen3"
    ](sys.argv[1])
  )
