"""The one table between sao-jax parameter paths and Hugging Face tensors.

Tensors are named by layer kind (`ModelConfig.layer_spec`), not by family:
a dense-MLP layer's tensors are the same in dense Qwen3 and in Qwen3-MoE's
`mlp_only_layers`, a full-attention layer's in both.

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
a slice of a stacked "layers/<path>" ("layers/sub_r/<path>" in a periodic
hybrid) for the layers after the unrolled ones: `ModelConfig.layer_location`.

A fused HF tensor that our layout keeps as several parameters (a Gated
DeltaNet layer's `in_proj_qkv` and `conv1d`, channels [q | k | v]) is one
`Tensor` per part (`_rows`): each reads its rows, and export joins the
parts, listed one after another, back into the one tensor.
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


def _linear(
  ours: str, name: str, unflatten: Callable[[tuple], tuple] | None = None, in_axes: int = 1
) -> Tensor:
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
    fused = pre + ("mlp.experts.down_proj" if theirs == "down_proj" else "mlp.experts.gate_up_proj")
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


def _rows(ours: str, name: str, begin: int, end: int, to_ours: Callable, to_hf: Callable) -> Tensor:
  """Rows [begin, end) of a fused HF tensor (q, k and v of `in_proj_qkv` and
  `conv1d`): import slices them out; export writes the rows, and the parts
  of one tensor, planned one after another, are joined along axis 0."""
  return Tensor(
    ours, (name,), lambda r: to_ours(r.get(name)[begin:end]), lambda x: [(name, to_hf(x))]
  )


def _attention_tensors(cfg: ModelConfig, pre: str, gated: bool) -> list[Tensor]:
  """A full-attention layer's; `gated`: q_proj holds [query | gate] per head."""
  h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  q_dim = 2 * hd if gated else hd
  return [
    _linear("attn/q", pre + "self_attn.q_proj.weight", lambda s: (s[0], h, q_dim)),
    _linear("attn/k", pre + "self_attn.k_proj.weight", lambda s: (s[0], kvh, hd)),
    _linear("attn/v", pre + "self_attn.v_proj.weight", lambda s: (s[0], kvh, hd)),
    _linear("attn/o", pre + "self_attn.o_proj.weight", lambda s: (h, hd, s[1]), in_axes=2),
    _copy("attn/q_norm/scale", pre + "self_attn.q_norm.weight"),
    _copy("attn/k_norm/scale", pre + "self_attn.k_norm.weight"),
  ]


def _linear_attention_tensors(cfg: ModelConfig, pre: str) -> list[Tensor]:
  """A Gated DeltaNet layer's (transformers' `linear_attn`): q, k and v split
  out of the fused projection and conv (channels [q | k | v])."""
  pre += "linear_attn."
  hk, h = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  proj, conv = [], []
  begin = 0
  for part, n, dim in (("q", hk, dk), ("k", hk, dk), ("v", h, dv)):
    end = begin + n * dim
    # in_proj_qkv [C, d] rows -> ours [d, n, dim]; conv1d [C, 1, K] rows -> ours [K, n, dim].
    proj.append(
      _rows(
        f"attn/{part}",
        pre + "in_proj_qkv.weight",
        begin,
        end,
        lambda w, n=n, dim=dim: w.T.reshape(w.shape[1], n, dim),
        lambda x: x.reshape(x.shape[0], -1).T,
      )
    )
    conv.append(
      _rows(
        f"attn/conv_{part}",
        pre + "conv1d.weight",
        begin,
        end,
        lambda w, n=n, dim=dim: w[:, 0, :].T.reshape(w.shape[2], n, dim),
        lambda x: x.reshape(x.shape[0], -1).T[:, None, :],
      )
    )
    begin = end
  return (
    proj
    + conv
    + [
      _linear("attn/z", pre + "in_proj_z.weight", lambda s: (s[0], h, dv)),
      _linear("attn/a", pre + "in_proj_a.weight"),
      _linear("attn/b", pre + "in_proj_b.weight"),
      _copy("attn/a_log", pre + "A_log"),
      _copy("attn/dt_bias", pre + "dt_bias"),
      _copy("attn/norm", pre + "norm.weight"),
      _linear("attn/o", pre + "out_proj.weight", lambda s: (h, dv, s[1]), in_axes=2),
    ]
  )


def layer_tensors(cfg: ModelConfig, i: int) -> list[Tensor]:
  """Layer i's parameters, paths relative to the layer ("attn/q", "moe/wo", ...)."""
  pre = f"model.layers.{i}."
  spec = cfg.layer_spec(i)
  out = [
    _copy("attn_norm/scale", pre + "input_layernorm.weight"),
    _copy("mlp_norm/scale", pre + "post_attention_layernorm.weight"),
  ]
  if spec.attention == "linear":
    out += _linear_attention_tensors(cfg, pre)
  else:
    out += _attention_tensors(cfg, pre, gated=spec.attention == "gated_full")
  swiglu = (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj"))
  if spec.mlp == "dense":
    return out + [_linear(f"mlp/{ours}", pre + f"mlp.{theirs}.weight") for ours, theirs in swiglu]
  out.append(_linear("moe/router", pre + "mlp.gate.weight"))
  for ours, theirs in swiglu:
    out.append(_experts(f"moe/{ours}", pre, theirs, cfg))
  if spec.mlp == "moe_shared":
    out += [
      _linear(f"moe/shared/{ours}", pre + f"mlp.shared_expert.{theirs}.weight")
      for ours, theirs in swiglu
    ]
    out.append(_linear("moe/shared_gate", pre + "mlp.shared_expert_gate.weight"))
  return out


def top_tensors(cfg: ModelConfig, head: str = "lm") -> list[Tensor]:
  """The parameters outside the layers: embeddings, final norm and the head.

  `head="value"`: the critic's value head, as a one-label token classifier's
  `score` Linear (weight [1, d], bias [1]).
  """
  out = [
    _copy("embed", "model.embed_tokens.weight"),
    _copy("final_norm/scale", "model.norm.weight"),
  ]
  if head == "value":
    out += [_linear("value_head", "score.weight"), _copy("value_bias", "score.bias")]
  elif not cfg.tie_embeddings:
    out.append(_linear("lm_head", "lm_head.weight"))
  return out
