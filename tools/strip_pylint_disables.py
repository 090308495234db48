"""Turns the tree's `# pylint: disable=...` comments into ruff's `# noqa`.

ruff (ruff.toml) is the project's linter; it does not read pylint's
comments. For each one this script:

  * removes it, keeping any reason written after it as a plain comment;
  * maps each pylint name to the ruff codes that flag the same thing
    (PYLINT_TO_RUFF below) and, where ruff with the project's config flags
    one of them on the comment's line (its scope for an own-line
    `disable=`, the next line for `disable-next=`), writes `# noqa: CODE`
    on the line ruff reports, before the reason.

A pylint name ruff has no rule for, or whose rule the config does not
select, or that ruff does not flag there, is dropped. A trailing
`# noqa: CODE` already there is treated the same way, so that it stays on
the line ruff reports once the formatter has split or joined its statement.
The files are formatted first (`ruff format`), so that each comment sits
where it will stay. Running it again changes nothing.

Usage: python tools/strip_pylint_disables.py [PATH ...]
(default: every Python file git tracks, run from the repository root).
"""

import collections
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tokenize

PYLINT_TO_RUFF = {
  "g-import-not-at-top": ("E402", "PLC0415"),
  "wrong-import-position": ("E402",),
  "import-outside-toplevel": ("PLC0415",),
  "g-bad-import-order": (),  # `ruff check --fix` sorts the imports (I001).
  "wrong-import-order": (),
  "protected-access": ("SLF001",),
  "broad-except": ("BLE001",),
  "broad-exception-caught": ("BLE001",),
  "bare-except": ("E722",),
  "unused-import": ("F401",),
  "unused-variable": ("F841",),
  "unused-argument": ("ARG001", "ARG002"),
  "consider-using-with": ("SIM115",),
  "invalid-name": ("N801", "N802", "N803", "N806", "N815", "N816"),
  "eval-used": ("S307",),
  "exec-used": ("S102",),
  "cell-var-from-loop": ("B023",),
  "unidiomatic-typecheck": ("E721",),
  "reimport": ("F811",),
  "redefined-builtin": ("A001", "A002"),
  "pointless-statement": ("B018",),
  "global-statement": ("PLW0603",),
  "multiple-imports": ("E401",),
}

_PYLINT = re.compile(r"(#\s*)?pylint:\s*disable(?P<next>-next)?=(?P<names>[\w,-]+)")
_UNKNOWN = set()  # pylint names met that PYLINT_TO_RUFF does not know
_NOQA = re.compile(r"#\s*noqa:\s*(?P<codes>[A-Z]+[0-9]+(?:[,\s]+[A-Z]+[0-9]+)*)")


@dataclasses.dataclass
class Disable:
  """One pylint comment: the ruff codes it maps to and the lines it covers
  (1-based, in the file after the comments are removed)."""

  codes: set[str]
  first: int
  last: int


def _comments(text: str) -> dict[int, tuple[int, str]]:
  """Line (1-based) -> (column, text) of the comment that ends it."""
  found = {}
  for tok in tokenize.generate_tokens(io.StringIO(text).readline):
    if tok.type == tokenize.COMMENT:
      found[tok.start[0]] = (tok.start[1], tok.string)
  return found


def _statements(text: str) -> dict[int, tuple[int, int]]:
  """Line (1-based) -> the first and last lines of its statement."""
  ends, start, in_code = {}, 1, False
  blank = (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)
  for tok in tokenize.generate_tokens(io.StringIO(text).readline):
    if tok.type == tokenize.NEWLINE or (tok.type == tokenize.NL and not in_code):
      ends.update((r, (start, tok.start[0])) for r in range(start, tok.start[0] + 1))
      start, in_code = tok.start[0] + 1, False
    elif tok.type not in blank:
      in_code = True
  return ends


def _join_comments(parts: list[str]) -> str:
  return "  ".join(p if p.startswith("#") else "# " + p for p in parts if p)


def _block_end(lines: list[str], row: int, indent: int) -> int:
  """The last line of the block an own-line comment at `row` sits in."""
  last = row
  for i in range(row, len(lines)):
    line = lines[i]
    if not line.strip():
      continue
    if len(line) - len(line.lstrip()) < indent:
      break
    last = i + 1
  return last


def _take(comment: str, trailing: bool) -> tuple[set[str], str, bool, bool]:
  """Splits one comment into the ruff codes its pylint disable maps to and
  its noqa names (a trailing comment's only), what else it says, whether it
  is a `disable-next`, and whether it held either directive."""
  codes, is_next, found = set(), False, False
  m = _PYLINT.search(comment)
  if m:
    found, is_next = True, bool(m.group("next"))
    for name in filter(None, m.group("names").split(",")):
      if name not in PYLINT_TO_RUFF:
        _UNKNOWN.add(name)
      codes.update(PYLINT_TO_RUFF.get(name, ()))
    rest = comment[m.end() :].strip()
    if rest.startswith("(") and rest.endswith(")"):
      rest = rest[1:-1]
    comment = _join_comments([comment[: m.start()].strip(), rest])
  n = _NOQA.search(comment) if trailing else None
  if n:
    found = True
    codes.update(re.split(r"[,\s]+", n.group("codes")))
    comment = _join_comments([comment[: n.start()].strip(), comment[n.end() :].strip()])
  return codes, comment, is_next, found


def strip(text: str) -> tuple[str, list[Disable]]:
  """Removes the pylint comments and the trailing `# noqa: ...` of one
  file's text; returns the new text and what each one disabled, on the new
  text's lines."""
  lines = text.splitlines(keepends=True)
  comments = _comments(text)
  statements = _statements(text)
  out, disables = [], []
  for row, line in enumerate(lines, start=1):
    col, comment = comments.get(row, (None, ""))
    code = line[:col].rstrip() if col is not None else ""
    codes, new_comment, is_next, found = _take(comment, trailing=bool(code))
    if not found:
      out.append(line)
      continue
    eol = line[len(line.rstrip("\r\n")) :]
    if not code:  # An own-line comment: it covers the next line or its block.
      if new_comment:
        out.append(line[:col] + new_comment + eol)
      here = len(out) + 1
      if is_next:
        disables.append(Disable(codes, here, here))
      else:
        disables.append(Disable(codes, here, _block_end(lines, row, col) - row + len(out)))
      continue
    # A comment on a statement's line covers the whole statement.
    out.append(code + ("  " + new_comment if new_comment else "") + eol)
    first, last = statements.get(row, (row, row))
    disables.append(Disable(codes, len(out) - (row - first), len(out) + last - row))
  return "".join(out), disables


def add_noqa(text: str, noqa: dict[int, set[str]]) -> str:
  """Writes `# noqa: CODES` on the given lines (merged with any there)."""
  lines = text.splitlines(keepends=True)
  comments = _comments(text)
  for row, codes in noqa.items():
    line = lines[row - 1]
    eol = line[len(line.rstrip("\r\n")) :]
    col, comment = comments.get(row, (len(line.rstrip("\r\n")), ""))
    m = _NOQA.search(comment)
    if m:
      codes = codes | set(re.split(r"[,\s]+", m.group("codes")))
      comment = (comment[: m.start()] + comment[m.end() :]).strip()
      comment = comment[1:].strip() if comment == "#" or comment.startswith("# ") else comment
    parts = ["# noqa: " + ", ".join(sorted(codes))] + ([comment] if comment else [])
    lines[row - 1] = line[:col].rstrip() + "  " + _join_comments(parts) + eol
  return "".join(lines)


def _ruff(*args: str) -> str:
  """Runs ruff with the project's config; returns what it printed."""
  return subprocess.run(
    [sys.executable, "-m", "ruff", *args], capture_output=True, text=True, check=True
  ).stdout


def _has_directive(path: str) -> bool:
  """Whether a file has a pylint comment or a trailing `# noqa: CODE`."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if "pylint:" not in text and "noqa:" not in text:
    return False
  return any(_take(c, trailing=True)[3] for _, c in _comments(text).values())


def _ruff_findings(paths: list[str]) -> dict[str, list[tuple[str, int, int]]]:
  """path -> (code, first line, last line) of each finding."""
  findings = collections.defaultdict(list)
  out = _ruff("check", "--exit-zero", "--no-cache", "--output-format", "json", *paths)
  for f in json.loads(out):
    findings[f["filename"]].append((f["code"], f["location"]["row"], f["end_location"]["row"]))
  return findings


DATA = "sao_jax/envs/task_data/"


def main(argv: list[str]) -> int:
  paths = (
    argv
    or subprocess.run(
      ["git", "ls-files", "*.py"], capture_output=True, text=True, check=True
    ).stdout.split()
  )
  # Shipped data, not the project's code (ruff.toml's extend-exclude).
  paths = [p for p in paths if not p.startswith(DATA) and _has_directive(p)]
  if not paths:
    return 0
  # Formatted first, so that a comment sits where it will stay: the formatter
  # leaves pragma comments (pylint's, noqa) out of its line width and moves
  # them with their line, but a statement it splits or joins moves the lines.
  _ruff("format", "-q", *paths)
  pending = {}
  for path in paths:
    with open(path, encoding="utf-8") as f:
      text = f.read()
    new_text, disables = strip(text)
    if new_text != text:
      with open(path, "w", encoding="utf-8") as f:
        f.write(new_text)
      pending[path] = disables
  if not pending:
    return 0
  findings = {os.path.abspath(k): v for k, v in _ruff_findings(sorted(pending)).items()}
  kept = dropped = 0
  for path, disables in pending.items():
    noqa = collections.defaultdict(set)
    for d in disables:
      hit = False
      for code, first, last in findings.get(os.path.abspath(path), ()):
        if code in d.codes and first <= d.last and last >= d.first:
          noqa[first].add(code)
          hit = True
      kept += hit
      dropped += not hit
    if noqa:
      with open(path, encoding="utf-8") as f:
        text = f.read()
      with open(path, "w", encoding="utf-8") as f:
        f.write(add_noqa(text, noqa))
  for name in sorted(_UNKNOWN):
    print(f"no ruff rule for pylint's {name}: dropped", file=sys.stderr)
  print(
    f"{kept + dropped} pylint or noqa comments in {len(pending)} files: "
    f"{kept} are `# noqa` on the line ruff flags, {dropped} dropped"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
