"""Tokenizers: a shipped character vocabulary for the tiny models, and HF files.

`CharTokenizer` is the vocabulary the bundled environments are written in
(digits, lower-case letters, a little punctuation); it needs no download.
`HFTokenizer` wraps a `tokenizer.json` (the `tokenizers` package) for real
models. Both expose the same small interface.
"""

from __future__ import annotations

import string
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

  def decode(self, ids: Sequence[int]) -> str:
    n = len(SPECIALS)
    return "".join(self.chars[i - n] if i >= n else "" for i in ids)


class HFTokenizer:
  """A Hugging Face `tokenizer.json` (needs the `tokenizers` package)."""

  def __init__(self, path: str, turn_end: str = TURN_END, bos: str | None = None,
               eos: str | None = None, pad: str | None = None):
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    self._tok = Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size()
    ids = self._tok.encode(turn_end, add_special_tokens=False).ids
    if len(ids) != 1:
      raise ValueError(f"turn_end {turn_end!r} must be a single token, got {ids}")
    self.turn_end_id = ids[0]
    lookup = lambda s, default: default if s is None else self._tok.token_to_id(s)
    self.bos_id = lookup(bos, None)
    self.eos_id = lookup(eos, None)
    self.pad_id = lookup(pad, 0)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  encode_lossy = encode

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(list(ids))
