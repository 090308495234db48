"""Model shapes: one frozen dataclass, presets from a CPU toy to Qwen3-30B-A3B."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer with Qwen3-MoE's architecture.

  Layer i is a mixture-of-experts layer unless i is in `dense_layers`
  (Qwen3-MoE's `mlp_only_layers`), where a dense SwiGLU MLP of width
  `dense_d_ff` is used instead.
  """
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  num_experts: int
  experts_per_token: int
  moe_d_ff: int
  dense_d_ff: int = 0
  dense_layers: tuple[int, ...] = ()
  # Qwen3-MoE renormalises the chosen experts' softmax weights to sum to 1.
  norm_topk_prob: bool = True
  rope_theta: float = 1e6
  rms_eps: float = 1e-6
  tie_embeddings: bool = False
  max_seq_len: int = 4096
  # "dense" evaluates every expert and weights by the (sparse) gates: exact
  # and fastest for a handful of tiny experts. "ragged" sorts token-expert
  # pairs and runs grouped matmuls (jax.lax.ragged_dot): the FLOPs of top-k.
  moe_impl: Literal["dense", "ragged"] = "dense"
  # Parameter and activation dtypes.
  param_dtype: Any = jnp.float32
  dtype: Any = jnp.float32

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
          f"({self.num_kv_heads}).")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
    if not 0 < self.experts_per_token <= self.num_experts:
      raise ValueError(
          f"experts_per_token ({self.experts_per_token}) must be in "
          f"[1, num_experts={self.num_experts}].")
    if any(not 0 <= i < self.num_layers for i in self.dense_layers):
      raise ValueError(f"dense_layers {self.dense_layers} out of range.")
    if self.dense_layers and self.dense_d_ff <= 0:
      raise ValueError("dense_layers needs dense_d_ff > 0.")
    if self.moe_impl not in ("dense", "ragged"):
      raise ValueError(f"moe_impl must be 'dense' or 'ragged', got {self.moe_impl!r}")

  @classmethod
  def from_dict(cls, d) -> "ModelConfig":
    """From a plain dict or ml_collections.ConfigDict (dtypes by name)."""
    d = dict(d)
    for key in ("param_dtype", "dtype"):
      if isinstance(d.get(key), str):
        d[key] = jnp.dtype(d[key])
    if "dense_layers" in d:
      d["dense_layers"] = tuple(d["dense_layers"])
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"Unknown model config fields: {sorted(unknown)}")
    return cls(**d)


def tiny(vocab_size: int = 64) -> ModelConfig:
  """~0.13M parameters: trains in minutes on 2 CPU cores."""
  return ModelConfig(
      vocab_size=vocab_size, d_model=64, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=16, num_experts=4, experts_per_token=2,
      moe_d_ff=64, max_seq_len=512, rope_theta=10_000.0)


def small(vocab_size: int = 64) -> ModelConfig:
  """~3M parameters: notebook scale, one dense layer like Qwen's mlp_only."""
  return ModelConfig(
      vocab_size=vocab_size, d_model=192, num_layers=4, num_heads=6,
      num_kv_heads=2, head_dim=32, num_experts=8, experts_per_token=2,
      moe_d_ff=192, dense_d_ff=512, dense_layers=(0,), max_seq_len=1024,
      rope_theta=10_000.0)


def qwen3_30b_a3b() -> ModelConfig:
  """Qwen3-30B-A3B's published shape (config.json of the HF release)."""
  return ModelConfig(
      vocab_size=151_936, d_model=2048, num_layers=48, num_heads=32,
      num_kv_heads=4, head_dim=128, num_experts=128, experts_per_token=8,
      moe_d_ff=768, dense_d_ff=6144, rope_theta=1e6, rms_eps=1e-6,
      tie_embeddings=False, max_seq_len=40_960, moe_impl="ragged",
      param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)


PRESETS = {"tiny": tiny, "small": small, "qwen3_30b_a3b": qwen3_30b_a3b}
