"""Shared test setup: 8 simulated CPU devices, before JAX initialises.

Compiled programs go to a persistent cache shared by the test processes
(xdist workers and the trainer launches they start): the end-to-end tests
launch the same tiny programs many times, and a cache hit replaces a
compile. Cache keys include the program and the JAX version, so a code
change cannot reuse a stale entry.
"""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "sao_jax_test_compile_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# What the tests' libraries write outside a test's tmp dir goes to one
# scratch directory of this session's, removed at its end: libtpu's logs
# (the AOT compile tests load it on purpose; else /tmp/tpu_logs) and Ray's
# sessions (else /tmp/ray/session_*). xdist workers inherit the controller's.
if "SAO_JAX_TEST_SCRATCH" not in os.environ:
  import atexit  # pylint: disable=g-import-not-at-top,g-bad-import-order
  import shutil  # pylint: disable=g-import-not-at-top,g-bad-import-order
  os.environ["SAO_JAX_TEST_SCRATCH"] = tempfile.mkdtemp(prefix="sao_jax_test_")
  atexit.register(shutil.rmtree, os.environ["SAO_JAX_TEST_SCRATCH"], True)
os.environ.setdefault("TPU_LOG_DIR", os.path.join(os.environ["SAO_JAX_TEST_SCRATCH"], "tpu_logs"))
os.environ.setdefault("RAY_TMPDIR", os.path.join(os.environ["SAO_JAX_TEST_SCRATCH"], "ray"))

# The suites sit beside the layer they test (tests/algo/, tests/models/, ...)
# and share helpers by module name (`from test_trainer import demo_trajs`):
# every test folder is importable, whichever file pytest collects first.
import sys  # pylint: disable=g-import-not-at-top,g-bad-import-order

_HERE = os.path.dirname(os.path.abspath(__file__))
# The repository root too: the config files import their bases as the
# `configs` package (`from configs import common`), which is not installed.
_ROOT = os.path.dirname(_HERE)
if _ROOT not in (os.path.abspath(p or os.curdir) for p in sys.path):
  sys.path.append(_ROOT)
for _entry in sorted(os.listdir(_HERE)):
  _folder = os.path.join(_HERE, _entry)
  if os.path.isdir(_folder) and not _entry.startswith((".", "_")) and _folder not in sys.path:
    sys.path.append(_folder)


def pytest_configure(config):
  # `make test` (CI) deselects these; `make test-all` runs them. Each one's
  # ground is covered in the default run by a named lighter test.
  config.addinivalue_line(
      "markers", "slow: a heavy end-to-end test whose coverage the default run has "
      "elsewhere (deselected by `make test`, run by `make test-all`)")


import gc  # pylint: disable=g-import-not-at-top,g-bad-import-order

import pytest  # pylint: disable=g-import-not-at-top,g-bad-import-order


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """After each test file, JAX's in-memory caches (compiled executables,
  traced jaxprs) are dropped: an xdist worker runs hundreds of files, and
  kept, their programs grew a worker past 7 GB, where two workers and a
  trainer launch outgrow a 24 GB machine. The persistent compile cache
  above still turns the next file's compiles of the same programs into loads."""
  yield
  import jax  # pylint: disable=g-import-not-at-top
  jax.clear_caches()
  gc.collect()
