"""Export params as a Hugging Face model directory of `cfg.family` (dense
Qwen3 or Qwen3-MoE: sao_jax/models/families.py).

    stats = export_params(params, cfg, "out/")            # bf16, 5 GiB shards

writes what vLLM, SGLang, lm-eval and `transformers` load:

    out/config.json                          the family's (`families.hf_config`)
    out/model-00001-of-0000N.safetensors     the tensors, in `hf_layout`'s names
    out/model.safetensors.index.json         tensor -> shard, total size
    out/<tokenizer files>                    `extra_files`, copied or written

A head over a vocabulary subset is first written over the whole vocabulary
(`full_vocabulary`, at the end of this file).

Streaming. The shards' headers are planned from shapes alone (each
conversion applied to a zero-strided view), then the data is written one unit
at a time: a unit is one parameter, or one layer's slice of a stacked
(`scan_layers`) one. Each unit is gathered to host (`process_allgather`
when the array spans processes: every process must call this in the same
order; only process 0 writes), converted, checked and written before the
next is gathered, so host memory peaks at one unit (`peak_host_bytes`:
one layer's experts for the largest), never at the model.

Refusals. A non-finite value (in the params, or made by the cast, e.g. a
float32 beyond bf16's range) stops the export with the parameter's name;
the directory is written as `<out>.partial` and renamed when complete, so
a refused or killed export leaves no directory that looks loadable. Only
the params given are written: a TrainState's optimizer moments never are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import jax
import ml_dtypes
import numpy as np

from sao_jax.algo.optim import param_path
from sao_jax.models import families, hf_layout
from sao_jax.models.config import ModelConfig
from sao_jax.models.hf_import import SAFETENSORS_DTYPES

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
_CODES = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}
INDEX = "model.safetensors.index.json"


class ExportError(ValueError):
  """An export that cannot be written as asked; the message is one line."""


@dataclasses.dataclass(frozen=True)
class _Unit:
  """One gather: `leaf` (a flat param path), optionally its slice `index`, and the
  layout entry that turns it into HF tensors."""

  leaf: str
  index: int | None
  tensor: hf_layout.Tensor
  outputs: tuple  # ((hf name, shape), ...)


def _plan(cfg: ModelConfig, flat: dict, head: str) -> list[_Unit]:
  """Every unit in write order; raises if the params and the layout disagree."""
  units, wanted = [], []
  entries = [(t.ours, None, t) for t in hf_layout.top_tensors(cfg, head)]
  for i in range(cfg.num_layers):
    where, index = cfg.layer_location(i)
    entries += [(f"{where}/{t.ours}", index, t) for t in hf_layout.layer_tensors(cfg, i)]
  for leaf, index, t in entries:
    wanted.append(leaf)
    if leaf not in flat:
      continue
    shape = flat[leaf].shape if index is None else flat[leaf].shape[1:]
    # The conversions are views (reshape, .T, x[j]): on a zero-strided array
    # they give the output shapes without allocating the tensor.
    outs = t.to_hf(np.broadcast_to(np.float32(0), shape))
    units.append(_Unit(leaf, index, t, tuple((n, a.shape) for n, a in outs)))
  missing, extra = sorted(set(wanted) - set(flat)), sorted(set(flat) - set(wanted))
  if missing or extra:
    raise ExportError(
      f"params do not match the {head!r} model of this config: missing "
      f"{missing[:5]}, not exportable {extra[:5]}"
    )
  return units


def _tensors(units: list[_Unit]) -> list[tuple]:
  """Every HF tensor (name, shape) in write order. Consecutive outputs of one
  name are row blocks of one tensor (hf_layout's fused q / k / v), joined
  along axis 0: their bytes follow one another in the file."""
  out: list[tuple] = []
  for u in units:
    for name, shape in u.outputs:
      if out and out[-1][0] == name:
        if tuple(out[-1][1][1:]) != tuple(shape[1:]):
          raise ExportError(f"{name}: row blocks of shapes {out[-1][1]} and {shape} do not join")
        out[-1] = (name, (out[-1][1][0] + shape[0],) + tuple(shape[1:]))
      else:
        out.append((name, tuple(shape)))
  return out


def _shards(units: list[_Unit], itemsize: int, shard_bytes: int) -> list[list[tuple]]:
  """Tensors (name, shape) grouped into shards of at most `shard_bytes` (a tensor
  larger than that gets a shard of its own), in write order."""
  shards, size = [[]], 0
  for name, shape in _tensors(units):
    n = int(np.prod(shape)) * itemsize
    if shards[-1] and size + n > shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append((name, shape))
    size += n
  return shards


def _header(tensors: list[tuple], code: str, itemsize: int) -> bytes:
  """A safetensors header for (name, shape) tensors of one dtype."""
  return _header_of(
    [(name, code, shape, int(np.prod(shape)) * itemsize) for name, shape in tensors]
  )


def _header_of(tensors: list[tuple]) -> bytes:
  """A safetensors header: 8-byte little-endian length, JSON padded to 8 bytes;
  `tensors` (name, dtype code, shape, bytes) in file order."""
  entries, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, code, shape, n in tensors:
    entries[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
    offset += n
  text = json.dumps(entries, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  return len(text).to_bytes(8, "little") + text


def _to_host(x, index):
  """One unit on this host as numpy (a collective when `x` spans processes)."""
  if index is not None:
    x = x[index]
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def _check_finite(name: str, a: np.ndarray, what: str) -> None:
  if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16:
    bad = ~np.isfinite(a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a)
    if bad.any():
      raise ExportError(
        f"{name}: {int(bad.sum())} non-finite values {what}; refusing to "
        "export a model that holds NaN or inf"
      )


def export_params(
  params,
  cfg: ModelConfig,
  out: str,
  *,
  dtype: str = "bfloat16",
  head: str = "lm",
  shard_bytes: int = 5 * 2**30,
  extra_files: dict[str, str] | None = None,
  notes: dict | None = None,
  carry: tuple[str, list] | None = None,
  config_extra: dict | None = None,
) -> dict:
  """Writes `params` as an HF model directory `out` (module docstring).

  Args:
    params: the policy's params (`head="lm"`) or the critic's (`head="value"`:
      written as a one-label token classifier of the family,
      `Qwen3MoeForTokenClassification` or `Qwen3ForTokenClassification`, the
      value head as `score`); global arrays of any sharding, or numpy.
    cfg: the model shape.
    dtype: "bfloat16" (default), "float16" or "float32".
    shard_bytes: the most bytes of tensors per safetensors file.
    extra_files: file name in `out` -> a source path to copy, or the bytes to
      write (tokenizer files, generation_config.json).
    notes: written as `sao_jax_export.json` with the export's own record.
    carry: (a source checkpoint, tensor names): tensors the model does not
      train (Qwen3.5's MTP head, `hf_import.mtp_tensors`), copied byte for
      byte in their stored dtype into `CARRIED` and listed in the index.
    config_extra: entries added to config.json (bos / eos / pad ids).

  Returns:
    {"dir", "files", "tensors", "bytes", "peak_host_bytes", "seconds"}.
  """
  start = time.time()
  if dtype not in DTYPES:
    raise ExportError(f"dtype = {dtype!r}: must be one of {sorted(DTYPES)}")
  if shard_bytes < 1:
    raise ExportError(f"shard_bytes = {shard_bytes}: must be >= 1")
  target = np.dtype(DTYPES[dtype])
  itemsize = target.itemsize
  flat = {param_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  units = _plan(cfg, flat, head)
  shards = _shards(units, itemsize, shard_bytes)
  names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
  where = {name: names[k] for k, shard in enumerate(shards) for name, _ in shard}

  primary = jax.process_index() == 0
  out = os.path.abspath(out)
  partial = out + ".partial"
  if primary:
    if os.path.exists(out) and os.listdir(out):
      raise ExportError(f"{out} exists and is not empty; export into a new directory")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
  peak = _stream_units(units, flat, target, (shards, names, where), partial if primary else None)
  total = sum(int(np.prod(s)) * itemsize for shard in shards for _, s in shard)
  if carry and carry[1] and primary:
    carried = _write_carried(partial, *carry)
    where.update(dict.fromkeys(carried["names"], CARRIED))
    names.append(CARRIED)
    total += carried["bytes"]
  stats = {
    "dir": out,
    "files": names,
    "tensors": len(where),
    "bytes": total,
    "peak_host_bytes": peak,
  }
  if primary:
    _publish(
      partial,
      out,
      {"metadata": {"total_size": total}, "weight_map": where},
      {**families.hf_config(cfg, dtype, head), **(config_extra or {})},
      extra_files,
      {"dtype": dtype, "head": head, **(notes or {})},
    )
  stats["seconds"] = round(time.time() - start, 3)
  return stats


def _stream_units(units, flat, target, layout, partial: str | None) -> int:
  """Casts and writes each unit's tensors into their safetensors files, one
  unit on the host at a time; the peak host bytes. `partial` None: this
  process holds shards but writes nothing (not the primary)."""
  shards, names, where = layout
  code, itemsize = _CODES[target], target.itemsize
  handles: dict[str, object] = {}
  peak = 0
  try:
    for u in units:
      host = _to_host(flat[u.leaf], u.index)
      label = u.leaf if u.index is None else f"{u.leaf}[{u.index}]"
      _check_finite(label, host, "in the params")
      with np.errstate(over="ignore"):  # an overflow is the inf checked next
        cast = host.astype(target)
      _check_finite(label, cast, f"after the cast to {target.name}")
      peak = max(peak, host.nbytes + cast.nbytes)
      del host
      for name, tensor in u.tensor.to_hf(cast):
        if partial is None:
          continue
        file = where[name]
        if file not in handles:
          for h in handles.values():
            h.close()
          handles.clear()
          handles[file] = open(os.path.join(partial, file), "wb")
          handles[file].write(_header(shards[names.index(file)], code, itemsize))
        handles[file].write(np.ascontiguousarray(tensor).tobytes())
      del cast
  except BaseException:
    for h in handles.values():
      h.close()
    if partial is not None:
      shutil.rmtree(partial, ignore_errors=True)
    raise
  for h in handles.values():
    h.close()
  return peak


# The file of the tensors an export carries over from the source checkpoint.
CARRIED = "model-carried.safetensors"


def _write_carried(partial: str, source: str, names: list) -> dict:
  """`names` of the checkpoint `source` copied unchanged (dtype, shape and
  bytes as stored) into `partial`/CARRIED; {"names", "bytes"}."""
  from sao_jax.models.hf_import import _Reader, read_safetensor

  reader = _Reader(source)
  stored = [reader.entry(n) for n in names]
  sizes = [e["data_offsets"][1] - e["data_offsets"][0] for _, e, _ in stored]
  with open(os.path.join(partial, CARRIED), "wb") as f:
    f.write(
      _header_of(
        [(n, e["dtype"], e["shape"], size) for n, (_, e, _), size in zip(names, stored, sizes)]
      )
    )
    for where in stored:
      f.write(np.ascontiguousarray(read_safetensor(*where)).tobytes())
  return {"names": names, "bytes": sum(sizes)}


def _publish(partial: str, out: str, index: dict, config: dict, extra_files, record: dict):
  """The directory's index, config, extra files and export record, then
  `partial` renamed to `out` in one step."""
  for name, obj in ((INDEX, index), ("config.json", config), ("sao_jax_export.json", record)):
    with open(os.path.join(partial, name), "w", encoding="utf-8") as f:
      json.dump(obj, f, indent=2)
  for name, src in (extra_files or {}).items():
    if isinstance(src, bytes):
      with open(os.path.join(partial, name), "wb") as f:
        f.write(src)
    else:
      shutil.copyfile(src, os.path.join(partial, name))
  if os.path.exists(out):
    os.rmdir(out)  # empty (checked by the caller)
  os.replace(partial, out)


# How the critic's exported head is read (written beside the value model).
VALUE_HEAD_NOTE = (
  "The sao-jax critic as a one-label ...ForTokenClassification of its family: score.weight "
  "[1, d] and score.bias [1] are the value head. Its output at position t-1 is the value V_t of "
  "emitting token t (sao-jax shifts values right by one: the value of a token is "
  "computed from its prefix); the first token of a sequence has no value."
)


# --- a head over a vocabulary subset, written over the whole vocabulary -------------


# What the lm_head rows of ids outside a head subset are (sao_jax_export.json).
OUTSIDE_NOTE = (
  "every id outside the subset has the same lm_head row, the mean of the covered ids' "
  "rows: its logit is the mean covered logit, never above the largest, so greedy "
  "decoding never picks one (an exact tie aside). No lm_head row (Qwen3 has no head bias) "
  "keeps sampling off them: they are many, and their total probability can be most of "
  "it. generation_config.json's suppress_tokens removes them in transformers' generate; "
  "a vLLM or SGLang request must pass allowed_token_ids = `ids`."
)


def full_vocabulary(params, cfg: ModelConfig, head: str = "lm") -> tuple[dict, ModelConfig, dict]:
  """Params of a model whose head covers `cfg.vocab_ids` only (sao_jax/models/head_vocab.py)
  as those of a model over the whole vocabulary, which is what an HF layout holds.

      embedding row of id t   covered: its own row; outside the subset: the shared
                              row S, through which the model reads every such id
                              (exact: the export reads any input as the run did)
      lm_head row of id t     covered: its head column; outside: the mean of the
                              covered columns (OUTSIDE_NOTE: what that guarantees)

  The lm_head is written untied (a tied run's head is its embedding's first S
  rows: the rows outside differ from the input's shared row). A critic
  (`head="value"`) has no lm_head: its embedding alone is expanded.

  Every process calls this (the gathers are collective). Returns (params,
  the full-vocabulary cfg, a record for sao_jax_export.json: "ids" covered,
  "outside_ids" the rest).
  """
  ids = np.asarray(cfg.vocab_ids, np.int64)
  rows = cfg.head_size
  embed = _to_host(params["embed"], None)  # [S + 1, d]
  full = np.repeat(embed[rows : rows + 1], cfg.vocab_size, axis=0)  # [V, d]
  full[ids] = embed[:rows]
  out = dict(params, embed=full)
  record = {
    "covered": int(rows),
    "vocab_size": int(cfg.vocab_size),
    "ids": ids.tolist(),
    "outside_embedding": "the shared row every uncovered id is read through",
    "outside_ids": np.setdiff1d(np.arange(cfg.vocab_size), ids).tolist(),
  }
  if head == "lm":
    w = embed[:rows].T if cfg.tie_embeddings else _to_host(params["lm_head"], None)  # [d, S]
    mean = w.astype(np.float64).mean(axis=1).astype(w.dtype)  # [d]
    lm_head = np.repeat(mean[:, None], cfg.vocab_size, axis=1)  # [d, V]
    lm_head[:, ids] = w
    out["lm_head"] = lm_head
    record["outside_lm_head"] = OUTSIDE_NOTE
  full_cfg = dataclasses.replace(cfg, vocab_ids=(), tie_embeddings=False)
  return out, full_cfg, record
