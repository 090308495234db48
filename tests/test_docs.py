"""The prose is checked like the code: names resolve, README stays short, the site builds.

(a) Every name a Markdown file of the repository writes in backticks, or links
to, must resolve (hidden folders such as .venv and .pytest_cache, the built
site/ and workdirs/ are not the repository's prose). A code span is
classified by these rules, first match wins:

1. A command: `make T ...` (each target T a rule of the Makefile; `VAR=x`
   and `-flags` are not targets), `python[3] X.py ...` / `X.py ...`
   (`VAR=x` assignments may come first): the script X.py exists, or
   `python -m M` with M in a folder of the repository: the module exists;
   and the path of each `--config=P` / `--config P` (up to a `:` argument;
   `...` is a placeholder) exists.
   The same rule reads each command line of a fenced ```bash / sh / shell /
   console block (a `$ ` prompt dropped, `\\` continuations joined).
2. A config flag or assignment: `--config.S.F[=...]`, `S.F = ...`: field F
   of section S (`sao_jax.config.sections.SECTIONS`).
3. A repository path: no spaces, and its first component a top-level
   entry of the repository (`sao_jax/...`, `configs/x.py`, `Makefile`), or
   `./` / `../` relative to the file. It exists (a glob matches something;
   a trailing `/` names a folder). `P:name` also checks that the Python
   file P defines `name`; `P:123` and pytest's `P::test` check P only;
   `F.md#anchor` also checks that F has a heading with that GitHub anchor.
   A span holding `<`, `{` or `$` is a placeholder and is skipped; a bare
   file name (`config.json`, `engine.py`) is not a repository path (it may
   name a workdir's file or another package's) and is skipped.
4. A dotted Python name: `sao_jax.a.b[.C[.m]]` resolves exactly (the
   module exists, C is defined in it by a def, class or assignment, not
   only imported unless the module is a package's `__init__`, and m is a
   member of class C); `sao_jax.a.b:fn` likewise. A short form `S.F`
   whose S is a config section names a field of that section, and else,
   like `mod.name` whose mod is the last component of a sao_jax module
   (`factories.build_programs`), a name that module defines, or a member
   of a class it defines (`run.state`); further components are not checked,
   and a trailing call `(...)` is dropped (a called name is never a config
   field: `env.task(i)` is an environment's method). A section that lacks
   the field and is also a module name passes if the module defines it. An
   object named like a section is written with its class
   (`Environment.max_turns`), else it reads as a field. A quoted string
   (`"chat.completion.chunk"`) is a value.
5. A layout tree: a code block whose first line is a top-level folder
   (`sao_jax/`), each later line whose first word is a file name (with a
   suffix of FILE_SUFFIXES) or a folder (`name/`) an entry, nested by
   indentation; each entry exists. Other words (an entry's description) are
   not read.
6. Anything else (a value such as `0.1`, a shell snippet, an expression,
   `jax.lax.scan`, a metric name) is not a name and is not checked.

A Markdown link `[t](target)` that is not a URL must point at an existing
file relative to the linking file, and its `#anchor`, if any, at a heading
of that file; a docs page may also link to a page the site generates
(docs/_hooks/hooks.py: the configuration reference and the API pages).
Fenced code blocks are read by rules 1 and 5 only; an indented block (a
list item's paragraph, or code) like text.

(b) README.md stays under `README_BUDGET` lines: detail belongs on the site.

(c) `mkdocs build --strict` passes (into a temporary directory): a broken
link or anchor, a missing API target or any warning fails it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from sao_jax.config import sections

ROOT = pathlib.Path(__file__).resolve().parent.parent
README_BUDGET = 300


def _site_hooks():
  """docs/_hooks/hooks.py, for the pages it generates (None without mkdocs)."""
  spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs/_hooks/hooks.py")
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except ImportError:
    return None
  return module


_HOOKS = _site_hooks()
# Pages the site generates (docs/_hooks/hooks.py): a docs page may link to them.
GENERATED = frozenset(
  [f"docs/{_HOOKS.CONFIG_PAGE}"] + [f"docs/reference/api/{m}.md" for m in _HOOKS.API_MODULES]
  if _HOOKS
  else []
)
SKIP_DIRS = {".git", "site", "workdirs", "node_modules", "build"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# Toy repositories shipped as task data: their own packages, not sao_jax's modules.
NOT_MODULES = ("sao_jax/data/repo_corpus/", "sao_jax/envs/task_data/")
SCRIPT_DIRS = ("launch", "configs", "benchmarks", "experiments")
# A span ending in one of these is a file name, never a dotted Python name.
FILE_SUFFIXES = frozenset(
  "py json jsonl md gz yaml yml txt png npz parquet safetensors jinja toml cfg ipynb "
  "html sh log csv pkl msgpack bin pt tar zip whl".split()
)

_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_FIELD_SET = re.compile(r"^(?:--config\.)?([a-z_]+)\.([a-z_]\w*)(?:\.\S*)?\s*=")
_IDENT = re.compile(r"^[A-Za-z_]\w*$")


def _markdown_files() -> list[pathlib.Path]:
  out = []
  for dirpath, dirnames, filenames in os.walk(ROOT):
    dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
    out += [pathlib.Path(dirpath, f) for f in filenames if f.endswith(".md")]
  return sorted(out)


# ------------------------------------------------------------ the index
@functools.cache
def _top_level() -> frozenset[str]:
  return frozenset(
    p.name
    for p in ROOT.iterdir()
    if p.name not in SKIP_DIRS and not p.name.startswith(".venv") and p.name != "__pycache__"
  )


@functools.cache
def _make_targets() -> frozenset[str]:
  text = (ROOT / "Makefile").read_text()
  targets = set()
  for m in re.finditer(r"^([^\s:=#$][^:=]*?)\s*:(?!=)", text, re.M):
    targets.update(m.group(1).split())
  return frozenset(targets)


@functools.cache
def _modules() -> dict[str, pathlib.Path]:
  """Dotted sao_jax module name -> its file."""
  out = {}
  for path in (ROOT / "sao_jax").rglob("*.py"):
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith(NOT_MODULES):
      continue
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    out[".".join(parts)] = path
  return out


@functools.cache
def _by_last_name() -> dict[str, list[pathlib.Path]]:
  """A module's last name -> its files: sao_jax's modules and the scripts of
  SCRIPT_DIRS (`stats.collapsed` may name experiments/stats.py)."""
  out = {}
  for name, path in _modules().items():
    out.setdefault(name.rpartition(".")[2], []).append(path)
  for folder in SCRIPT_DIRS:
    for path in sorted((ROOT / folder).glob("*.py")):
      out.setdefault(path.stem, []).append(path)
  return out


@dataclasses.dataclass(frozen=True)
class _Names:
  defined: frozenset[str]  # def, class, assignment at the top level
  imported: frozenset[str]  # bound only by an import
  members: dict  # class name -> its members (and self.x attributes)
  bases: dict  # class name -> the names of its bases

  def members_of(self, cls: str) -> frozenset[str] | None:
    """`cls`'s members with those it inherits from classes of this module;
    None when a base is defined elsewhere (its members are not known here)."""
    out = set(self.members[cls])
    for base in self.bases[cls]:
      if base in ("object", "Protocol", "NamedTuple", "Generic", "Exception", "ValueError"):
        continue
      inherited = self.members_of(base) if base in self.members and base != cls else None
      if inherited is None:
        return None
      out |= inherited
    return frozenset(out)


def _targets(node) -> list[str]:
  if isinstance(node, ast.Name):
    return [node.id]
  if isinstance(node, (ast.Tuple, ast.List)):
    return [n for e in node.elts for n in _targets(e)]
  return []


def _class_members(cls: ast.ClassDef) -> frozenset[str]:
  out = set()
  for node in ast.walk(cls):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      out.add(node.name)
    elif isinstance(node, ast.Assign):
      out.update(n for t in node.targets for n in _targets(t))
      out.update(t.attr for t in node.targets if isinstance(t, ast.Attribute))
    elif isinstance(node, ast.AnnAssign):
      out.update(_targets(node.target))
      if isinstance(node.target, ast.Attribute):
        out.add(node.target.attr)
  return frozenset(out)


@functools.cache
def _names(path: pathlib.Path) -> _Names:
  defined, imported, members, bases = set(), set(), {}, {}
  body = list(ast.parse(path.read_text(), str(path)).body)
  while body:
    node = body.pop(0)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      defined.add(node.name)
    elif isinstance(node, ast.ClassDef):
      defined.add(node.name)
      members[node.name] = _class_members(node)
      bases[node.name] = [ast.unparse(b).split("[")[0].rpartition(".")[2] for b in node.bases]
    elif isinstance(node, ast.Assign):
      defined.update(n for t in node.targets for n in _targets(t))
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
      defined.update(_targets(node.target))
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      imported.update((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, (ast.If, ast.Try, ast.With)):
      body += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
      body += [s for h in getattr(node, "handlers", []) for s in h.body]
  return _Names(frozenset(defined), frozenset(imported - defined), members, bases)


def _defines(module: str | pathlib.Path, name: str) -> bool:
  path = _modules()[module] if isinstance(module, str) else module
  names = _names(path)
  return name in names.defined or (path.name == "__init__.py" and name in names.imported)


def _member(path: pathlib.Path, name: str) -> bool:
  """`name` is a member of some class the file defines."""
  return any(name in m for m in _names(path).members.values())


# ----------------------------------------------------------- the checks
def _field(section: str, field: str) -> str | None:
  """None if `section.field` is a config field, else why not."""
  cls = sections.SECTIONS.get(section)
  if cls is None:
    return f"no config section {section!r}"
  if field not in {f.name for f in dataclasses.fields(cls)}:
    return f"config section {section!r} has no field {field!r}"
  return None


def _full_name(name: str) -> str | None:
  """`sao_jax.a.b[.C[.m]]` or `sao_jax.a.b:C`: None if it resolves, else why not."""
  module, colon, rest = name.partition(":")
  parts = module.split(".") + (rest.split(".") if colon else [])
  i = len(parts)
  while i and ".".join(parts[:i]) not in _modules():
    i -= 1
  if not i:
    return "no such module"
  found, attrs = ".".join(parts[:i]), parts[i:]
  if colon and i < len(module.split(".")):
    return f"no module {module}"
  if not attrs:
    return None
  if not _defines(found, attrs[0]):
    return f"{found} does not define {attrs[0]!r}"
  names = _names(_modules()[found])
  if len(attrs) > 1 and attrs[0] in names.members:
    members = names.members_of(attrs[0])
    if members is not None and attrs[1] not in members:
      return f"{found}.{attrs[0]} has no member {attrs[1]!r}"
  return None


def _short_name(name: str, called: bool) -> str | None:
  """`S.F` (a config field) or `mod.name`; None if it resolves or is not a name.
  A called name (`env.task(i)`) is never a config field."""
  head, attr = name.split(".")[:2]
  why = _field(head, attr) if head in sections.SECTIONS and not called else None
  if head in sections.SECTIONS and why is None:
    return None
  modules = [m for m in _modules() if m.rpartition(".")[2] == head]
  rest = name.split(".", 1)[1]
  if any(_full_name(f"{m}.{rest}") is None for m in modules):
    return None  # a submodule's name: `envs.registry.ENVIRONMENTS`
  files = _by_last_name().get(head, [])
  if any(_defines(f, attr) or _member(f, attr) for f in files):
    return None
  if files:
    return f"not defined in {' or '.join(str(f.relative_to(ROOT)) for f in files)}"
  return why


def _anchors(path: pathlib.Path) -> set[str]:
  """The GitHub anchors of a Markdown file's headings."""
  out, seen, fenced = set(), {}, False
  for line in path.read_text(encoding="utf-8").splitlines():
    if line.lstrip().startswith("```"):
      fenced = not fenced
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if fenced or not m:
      continue
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda g: g.group(1) or "", m.group(1))
    slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    out.add(slug if n == 0 else f"{slug}-{n}")
  return out


def _path(text: str, base: pathlib.Path) -> str | None:
  """A repository path (rule 3): None if it resolves, else why not."""
  target, _, anchor = text.partition("#")
  target, colon, symbol = target.partition(":")
  if target.startswith(("./", "../")):
    path = (base / target).resolve()
  elif target.split("/")[0] in _packages():
    path = ROOT / "sao_jax" / target
  else:
    path = ROOT / target
  if any(c in target for c in "*?["):
    return None if glob.glob(str(path), recursive=True) else "matches no file"
  if not path.exists() or (target.endswith("/") and not path.is_dir()):
    return "no such file or folder"
  if anchor and path.suffix == ".md" and anchor not in _anchors(path):
    return f"{path.relative_to(ROOT)} has no heading with anchor #{anchor}"
  if (
    colon
    and _IDENT.match(symbol)
    and path.suffix == ".py"
    and path.is_relative_to(ROOT / "sao_jax")
  ):
    names = _names(path)
    if symbol not in names.defined | names.imported:
      return f"{target} does not define {symbol!r}"
  return None


@functools.cache
def _packages() -> frozenset[str]:
  """sao_jax's layer folders: `rollout/engine.py` is short for sao_jax/rollout/engine.py."""
  return frozenset(p.name for p in (ROOT / "sao_jax").iterdir() if (p / "__init__.py").exists())


def _is_repo_path(text: str) -> bool:
  if " " in text or any(c in text for c in "<>{}$"):
    return False
  if text.startswith(("./", "../")):
    return True
  first = re.split(r"[/:#]", text, maxsplit=1)[0]
  if first in _packages() and "/" in text:
    return text.partition(":")[0].partition("#")[0].endswith((".py", "/"))
  return first in _top_level() and ("/" in text or first == text.partition(":")[0])


def _command(text: str, base: pathlib.Path) -> list[str] | None:
  """Rule 1: None if `text` is not a command, else the reasons it fails."""
  try:
    words = shlex.split(text, comments=True)
  except ValueError:
    return None
  while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
    words.pop(0)
  if not words:
    return None
  if words[0] == "make":
    return [
      f"no Makefile target {w!r}"
      for w in words[1:]
      if not w.startswith("-") and "=" not in w and w not in _make_targets()
    ]
  python = words[0] in ("python", "python3")
  if python and len(words) > 2 and words[1] == "-m":
    bad = [] if _module_exists(words[2]) else [f"no module {words[2]}"]
  elif python and len(words) > 1 and words[1].endswith(".py"):
    words = words[1:]
    script = (base if words[0].startswith(("./", "../")) else ROOT) / words[0]
    bad = [] if script.is_file() else [f"no script {words[0]}"]
  elif words[0].endswith(".py") and "/" in words[0] and len(words) > 1:
    script = (base if words[0].startswith(("./", "../")) else ROOT) / words[0]
    bad = [] if script.is_file() else [f"no script {words[0]}"]
  else:
    return None
  for i, w in enumerate(words):
    value = (
      w.partition("=")[2]
      if w.startswith("--config=")
      else (words[i + 1] if w == "--config" and i + 1 < len(words) else None)
    )
    if (
      value
      and not any(c in value for c in "<>{}$")
      and "..." not in value
      and not (ROOT / value.partition(":")[0]).exists()
    ):
      bad.append(f"no config file {value.partition(':')[0]}")
  return bad


def _module_exists(name: str) -> bool:
  """`python -m name`: True unless name is in a folder of this repository
  (sao_jax, experiments, ...) and no module or package there has it."""
  if name.split(".")[0] not in _top_level():
    return True
  path = ROOT.joinpath(*name.split("."))
  return (
    path.with_suffix(".py").is_file()
    or (path / "__main__.py").is_file()
    or (path / "__init__.py").is_file()
  )


def _span(text: str, base: pathlib.Path) -> list[str]:
  """The reasons a code span does not resolve ([] when it does or is no name)."""
  text = text.strip()
  bad = _command(text, base)
  if bad is not None:
    return bad
  m = _FIELD_SET.match(text) or re.match(r"^--config\.([a-z_]+)\.([a-z_]\w*)\S*$", text)
  if m and m.group(1) in sections.SECTIONS:
    why = _field(m.group(1), m.group(2))
    return [why] if why else []
  if _is_repo_path(text):
    why = _path(text, base)
    return [why] if why else []
  name = re.sub(r"\(.*\)$", "", text)
  called = name != text
  if name.rpartition(".")[2] in FILE_SUFFIXES:
    return []
  if name.startswith("config.") and name.split(".")[1] in sections.SECTIONS:
    name = name.removeprefix("config.")
  if name.startswith("sao_jax.") and re.match(r"^[\w.]+(:[\w.]+)?$", name):
    why = _full_name(name)
    return [why] if why else []
  if _DOTTED.match(name):
    why = _short_name(name, called)
    return [why] if why else []
  return []


def _shell_lines(block: list[tuple[int, str]]):
  """The command lines of a fenced shell block, continuations joined."""
  pending, start = "", 0
  for number, line in block:
    line = line.strip().removeprefix("$ ")
    if not pending:
      start = number
    if line.endswith("\\"):
      pending += line[:-1] + " "
      continue
    yield start, pending + line
    pending = ""


def _tree(block: list[tuple[int, str]]) -> list[tuple[int, str, str]]:
  """A layout tree (rule 6): (line, entry, why) for each entry that does not exist."""
  out, stack = [], []  # stack: (indent, folder path)
  for number, line in block:
    entry = line.split()[0] if line.strip() else ""
    if not (entry.endswith("/") or entry.rpartition(".")[2] in FILE_SUFFIXES) or (
      "." not in entry and not entry.endswith("/")
    ):
      continue
    indent = len(line) - len(line.lstrip())
    while stack and stack[-1][0] >= indent:
      stack.pop()
    rel = (stack[-1][1] if stack else "") + entry
    if not (ROOT / rel).exists():
      out.append((number, rel, "no such file or folder"))
    if entry.endswith("/"):
      stack.append((indent, rel))
  return out


def _is_tree(block: list[tuple[int, str]]) -> bool:
  first = next((line.strip() for _, line in block if line.strip()), "")
  return first.endswith("/") and first[:-1] in _top_level()


def _blocks(lines: list[str]):
  """(kind, lang, [(number, line)]) for each code block; kind "fenced" or
  "indented" (a 4-space block after a blank line), and "text" for each
  other line."""
  i = 0
  while i < len(lines):
    m = re.match(r"^\s*(```+|~~~+)\s*([\w-]*)", lines[i])
    if m:
      j = i + 1
      while j < len(lines) and not lines[j].strip().startswith(m.group(1)):
        j += 1
      yield "fenced", m.group(2).lower(), [(k + 1, lines[k]) for k in range(i + 1, j)]
      i = j + 1
      continue
    if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
      j = i
      while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
        j += 1
      yield "indented", "", [(k + 1, lines[k]) for k in range(i, j)]
      i = j
      continue
    yield "text", "", [(i + 1, lines[i])]
    i += 1


def unresolved(path: pathlib.Path) -> list[str]:
  """'file:line: `name`: why' for each name of `path` that does not resolve."""
  rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
  out = []
  for kind, lang, block in _blocks(path.read_text(encoding="utf-8").splitlines()):
    if kind != "text" and _is_tree(block):
      out += [f"{rel}:{n}: `{entry}`: {why}" for n, entry, why in _tree(block)]
      continue
    if kind == "fenced":
      if lang in SHELL_LANGS:
        for start, command in _shell_lines(block):
          out += [
            f"{rel}:{start}: `{command}`: {why}" for why in _command(command, path.parent) or []
          ]
      continue
    for number, line in block:
      out += _text_line(rel, number, line, path.parent)
  return out


def _text_line(rel: str, number: int, line: str, base: pathlib.Path) -> list[str]:
  out = []
  for span in _SPAN.finditer(line):
    out += [f"{rel}:{number}: `{span.group(2)}`: {why}" for why in _span(span.group(2), base)]
  for link in _LINK.finditer(_SPAN.sub("", line)):
    target = link.group(1)
    if "://" in target or target.startswith(("mailto:", "#")):
      continue
    why = _path(target if target.startswith("../") else "./" + target, base)
    page = os.path.relpath(base / target.partition("#")[0], ROOT).replace(os.sep, "/")
    if why and page not in GENERATED:
      out.append(f"{rel}:{number}: link ({target}): {why}")
  return out


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_names_resolve(path):
  bad = unresolved(path)
  assert not bad, f"{len(bad)} names do not resolve:\n" + "\n".join(bad)


def test_the_rules_tell_names_from_values(tmp_path):
  """The classifier flags each kind of stale name and passes values and snippets."""
  page = tmp_path / "page.md"
  page.write_text(
    "\n".join(
      [
        "`trainer.build_programs` `factories.build_programs` `sao_jax.algo.losses.nope`",
        "`sao_jax/nope.py` `configs/sao_tiny.py` `rl.nope` `rl.steps` `--config.rl.steps=3`",
        "`make nope` `make test` `python launch/nope.py --config=configs/sao_tiny.py`",
        '`0.1` `jax.lax.scan` `x = f(y)` `config.json` `env.task(index)` `"a.b.c"`',
        "[ok](page.md) [gone](nope.md)",
        "```bash",
        "python launch/train.py --config=configs/nope.py \\",
        "    --workdir=w",
        "```",
        "",
        "    sao_jax/",
        "      algo/",
        "        losses.py   the losses",
        "        nope.py     gone",
      ]
    )
    + "\n"
  )
  bad = [line.split(": ", 1)[1] for line in unresolved(page)]
  assert [b.split(":")[0] for b in bad] == [
    "`trainer.build_programs`",
    "`sao_jax.algo.losses.nope`",
    "`sao_jax/nope.py`",
    "`rl.nope`",
    "`make nope`",
    "`python launch/nope.py --config=configs/sao_tiny.py`",
    "link (nope.md)",
    "`python launch/train.py --config=configs/nope.py  --workdir=w`",
    "`sao_jax/algo/nope.py`",
  ], bad


def test_readme_within_budget():
  lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
  assert lines < README_BUDGET, (
    f"README.md has {lines} lines, the budget is {README_BUDGET}: move detail to docs/"
  )


@pytest.mark.integration  # mkdocs in a subprocess, ~20 s
def test_site_builds_strictly(tmp_path):
  pytest.importorskip("mkdocs")
  pytest.importorskip("mkdocstrings")
  env = dict(
    os.environ,
    NO_MKDOCS_2_WARNING="1",
    PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
  )
  # Not --quiet: it hides the warnings from the count that --strict fails on.
  done = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  said = [l for l in (done.stdout + done.stderr).splitlines() if not l.startswith("INFO")]
  assert done.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(said)
