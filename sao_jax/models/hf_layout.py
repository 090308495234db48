"""The one table between sao-jax parameter paths and Hugging Face Qwen3-MoE tensors.

Import (`hf_import.py`) and export (`hf_export.py`) both read it, so a
name or a transpose is written once. Each `Tensor` names a parameter of
ours (a path inside one layer, "attn/q", or a top-level one, "embed"), the
HF tensors it is made of, and the two conversions:

    to_ours(reader) -> our array       reader: .get(hf name), `name in reader`
    to_hf(our array) -> [(hf name, array), ...]     in the order of `hf`; views
                                                   (reshape, .T, x[j]) only, so
                                                   export plans shards with it
                                                   on a zero-strided array

Our layout keeps heads and experts as axes ([d, heads, head_dim], one
[experts, d, f] tensor per MoE matrix) and stores matrices as [in, out]; HF
stores `nn.Linear` weights as [out, in], attention projections flat, and
experts one tensor each (`mlp.experts.{j}.gate_proj.weight`, the Hub's
layout, which export writes) or fused 3-D (`mlp.experts.gate_up_proj`,
recent transformers' layout, which import also reads).

Layer i's parameters are "layer_{i}/<path>", or, with `cfg.scan_layers`,
slice j of the stacked "layers/<path>" for the MoE layers after the
unrolled dense prefix (`unrolled_layers`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from sao_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Tensor:
  ours: str
  hf: tuple[str, ...]
  to_ours: Callable  # reader -> np.ndarray
  to_hf: Callable  # np.ndarray -> list[(name, np.ndarray)]


def _linear(ours: str, name: str, unflatten: Callable[[tuple], tuple] | None = None,
            in_axes: int = 1) -> Tensor:
  """An `nn.Linear` weight: HF [out, in] <-> ours [in..., out...].

  `unflatten`: our shape from the transposed [in, out] one (heads as axes);
  `in_axes`: how many of our leading axes are the input (2 for attn/o's
  [heads, head_dim, d]).
  """

  def to_ours(r):
    w = r.get(name).T
    return w.reshape(unflatten(w.shape)) if unflatten else w

  def to_hf(x):
    flat = x.reshape(int(np.prod(x.shape[:in_axes])), -1)
    return [(name, flat.T)]

  return Tensor(ours, (name,), to_ours, to_hf)


def _copy(ours: str, name: str) -> Tensor:
  return Tensor(ours, (name,), lambda r: r.get(name), lambda x: [(name, x)])


def _experts(ours: str, pre: str, theirs: str, cfg: ModelConfig) -> Tensor:
  """One MoE matrix: ours [E, in, out] <-> HF per-expert [out, in] (or fused, import only)."""
  names = tuple(f"{pre}mlp.experts.{j}.{theirs}.weight" for j in range(cfg.num_experts))
  f = cfg.moe_d_ff

  def to_ours(r):
    fused = pre + ("mlp.experts.down_proj" if theirs == "down_proj"
                   else "mlp.experts.gate_up_proj")
    if fused in r:
      w = r.get(fused)
      if theirs == "gate_proj":
        w = w[:, :f]
      elif theirs == "up_proj":
        w = w[:, f:]
      return np.swapaxes(w, 1, 2)
    first = r.get(names[0]).T
    buf = np.empty((cfg.num_experts,) + first.shape, first.dtype)  # one layer's experts
    buf[0] = first
    for j in range(1, cfg.num_experts):
      buf[j] = r.get(names[j]).T
    return buf

  def to_hf(x):
    return [(n, x[j].T) for j, n in enumerate(names)]

  return Tensor(ours, names, to_ours, to_hf)


def fused_names(cfg: ModelConfig, i: int) -> tuple[str, ...]:
  """Layer i's fused expert tensors (recent transformers' layout), which import accepts."""
  if i in cfg.dense_layers:
    return ()
  pre = f"model.layers.{i}."
  return (pre + "mlp.experts.gate_up_proj", pre + "mlp.experts.down_proj")


def layer_tensors(cfg: ModelConfig, i: int) -> list[Tensor]:
  """Layer i's parameters, paths relative to the layer ("attn/q", "moe/wo", ...)."""
  pre = f"model.layers.{i}."
  h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  out = [
      _copy("attn_norm/scale", pre + "input_layernorm.weight"),
      _copy("mlp_norm/scale", pre + "post_attention_layernorm.weight"),
      _linear("attn/q", pre + "self_attn.q_proj.weight", lambda s: (s[0], h, hd)),
      _linear("attn/k", pre + "self_attn.k_proj.weight", lambda s: (s[0], kvh, hd)),
      _linear("attn/v", pre + "self_attn.v_proj.weight", lambda s: (s[0], kvh, hd)),
      _linear("attn/o", pre + "self_attn.o_proj.weight", lambda s: (h, hd, s[1]), in_axes=2),
      _copy("attn/q_norm/scale", pre + "self_attn.q_norm.weight"),
      _copy("attn/k_norm/scale", pre + "self_attn.k_norm.weight"),
  ]
  if i in cfg.dense_layers:
    for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
      out.append(_linear(f"mlp/{ours}", pre + f"mlp.{theirs}.weight"))
    return out
  out.append(_linear("moe/router", pre + "mlp.gate.weight"))
  for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
    out.append(_experts(f"moe/{ours}", pre, theirs, cfg))
  return out


def top_tensors(cfg: ModelConfig, head: str = "lm") -> list[Tensor]:
  """The parameters outside the layers: embeddings, final norm and the head.

  `head="value"`: the critic's value head, as a one-label token classifier's
  `score` Linear (weight [1, d], bias [1]).
  """
  out = [_copy("embed", "model.embed_tokens.weight"), _copy("final_norm/scale", "model.norm.weight")]
  if head == "value":
    out += [_linear("value_head", "score.weight"), _copy("value_bias", "score.bias")]
  elif not cfg.tie_embeddings:
    out.append(_linear("lm_head", "lm_head.weight"))
  return out


def unrolled_layers(cfg: ModelConfig) -> int:
  """Layers with their own "layer_i" entries; with scan_layers the rest are stacked."""
  return len(cfg.dense_layers) if cfg.scan_layers else cfg.num_layers


def hf_config(cfg: ModelConfig, dtype: str = "bfloat16", head: str = "lm") -> dict:
  """A Qwen3-MoE `config.json` for `cfg`: what `hf_import.config_from_hf` and
  transformers' Qwen3MoeConfig read back to the same architecture."""
  out = {
      "architectures": ["Qwen3MoeForTokenClassification" if head == "value"
                        else "Qwen3MoeForCausalLM"],
      "model_type": "qwen3_moe",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.dense_d_ff,  # dense (mlp_only) layers' width
      "moe_intermediate_size": cfg.moe_d_ff,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "num_experts": cfg.num_experts,
      "num_experts_per_tok": cfg.experts_per_token,
      "norm_topk_prob": cfg.norm_topk_prob,
      "decoder_sparse_step": 1,
      "mlp_only_layers": list(cfg.dense_layers),
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
      "output_router_logits": False,
      "router_aux_loss_coef": 0.001,
      "initializer_range": 0.02,
      "use_cache": True,
      "torch_dtype": dtype,
  }
  if head == "value":
    out["num_labels"] = 1
  return out
