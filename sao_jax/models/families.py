"""The model families sao-jax imports and exports: one record per architecture
(its Hugging Face `model_type`s), the mapping between its `config.json` and
`ModelConfig`.

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
  """One architecture: its `model_type`s, classes, config mapping, layer kinds."""

  name: str  # ModelConfig.family
  # The config.json `model_type`s it reads; the first is what export writes
  # (a text-only causal LM: Qwen3.5's "qwen3_5_text", not the multimodal "qwen3_5").
  model_types: tuple[str, ...]
  causal_lm: str  # `architectures` of a policy export
  # Of a critic export (the value head as `score`); None: transformers has no
  # such class for the family, and a critic export is refused.
  token_classification: str | None
  attention_kinds: frozenset[str]
  mlp_kinds: frozenset[str]
  from_hf: Callable[[dict], dict]  # config.json -> ModelConfig keyword arguments
  to_hf: Callable[[Any], dict]  # ModelConfig -> the family's own config.json fields

  @property
  def model_type(self) -> str:
    return self.model_types[0]


def _require(hf: dict, *names: str) -> list:
  missing = [n for n in names if n not in hf]
  if missing:
    raise ValueError(f"config.json of model_type {hf.get('model_type')!r} lacks {missing}")
  return [hf[n] for n in names]


def _shared_from_hf(hf: dict) -> dict:
  """The fields every Qwen3-style config.json spells alike."""
  vocab, d, layers, heads = _require(
    hf, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"
  )
  rope = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 1e6)
  return dict(
    vocab_size=vocab,
    d_model=d,
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=hf.get("num_key_value_heads") or heads,
    head_dim=hf.get("head_dim") or d // heads,
    rope_theta=float(rope),
    rms_eps=hf.get("rms_norm_eps", 1e-6),
    tie_embeddings=hf.get("tie_word_embeddings", False),
    max_seq_len=hf.get("max_position_embeddings", 4096),
  )


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
    raise ValueError(
      "config.json sets use_sliding_window: sliding-window attention is not supported"
    )
  return dict(
    shared, num_experts=0, experts_per_token=0, moe_d_ff=0, dense_d_ff=d_ff, family="qwen3"
  )


def _qwen3_to_hf(cfg) -> dict:
  return {"intermediate_size": cfg.dense_d_ff, "max_window_layers": cfg.num_layers}


def _qwen3_moe_from_hf(hf: dict) -> dict:
  shared = _shared_from_hf(hf)
  # transformers 5.x writes the expert count as `num_local_experts` (its
  # Qwen3MoeConfig maps `num_experts` onto it); earlier versions and the
  # Hub's release files write `num_experts`. Both are read.
  num_experts = hf.get("num_experts", hf.get("num_local_experts"))
  if num_experts is None:
    raise ValueError(
      "config.json of model_type 'qwen3_moe' sets neither 'num_experts' nor 'num_local_experts'"
    )
  (top_k, moe_ff) = _require(hf, "num_experts_per_tok", "moe_intermediate_size")
  layers = shared["num_layers"]
  step = hf.get("decoder_sparse_step", 1) or 1
  dense = set(hf.get("mlp_only_layers") or [])
  dense |= {i for i in range(layers) if num_experts == 0 or (i + 1) % step != 0}
  return dict(
    shared,
    num_experts=num_experts,
    experts_per_token=top_k,
    moe_d_ff=moe_ff,
    dense_d_ff=hf.get("intermediate_size", 0),
    dense_layers=tuple(sorted(dense)),
    norm_topk_prob=hf.get("norm_topk_prob", True),
    family="qwen3_moe",
  )


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


def _text_config(hf: dict) -> dict:
  """The text model's fields: a multimodal config.json's `text_config`
  (Qwen3.5's releases are image-text models; the vision tower is not
  imported), else the file itself."""
  text = hf.get("text_config")
  if not isinstance(text, dict):
    return hf
  return {"tie_word_embeddings": hf.get("tie_word_embeddings", False), **text}


_LAYER_TYPES = {"linear_attention": "linear", "full_attention": "gated_full"}


def _hybrid_from_hf(hf: dict) -> dict:
  """The fields Qwen3.5 and Qwen3.5-MoE share: the layer pattern, Gated
  DeltaNet's shapes, partial rotary, zero-centred norms."""
  text = _text_config(hf)
  shared = _shared_from_hf(text)
  rope = text.get("rope_parameters") or {}
  if rope.get("rope_type", "default") != "default":
    raise ValueError(f"rope_type {rope['rope_type']!r} is not supported (default RoPE only)")
  layers = shared["num_layers"]
  types = text.get("layer_types")
  if types is None:
    interval = text.get("full_attention_interval", 4)
    types = [
      "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    ]
  if len(types) != layers or any(t not in _LAYER_TYPES for t in types):
    raise ValueError(f"layer_types must list {layers} of {sorted(_LAYER_TYPES)}")
  factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
  conv, kdim, vdim, kheads, vheads = _require(
    text,
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
  )
  return dict(
    shared,
    attention_kinds=tuple(_LAYER_TYPES[t] for t in types),
    linear_conv_kernel=conv,
    linear_key_head_dim=kdim,
    linear_value_head_dim=vdim,
    linear_num_key_heads=kheads,
    linear_num_value_heads=vheads,
    rotary_dim=int(shared["head_dim"] * factor),
    zero_centered_norm=True,
  )


def _hybrid_to_hf(cfg) -> dict:
  factor = cfg.rotary_dims / cfg.head_dim
  return {
    "layer_types": [
      {"linear": "linear_attention"}.get(k, "full_attention")
      for k in (s.attention for s in cfg.layer_specs)
    ],
    "linear_conv_kernel_dim": cfg.linear_conv_kernel,
    "linear_key_head_dim": cfg.linear_key_head_dim,
    "linear_value_head_dim": cfg.linear_value_head_dim,
    "linear_num_key_heads": cfg.linear_num_key_heads,
    "linear_num_value_heads": cfg.linear_num_value_heads,
    "partial_rotary_factor": factor,
    "rope_parameters": {
      "rope_type": "default",
      "rope_theta": cfg.rope_theta,
      "partial_rotary_factor": factor,
    },
  }


def _qwen3_5_from_hf(hf: dict) -> dict:
  (d_ff,) = _require(_text_config(hf), "intermediate_size")
  return dict(
    _hybrid_from_hf(hf),
    num_experts=0,
    experts_per_token=0,
    moe_d_ff=0,
    dense_d_ff=d_ff,
    family="qwen3_5",
  )


def _qwen3_5_to_hf(cfg) -> dict:
  return {**_hybrid_to_hf(cfg), "intermediate_size": cfg.dense_d_ff}


def _qwen3_5_moe_from_hf(hf: dict) -> dict:
  experts, top_k, moe_ff, shared_ff = _require(
    _text_config(hf),
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
  )
  # Every layer is MoE; the router always renormalises its top-k.
  return dict(
    _hybrid_from_hf(hf),
    num_experts=experts,
    experts_per_token=top_k,
    moe_d_ff=moe_ff,
    shared_expert_d_ff=shared_ff,
    norm_topk_prob=True,
    family="qwen3_5_moe",
  )


def _qwen3_5_moe_to_hf(cfg) -> dict:
  return {
    **_hybrid_to_hf(cfg),
    "num_experts": cfg.num_experts,
    "num_experts_per_tok": cfg.experts_per_token,
    "moe_intermediate_size": cfg.moe_d_ff,
    "shared_expert_intermediate_size": cfg.shared_expert_d_ff,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
  }


QWEN3 = Family(
  name="qwen3",
  model_types=("qwen3",),
  causal_lm="Qwen3ForCausalLM",
  token_classification="Qwen3ForTokenClassification",
  attention_kinds=frozenset({"full"}),
  mlp_kinds=frozenset({"dense"}),
  from_hf=_qwen3_from_hf,
  to_hf=_qwen3_to_hf,
)

QWEN3_MOE = Family(
  name="qwen3_moe",
  model_types=("qwen3_moe",),
  causal_lm="Qwen3MoeForCausalLM",
  token_classification="Qwen3MoeForTokenClassification",
  attention_kinds=frozenset({"full"}),
  mlp_kinds=frozenset({"dense", "moe"}),
  from_hf=_qwen3_moe_from_hf,
  to_hf=_qwen3_moe_to_hf,
)

# The Qwen3.5 / 3.6 hybrids: three Gated DeltaNet layers to one gated full
# attention, dense MLPs or MoE with a shared expert.
QWEN3_5 = Family(
  name="qwen3_5",
  model_types=("qwen3_5_text", "qwen3_5"),
  causal_lm="Qwen3_5ForCausalLM",
  # Qwen3_5ForTokenClassification exists but reads the multimodal config
  # (model_type "qwen3_5"): from a text-model directory it loads no weights.
  token_classification=None,
  attention_kinds=frozenset({"linear", "gated_full"}),
  mlp_kinds=frozenset({"dense"}),
  from_hf=_qwen3_5_from_hf,
  to_hf=_qwen3_5_to_hf,
)

QWEN3_5_MOE = Family(
  name="qwen3_5_moe",
  model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
  causal_lm="Qwen3_5MoeForCausalLM",
  token_classification=None,
  attention_kinds=frozenset({"linear", "gated_full"}),
  mlp_kinds=frozenset({"moe_shared"}),
  from_hf=_qwen3_5_moe_from_hf,
  to_hf=_qwen3_5_moe_to_hf,
)

FAMILIES = {f.name: f for f in (QWEN3, QWEN3_MOE, QWEN3_5, QWEN3_5_MOE)}
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}


def get(name: str) -> Family:
  """The family of a ModelConfig.family name or a config.json model_type."""
  fam = FAMILIES.get(name) or _BY_MODEL_TYPE.get(name)
  if fam is None:
    raise ValueError(
      f"model_type {name!r} is not supported; supported: {', '.join(sorted(_BY_MODEL_TYPE))}"
    )
  return fam


def check(cfg) -> None:
  """Raises if `cfg.family` is unknown or cannot hold one of `cfg`'s layers."""
  fam = get(cfg.family)
  for i, spec in enumerate(cfg.layer_specs):
    if spec.attention not in fam.attention_kinds or spec.mlp not in fam.mlp_kinds:
      raise ValueError(
        f"family {cfg.family!r} has no {spec.attention}-attention / {spec.mlp}-MLP layer "
        f"(layer {i}); it holds attention {sorted(fam.attention_kinds)}, MLP "
        f"{sorted(fam.mlp_kinds)}"
      )


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
  if head == "value" and fam.token_classification is None:
    raise ValueError(
      f"transformers has no token-classification class for family "
      f"{fam.name!r}: the critic cannot be exported as one"
    )
  out = {
    "architectures": [fam.token_classification if head == "value" else fam.causal_lm],
    "model_type": fam.model_type,
    **_shared_to_hf(cfg),
    **fam.to_hf(cfg),
    "torch_dtype": dtype,
  }
  if head == "value":
    out["num_labels"] = 1
  return out
