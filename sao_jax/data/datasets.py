"""datasets: read a user's task rows (verl's format), keeping the bad ones apart.

A row, one JSON object per line of a `.jsonl` / `.jsonl.gz` file or one row
of a `.parquet` file:

    {"prompt": [{"role": "user", "content": "What is 2+3?"}],   # or a string
     "reward_model": {"ground_truth": "5"},                      # or "answer": "5"
     "data_source": "toy", "extra_info": {...},                  # optional
     "tools": [{"type": "function", "function": {...}}],         # optional
     "completion": "... \\boxed{5}"}                              # optional demonstration

`load_rows` returns the valid rows and, apart, every rejected one as
`(where, reason)`: `where` is "file:line" (1-based, as an editor counts) or
"file:row N" (parquet, 0-based, as pyarrow indexes); `reason` is a short,
stable sentence naming the field ("message N" counts a list from 0). A dataset of thousands of rows usually
has a few broken ones, and one bad line should neither stop a run nor
disappear silently: the caller reports them before training starts.
`strict=True` raises on the first instead. A file that cannot be read, or
holds no valid row, is a `DatasetError` either way.

Rows are read line by line with a size cap (`max_row_bytes`): a runaway
line is rejected without being held in memory, and a line that is not UTF-8
is rejected alone, the rest still read. Parquet needs pyarrow (imported
only for parquet files); its nested columns arrive as Python objects, and
since parquet unifies the struct type of a column across rows, message
keys that are None (a field another row has) are dropped; `extra_info`, the
user's own data, is kept as read. A ground truth read as a whole float
(parquet's double column: 5.0) becomes the integer text "5".

A completion (top level, or `extra_info.completion`) is a string (one
assistant message) or a list of assistant / tool messages starting with an
assistant one. Assistant `tool_calls` are normalised to
`{"name", "arguments": dict}` (OpenAI's `{"type": "function", "function":
{"name", "arguments": "<json>"}}` is accepted).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import zlib
from typing import Any, Callable, Iterator

import numpy as np

MAX_ROW_BYTES = 1 << 20

PROMPT_ROLES = ("system", "user", "assistant")


class DatasetError(ValueError):
  """The file cannot be used: unreadable, no valid row, or a bad row in strict mode."""


@dataclasses.dataclass(frozen=True)
class Row:
  messages: tuple[dict, ...]
  ground_truth: str
  data_source: str
  extra_info: dict
  tools: tuple[dict, ...]
  # A demonstration: assistant / tool messages, () if the row has none.
  completion: tuple[dict, ...]
  where: str


class BadRow(Exception):
  """A row's rejection reason (raised by a row parser; see `read_rows`)."""


_Bad = BadRow


# --- validation ------------------------------------------------------------------


def _message(m: Any, label: str, roles: tuple[str, ...]) -> dict:
  if not isinstance(m, dict):
    raise _Bad(f"{label}: must be an object")
  m = {k: v for k, v in m.items() if v is not None}
  if m.get("role") not in roles:
    raise _Bad(f"{label}: role must be one of {'/'.join(roles)}")
  if not isinstance(m.get("content", None), str):
    raise _Bad(f"{label}: content must be a string")
  return m


def _messages(prompt: Any) -> tuple[dict, ...]:
  if prompt is None:
    raise _Bad("prompt missing")
  if isinstance(prompt, str):
    prompt = [{"role": "user", "content": prompt}]
  if not isinstance(prompt, (list, tuple)):
    raise _Bad("prompt must be a string or a list of messages")
  if not prompt:
    raise _Bad("prompt is empty")
  messages = tuple(_message(m, f"message {i}", PROMPT_ROLES) for i, m in enumerate(prompt))
  if not any(m["content"].strip() for m in messages):
    raise _Bad("prompt has no text")
  if messages[-1]["role"] == "assistant":
    raise _Bad("prompt ends with an assistant message (that turn is the policy's to write)")
  return messages


def _ground_truth(row: dict) -> str:
  reward_model = row.get("reward_model")
  if reward_model is not None and not isinstance(reward_model, dict):
    raise _Bad("reward_model must be an object")
  gt = (reward_model or {}).get("ground_truth")
  if gt is None:
    gt = row.get("answer")
  if gt is None:
    raise _Bad("no ground truth (reward_model.ground_truth or answer)")
  if isinstance(gt, bool) or not isinstance(gt, (str, int, float)):
    raise _Bad("ground truth must be a string or a number")
  if isinstance(gt, float):
    if not math.isfinite(gt):
      raise _Bad("ground truth must be a finite number")
    if gt.is_integer():  # parquet's double column: 5.0 is the integer 5
      gt = int(gt)
  gt = str(gt).strip()
  if not gt:
    raise _Bad("ground truth is empty")
  return gt


def _json_field(value: Any, field: str) -> Any:
  # Parquet stores heterogeneous nested data (tool schemas) as JSON strings.
  if isinstance(value, str):
    try:
      return json.loads(value)
    except ValueError as e:
      raise _Bad(f"{field}: bad JSON: {e}") from e
  return value


def _tools(value: Any) -> tuple[dict, ...]:
  if value is None:
    return ()
  value = _json_field(value, "tools")
  bad = _Bad("tools must be a list of function schemas")
  if not isinstance(value, (list, tuple)):
    raise bad
  for t in value:
    fn = t.get("function", t) if isinstance(t, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
      raise bad
  return tuple(value)


def _tool_call(call: Any) -> dict:
  if not isinstance(call, dict):
    raise ValueError
  fn = call.get("function", call)
  if not isinstance(fn, dict):
    raise ValueError
  name, arguments = fn.get("name"), fn.get("arguments", {})
  if isinstance(arguments, str):
    arguments = json.loads(arguments)
  if not isinstance(name, str) or not name or not isinstance(arguments, dict):
    raise ValueError
  return {"name": name, "arguments": arguments}


def _completion(value: Any) -> tuple[dict, ...]:
  if value is None:
    return ()
  if isinstance(value, str):
    return ({"role": "assistant", "content": value},)
  if not isinstance(value, (list, tuple)):
    raise _Bad("completion must be a string or a list of messages")
  out = []
  for i, m in enumerate(value):
    label = f"completion message {i}"
    if isinstance(m, dict) and m.get("role") == "assistant" and m.get("content") is None:
      m = {**m, "content": ""}  # OpenAI: a turn of tool calls only
    m = _message(m, label, ("assistant", "tool"))
    if "tool_calls" in m:
      if m["role"] != "assistant" or not isinstance(m["tool_calls"], (list, tuple)):
        raise _Bad(f"{label}: tool_calls must be a list of {{name, arguments}}")
      try:
        m["tool_calls"] = [_tool_call(c) for c in m["tool_calls"]]
      except ValueError:
        raise _Bad(f"{label}: tool_calls must be a list of {{name, arguments}}") from None
    if not isinstance(m.get("reasoning_content", ""), str):
      raise _Bad(f"{label}: reasoning_content must be a string")
    out.append(m)
  if out and out[0]["role"] != "assistant":
    raise _Bad("completion must start with an assistant message")
  return tuple(out)


def parse_row(row: Any, where: str) -> Row:
  """A validated `Row`, or `_Bad` with the reason."""
  if not isinstance(row, dict):
    raise _Bad("not a JSON object")
  messages = _messages(row.get("prompt"))
  ground_truth = _ground_truth(row)
  data_source = row.get("data_source")
  if data_source is None:
    data_source = ""
  if not isinstance(data_source, str):
    raise _Bad("data_source must be a string")
  extra_info = row.get("extra_info")
  if extra_info is None:
    extra_info = {}
  if not isinstance(extra_info, dict):
    raise _Bad("extra_info must be an object")
  tools = _tools(row.get("tools"))
  completion = row.get("completion")
  if completion is None:
    completion = extra_info.get("completion")
  return Row(messages, ground_truth, data_source, extra_info, tools, _completion(completion), where)


# --- readers ---------------------------------------------------------------------


def _lines(f, max_row_bytes: int) -> Iterator[tuple[int, bytes | None, int]]:
  """(1-based line number, the line without its end or None if over the cap, size).

  `size` counts the line's bytes without its end; only `limit` bytes of a
  long line are ever held.
  """
  limit = max_row_bytes + 3  # the cap, "\r\n", and one byte to see it overflow
  number = 0
  while True:
    line = f.readline(limit)
    if not line:
      return
    number += 1
    if len(line) == limit and not line.endswith(b"\n"):
      size = len(line)
      while line and not line.endswith(b"\n"):  # skip the rest, a chunk at a time
        line = f.readline(1 << 20)
        size += len(line.rstrip(b"\r\n"))
      yield number, None, size
      continue
    content = line.rstrip(b"\r\n")
    yield number, (content if len(content) <= max_row_bytes else None), len(content)


def _jsonl_rows(path: str, opener, max_row_bytes: int) -> Iterator[tuple[str, Any]]:
  with opener(path, "rb") as f:
    for number, line, size in _lines(f, max_row_bytes):
      where = f"{path}:{number}"
      if line is None:
        yield where, _Bad(f"row is over max_row_bytes ({size} > {max_row_bytes} bytes)")
        continue
      if number == 1 and line.startswith(b"\xef\xbb\xbf"):
        line = line[3:]  # a UTF-8 byte order mark
      try:
        text = line.decode("utf-8")
      except UnicodeDecodeError as e:
        yield where, _Bad(f"not UTF-8 (byte {e.start})")
        continue
      if not text.strip():
        continue
      try:
        yield where, json.loads(text)
      except RecursionError:
        yield where, _Bad("bad JSON: nested too deeply")
      except ValueError as e:  # JSONDecodeError, or an integer over Python's digit limit
        detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else e
        yield where, _Bad(f"bad JSON: {detail}")


def _parquet_rows(path: str) -> Iterator[tuple[str, Any]]:
  try:
    import pyarrow.parquet as pq
  except ImportError as e:
    raise DatasetError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
  try:
    parquet = pq.ParquetFile(path)
  except Exception as e:  # pyarrow's own error types
    raise DatasetError(f"{path}: not a readable parquet file: {e}") from e
  index = 0
  try:
    for batch in parquet.iter_batches(batch_size=1024):
      for row in batch.to_pylist():
        yield f"{path}:row {index}", row
        index += 1
  except Exception as e:
    raise DatasetError(f"{path}: cannot read row {index}: {e}") from e


def _rows(path: str, max_row_bytes: int) -> Iterator[tuple[str, Any]]:
  name = path.lower()
  if name.endswith(".jsonl"):
    return _jsonl_rows(path, open, max_row_bytes)
  if name.endswith(".jsonl.gz"):
    return _jsonl_rows(path, gzip.open, max_row_bytes)
  if name.endswith(".parquet"):
    return _parquet_rows(path)
  raise DatasetError(f"{path}: unknown file type; use .jsonl, .jsonl.gz or .parquet")


def prompt_key(row: Row) -> tuple:
  """What makes two prompts the same: each message's role and its text with
  whitespace runs made one space and the ends stripped."""
  return tuple((m["role"], " ".join(m["content"].split())) for m in row.messages)


def _truth_key(ground_truth: str) -> str:
  return " ".join(ground_truth.split())


def dedupe_rows(
  rows: list[Row], keep_repeats: bool = False
) -> tuple[list[Row], list[tuple[str, str]], list[tuple[str, str]]]:
  """(rows kept, [(where, reason)] of the dropped ones, [(where, reason)] of
  repeats kept).

  A repeat of a prompt (`prompt_key`) with the same ground truth is dropped,
  the first kept (with `keep_repeats`: kept, and listed). A prompt that
  comes with different ground truths is dropped in every row, always:
  which one is right cannot be told, and training on either would reward a
  wrong answer half of the time.
  """
  first: dict[tuple, Row] = {}
  truths: dict[tuple, set] = {}
  for r in rows:
    key = prompt_key(r)
    first.setdefault(key, r)
    truths.setdefault(key, set()).add(_truth_key(r.ground_truth))
  kept, dropped, repeats = [], [], []
  for r in rows:
    key = prompt_key(r)
    head = first[key]
    if len(truths[key]) > 1:
      others = sorted(truths[key] - {_truth_key(r.ground_truth)})
      dropped.append(
        (
          r.where,
          f"conflicting ground truth: {r.ground_truth[:40]!r} here, "
          f"{others[0][:40]!r} for the same prompt elsewhere"
          + (f" (first at {head.where})" if head is not r else ""),
        )
      )
    elif head is not r:
      (repeats if keep_repeats else dropped).append((r.where, f"duplicate prompt of {head.where}"))
      if keep_repeats:
        kept.append(r)
    else:
      kept.append(r)
  return kept, dropped, repeats


def without_heldout(
  train: list[Row], heldout: list[Row]
) -> tuple[list[Row], list[tuple[str, str]]]:
  """(training rows whose prompt is not held out, [(where, reason)] of the others):
  a held-out prompt seen in training would measure memory, not skill."""
  held = {}
  for r in heldout:
    held.setdefault(prompt_key(r), r.where)
  kept, dropped = [], []
  for r in train:
    where = held.get(prompt_key(r))
    if where is None:
      kept.append(r)
    else:
      dropped.append((r.where, f"prompt also held out at {where}"))
  return kept, dropped


# The reasons `dedupe_rows` and `without_heldout` give, by their first words
# (`hygiene_counts`).
HYGIENE_REASONS = {
  "duplicate prompt": "duplicate",
  "conflicting ground truth": "conflicting",
  "prompt also held out": "in_heldout",
  "prompt has no text": "empty_prompt",
  "prompt is empty": "empty_prompt",
  "prompt ends with an assistant": "assistant_final",
}


def hygiene_counts(rejected: list[tuple[str, str]]) -> dict[str, int]:
  """Rejections by kind: the hygiene kinds of `HYGIENE_REASONS`, the rest "other"."""
  counts = dict.fromkeys(dict.fromkeys(HYGIENE_REASONS.values()), 0)
  counts["other"] = 0
  for _, reason in rejected:
    kind = next((k for prefix, k in HYGIENE_REASONS.items() if reason.startswith(prefix)), "other")
    counts[kind] += 1
  return counts


def read_rows(
  path: str | os.PathLike,
  parse: Callable[[Any, str], Any],
  *,
  strict: bool = False,
  max_row_bytes: int = MAX_ROW_BYTES,
  allow_empty: bool = False,
) -> tuple[list, list[tuple[str, str]]]:
  """(parsed rows, [(where, reason)] of the rejected ones) of any row schema.

  The reader of `load_rows` (line cap, UTF-8, JSON, parquet) with the row
  check `parse(value, where)`, which returns a row or raises `BadRow` with
  the reason. `strict` raises DatasetError on the first bad row; a file that
  cannot be read, or (unless `allow_empty`) holds no valid row, is a
  DatasetError either way.
  """
  path = os.fspath(path)
  rows: list = []
  rejected: list[tuple[str, str]] = []
  try:
    for where, value in _rows(path, max_row_bytes):
      try:
        if isinstance(value, BadRow):
          raise value
        rows.append(parse(value, where))
      except BadRow as e:
        if strict:
          raise DatasetError(f"{where}: {e}") from None
        rejected.append((where, str(e)))
  except (OSError, EOFError, zlib.error) as e:  # gzip's errors included
    raise DatasetError(f"{path}: cannot read: {e}") from e
  if not rows and not allow_empty:
    first = f"; first: {rejected[0][0]}: {rejected[0][1]}" if rejected else ""
    raise DatasetError(f"{path}: no valid rows ({len(rejected)} rejected{first})")
  return rows, rejected


def load_rows(
  path: str | os.PathLike,
  *,
  strict: bool = False,
  max_row_bytes: int = MAX_ROW_BYTES,
  keep_repeats: bool = False,
  repeats: list | None = None,
) -> tuple[list[Row], list[tuple[str, str]]]:
  """(valid rows, [(where, reason)] of the rejected ones); see the module docstring.

  Repeated prompts are dropped as `dedupe_rows` says (with `strict`, the
  first is a DatasetError); `keep_repeats` keeps same-truth repeats (their
  rows are then in `repeats`, a list the caller passes in, to report).
  """
  path = os.fspath(path)
  rows, rejected = read_rows(
    path, parse_row, strict=strict, max_row_bytes=max_row_bytes, allow_empty=True
  )
  rows, dropped, kept_repeats = dedupe_rows(rows, keep_repeats)
  if dropped and strict:
    raise DatasetError(f"{dropped[0][0]}: {dropped[0][1]}")
  rejected += dropped
  if repeats is not None:
    repeats += kept_repeats
  if not rows:
    first = f"; first: {rejected[0][0]}: {rejected[0][1]}" if rejected else ""
    raise DatasetError(f"{path}: no valid rows ({len(rejected)} rejected{first})")
  return rows, rejected


def split_rows(rows: list[Row], heldout_fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
  """(train, heldout): a seeded `heldout_fraction` of the rows held out.

  Rows with the same prompt (`prompt_key`) go to the same side: the
  fraction is of distinct prompts. Deterministic in (the prompts' grouping,
  heldout_fraction, seed); each side keeps file order. With 0 < fraction <
  1 and at least two distinct prompts, each side gets one.
  """
  if not 0.0 <= heldout_fraction <= 1.0:
    raise ValueError(f"heldout_fraction = {heldout_fraction}: must be in [0, 1]")
  group: dict[tuple, int] = {}
  of_row = [group.setdefault(prompt_key(r), len(group)) for r in rows]
  n = len(group)
  k = int(round(n * heldout_fraction))
  if 0.0 < heldout_fraction < 1.0 and n >= 2:
    k = min(max(k, 1), n - 1)
  held = set(np.random.default_rng(seed).permutation(n)[:k].tolist())
  train = [r for r, g in zip(rows, of_row) if g not in held]
  heldout = [r for r, g in zip(rows, of_row) if g in held]
  return train, heldout


def rows_dataset(rows: list[Row]):
  """The rows as a `grain.MapDataset` (index, shuffle, batch as grain does)."""
  import grain

  return grain.MapDataset.source(rows)
