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
  from sao_jax.train import trainer

  for cell in nb["cells"]:
    if cell["cell_type"] != "code":
      continue
    src = "".join(line for line in cell["source"] if not line.lstrip().startswith(("%", "!")))
    tree = ast.parse(src)
    for node in ast.walk(tree):
      if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "trainer"
      ):
        assert hasattr(trainer, node.attr), node.attr


_EXECUTE = """
import json, sys
nb = json.load(open(sys.argv[1], encoding="utf-8"))
namespace = {"__name__": "__main__"}
for i, cell in enumerate(nb["cells"]):
  if cell["cell_type"] != "code":
    continue
  # Shell and magic lines (installs) are for Colab; the test runs in .venv.
  src = "".join(l for l in cell["source"] if not l.lstrip().startswith(("%", "!")))
  print(f"--- cell {i}", flush=True)
  exec(compile(src, f"cell {i}", "exec"), namespace)
"""


# The Colab notebook runs headless in the default run (the next test); every
# notebook's cells parse and name real functions (test_code_cells_parse_...).
@pytest.mark.slow
def test_quickstart_executes_headless_on_a_smoke_budget(tmp_path):
  """Every code cell of notebooks/quickstart.ipynb runs, top to bottom, in one namespace;
  its workdir (`tempfile.mkdtemp`) lands in the test's tmp dir (TMPDIR), not /tmp."""
  import subprocess
  import sys

  nb_dir = os.path.join(os.path.dirname(__file__), "..", "notebooks")
  # One CPU device (the notebook's setting), not the tests' simulated eight.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(SAO_QUICKSTART_SMOKE="1", MPLBACKEND="Agg", JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
  proc = subprocess.run(
    [sys.executable, "-c", _EXECUTE, "quickstart.ipynb"],
    cwd=nb_dir,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "--- cell" in proc.stdout and "turns, reward" in proc.stdout
  assert glob.glob(str(tmp_path / "sao_quickstart_*" / "metrics.jsonl"))


def test_qwen3_colab_runs_on_a_tiny_checkpoint_transformers_saved(tmp_path):
  """notebooks/qwen3_colab.ipynb, every cell, on a tiny random Qwen3 that
  `Qwen3ForCausalLM.save_pretrained` wrote with a tokenizer.json and Qwen3's
  chat template (tests/hf_fixtures.py): import, the template check, SFT ->
  value pretraining -> async SAO -> eval, and an export transformers loads."""
  pytest.importorskip("transformers", reason="the 'parity' extra (make test installs it)")
  import subprocess
  import sys

  import hf_fixtures

  hf_dir = hf_fixtures.write_tiny_qwen3(str(tmp_path / "tiny_qwen3"))
  nb_dir = os.path.join(os.path.dirname(__file__), "..", "notebooks")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(
    SAO_COLAB_SMOKE="1",
    SAO_COLAB_HF_DIR=hf_dir,
    MPLBACKEND="Agg",
    JAX_PLATFORMS="cpu",
    TMPDIR=str(tmp_path),
  )  # its workdir: removed with tmp_path
  proc = subprocess.run(
    [sys.executable, "-c", _EXECUTE, "qwen3_colab.ipynb"],
    cwd=nb_dir,
    env=env,
    capture_output=True,
    text=True,
    timeout=1200,
    check=False,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = proc.stdout
  assert "[model] qwen3 from" in out and "[sft] 2/2" in out and "[rl] 2/2" in out
  assert "max |logit difference|" in out
