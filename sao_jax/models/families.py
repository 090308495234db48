"""The model families sao-jax imports and exports: one record per Hugging Face
`model_type`, the mapping between its `config.json` and `ModelConfig`.

    fam = FAMILIES["qwen3"]
    kwargs = fam.from_hf(config_json)       # ModelConfig fields
    config_json = hf_config(cfg)            # what transformers reads back

A family says which layer kinds it can hold (`ModelConfig.layer_specs`);
the tensors of each kind are named once, in `hf_layout`, whichever family
holds the layer. Adding a family is a record here plus its parity test
against transformers' own class (tests/models/test_families.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Family:
  """One `model_type`: its classes, its config mapping, its layer kinds."""
  model_type: str
  causal_lm: str  # `architectures` of a policy export
  token_classification: str  # of a critic export (the value head as `score`)
  attention_kinds: frozenset[str]
  mlp_kinds: frozenset[str]
  from_hf: Callable[[dict], dict]  # config.json -> ModelConfig keyword arguments
  to_hf: Callable[[Any], dict]  # ModelConfig -> the family's own config.json fields


def _require(hf: dict, *names: str) -> list:
  missing = [n for n in names if n not in hf]
  if missing:
    raise ValueError(f"config.json of model_type {hf.get('model_type')!r} lacks {missing}")
  return [hf[n] for n in names]


def _shared_from_hf(hf: dict) -> dict:
  """The fields every Qwen3-style config.json spells alike."""
  vocab, d, layers, heads = _require(hf, "vocab_size", "hidden_size", "num_hidden_layers",
                                     "num_attention_heads")
  rope = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 1e6)
  return dict(
      vocab_size=vocab, d_model=d, num_layers=layers, num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or d // heads, rope_theta=float(rope),
      rms_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=hf.get("tie_word_embeddings", False),
      max_seq_len=hf.get("max_position_embeddings", 4096))


def _shared_to_hf(cfg) -> dict:
  return {
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "rms_norm_eps": cfg.rms_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None,
      "max_position_embeddings": cfg.max_seq_len,
      "tie_word_embeddings": cfg.tie_embeddings,
      "attention_bias": False,
      "attention_dropout": 0.0,
      "hidden_act": "silu",
      "use_sliding_window": False,
      "sliding_window": None,
      "initializer_range": 0.02,
      "use_cache": True,
  }


def _qwen3_from_hf(hf: dict) -> dict:
  shared = _shared_from_hf(hf)
  (d_ff,) = _require(hf, "intermediate_size")
  if hf.get("use_sliding_window"):
    raise ValueError("config.json sets use_sliding_window: sliding-window attention is "
                     "not supported")
  return dict(shared, num_experts=0, experts_per_token=0, moe_d_ff=0, dense_d_ff=d_ff,
              family="qwen3")


def _qwen3_to_hf(cfg) -> dict:
  return {"intermediate_size": cfg.dense_d_ff, "max_window_layers": cfg.num_layers}


def _qwen3_moe_from_hf(hf: dict) -> dict:
  shared = _shared_from_hf(hf)
  # transformers 5.x writes the expert count as `num_local_experts` (its
  # Qwen3MoeConfig maps `num_experts` onto it); earlier versions and the
  # Hub's release files write `num_experts`. Both are read.
  num_experts = hf.get("num_experts", hf.get("num_local_experts"))
  if num_experts is None:
    raise ValueError("config.json of model_type 'qwen3_moe' sets neither 'num_experts' nor "
                     "'num_local_experts'")
  (top_k, moe_ff) = _require(hf, "num_experts_per_tok", "moe_intermediate_size")
  layers = shared["num_layers"]
  step = hf.get("decoder_sparse_step", 1) or 1
  dense = set(hf.get("mlp_only_layers") or [])
  dense |= {i for i in range(layers) if num_experts == 0 or (i + 1) % step != 0}
  return dict(shared, num_experts=num_experts, experts_per_token=top_k, moe_d_ff=moe_ff,
              dense_d_ff=hf.get("intermediate_size", 0), dense_layers=tuple(sorted(dense)),
              norm_topk_prob=hf.get("norm_topk_prob", True), family="qwen3_moe")


def _qwen3_moe_to_hf(cfg) -> dict:
  return {
      "intermediate_size": cfg.dense_d_ff,  # dense (mlp_only) layers' width
      "moe_intermediate_size": cfg.moe_d_ff,
      "num_experts": cfg.num_experts,
      "num_experts_per_tok": cfg.experts_per_token,
      "norm_topk_prob": cfg.norm_topk_prob,
      "decoder_sparse_step": 1,
      "mlp_only_layers": list(cfg.dense_layers),
      "output_router_logits": False,
      "router_aux_loss_coef": 0.001,
  }


QWEN3 = Family(
    model_type="qwen3", causal_lm="Qwen3ForCausalLM",
    token_classification="Qwen3ForTokenClassification",
    attention_kinds=frozenset({"full"}), mlp_kinds=frozenset({"dense"}),
    from_hf=_qwen3_from_hf, to_hf=_qwen3_to_hf)

QWEN3_MOE = Family(
    model_type="qwen3_moe", causal_lm="Qwen3MoeForCausalLM",
    token_classification="Qwen3MoeForTokenClassification",
    attention_kinds=frozenset({"full"}), mlp_kinds=frozenset({"dense", "moe"}),
    from_hf=_qwen3_moe_from_hf, to_hf=_qwen3_moe_to_hf)

FAMILIES = {f.model_type: f for f in (QWEN3, QWEN3_MOE)}


def get(model_type: str) -> Family:
  if model_type not in FAMILIES:
    raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                     f"{', '.join(sorted(FAMILIES))}")
  return FAMILIES[model_type]


def check(cfg) -> None:
  """Raises if `cfg.family` is unknown or cannot hold one of `cfg`'s layers."""
  fam = get(cfg.family)
  for i, spec in enumerate(cfg.layer_specs):
    if spec.attention not in fam.attention_kinds or spec.mlp not in fam.mlp_kinds:
      raise ValueError(
          f"family {cfg.family!r} has no {spec.attention}-attention / {spec.mlp}-MLP layer "
          f"(layer {i}); it holds attention {sorted(fam.attention_kinds)}, MLP "
          f"{sorted(fam.mlp_kinds)}")


def read_config_json(path: str) -> tuple[str, dict]:
  """(the file read, its JSON) from a `config.json` or its directory."""
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  with open(path, encoding="utf-8") as f:
    hf = json.load(f)
  if not isinstance(hf, dict):
    raise ValueError(f"{path}: not a JSON object")
  return path, hf


def config_kwargs(path: str) -> dict:
  """ModelConfig keyword arguments from an HF `config.json` (file or directory),
  by its `model_type`; one line naming the supported ones otherwise."""
  path, hf = read_config_json(path)
  try:
    return get(hf.get("model_type", "")).from_hf(hf)
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None


def hf_config(cfg, dtype: str = "bfloat16", head: str = "lm") -> dict:
  """The `config.json` of `cfg`'s family: what `config_kwargs` and transformers'
  own config class read back to the same architecture. `head="value"`: the
  critic as a one-label token classifier."""
  fam = get(cfg.family)
  out = {"architectures": [fam.token_classification if head == "value" else fam.causal_lm],
         "model_type": fam.model_type, **_shared_to_hf(cfg), **fam.to_hf(cfg),
         "torch_dtype": dtype}
  if head == "value":
    out["num_labels"] = 1
  return out
