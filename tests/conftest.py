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
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "sao_jax_test_compile_cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# What the tests' libraries write outside a test's tmp dir goes to one
# scratch directory of this session's, removed at its end: libtpu's logs
# (the AOT compile tests load it on purpose; else /tmp/tpu_logs) and Ray's
# sessions (else /tmp/ray/session_*). xdist workers inherit the controller's.
if "SAO_JAX_TEST_SCRATCH" not in os.environ:
  import atexit
  import shutil

  os.environ["SAO_JAX_TEST_SCRATCH"] = tempfile.mkdtemp(prefix="sao_jax_test_")
  atexit.register(shutil.rmtree, os.environ["SAO_JAX_TEST_SCRATCH"], True)
os.environ.setdefault("TPU_LOG_DIR", os.path.join(os.environ["SAO_JAX_TEST_SCRATCH"], "tpu_logs"))
os.environ.setdefault("RAY_TMPDIR", os.path.join(os.environ["SAO_JAX_TEST_SCRATCH"], "ray"))

# The suites sit beside the layer they test (tests/algo/, tests/models/, ...)
# and share helpers by module name (`from test_trainer import demo_trajs`):
# every test folder is importable, whichever file pytest collects first.
import sys

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


# The test tiers. A file here is `integration`: it launches the trainer (as a
# subprocess or in process), a subprocess, a server or a multi-process fleet,
# or it compiles a whole model's programs (engine, train step, oracles in
# transformers), which costs minutes of CPU. Every other test is `unit`:
# `make test-fast` runs those alone, in under 2 minutes on 2 cores. A test
# marked `slow` in its file keeps that mark and no tier: `make test` runs
# unit + integration, `make test-all` the slow ones too.
INTEGRATION = frozenset(
  {
    "data/test_checkpoint_multiprocess.py",  # two checkpointing processes
    "transport/test_fleet.py",  # a fleet of trainer processes
    "data/test_gcs.py",  # a GCS emulator server
    "transport/test_weight_transfer.py",  # sender and receiver processes
    "transport/test_weight_channel.py",  # each channel end to end, the transfer server
    "envs/test_math_tool.py",  # trains in process
    "envs/test_repo_repair.py",  # trains in process
    "envs/test_grader_hacks.py",  # graders in sandboxed subprocesses
    "envs/test_humaneval.py",  # graders in sandboxed subprocesses
    "envs/test_sandbox.py",  # sandboxed subprocesses
    "envs/test_sandbox_limits.py",  # sandboxed subprocesses
    "envs/test_user_package.py",  # the trainer on a user's package
    "envs/test_verify.py",  # the verifier's worker process
    "faults/test_bad_config.py",  # launches the trainer
    "faults/test_bad_data.py",  # a killed writer process
    "faults/test_checkpoint_faults.py",  # a killed writer process
    "faults/test_disk_full_run.py",  # launches the trainer
    "faults/test_trainer_faults.py",  # launches the trainer
    "models/test_hf_export.py",  # multi-process export
    "models/test_platforms.py",  # a fresh interpreter
    "pod/test_kube.py",  # subprocesses
    "pod/test_netns.py",  # network namespaces, subprocesses
    "pod/test_pod_ray.py",  # a Ray cluster
    "serving/test_jetstream.py",  # the gRPC server
    "serving/test_openai_api.py",  # the HTTP endpoint and agent subprocesses
    "serving/test_openai_server.py",  # the HTTP endpoint
    "rollout/test_routing_replay.py",  # launches the trainer
    "rollout/test_vllm_backend.py",  # a vLLM server
    "rollout/test_vllm_chain.py",  # a vLLM server
    "rollout/test_vllm_fleet.py",  # a vLLM server and trainer processes
    "serving/test_vllm_serving.py",  # a vLLM server
    "test_compile.py",  # launch/compile.py subprocesses
    "test_experiments.py",  # the experiment scripts
    "test_export_vllm.py",  # a vLLM server
    "test_fairness.py",  # trains in process
    "test_notebooks.py",  # runs the notebooks
    "train/test_eval_data.py",  # launches the trainer
    "train/test_eval_jsonl.py",  # launches the trainer
    "train/test_extension_points.py",  # runs the RL loop in process
    "train/test_lora_run.py",  # launches the trainer
    "train/test_multihost.py",  # a multi-process run
    "train/test_qwen3_5_run.py",  # launches the trainer
    "train/test_trainer.py",  # launches the trainer
    "train/test_wandb.py",  # W&B's service process
    # Whole-model programs compiled on CPU.
    "transport/test_weight_delta.py",
    "envs/test_tokenizers.py",  # every HF tokenizer of the corpus loaded
    "faults/test_env_faults.py",
    "faults/test_nonfinite_updates.py",
    "models/test_action_logits.py",
    "models/test_context_parallel.py",
    "models/test_deltanet.py",
    "models/test_families.py",
    "models/test_head_vocab.py",
    "models/test_hf_import.py",
    "models/test_lora.py",
    "models/test_model_scale.py",
    "models/test_models.py",
    "models/test_moe_parallel.py",
    "models/test_paged.py",
    "models/test_precision.py",
    "models/test_qwen3_5.py",
    "models/test_routing.py",
    "rollout/test_chat_driver.py",
    "rollout/test_chunked_prefill.py",
    "rollout/test_compile_engine.py",
    "rollout/test_engine_sharded.py",
    "rollout/test_rollout.py",
    "serving/test_serving.py",
    "test_export_run.py",
    "test_export_tokenizer.py",
    "train/test_dis_diagnostics.py",
    "train/test_eval_sets.py",
    "train/test_train_step.py",
  }
)


def pytest_configure(config):
  # `make test` (CI) deselects these; `make test-all` runs them. Each one's
  # ground is covered in the default run by a named lighter test.
  config.addinivalue_line(
    "markers",
    "slow: a heavy end-to-end test whose coverage the default run has "
    "elsewhere (deselected by `make test`, run by `make test-all`)",
  )
  config.addinivalue_line(
    "markers",
    "integration: launches the trainer, a subprocess, a server or a "
    "multi-process fleet (tests/conftest.py INTEGRATION lists the files)",
  )
  config.addinivalue_line(
    "markers", "unit: in one process, quick (`make test-fast` runs these alone)"
  )
  moved = sorted(f for f in INTEGRATION if not os.path.isfile(os.path.join(_HERE, f)))
  if moved:
    raise pytest.UsageError(f"tests/conftest.py INTEGRATION names missing files: {moved}")


def pytest_ignore_collect(collection_path, config):
  """`-m unit` does not import the integration files at all (their imports,
  torch and transformers among them, are most of a collection's time)."""
  if config.getoption("markexpr") == "unit":
    path = os.path.relpath(str(collection_path), _HERE).replace(os.sep, "/")
    if path in INTEGRATION:
      return True
  return None


def pytest_collection_modifyitems(config, items):
  """Gives each test not marked slow its tier, by file (INTEGRATION); a test
  marked integration itself (a subprocess in an otherwise quick file) keeps it."""
  del config  # unused
  for item in items:
    if item.get_closest_marker("slow") or item.get_closest_marker("integration"):
      continue
    path = os.path.relpath(str(item.path), _HERE).replace(os.sep, "/")
    item.add_marker(pytest.mark.integration if path in INTEGRATION else pytest.mark.unit)


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """After each test file, JAX's in-memory caches (compiled executables,
  traced jaxprs) are dropped: an xdist worker runs hundreds of files, and
  kept, their programs grew a worker past 7 GB, where two workers and a
  trainer launch outgrow a 24 GB machine. The persistent compile cache
  above still turns the next file's compiles of the same programs into loads."""
  yield
  import jax

  jax.clear_caches()
  gc.collect()
