"""Notebooks stay in sync with the code: valid JSON, code cells that compile."""

import ast
import glob
import json
import os

import pytest

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))


def test_there_are_notebooks():
  assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_code_cells_parse_and_use_real_names(path):
  nb = json.load(open(path, encoding="utf-8"))
  from sao_jax import trainer  # pylint: disable=g-import-not-at-top
  for cell in nb["cells"]:
    if cell["cell_type"] != "code":
      continue
    src = "".join(line for line in cell["source"] if not line.lstrip().startswith(("%", "!")))
    tree = ast.parse(src)
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id == "trainer"):
        assert hasattr(trainer, node.attr), node.attr
