"""Import Hugging Face safetensors checkpoints of the supported families
(sao_jax/models/families.py: dense Qwen3 and Qwen3-MoE).

    cfg = config_from_hf("ckpt/config.json")
    params = load_hf_checkpoint("ckpt/", cfg, shardings=param_shardings)

The name and layout of every tensor is `hf_layout`'s table (shared with
`hf_export`). Reads `*.safetensors` shards (through `model.safetensors.index.json` when
present), one target parameter at a time: a tensor is read from disk, laid
out as this library expects (transposes, per-expert stacking), cast, and
placed with its sharding before the next one is read. Host memory therefore
peaks at one parameter (one layer's stacked experts for MoE weights), never
at a second copy of the model.

Both expert layouts are understood: the Hub's per-expert tensors
(`mlp.experts.{j}.gate_proj.weight`, ...) and the fused 3-D tensors of
recent `transformers` (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).

With `cfg.scan_layers` the scanned layers' parameters are stacked
("layers/...", [n, ...]). Such a parameter is allocated on the devices first, in its
sharding, and each HF layer's tensor is read, placed and written into its
slot before the next is read: host memory still peaks at one layer's
tensor, device memory at the stacked parameter plus one layer.
"""

from __future__ import annotations

import functools
import glob
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from sao_jax.algo.optim import param_path
from sao_jax.models import families, hf_layout
from sao_jax.models.config import ModelConfig


def config_from_hf(path: str, **overrides) -> ModelConfig:
  """ModelConfig from an HF `config.json` (file or its directory), by its
  `model_type` (sao_jax/models/families.py: qwen3, qwen3_moe); any other is
  refused in one line naming the supported ones. `overrides` set how the
  model runs (dtypes, scan, kernels) or replace architecture fields."""
  return ModelConfig(**{**families.config_kwargs(path), **overrides})


# safetensors' dtype codes (the format's header) -> numpy dtypes. bfloat16,
# which every Qwen3 release stores, is not a numpy dtype, so safetensors'
# numpy reader refuses it ("data type 'bfloat16' not understood"): tensors
# are read here from the documented layout instead (an 8-byte little-endian
# header length, a JSON header of dtype / shape / data_offsets, the data).
SAFETENSORS_DTYPES = {
  "BF16": ml_dtypes.bfloat16,
  "F16": np.float16,
  "F32": np.float32,
  "F64": np.float64,
  "I8": np.int8,
  "I16": np.int16,
  "I32": np.int32,
  "I64": np.int64,
  "U8": np.uint8,
  "BOOL": np.bool_,
}


def read_safetensors_header(file: str) -> tuple[dict, int]:
  """(tensor name -> {"dtype", "shape", "data_offsets"}, where the data starts)."""
  with open(file, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  return header, 8 + n


def read_safetensor(file: str, entry: dict, data_start: int) -> np.ndarray:
  """One tensor of a safetensors file as a numpy array (bfloat16 included)."""
  code = entry["dtype"]
  if code not in SAFETENSORS_DTYPES:
    raise ValueError(
      f"{file}: tensor dtype {code} is not supported (supported: {sorted(SAFETENSORS_DTYPES)})"
    )
  begin, end = entry["data_offsets"]
  dtype = np.dtype(SAFETENSORS_DTYPES[code])
  with open(file, "rb") as f:
    f.seek(data_start + begin)
    data = f.read(end - begin)
  return np.frombuffer(data, dtype).reshape(entry["shape"]).copy()


# A Qwen3.5 release is an image-text model: its text model's tensors sit
# under this prefix, beside a vision tower and an MTP head.
MULTIMODAL_TEXT = "model.language_model."
VISION_PREFIX = "model.visual."
# Multi-token-prediction heads (Qwen3.5's `mtp.*`): not part of the model
# sao-jax trains; an export carries them over unchanged (`hf_export`'s `carry`).
MTP_PREFIX = "mtp."


def mtp_tensors(path: str) -> list[str]:
  """The names of a checkpoint's MTP-head tensors (sorted; [] when none)."""
  return sorted(n for n in _Reader(path).names() if n.startswith(MTP_PREFIX))


class _Reader:
  """Name -> tensor over a directory of safetensors shards, read lazily.

  Names are the text model's ("model.layers.0..."); in a multimodal
  checkpoint they are read from under MULTIMODAL_TEXT."""

  def __init__(self, path: str):
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(path):
      files = [path]
    elif os.path.exists(index):
      with open(index, encoding="utf-8") as f:
        files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    else:
      files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
      raise FileNotFoundError(f"No .safetensors files at {path!r}.")
    self._where = {}
    for file in files:
      header, start = read_safetensors_header(file)
      for name, entry in header.items():
        self._where[name] = (file, entry, start)
    self.used = set()
    self.multimodal = any(n.startswith(MULTIMODAL_TEXT) for n in self._where)

  def names(self) -> list[str]:
    return list(self._where)

  def entry(self, name: str) -> tuple:
    """(file, header entry, data start) of a tensor stored under `name`."""
    if name not in self._where:
      raise KeyError(f"Checkpoint has no tensor {name!r}.")
    return self._where[name]

  def _stored(self, name: str) -> str:
    if self.multimodal and name.startswith("model."):
      return MULTIMODAL_TEXT + name[len("model.") :]
    return name

  def __contains__(self, name):
    return self._stored(name) in self._where

  def get(self, name: str) -> np.ndarray:
    stored = self._stored(name)
    if stored not in self._where:
      raise KeyError(f"Checkpoint has no tensor {stored!r}.")
    self.used.add(stored)
    return read_safetensor(*self._where[stored])

  def unused(self):
    """Tensors nothing read, but the vision tower and MTP head (left out on purpose)."""
    return sorted(
      n for n in set(self._where) - self.used if not n.startswith((VISION_PREFIX, MTP_PREFIX))
    )

  def left_out(self) -> str:
    """One line on what an import leaves out on purpose ("" when nothing)."""
    vision = sum(n.startswith(VISION_PREFIX) for n in self._where)
    mtp = sum(n.startswith(MTP_PREFIX) for n in self._where)
    notes = []
    if vision:
      notes.append(
        f"{vision} vision-tower tensors (model.visual.*) not imported: sao-jax "
        "trains the text model"
      )
    if mtp:
      notes.append(
        f"{mtp} MTP-head tensors (mtp.*) not trained: an export from this run "
        "carries them over unchanged"
      )
    return "; ".join(notes)


def _without_leading_axis(sharding):
  """The sharding of one layer's slice of a stacked [n, ...] parameter."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:])
    )
  return sharding  # single-device: any shape


@functools.lru_cache(maxsize=None)
def _stacked_ops(shape, dtype, sharding):
  """(zeros, write) jitted for one stacked parameter's shape and sharding.

  `write(buf, layer, j)` sets buf[j] = layer in place (buf is donated); j is
  traced, so one compile serves every layer.
  """
  kw = {} if sharding is None else {"out_shardings": sharding}
  zeros = jax.jit(lambda: jnp.zeros(shape, dtype), **kw)
  write = jax.jit(
    lambda buf, x, j: jax.lax.dynamic_update_index_in_dim(buf, x, j, 0), donate_argnums=0, **kw
  )
  return zeros, write


def _load_stacked(name: str, loaders, layers, shape, sharding):
  """A stacked [n, ...] parameter, one HF layer at a time (see module docstring)."""
  zeros, write = _stacked_ops(tuple(shape.shape), shape.dtype, sharding)
  layer_sharding = _without_leading_axis(sharding)
  buf = zeros()
  for j, (load, layer) in enumerate(zip(loaders, layers)):
    host = np.asarray(load())
    if host.shape != tuple(shape.shape[1:]):
      raise ValueError(
        f"{name} (model.layers.{layer}): checkpoint shape {host.shape} "
        f"!= model {tuple(shape.shape[1:])}"
      )
    buf = write(buf, jax.device_put(host.astype(shape.dtype), layer_sharding), j)
    del host
  return buf


def load_hf_checkpoint(
  path: str, cfg: ModelConfig, shardings=None, *, strict: bool = True, head: str = "lm"
):
  """Loads params from a safetensors checkpoint of `cfg.family`.

  Args:
    path: a directory of shards, or one `.safetensors` file.
    cfg: the model shape (see `config_from_hf`).
    shardings: optional pytree of `jax.sharding.Sharding` matching the params;
      each tensor goes straight to its sharded placement.
    strict: raise if the checkpoint holds tensors this model does not use.
    head: "lm" (the policy) or "value" (a critic exported by `hf_export`, its
      head as `score`).

  Returns:
    The params pytree, in `cfg.param_dtype`.
  """
  r = _Reader(path)
  loaders = {t.ours: functools.partial(t.to_ours, r) for t in hf_layout.top_tensors(cfg, head)}
  # Unrolled layers have their own entries; scanned ones share a stacked one
  # (its loaders and HF layers in index order).
  stacked: dict[str, list] = {}
  for i in range(cfg.num_layers):
    where, index = cfg.layer_location(i)
    for t in hf_layout.layer_tensors(cfg, i):
      load = functools.partial(t.to_ours, r)
      if index is None:
        loaders[f"{where}/{t.ours}"] = load
      else:
        stacked.setdefault(f"{where}/{t.ours}", []).append((load, i))

  from sao_jax.models.policy import init_params

  shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), head))
  flat_shapes = {
    param_path(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]
  }
  mapped = set(loaders) | set(stacked)
  if set(flat_shapes) != mapped:
    raise ValueError(
      f"Import mapping mismatch: model-only "
      f"{sorted(set(flat_shapes) - mapped)}, mapping-only "
      f"{sorted(mapped - set(flat_shapes))}"
    )
  flat_shardings = {}
  if shardings is not None:
    flat_shardings = {
      param_path(path): s for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]
    }

  flat = {}
  for name, shape in flat_shapes.items():
    if name in stacked:
      flat[name] = _load_stacked(
        name,
        [load for load, _ in stacked[name]],
        [i for _, i in stacked[name]],
        shape,
        flat_shardings.get(name),
      )
      continue
    host = np.asarray(loaders[name]())
    if host.shape != shape.shape:
      raise ValueError(f"{name}: checkpoint shape {host.shape} != model {shape.shape}")
    host = host.astype(shape.dtype)
    flat[name] = jax.device_put(host, flat_shardings.get(name))
    del host
  if note := r.left_out():
    print(f"[model] {path}: {note}", flush=True)
  if strict and (
    extra := [n for n in r.unused() if not (cfg.tie_embeddings and n == "lm_head.weight")]
  ):
    raise ValueError(
      f"Checkpoint tensors not used by the model: {extra[:10]}{' ...' if len(extra) > 10 else ''}"
    )

  params: dict = {}
  for name, value in flat.items():
    node = params
    *parents, leaf = name.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return params
