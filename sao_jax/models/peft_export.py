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

Not expressible here, refused in one line: adapters on MoE experts
(transformers fuses each layer's experts into one 3-D parameter, which is no
`nn.Linear` module), on a part of a fused tensor (Gated DeltaNet's
in_proj_qkv), and leaves trained whole (the critic's value head; the
critic is not a causal LM). Those export as merged weights
(`hf_export.export_params` of `lora.merge(base, adapters)`).
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
    tensors = hf_layout.layer_tensors(cfg, int(key[len("layer_"):]))
    return {t.ours: t for t in tensors}
  return {"": t for t in hf_layout.top_tensors(cfg) if t.ours == key}


def _adapter_items(tree, prefix: str = ""):
  """(path, {A, B}) of every adapter in a subtree; a whole leaf is refused."""
  for k, v in tree.items():
    path = f"{prefix}/{k}" if prefix else k
    if isinstance(v, dict) and lora.A in v:
      yield path, v
    elif isinstance(v, dict):
      yield from _adapter_items(v, path)
    else:
      raise ValueError(f"peft export: {path!r} is trained whole, not adapted; PEFT's "
                       "LoRA format holds adapters only (export merged weights instead)")


def peft_tensors(cfg: ModelConfig, adapters) -> dict[str, np.ndarray]:
  """The adapter file's tensors (float32), by PEFT's names."""
  shared = {}
  for i in range(cfg.num_layers):
    for t in hf_layout.layer_tensors(cfg, i):
      for name in t.hf:
        shared[name] = shared.get(name, 0) + 1
  out = {}
  for key, sub in _layer_trees(cfg, jax.device_get(adapters)).items():
    if isinstance(sub, dict) and lora.A in sub:  # a top-level matrix (lm_head)
      items = [("", sub)]
    else:
      items = list(_adapter_items(sub if isinstance(sub, dict) else {key: sub}))
    table = _modules(cfg, key)
    for ours, ad in items:
      t = table.get(ours)
      where = f"{key}/{ours}" if ours else key
      if t is None or len(t.hf) != 1 or shared.get(t.hf[0], 1) > 1:
        why = ("MoE experts are one fused parameter in transformers"
               if t is not None and len(t.hf) > 1 else "it is part of a fused tensor"
               if t is not None else "it has no Hugging Face tensor")
        raise ValueError(f"peft export: no nn.Linear module for {where!r} ({why}); "
                         "export merged weights instead")
      module = t.hf[0][:-len(".weight")]
      a, b = np.asarray(ad[lora.A], np.float32), np.asarray(ad[lora.B], np.float32)
      out[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
      out[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.T)
  return out


def adapter_config(cfg: lora.LoraConfig, modules: list[str],
                   base_model: str | None = None) -> dict[str, Any]:
  """peft's LoraConfig as JSON: the adapted modules named in full (peft
  matches a listed name exactly or as a dotted suffix)."""
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
      "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": 0.0, "bias": "none",
      "target_modules": sorted(modules), "fan_in_fan_out": False, "use_rslora": False,
      "use_dora": False, "init_lora_weights": True, "inference_mode": True,
      "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
  }


def export_adapters(adapters, cfg: ModelConfig, lora_cfg: lora.LoraConfig, out: str, *,
                    base_model: str | None = None) -> dict:
  """Writes `out`/adapter_config.json and adapter_model.safetensors; returns
  {"dir", "modules", "parameters"}. `base_model`: the base's HF directory or
  Hub id, recorded for `PeftModel.from_pretrained` users."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  tensors = peft_tensors(cfg, adapters)
  modules = sorted({n[len(PREFIX):-len(".lora_A.weight")] for n in tensors
                    if n.endswith(".lora_A.weight")})
  os.makedirs(out, exist_ok=True)
  save_file(tensors, os.path.join(out, WEIGHTS), metadata={"format": "pt"})
  with open(os.path.join(out, CONFIG), "w", encoding="utf-8") as f:
    json.dump(adapter_config(lora_cfg, modules, base_model), f, indent=2)
  return {"dir": out, "modules": len(modules),
          "parameters": int(sum(x.size for x in tensors.values()))}
