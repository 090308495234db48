"""MkDocs hooks of the docs site: generated pages, the evidence files, repository links.

Nothing generated is checked in; every build makes it again from the code:

* `reference/config.md`: every section of `sao_jax/config/sections.py`, each
  field with its default, its check (what it allows) and its doc, read from
  the field's `knob` metadata.
* `reference/api/<module>.md`: one mkdocstrings page a public module
  (`API_MODULES`).
* The evidence files (`EVIDENCE`: benchmarks/RESULTS.md, experiments/README.md)
  become pages of the site at their repository paths, with the images they
  show, so a page links to a figure as GitHub does, `../benchmarks/RESULTS.md#kernels`,
  and strict mode checks the file and the anchor.
* The Design section of the nav lists docs/DESIGN.md, then every
  `docs/design/*.md` present at build time (none is named in mkdocs.yml, so
  a page that is absent is never listed).

Links are written as GitHub reads them, relative to the file in the
repository. A link from a docs page that leaves docs/ for an evidence page
is rewritten to that page; any other link out of docs/ is left as written,
and strict mode fails on it (name a source file in backticks instead:
tests/test_docs.py checks it exists).
"""

from __future__ import annotations

import dataclasses
import html
import os
import posixpath
import re
import sys

from mkdocs.structure.files import File, Files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Repository files served as pages at their own paths.
EVIDENCE = ("benchmarks/RESULTS.md", "experiments/README.md")

# The modules a user imports, by the reader's task (the API reference).
API_MODULES = (
  "sao_jax.algo.advantages",
  "sao_jax.algo.losses",
  "sao_jax.models.config",
  "sao_jax.models.families",
  "sao_jax.config.sections",
  "sao_jax.envs.base",
  "sao_jax.envs.registry",
  "sao_jax.envs.chat",
  "sao_jax.rollout.engine_protocol",
  "sao_jax.serving.openai_api",
  "sao_jax.train.trainer",
  "sao_jax.train.run",
  "sao_jax.train.export",
  "sao_jax.train.evaluation",
)

CONFIG_PAGE = "reference/config.md"
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


# ------------------------------------------------------------------- nav
def _title(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.startswith("# "):
        return line[2:].strip()
  return os.path.splitext(os.path.basename(path))[0]


def _section(nav: list, title: str) -> list:
  for item in nav:
    if isinstance(item, dict) and title in item:
      return item[title]
  raise ValueError(f"mkdocs.yml: the nav has no section {title!r}")


def on_config(config):
  """Adds the present docs/design/*.md pages and the API pages to the nav."""
  design_dir = os.path.join(config["docs_dir"], "design")
  design = _section(config["nav"], "Design")
  if os.path.isdir(design_dir):
    for name in sorted(os.listdir(design_dir)):
      if name.endswith(".md"):
        design.append({_title(os.path.join(design_dir, name)): f"design/{name}"})
  api = _section(_section(config["nav"], "Reference"), "API")
  api.extend({m.removeprefix("sao_jax."): f"reference/api/{m}.md"} for m in API_MODULES)
  return config


# ----------------------------------------------------------------- files
def on_files(files: Files, config) -> Files:
  """The generated pages and the evidence files (with their images)."""
  files.append(File.generated(config, CONFIG_PAGE, content=config_reference()))
  for module in API_MODULES:
    files.append(
      File.generated(config, f"reference/api/{module}.md", content=f"# {module}\n\n::: {module}\n")
    )
  for path in EVIDENCE:
    files.append(File.generated(config, path, abs_src_path=os.path.join(REPO, path)))
    for image in _images(path):
      files.append(File.generated(config, image, abs_src_path=os.path.join(REPO, image)))
  return files


def _images(path: str) -> list[str]:
  """The repository files an evidence page shows (`![..](x.png)`), that exist."""
  with open(os.path.join(REPO, path), encoding="utf-8") as f:
    text = f.read()
  out = []
  for m in re.finditer(r"!\[[^\]]*\]\(([^)\s#]+)\)", text):
    target = posixpath.normpath(posixpath.join(posixpath.dirname(path), m.group(1)))
    if "://" not in m.group(1) and os.path.isfile(os.path.join(REPO, target)):
      out.append(target)
  return sorted(set(out))


# ----------------------------------------------------------------- links
def on_page_markdown(markdown: str, page, config, files) -> str:
  """Links from docs/ to an evidence file point at its page of the site."""
  src = page.file.src_uri
  if src in EVIDENCE or src.startswith("reference/"):
    return markdown

  def rewrite(m):
    target, _, anchor = m.group(2).partition("#")
    if "://" in target or not target.startswith("../"):
      return m.group(0)
    repo_path = posixpath.normpath(posixpath.join("docs", posixpath.dirname(src), target))
    if repo_path not in EVIDENCE:
      return m.group(0)
    rel = posixpath.relpath(repo_path, posixpath.dirname(src) or ".")
    return m.group(1) + rel + ("#" + anchor if anchor else "") + m.group(3)

  return _LINK.sub(rewrite, markdown)


# ------------------------------------------------------ config reference
_EVIDENCE_REF = re.compile(r"\b((?:%s)(?:#[\w-]+)?)" % "|".join(re.escape(p) for p in EVIDENCE))


def _cell(text: str) -> str:
  """Plain text for a table cell: HTML escaped, pipes and asterisks kept literal;
  a reference to an evidence heading (`benchmarks/RESULTS.md#kernels`) becomes a
  link, whose anchor strict mode checks."""
  text = html.escape(" ".join(str(text).split()), quote=False)
  text = text.replace("|", "&#124;").replace("*", "\\*")
  return _EVIDENCE_REF.sub(lambda m: f"[{m.group(1)}](../{m.group(1)})", text)


def _code(value) -> str:
  return f"<code>{_cell(repr(value))}</code>"


def _default(f: dataclasses.Field):
  if f.default is not dataclasses.MISSING:
    return f.default
  return f.default_factory()


def config_reference() -> str:
  """The configuration reference page, from the section records of sections.py."""
  if REPO not in sys.path:  # document this tree, installed or not
    sys.path.insert(0, REPO)
  from sao_jax.config import sections

  lines = [
    "# Configuration reference",
    "",
    "Generated at build time from `sao_jax/config/sections.py`: each field is declared "
    "there once, with its default, its doc and its check, and a record checks itself on "
    "construction (`sao_jax.config.sections.ConfigError` names the field). Set a field "
    "in a config file (`configs/*.py`, derived from `configs/common.py`) or on the "
    "command line: `--config.rl.steps=3`. Rules that join fields of different sections "
    "live in `sao_jax.train.configuration.validate`.",
    "",
  ]
  records = [("Top level", sections.TopLevel)] + [(n, c) for n, c in sections.SECTIONS.items()]
  for name, cls in records:
    lines += [f"## {name}", ""]
    if cls.__doc__ and cls.__doc__ != sections.Section.__doc__:
      lines += [_cell(cls.__doc__), ""]
    if cls.check_together is not sections.Section.check_together:
      lines += [
        f"Besides each field's check, `{cls.__name__}.check_together` checks rules "
        "between this section's fields.",
        "",
      ]
    lines += ["| Field | Default | Allowed | Meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
      check = f.metadata.get("check")
      allowed = _cell(check.describe()) if check is not None else "(no check of its own)"
      lines.append(
        f"| <code>{cls.field_name(f.name)}</code> | {_code(_default(f))} | "
        f"{allowed} | {_cell(f.metadata.get('doc', ''))} |"
      )
    lines.append("")
  return "\n".join(lines)
