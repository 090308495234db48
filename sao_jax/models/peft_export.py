"""LoRA adapters as a PEFT adapter directory that `peft` loads onto transformers.

    out/adapter_config.json          peft's LoraConfig: r, lora_alpha, the
                                     adapted modules by their full names
    out/adapter_model.safetensors    base_model.model.<module>.lora_A.weight [r, in]
                                     base_model.model.<module>.lora_B.weight [out, r]

Module names come from hf_layout's table (the tensor `model.layers.3.
self_attn.q_proj.weight` is the module `model.layers.3.self_attn.q_proj`).
Ours are A [in, r] and B [r, out] over a weight viewed as [in, out]
(sao_jax/models/lora.py); an `nn.Linear` holds [out, in] and peft adds
`lora_B.weight @ lora_A.weight` (x) scale, so lora_A = A^T and lora_B = B^T,
with the same row-major flattening of head axes that hf_layout writes
(q [d, heads, head_dim] -> q_proj [heads * head_dim, d]). peft's scale is
lora_alpha / r, ours alpha / r.

MoE experts: transformers fuses a layer's experts into the parameters
`mlp.experts.gate_up_proj` [E, 2F, d] and `down_proj` [E, d, F], which peft
adapts as `target_parameters` (one adapter per expert, its 3-D layout in
`_experts`); our separate gate and up adapters become one of rank 2r on
gate_up_proj (`_gate_up`), and the file's other adapters are zero-padded to
2r with alpha doubled, so every product and scale is unchanged.

Not expressible here, refused in one line: an adapter on a part of a fused
tensor (Gated DeltaNet's in_proj_qkv) and leaves trained whole (the
critic's value head; the critic is not a causal LM). Those export as merged
weights (`hf_export.export_params` of `lora.merge(base, adapters)`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from sao_jax.models import hf_layout, lora, policy
from sao_jax.models.config import ModelConfig

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def _layer_trees(cfg: ModelConfig, adapters) -> dict:
  """{top-level name or "layer_i": subtree} of the adapters, scanned stacks split."""
  tree = dict(adapters)
  if cfg.scan_layers and "layers" in tree:
    tree = policy.unscan_params(cfg, tree)
  return tree


def _modules(cfg: ModelConfig, key: str) -> dict[str, hf_layout.Tensor]:
  """Our path inside `key` ("attn/q", or "" for a top-level leaf) -> its Tensor."""
  if key.startswith("layer_"):
    tensors = hf_layout.layer_tensors(cfg, int(key[len("layer_") :]))
    return {t.ours: t for t in tensors}
  found = [t for t in hf_layout.top_tensors(cfg) if t.ours == key]
  return {"": found[-1]} if found else {}


def _adapter_items(tree, prefix: str = ""):
  """(path, {A, B}) of every adapter in a subtree; a whole leaf is refused."""
  for k, v in tree.items():
    path = f"{prefix}/{k}" if prefix else k
    if isinstance(v, dict) and lora.A in v:
      yield path, v
    elif isinstance(v, dict):
      yield from _adapter_items(v, path)
    else:
      raise ValueError(
        f"peft export: {path!r} is trained whole, not adapted; PEFT's "
        "LoRA format holds adapters only (export merged weights instead)"
      )


# Our experts' matrices -> their fused parameter in transformers' Qwen3-MoE
# (`mlp.experts.gate_up_proj` [E, 2F, d]: gate rows first; `down_proj` [E, d, F]).
_EXPERTS = {"moe/wi_gate": "gate_up_proj", "moe/wi_up": "gate_up_proj", "moe/wo": "down_proj"}


def _zero_pad(ad: dict, rank: int) -> tuple[np.ndarray, np.ndarray]:
  """(A, B) with rank `rank`: zero columns of A and rows of B (A @ B unchanged)."""
  a, b = np.asarray(ad[lora.A], np.float32), np.asarray(ad[lora.B], np.float32)
  extra = rank - a.shape[-1]
  pad = lambda x, axis: np.concatenate(
    [x, np.zeros(x.shape[:axis] + (extra,) + x.shape[axis + 1 :], np.float32)], axis
  )
  return (pad(a, a.ndim - 1), pad(b, b.ndim - 2)) if extra else (a, b)


def _gate_up(layer: dict, f: int, r: int) -> tuple[np.ndarray, np.ndarray]:
  """One rank-2r adapter of the fused gate_up_proj from the rank-r gate and up
  ones (A = [A_gate | A_up], B block-diagonal: A @ B = [A_g B_g | A_u B_u]); a
  matrix without an adapter contributes zeros."""
  parts = [layer.get("wi_gate"), layer.get("wi_up")]
  some = next(p for p in parts if p is not None)
  e, d = np.shape(some[lora.A])[:2]
  a, b = np.zeros((e, d, 2 * r), np.float32), np.zeros((e, 2 * r, 2 * f), np.float32)
  for j, part in enumerate(parts):
    if part is not None:
      a[:, :, j * r : (j + 1) * r] = np.asarray(part[lora.A], np.float32)
      b[:, j * r : (j + 1) * r, j * f : (j + 1) * f] = np.asarray(part[lora.B], np.float32)
  return a, b


def _experts(cfg: ModelConfig, i: int, moe: dict, r: int, rank: int, out: dict) -> list[str]:
  """Layer i's expert adapters as peft's ParamWrappers (one per fused parameter,
  nested on the module `experts` in the order of the returned names: the first
  is innermost, `experts.base_layer`). peft's 3-D layout: lora_A [E * R, in]
  (expert-major), lora_B [out, R * E] (expert-minor)."""
  module = f"model.layers.{i}.mlp.experts"
  fused = []
  if "wi_gate" in moe or "wi_up" in moe:
    fused.append(
      ("gate_up_proj", _zero_pad(dict(zip((lora.A, lora.B), _gate_up(moe, cfg.moe_d_ff, r))), rank))
    )
  if "wo" in moe:
    fused.append(("down_proj", _zero_pad(moe["wo"], rank)))
  for depth, (_, (a, b)) in enumerate(fused):
    name = module + ".base_layer" * (len(fused) - 1 - depth)
    out[f"{PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(
      np.transpose(a, (0, 2, 1)).reshape(-1, a.shape[1])
    )
    out[f"{PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(
      np.transpose(b, (2, 1, 0)).reshape(b.shape[2], -1)
    )
  return [f"{module}.{param}" for param, _ in fused]


def _linear_module(cfg: ModelConfig, key: str, ours: str, shared: dict) -> str:
  """The nn.Linear module of our matrix `ours` in `key`, or a one-line refusal."""
  t = _modules(cfg, key).get(ours)
  where = f"{key}/{ours}" if ours else key
  if t is None or len(t.hf) != 1 or shared.get(t.hf[0], 1) > 1:
    why = "it is part of a fused tensor" if t is not None else "it has no Hugging Face tensor"
    raise ValueError(
      f"peft export: no nn.Linear module for {where!r} ({why}); export merged weights instead"
    )
  return t.hf[0][: -len(".weight")]


def peft_adapter(cfg: ModelConfig, adapters, rank: int) -> tuple[dict, list, list, int]:
  """(tensors by PEFT's names, target modules, target parameters, the file's rank).

  Adapters on the experts' gate and up matrices share transformers' fused
  gate_up_proj, so they export as one adapter of rank 2r; every other
  adapter is then zero-padded to 2r (peft's rank is one per file here) and
  the alpha scaled with it (`adapter_config`), which leaves each A @ B, and
  the scale, as they were.
  """
  adapters = _layer_trees(cfg, jax.device_get(adapters))
  fused = any(
    _EXPERTS.get(p) == "gate_up_proj"
    for sub in adapters.values()
    if isinstance(sub, dict)
    for p, _ in _adapter_items(sub)
  )
  out_rank = 2 * rank if fused else rank
  shared = {}
  for i in range(cfg.num_layers):
    for t in hf_layout.layer_tensors(cfg, i):
      for name in t.hf:
        shared[name] = shared.get(name, 0) + 1
  tensors, modules, params = {}, [], []
  for key, sub in adapters.items():
    if isinstance(sub, dict) and lora.A in sub:  # a top-level matrix (lm_head)
      items = [("", sub)]
    else:
      items = list(_adapter_items(sub if isinstance(sub, dict) else {key: sub}))
    for ours, ad in items:
      if ours in _EXPERTS:
        continue
      module = _linear_module(cfg, key, ours, shared)
      a, b = _zero_pad(ad, out_rank)
      tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
      tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.T)
      modules.append(module)
    if any(ours in _EXPERTS for ours, _ in items):
      params += _experts(cfg, int(key[len("layer_") :]), sub["moe"], rank, out_rank, tensors)
  return tensors, modules, params, out_rank


def adapter_config(
  cfg: lora.LoraConfig,
  modules: list[str],
  parameters: list[str],
  rank: int,
  base_model: str | None = None,
) -> dict[str, Any]:
  """peft's LoraConfig as JSON: the adapted modules and (fused expert)
  parameters named in full (peft matches a listed name exactly or as a dotted
  suffix); `rank` the file's (>= cfg.rank), alpha scaled to keep alpha / r."""
  return {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base_model,
    "r": rank,
    "lora_alpha": cfg.alpha * rank / cfg.rank,
    "lora_dropout": 0.0,
    "bias": "none",
    "target_modules": sorted(modules),
    "target_parameters": parameters,
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "init_lora_weights": True,
    "inference_mode": True,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
  }


def export_adapters(
  adapters, cfg: ModelConfig, lora_cfg: lora.LoraConfig, out: str, *, base_model: str | None = None
) -> dict:
  """Writes `out`/adapter_config.json and adapter_model.safetensors; returns
  {"dir", "modules", "parameters", "rank", "elements"}. `base_model`: the
  base's HF directory or Hub id, recorded for `PeftModel.from_pretrained` users."""
  from safetensors.numpy import save_file

  tensors, modules, params, rank = peft_adapter(cfg, adapters, lora_cfg.rank)
  os.makedirs(out, exist_ok=True)
  save_file(tensors, os.path.join(out, WEIGHTS), metadata={"format": "pt"})
  with open(os.path.join(out, CONFIG), "w", encoding="utf-8") as f:
    json.dump(adapter_config(lora_cfg, modules, params, rank, base_model), f, indent=2)
  return {
    "dir": out,
    "modules": len(modules),
    "parameters": len(params),
    "rank": rank,
    "elements": int(sum(x.size for x in tensors.values())),
  }
