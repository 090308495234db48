"""Model shapes: one frozen dataclass whose layers are data, and presets from a
CPU toy to Qwen3-30B-A3B.

A model is a stack of pre-norm layers, each an attention kind and an MLP kind
(`LayerSpec`, listed by `ModelConfig.layer_specs`):

    attention  "full"        softmax attention with q/k RMSNorm and RoPE (Qwen3)
               "gated_full"  the same, its output gated by sigmoid(x W_g) per
                             head dimension (Qwen3-Next / Qwen3.5's full layers)
               "linear"      Gated DeltaNet linear attention (Qwen3.5's linear
                             layers: sao_jax/models/deltanet.py)
    mlp        "dense"       a SwiGLU MLP of width `dense_d_ff`
               "moe"         top-k routed SwiGLU experts (Qwen3-MoE)
               "moe_shared"  routed experts plus a sigmoid-gated shared SwiGLU
                             expert of width `shared_expert_d_ff` (Qwen3.5-MoE)

The fields say which layer is which: `attention_kinds` (one per layer, or
() for all "full"), `num_experts` (0: every MLP dense), `dense_layers` (MoE
models' dense exceptions, Qwen3-MoE's `mlp_only_layers`) and
`shared_expert_d_ff`. A family (sao_jax/models/families.py) is the
`config.json` <-> ModelConfig mapping of one Hugging Face `model_type`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax.numpy as jnp

REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
ATTENTION_IMPLS = ("reference", "chunked", "splash")
MOE_IMPLS = ("dense", "ragged", "expert_parallel", "blocked")
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
ATTENTION_KINDS = ("full", "gated_full", "linear")
MLP_KINDS = ("dense", "moe", "moe_shared")
# Declared layer kinds that no module implements yet: a config naming one
# is refused in one line (every kind above is built today).
UNBUILT_KINDS: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """One layer's kinds: `attention` in ATTENTION_KINDS, `mlp` in MLP_KINDS."""

  attention: str = "full"
  mlp: str = "moe"

  @property
  def is_moe(self) -> bool:
    return self.mlp in ("moe", "moe_shared")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer whose layers are listed by `layer_specs`.

  Layer i's MLP is dense when `num_experts` is 0 (a dense model: Qwen3) or
  i is in `dense_layers` (Qwen3-MoE's `mlp_only_layers`): a SwiGLU of width
  `dense_d_ff`. Otherwise it is a mixture of `num_experts` experts (with a
  shared expert when `shared_expert_d_ff` > 0). Its attention is
  `attention_kinds[i]` ("full" when the tuple is empty).
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  # 0: a dense model (every MLP is dense; experts_per_token and moe_d_ff 0).
  num_experts: int
  experts_per_token: int
  moe_d_ff: int
  dense_d_ff: int = 0
  dense_layers: tuple[int, ...] = ()
  # > 0: every MoE layer adds a shared SwiGLU expert of this width, gated
  # per token by sigmoid(x W_sg) (Qwen3.5-MoE's shared_expert).
  shared_expert_d_ff: int = 0
  # Each layer's attention kind (ATTENTION_KINDS), or (): every layer "full".
  attention_kinds: tuple[str, ...] = ()
  # Gated DeltaNet ("linear" layers; sao_jax/models/deltanet.py): key heads
  # (each serving value_heads / key_heads value heads), value heads, their
  # dims, and the causal conv's taps. All 0 when no layer is "linear".
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_conv_kernel: int = 4
  # Tokens per chunk of the chunked delta rule (training and prefill).
  deltanet_chunk: int = 64
  # Rotary dims per attention head: the first `rotary_dim` of head_dim turn,
  # the rest pass through (Qwen3.5: partial_rotary_factor 0.25). 0: all.
  rotary_dim: int = 0
  # RMSNorm weights stored as offsets from 1, y = x_hat * (1 + w), initialised
  # at 0 (Qwen3.5's every norm but the DeltaNet output norm); else y = w x_hat.
  zero_centered_norm: bool = False
  # The Hugging Face family the weights are laid out and exported as
  # (sao_jax/models/families.py: qwen3, qwen3_moe).
  family: str = "qwen3_moe"
  # Qwen3-MoE renormalises the chosen experts' softmax weights to sum to 1.
  norm_topk_prob: bool = True
  rope_theta: float = 1e6
  rms_eps: float = 1e-6
  tie_embeddings: bool = False
  max_seq_len: int = 4096
  # "dense" evaluates every expert and weights by the (sparse) gates: exact
  # and fastest for a handful of tiny experts. "ragged" sorts token-expert
  # pairs and runs grouped matmuls (jax.lax.ragged_dot): the FLOPs of top-k.
  # "expert_parallel" dispatches with all-to-all over the mesh's expert axes
  # (sao_jax/models/moe.py); without expert parallelism it is "ragged".
  # "blocked" sorts the pairs into expert-pure blocks of `moe_block` rows
  # and runs batched matmuls (moe.blocked_moe): the FLOPs of top-k with
  # plain dots, the fastest exact path on CPU for a train batch; calls too
  # small to fill the blocks (decode steps) give each expert 1.5x its
  # balanced share of rows (moe.capacity_moe), or run "dense" when an
  # expert's load exceeds that.
  moe_impl: Literal["dense", "ragged", "expert_parallel", "blocked"] = "dense"
  # blocked only: rows per expert block. Larger blocks pad more (up to one
  # block per expert) but make bigger matmuls, which XLA:CPU runs at a much
  # higher rate (how 512 was chosen:
  # benchmarks/RESULTS.md#models-and-the-train-step).
  moe_block: int = 512
  # expert_parallel only: <= 0 is dropless (buffers sized for the worst
  # case); c > 0 gives each device pair c x its balanced share of rows and
  # drops the overflow (counted in intermediates "moe_dropped").
  moe_capacity_factor: float = 0.0
  # expert_parallel only: each device dispatches its tokens in rounds of
  # this many (bounded all-to-all buffers, same result); 0: one round.
  moe_dispatch_chunk: int = 0
  # Parameter and activation dtypes (FLOAT_DTYPES; names are accepted).
  # Mixed precision, bf16 compute with fp32 master weights: dtype
  # "bfloat16", param_dtype "float32". Every matmul and activation is then
  # bf16, while RMSNorm statistics, the attention and router softmaxes and
  # the log-probs stay fp32; gradients come back fp32 (the transpose of the
  # cast), so Adam's moments and the update are fp32.
  param_dtype: Any = jnp.float32
  dtype: Any = jnp.float32
  # --- Scale (docs/DESIGN.md section 8). The defaults are the plain reference
  # path that the tiny / small presets train with; each scale setting has a
  # CPU test against it (tests/models/test_model_scale.py).
  # Run the layers as one `nn.scan` over a stacked "layers" parameter axis
  # (params "layers/attn/q" [n, D, H, hd]): the program is one layer (one
  # repeating block) long, so compile time and HLO size do not grow with
  # depth. What is scanned is the run of repeating layers that ends the
  # stack (`scan_prefix` says where it starts, `scan_period` how many layers
  # a step holds): every layer of a dense model, the MoE layers after
  # Qwen3-MoE's dense prefix, Qwen3.5's blocks of four ("layers/sub_r").
  # The layers before it stay unrolled as "layer_0" ... "layer_{k-1}".
  scan_layers: bool = False
  # Rematerialisation of each layer in the backward pass (REMAT_POLICIES):
  # "none" stores every activation; "full" stores only each layer's input and
  # recomputes the layer (activation memory of one layer); "dots_saveable" /
  # "dots_with_no_batch_dims_saveable" keep matmul outputs and recompute the
  # elementwise work (jax.checkpoint_policies of the same names).
  remat: str = "none"
  # Training-time attention (ATTENTION_IMPLS). "reference" materialises
  # [B, H, L, L] fp32 logits: the oracle. "chunked" is blockwise attention
  # with an online softmax over key blocks and a flash-style backward in
  # pure JAX: memory O(B H L hd + B H block^2). "splash" is the Pallas TPU
  # kernel, taken when the compile target is a TPU (the mesh set with
  # jax.set_mesh, else the default backend) and L is a multiple of 128;
  # elsewhere it is "chunked". On the KV-cache path a decode step (one new
  # token) always uses the reference math ([B, H, 1, S] logits); several new
  # tokens use the reference under "reference" and otherwise
  # attention.cached_attention (key blocks of attention_block entries).
  attention_impl: str = "reference"
  # Query and key block length of the chunked and splash attention.
  attention_block: int = 512
  # Sequence tokens per chunk when token_logprobs takes the log-softmax at
  # the target token from final hidden states: peak logits [B, chunk, V]
  # instead of [B, L, V], recomputed in the backward pass. 0: full logits.
  logits_chunk: int = 0
  # New tokens per pass when the engine appends many at once
  # (decoding.extend_last, a chunked prefill): the KV cache is written chunk
  # by chunk, and only each row's last hidden state meets the LM head, so
  # peak activations are those of [B, prefill_chunk] tokens and no
  # [B, W, V] logits exist. 0: the whole width in one pass with full
  # logits (decoding.extend), the reference.
  prefill_chunk: int = 0
  # The head over a subset of the vocabulary, for a model trained from
  # scratch (sao_jax/models/head_vocab.py): the sorted token ids it covers.
  # Ids stay the tokenizer's everywhere outside the model: the embedding has
  # a row per covered id plus one shared by every other id, the LM head a
  # column per covered id, sampling returns tokenizer ids and the log-probs
  # are those of the distribution over the subset. (): the full head over
  # `vocab_size` (every imported checkpoint).
  vocab_ids: tuple[int, ...] = dataclasses.field(default=(), repr=False)

  def __post_init__(self):
    for field in ("param_dtype", "dtype"):
      value = getattr(self, field)
      try:
        dtype = jnp.dtype(value)
      except TypeError:
        dtype = None
      if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{field} must be one of {[d.name for d in FLOAT_DTYPES]}, got {value!r}")
      object.__setattr__(self, field, dtype)  # one canonical form: equal configs hash alike
    for field in (
      "vocab_size",
      "d_model",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "max_seq_len",
    ):
      _check_int(field, getattr(self, field), 1)
    for field in (
      "num_experts",
      "experts_per_token",
      "moe_d_ff",
      "dense_d_ff",
      "shared_expert_d_ff",
      "linear_num_key_heads",
      "linear_num_value_heads",
      "linear_key_head_dim",
      "linear_value_head_dim",
      "rotary_dim",
    ):
      _check_int(field, getattr(self, field), 0)
    if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
      raise ValueError(f"rope_theta = {self.rope_theta!r}: must be a number > 0")
    if not (isinstance(self.rms_eps, (int, float)) and 0 < self.rms_eps < 1):
      raise ValueError(f"rms_eps = {self.rms_eps!r}: must be in (0, 1)")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})."
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
    if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
      raise ValueError(
        f"rotary_dim = {self.rotary_dim}: must be even and <= head_dim "
        f"({self.head_dim}); 0 turns all of head_dim"
      )
    _check_int("linear_conv_kernel", self.linear_conv_kernel, 1)
    _check_int("deltanet_chunk", self.deltanet_chunk, 1)
    self._check_layers()
    if self.moe_impl not in MOE_IMPLS:
      raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(
        f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}"
      )
    if self.attention_block <= 0:
      raise ValueError(f"attention_block must be positive, got {self.attention_block}")
    if self.attention_impl == "splash" and self.attention_block % 128:
      raise ValueError(
        "attention_impl='splash' needs attention_block a multiple of 128 "
        f"(the TPU lane width), got {self.attention_block}"
      )
    if self.logits_chunk < 0:
      raise ValueError(f"logits_chunk must be >= 0 (0: full logits), got {self.logits_chunk}")
    if self.moe_block < 1:
      raise ValueError(f"moe_block must be positive, got {self.moe_block}")
    if self.moe_dispatch_chunk < 0:
      raise ValueError(
        f"moe_dispatch_chunk must be >= 0 (0: one round), got {self.moe_dispatch_chunk}"
      )
    if self.prefill_chunk < 0:
      raise ValueError(f"prefill_chunk must be >= 0 (0: one pass), got {self.prefill_chunk}")
    if self.vocab_ids:
      ids = tuple(int(i) for i in self.vocab_ids)
      if list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= self.vocab_size:
        raise ValueError(
          "vocab_ids must be distinct token ids in increasing order, in "
          f"[0, vocab_size={self.vocab_size})"
        )
      object.__setattr__(self, "vocab_ids", ids)
    if self.scan_layers and not self.scannable:
      raise ValueError(
        f"scan_layers scans the run of identical layers that ends the stack; with "
        f"these layers ({self._kinds_summary()}) {self.scan_prefix} of "
        f"{self.num_layers} would stay unrolled. Use scan_layers=False."
      )

  def _check_layers(self):
    """The layer description: experts, dense layers, attention kinds, family."""
    object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
    object.__setattr__(self, "attention_kinds", tuple(self.attention_kinds))
    if self.num_experts:
      if not 0 < self.experts_per_token <= self.num_experts:
        raise ValueError(
          f"experts_per_token ({self.experts_per_token}) must be in "
          f"[1, num_experts={self.num_experts}]."
        )
      if self.moe_d_ff < 1:
        raise ValueError(f"moe_d_ff = {self.moe_d_ff}: a model with experts needs it >= 1")
    elif self.experts_per_token or self.moe_d_ff or self.shared_expert_d_ff:
      raise ValueError(
        "num_experts = 0 (a dense model) needs experts_per_token, moe_d_ff "
        "and shared_expert_d_ff 0, got "
        f"{self.experts_per_token}, {self.moe_d_ff}, {self.shared_expert_d_ff}"
      )
    if any(not 0 <= i < self.num_layers for i in self.dense_layers):
      raise ValueError(f"dense_layers {self.dense_layers} out of range.")
    if (self.dense_layers or not self.num_experts) and self.dense_d_ff <= 0:
      raise ValueError("dense layers (dense_layers, or num_experts = 0) need dense_d_ff > 0.")
    if self.attention_kinds and len(self.attention_kinds) != self.num_layers:
      raise ValueError(
        f"attention_kinds has {len(self.attention_kinds)} entries for "
        f"{self.num_layers} layers (or () for all 'full')"
      )
    for kind in self.attention_kinds:
      if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention kind {kind!r}: must be one of {ATTENTION_KINDS}")
    if "linear" in self.attention_kinds:
      heads = (
        self.linear_num_key_heads,
        self.linear_num_value_heads,
        self.linear_key_head_dim,
        self.linear_value_head_dim,
      )
      if min(heads) < 1 or heads[1] % heads[0]:
        raise ValueError(
          "linear (Gated DeltaNet) layers need linear_num_key_heads, "
          "linear_num_value_heads, linear_key_head_dim and linear_value_head_dim >= 1, "
          f"value heads a multiple of key heads; got {heads}"
        )
    for kind in sorted({k for spec in self.layer_specs for k in (spec.attention, spec.mlp)}):
      if kind in UNBUILT_KINDS:
        built = [k for k in ATTENTION_KINDS + MLP_KINDS if k not in UNBUILT_KINDS]
        raise ValueError(f"layer kind {kind!r}: {UNBUILT_KINDS[kind]} (built: {built})")
    from sao_jax.models import families

    families.check(self)

  def layer_spec(self, i: int) -> LayerSpec:
    """Layer i's attention and MLP kinds."""
    attention = self.attention_kinds[i] if self.attention_kinds else "full"
    if not self.num_experts or i in self.dense_layers:
      mlp = "dense"
    else:
      mlp = "moe_shared" if self.shared_expert_d_ff else "moe"
    return LayerSpec(attention, mlp)

  @property
  def layer_specs(self) -> tuple[LayerSpec, ...]:
    return tuple(self.layer_spec(i) for i in range(self.num_layers))

  def _kinds_summary(self) -> str:
    return ", ".join(f"{i}: {s.attention}/{s.mlp}" for i, s in enumerate(self.layer_specs))

  @functools.cached_property
  def _scan_shape(self) -> tuple[int, int]:
    """(prefix, period): the scanned run is layers prefix..n-1, whole repeats
    of its last `period` layers' kinds. Of the runs that end the stack, the
    one whose program is shortest (prefix + period layers; ties: the shorter
    period): a uniform stack is (0, 1), Qwen3-MoE with a dense first layer
    (1, 1), Qwen3.5's [linear x3, full] x n (0, 4)."""
    specs = self.layer_specs
    n = len(specs)
    best = (n, n)
    for p in range(1, n + 1):
      k = n - p
      while k - p >= 0 and specs[k - p : k] == specs[k : k + p]:
        k -= p
      if k + p < sum(best):
        best = (k, p)
    return best

  @property
  def scan_prefix(self) -> int:
    """The layers before the scanned run (0 for a dense, uniform or purely
    periodic stack)."""
    return self._scan_shape[0]

  @property
  def scan_period(self) -> int:
    """Layers per step of the scan: 1, or the hybrid's repeating block (4 for
    Qwen3.5: three linear layers and a full one)."""
    return self._scan_shape[1]

  @property
  def scannable(self) -> bool:
    """Whether `scan_layers` may take this stack: at most half of it before
    the scanned run (beyond that the scan saves little and hides a layout
    that should be unrolled)."""
    return self.scan_prefix <= self.num_layers // 2

  @property
  def unrolled_layers(self) -> int:
    """Layers with their own "layer_i" parameters; with scan_layers the rest
    are stacked under "layers"."""
    return self.scan_prefix if self.scan_layers else self.num_layers

  def layer_location(self, i: int) -> tuple[str, int | None]:
    """Where layer i's parameters (and cache) live: ("layer_i", None) for an
    unrolled layer; for a scanned one the stacked subtree and its index on
    the leading axis: ("layers", j) with period 1, ("layers/sub_r", g) for
    layer r of scan step g of a longer period."""
    k = self.unrolled_layers
    if i < k:
      return f"layer_{i}", None
    g, r = divmod(i - k, self.scan_period)
    return ("layers" if self.scan_period == 1 else f"layers/sub_{r}"), g

  @property
  def head_size(self) -> int:
    """Columns of the LM head: the subset's size (`vocab_ids`), else `vocab_size`."""
    return len(self.vocab_ids) if self.vocab_ids else self.vocab_size

  @property
  def num_scanned_layers(self) -> int:
    """Layers inside the scan: those after `scan_prefix` (0 unscanned)."""
    return self.num_layers - self.scan_prefix if self.scan_layers else 0

  @property
  def scan_steps(self) -> int:
    """Length of the "layers" axis: scan steps of `scan_period` layers each."""
    return self.num_scanned_layers // self.scan_period

  @property
  def rotary_dims(self) -> int:
    """The rotated dims of each attention head (`rotary_dim`, 0: head_dim)."""
    return self.rotary_dim or self.head_dim

  @property
  def linear_conv_channels(self) -> int:
    """A DeltaNet layer's conv channels: q, k (key heads) and v (value heads)."""
    return (
      2 * self.linear_num_key_heads * self.linear_key_head_dim
      + self.linear_num_value_heads * self.linear_value_head_dim
    )

  @property
  def num_moe_layers(self) -> int:
    """MoE layers (routing replay's leading axis, `Transformer`'s `routing`)."""
    return sum(s.is_moe for s in self.layer_specs)

  @classmethod
  def from_dict(cls, d) -> "ModelConfig":
    """From a plain dict or ml_collections.ConfigDict (dtypes by name)."""
    d = dict(d)
    for name in ("dense_layers", "vocab_ids", "attention_kinds"):
      if name in d:
        d[name] = tuple(d[name])
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"Unknown model config fields: {sorted(unknown)}")
    return cls(**d)


# The fields an HF config.json sets (sao_jax/models/families.py); the rest say
# how to run the model (dtypes, scan, remat, kernels) and come from a preset.
ARCHITECTURE_FIELDS = (
  "vocab_size",
  "d_model",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "num_experts",
  "experts_per_token",
  "moe_d_ff",
  "dense_d_ff",
  "dense_layers",
  "shared_expert_d_ff",
  "attention_kinds",
  "linear_num_key_heads",
  "linear_num_value_heads",
  "linear_key_head_dim",
  "linear_value_head_dim",
  "linear_conv_kernel",
  "rotary_dim",
  "zero_centered_norm",
  "norm_topk_prob",
  "rope_theta",
  "rms_eps",
  "tie_embeddings",
  "max_seq_len",
  "family",
)


def with_architecture(run_as: ModelConfig, arch: ModelConfig, **overrides) -> ModelConfig:
  """`arch`'s architecture run as `run_as` says (its dtypes, scan, remat and
  kernels), then `overrides`. A stack the scan cannot take whole (more than
  half of it would stay unrolled) runs unscanned."""
  cfg = dataclasses.replace(
    run_as, scan_layers=False, **{f: getattr(arch, f) for f in ARCHITECTURE_FIELDS}
  )
  scan = run_as.scan_layers and cfg.scannable
  return dataclasses.replace(cfg, **{"scan_layers": scan, **overrides})


def _check_int(field: str, value, low: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ValueError(f"{field} = {value!r}: must be an integer >= {low}")


def tiny(vocab_size: int = 64) -> ModelConfig:
  """~0.13M parameters: trains in minutes on 2 CPU cores."""
  return ModelConfig(
    vocab_size=vocab_size,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_experts=4,
    experts_per_token=2,
    moe_d_ff=64,
    max_seq_len=512,
    rope_theta=10_000.0,
  )


def small(vocab_size: int = 64) -> ModelConfig:
  """~3M parameters: notebook scale, one dense layer like Qwen's mlp_only."""
  return ModelConfig(
    vocab_size=vocab_size,
    d_model=192,
    num_layers=4,
    num_heads=6,
    num_kv_heads=2,
    head_dim=32,
    num_experts=8,
    experts_per_token=2,
    moe_d_ff=192,
    dense_d_ff=512,
    dense_layers=(0,),
    max_seq_len=1024,
    rope_theta=10_000.0,
  )


# How the releases' shapes run on a pod (every preset of a real checkpoint):
POD_RUN = dict(
  # Mixed precision: float32 master weights, bfloat16 compute. bf16
  # params would round the RL updates away (a step of lr 1e-6 is far
  # below half an ulp of a 0.02 weight, 6.1e-5: sao_jax/models/precision.py);
  # the engines hold bf16 copies, cast once per version.
  param_dtype=jnp.float32,
  dtype=jnp.bfloat16,
  # The layers as one scan with full remat (the backward keeps one
  # [B, L, D] input per layer), splash attention on TPU (chunked
  # elsewhere), log-probs over 1024-token chunks (peak logits
  # [B, 1024, 151936] fp32, not [B, L, 151936]).
  scan_layers=True,
  remat="full",
  attention_impl="splash",
  attention_block=512,
  logits_chunk=1024,
  # The engine appends long re-feeds 2048 tokens at a time (chunked
  # prefill); prompts and observations (<= 2048) are one pass.
  prefill_chunk=2048,
)


def qwen3_30b_a3b() -> ModelConfig:
  """Qwen3-30B-A3B's published shape (config.json of the HF release)."""
  return ModelConfig(
    vocab_size=151_936,
    d_model=2048,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    num_experts=128,
    experts_per_token=8,
    moe_d_ff=768,
    dense_d_ff=6144,
    rope_theta=1e6,
    rms_eps=1e-6,
    # Expert-parallel (dropless) MoE: the RL step at full depth needs a
    # fraction of "ragged"'s memory per chip (the compiler's figures:
    # benchmarks/RESULTS.md#pods-compile-and-fit).
    tie_embeddings=False,
    max_seq_len=40_960,
    moe_impl="expert_parallel",
    # Dispatch rounds of 8192 tokens a chip bound the dropless all-to-all
    # buffers (in one round the RL step at 256 x 32768 does not fit: same
    # section).
    moe_dispatch_chunk=8192,
    **POD_RUN,
  )


def tiny_dense(vocab_size: int = 64) -> ModelConfig:
  """A dense Qwen3 of ~0.1M parameters with tied embeddings (the small Qwen3
  models' layout): the CPU toy of the dense family."""
  return ModelConfig(
    vocab_size=vocab_size,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_experts=0,
    experts_per_token=0,
    moe_d_ff=0,
    dense_d_ff=128,
    tie_embeddings=True,
    max_seq_len=512,
    rope_theta=10_000.0,
    family="qwen3",
  )


def tiny_hybrid(vocab_size: int = 64) -> ModelConfig:
  """A Qwen3.5-MoE of ~0.2M parameters: Gated DeltaNet and gated full attention
  alternating ([linear, full] x 2, scanned as a period of 2), MoE layers
  with a shared expert, zero-centred norms, a quarter of each head rotary.
  The CPU toy of the hybrid family."""
  return ModelConfig(
    vocab_size=vocab_size,
    d_model=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_experts=4,
    experts_per_token=2,
    moe_d_ff=64,
    shared_expert_d_ff=64,
    attention_kinds=("linear", "gated_full") * 2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    deltanet_chunk=32,
    rotary_dim=4,
    zero_centered_norm=True,
    max_seq_len=512,
    rope_theta=10_000.0,
    family="qwen3_5_moe",
  )


def _qwen3_dense(
  *, d_model: int, d_ff: int, num_layers: int, num_heads: int, tie: bool
) -> ModelConfig:
  """A dense Qwen3 release's shape, run as POD_RUN says."""
  return ModelConfig(
    vocab_size=151_936,
    d_model=d_model,
    num_layers=num_layers,
    num_heads=num_heads,
    num_kv_heads=8,
    head_dim=128,
    num_experts=0,
    experts_per_token=0,
    moe_d_ff=0,
    dense_d_ff=d_ff,
    rope_theta=1e6,
    rms_eps=1e-6,
    tie_embeddings=tie,
    max_seq_len=40_960,
    family="qwen3",
    **POD_RUN,
  )


# The shapes of the dense Qwen3 releases, from each one's config.json on the
# Hugging Face Hub (Qwen/Qwen3-0.6B, Qwen/Qwen3-1.7B, Qwen/Qwen3-8B): hidden
# size, intermediate size, layers, attention heads (8 kv heads and head_dim
# 128 in all three), and whether the LM head is the embedding's transpose.
def qwen3_0_6b() -> ModelConfig:
  """Qwen3-0.6B: 0.60B parameters (0.44B outside the tied embedding)."""
  return _qwen3_dense(d_model=1024, d_ff=3072, num_layers=28, num_heads=16, tie=True)


def qwen3_1_7b() -> ModelConfig:
  """Qwen3-1.7B: 1.72B parameters (1.41B outside the tied embedding)."""
  return _qwen3_dense(d_model=2048, d_ff=6144, num_layers=28, num_heads=16, tie=True)


def qwen3_8b() -> ModelConfig:
  """Qwen3-8B: 8.19B parameters, an untied LM head."""
  return _qwen3_dense(d_model=4096, d_ff=12_288, num_layers=36, num_heads=32, tie=False)


def qwen3_5_35b_a3b() -> ModelConfig:
  """Qwen3.5-35B-A3B's published shape (the text_config of the HF release's
  config.json, Qwen/Qwen3.5-35B-A3B): 40 layers in 10 blocks of three Gated
  DeltaNet layers (16 key / 32 value heads of 128) and one gated full
  attention (16 heads, 2 kv heads of 256, a quarter rotary, theta 1e7);
  every MLP 256 routed experts of 512 (top 8) plus a shared expert of 512;
  vocabulary 248,320, untied. The scan is one block of four layers."""
  return ModelConfig(
    vocab_size=248_320,
    d_model=2048,
    num_layers=40,
    num_heads=16,
    num_kv_heads=2,
    head_dim=256,
    num_experts=256,
    experts_per_token=8,
    moe_d_ff=512,
    shared_expert_d_ff=512,
    attention_kinds=("linear", "linear", "linear", "gated_full") * 10,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel=4,
    rotary_dim=64,
    zero_centered_norm=True,
    rope_theta=1e7,
    rms_eps=1e-6,
    tie_embeddings=False,
    max_seq_len=262_144,
    family="qwen3_5_moe",
    moe_impl="expert_parallel",
    moe_dispatch_chunk=8192,
    **POD_RUN,
  )


# Presets whose vocabulary follows the run's tokenizer (model.vocab_from_tokenizer).
TOY_PRESETS = ("tiny", "small", "tiny_dense", "tiny_hybrid")

PRESETS = {
  "tiny": tiny,
  "small": small,
  "tiny_dense": tiny_dense,
  "tiny_hybrid": tiny_hybrid,
  "qwen3_0_6b": qwen3_0_6b,
  "qwen3_1_7b": qwen3_1_7b,
  "qwen3_8b": qwen3_8b,
  "qwen3_30b_a3b": qwen3_30b_a3b,
  "qwen3_5_35b_a3b": qwen3_5_35b_a3b,
}
