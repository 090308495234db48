"""The package's layers (docs/DESIGN.md section 6): no import circle, no arrow up.

Every `import` in sao_jax counts, deferred ones inside functions too: a
deferred import still makes the lower module know the upper one. The
layers, low to high, are the folders of sao_jax/ below; a module may import
its own layer and the layers under it.
"""

import ast
import io
import pathlib
import tokenize

import pytest

import sao_jax

LAYERS = (
  "algo",
  "models",
  "config",
  "data",
  "transport",
  "envs",
  "rollout",
  "serving",
  "train",
  "pod",
)
PACKAGE = pathlib.Path(sao_jax.__file__).parent
# Toy repositories shipped as data (their own packages, never imported by sao_jax).
NOT_CODE = ("sao_jax/envs/task_data/repo_corpus/",)


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    rel = path.relative_to(PACKAGE.parent).as_posix()
    if rel.startswith(NOT_CODE):
      continue
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    out[".".join(parts)] = path
  return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
  """The sao_jax modules `name` imports, anywhere in its file."""
  found = set()
  package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
      targets = [f"{base}.{a.name}" for a in node.names] + [base]
    for t in targets:
      while t and t not in modules:
        t = t.rpartition(".")[0]
      if t and t != name and t != "sao_jax":
        found.add(t)
  return found


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int | None:
  parts = module.split(".")
  return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_every_module_has_a_layer():
  loose = [m for m in _modules() if m != "sao_jax" and _layer(m) is None]
  assert not loose, (
    f"modules outside the layer folders {LAYERS}: {loose}; put each in the "
    "folder of its layer (docs/DESIGN.md section 6)"
  )


def test_no_import_arrow_goes_up():
  up = [
    f"{m} ({LAYERS[_layer(m)]}) imports {t} ({LAYERS[_layer(t)]})"
    for m, targets in sorted(_graph().items())
    if _layer(m) is not None
    for t in sorted(targets)
    if _layer(t) is not None and _layer(t) > _layer(m)
  ]
  assert not up, "imports from a higher layer:\n  " + "\n  ".join(up)


def test_no_import_circle():
  cycles = _cycles(_graph())
  assert not cycles, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


def test_the_walk_sees_deferred_and_relative_imports(tmp_path):
  """The checker itself: a deferred import and a relative one are arrows."""
  pkg = tmp_path / "sao_jax"
  (pkg / "algo").mkdir(parents=True)
  (pkg / "algo" / "__init__.py").write_text("")
  (pkg / "algo" / "low.py").write_text("def f():\n  from sao_jax.train import high\n")
  (pkg / "algo" / "rel.py").write_text("from . import low\n")
  modules = {
    "sao_jax.algo": pkg / "algo" / "__init__.py",
    "sao_jax.algo.low": pkg / "algo" / "low.py",
    "sao_jax.algo.rel": pkg / "algo" / "rel.py",
    "sao_jax.train.high": pkg / "high.py",
  }
  assert _imports("sao_jax.algo.low", modules["sao_jax.algo.low"], modules) == {
    "sao_jax.train.high"
  }
  assert _imports("sao_jax.algo.rel", modules["sao_jax.algo.rel"], modules) == {
    "sao_jax.algo.low",
    "sao_jax.algo",
  }
  assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_folder_exists(layer):
  assert (PACKAGE / layer / "__init__.py").is_file()


MAX_FUNCTION_LINES = 80


def _continuation_lines(source: str) -> set[int]:
  """The lines that begin inside an open bracket: an argument list or a
  literal the formatter wrapped, which one line of the statement holds."""
  depth, seen, out = 0, set(), set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    row = tok.start[0]
    if row not in seen and tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
      seen.add(row)
      if depth > 0:
        out.add(row)
    if tok.type == tokenize.OP and tok.string in "([{":
      depth += 1
    elif tok.type == tokenize.OP and tok.string in ")]}":
      depth -= 1
  return out


def test_no_function_is_longer_than_80_lines():
  """A function that does not fit a screen does more than one thing.

  A line counts unless it continues a bracketed expression begun above it:
  the formatter puts one argument per line where a call does not fit in
  100 columns, which makes a function taller without making it do more.
  """
  long = []
  for path in _modules().values():
    source = path.read_text()
    wrapped = _continuation_lines(source)
    for node in ast.walk(ast.parse(source, str(path))):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        span = range(node.lineno, node.end_lineno + 1)
        lines = sum(1 for row in span if row not in wrapped)
        if lines > MAX_FUNCTION_LINES:
          long.append(
            f"{path.relative_to(PACKAGE.parent).as_posix()}:{node.lineno} {node.name} ({lines})"
          )
  assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(sorted(long))


def test_a_wrapped_call_counts_as_the_line_it_continues():
  source = "def f():\n  g(\n    1,\n    2,\n  )\n  return [\n    3]\n"
  assert _continuation_lines(source) == {3, 4, 5, 7}


# Where a ConfigDict may still be held: the flag edge. sections builds the
# defaults configs/common.py starts from and reads a loaded config;
# configuration is the launch scripts' edge (flag errors, `--set` fields);
# trainer and run take the flags' config (config.json, run.build loads it).
CONFIGDICT_EDGE = {
  "sao_jax.config.sections",
  "sao_jax.train.configuration",
  "sao_jax.train.trainer",
  "sao_jax.train.run",
}


def test_the_configdict_stops_at_the_flag_edge():
  """Below run.build everything reads the typed sections."""
  holders = set()
  for name, path in _modules().items():
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import) and any(
        a.name.startswith("ml_collections") for a in node.names
      ):
        holders.add(name)
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ml_collections"):
        holders.add(name)
  assert holders <= CONFIGDICT_EDGE, (
    f"ml_collections imported below the flag edge: {sorted(holders - CONFIGDICT_EDGE)}"
  )
