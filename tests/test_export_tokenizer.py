"""The tokenizer files an export writes, read by transformers' AutoTokenizer.

Oracle: sao-jax's own tokenizer and chat formats. A Hugging Face tokenizer
matches added-token text inside a string (that is how `apply_chat_template`'s
rendered string reaches the model), so the reference for `encode(text)` is
sao-jax's tokenizer on the pieces between added tokens, with each added token
by id. The chat template must give `chat.render`'s ids exactly, for a
multi-turn conversation with tools, reasoning and non-ASCII text, thinking on
and off. Qwen3 runs by default; Qwen3.5 (a 248k vocabulary, slower to build)
and a large random-text comparison are slow tests.
"""

from __future__ import annotations

import json
import os
import random
import re
import types

import pytest
from test_chat import PYTHON, WEATHER

from sao_jax.envs import chat, hf_tokenizer_export
from sao_jax.envs import tokenizer as tokenizer_lib

transformers = pytest.importorskip("transformers")

MIXED = (
  "The answer is 42.\nLe café coûte 3,50 € — naïve façade. 你好，世界！这是中文。"
  "こんにちは 한국어 Привет мир. ٱلْعَرَبِيَّة 🙂👍🏽🇫🇷 e\u0301\n"
  "def f(x: int) -> int:\n    return x ** 2  # ok\n\n\tif x != 0: print(f'{x:>8}')\n"
  "  ======  ------  ********  \r\n\r\n    \n"
  '<|im_start|>user\nhi<|im_end|>\n<tool_call>{"a": 1}</tool_call><think>x</think>'
  "<|endoftext|>< |im_end| > <tool_call"
)

CONVERSATION = [
  {"role": "system", "content": "You are a careful assistant."},
  {"role": "user", "content": "What is 14 plus 5 times 3? 谢谢"},
  {
    "role": "assistant",
    "content": "I will compute it.",
    "reasoning_content": "Use python.",
    "tool_calls": [
      {"type": "function", "function": {"name": "python", "arguments": {"code": "print(14+5*3)"}}}
    ],
  },
  {"role": "tool", "content": "29"},
  {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}],
  },
  {"role": "tool", "content": "sunny, 21°C"},
  {"role": "assistant", "content": "It is 29, and sunny.", "reasoning_content": "Done."},
  {"role": "user", "content": "Thanks!  "},
]


def hf_reference(tok, text: str) -> list[int]:
  """`text` as a HF tokenizer encodes it: added tokens matched, the rest sao-jax's."""
  pattern = "(" + "|".join(map(re.escape, tok.added_tokens)) + ")"
  ids = []
  for k, piece in enumerate(re.split(pattern, text)):
    if k % 2:
      ids.append(tok.special_id(piece))
    elif piece:
      ids += tok.encode(piece)
  return ids


def export_dir(path, name: str, thinking: bool = True):
  """The tokenizer files of a `name` run (qwen3 / qwen3_5 tokenizer and format) in `path`."""
  env = types.SimpleNamespace(
    tokenizer=name, tokenizer_path="", chat_format=name, thinking=thinking
  )
  tok = tokenizer_lib.TOKENIZERS[name]()
  fmt = chat.make_format(name, tok, enable_thinking=thinking)
  files = hf_tokenizer_export.tokenizer_files(
    env, tok, fmt.turn_end_id, sampling={"temperature": 0.7}
  )
  for file, data in files.items():
    (path / file).write_bytes(data)
  return tok, transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
  path = tmp_path_factory.mktemp("qwen3_export")
  tok, hf = export_dir(path, "qwen3")
  return path, tok, hf


def _template_ids(hf, messages, tools, generation_prompt, **kw):
  out = hf.apply_chat_template(
    messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True, **kw
  )
  return list(out["input_ids"] if hasattr(out, "keys") else out)


def check_same_as_sao_jax(name, tok, hf):
  """Encode, decode and the chat template against sao-jax's tokenizer and format."""
  assert len(hf) == tok.vocab_size
  assert hf.encode(MIXED, add_special_tokens=False) == hf_reference(tok, MIXED)
  plain = MIXED.split("<|im_start|>")[0]
  assert hf.encode(plain, add_special_tokens=False) == tok.encode(plain)
  assert (
    hf.decode(tok.encode(plain))
    == tok.decode(tok.encode(plain))
    == plain.replace("e\u0301", "\u00e9")
  )  # NFC, as both normalise
  for thinking in (True, False):
    fmt = chat.make_format(name, tok, enable_thinking=thinking)
    for generation_prompt in (True, False):
      for messages in (CONVERSATION, CONVERSATION[1:2]):
        ours = fmt.render(messages, (PYTHON, WEATHER), generation_prompt)
        theirs = _template_ids(
          hf, messages, [PYTHON, WEATHER], generation_prompt, enable_thinking=thinking
        )
        assert theirs == ours, (thinking, generation_prompt, len(messages))


def test_qwen3_export_tokenizer_and_template_are_sao_jaxs(qwen3):
  _, tok, hf = qwen3
  check_same_as_sao_jax("qwen3", tok, hf)


def test_qwen3_special_ids_and_generation_config(qwen3):
  path, tok, hf = qwen3
  assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
  assert hf.bos_token is None
  generation = json.loads((path / "generation_config.json").read_text())
  assert generation["eos_token_id"] == [151645, 151643]  # the turn end, then eos
  assert generation["pad_token_id"] == 151643 and generation["temperature"] == 0.7
  # <think> / <tool_call> survive a decode that skips special tokens (vLLM's
  # default), so reasoning and tool-call parsers see them; <|im_end|> does not.
  ids = [
    tok.special_id("<think>"),
    9707,
    tok.special_id("</think>"),
    tok.special_id("<tool_call>"),
    tok.special_id("<|im_end|>"),
  ]
  assert hf.decode(ids, skip_special_tokens=True) == "<think>Hello</think><tool_call>"


def test_a_run_with_thinking_off_defaults_the_template_to_it(tmp_path):
  """The published template thinks by default; a run trained without thinking exports
  a template whose default is the run's."""
  env = types.SimpleNamespace(
    tokenizer="qwen3", tokenizer_path="", chat_format="qwen3", thinking=False
  )
  template = hf_tokenizer_export.chat_template("qwen3", thinking=False)
  assert template.startswith(hf_tokenizer_export.THINKING_OFF)
  assert (
    hf_tokenizer_export.chat_template("qwen3") == template[len(hf_tokenizer_export.THINKING_OFF) :]
  )
  assert hf_tokenizer_export.chat_template("raw") is None
  config = hf_tokenizer_export.qwen_tokenizer_config(tokenizer_lib.QWEN3, template, 4096)
  assert config["chat_template"] == template and config["model_max_length"] == 4096
  # Rendered with the template alone (as transformers does, no enable_thinking given).
  import jinja2.sandbox

  jenv = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  jenv.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
  text = jenv.from_string(template).render(
    messages=CONVERSATION[1:2], tools=None, add_generation_prompt=True
  )
  assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  del env


def test_a_users_tokenizer_is_copied_and_given_a_config(tmp_path):
  """env.tokenizer_path: the file and its HF siblings copied as they are; without a
  tokenizer_config.json beside it, one is written with the run's special tokens."""
  from tokenizers import Tokenizer, models, pre_tokenizers

  src = tmp_path / "mine"
  src.mkdir()
  tok_json = Tokenizer(
    models.WordLevel({"<pad>": 0, "<eos>": 1, "a": 2, "b": 3}, unk_token="<pad>")
  )
  tok_json.pre_tokenizer = pre_tokenizers.Whitespace()
  tok_json.add_special_tokens(["<pad>", "<eos>"])
  tok_json.save(str(src / "tokenizer.json"))
  (src / "special_tokens_map.json").write_text('{"eos_token": "<eos>"}')
  tok = tokenizer_lib.HFTokenizer(str(src / "tokenizer.json"), eos="<eos>", pad="<pad>")
  env = types.SimpleNamespace(
    tokenizer="char", tokenizer_path=str(src / "tokenizer.json"), chat_format="plain", thinking=True
  )
  files = hf_tokenizer_export.tokenizer_files(env, tok, tok.eos_id)
  assert files["tokenizer.json"] == str(src / "tokenizer.json")
  assert files["special_tokens_map.json"] == str(src / "special_tokens_map.json")
  config = json.loads(files["tokenizer_config.json"])
  assert config["eos_token"] == "<eos>" and config["pad_token"] == "<pad>"
  assert "chat_template" not in config  # plain text has no template
  assert json.loads(files["generation_config.json"])["eos_token_id"] == 1
  char = types.SimpleNamespace(
    tokenizer="char", tokenizer_path="", chat_format="raw", thinking=True
  )
  assert not hf_tokenizer_export.tokenizer_files(char, tokenizer_lib.CharTokenizer(), 3)


@pytest.mark.slow
def test_qwen3_5_export_tokenizer_and_template_are_sao_jaxs(tmp_path):
  tok, hf = export_dir(tmp_path, "qwen3_5")
  check_same_as_sao_jax("qwen3_5", tok, hf)
  assert hf.encode("e\u0301\u0301x", add_special_tokens=False) == tok.encode("e\u0301\u0301x")


@pytest.mark.slow
def test_qwen3_export_encodes_random_text_as_sao_jax(qwen3):
  """Thousands of random strings over scripts, symbols and runs of one character:
  the BPE built from the ranks encodes each exactly as tiktoken does."""
  _, tok, hf = qwen3
  rng = random.Random(0)
  pool = (
    list("abcxyzABC 019\n\t.,:;!?'\"()[]{}<>-=+*/\\_#@$%^&|~`")
    + list("你好世界中文日本語のテ한국어éèçüößñ€😀🎉👍🏽")
    + ["\u0301", "\u200b", "\r\n", "    "]
  )
  texts = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 120))) for _ in range(3000)]
  texts += [c * n for c in " -=*#\n\t0a你🙂" for n in range(1, 70)]
  texts += [(a + b) * n for a in " -=a" for b in " -=b" for n in range(1, 30)]
  clean = [t.replace("<", "(") for t in texts]  # no added-token text: plain BPE
  got = [e.ids for e in hf.backend_tokenizer.encode_batch(clean, add_special_tokens=False)]
  assert [i for i, (t, g) in enumerate(zip(clean, got)) if g != tok.encode(t)] == []


def test_the_shipped_templates_are_the_published_ones():
  """chat_templates/ ships tests/fixtures' published templates unchanged (their render is
  checked against sao-jax's formats in tests/envs/test_chat*.py)."""
  fixtures = os.path.join(os.path.dirname(__file__), "fixtures")
  for name in ("qwen3", "qwen3_5"):
    with open(os.path.join(fixtures, f"{name}_chat_template.jinja"), encoding="utf-8") as f:
      assert hf_tokenizer_export.chat_template(name) == f.read()
