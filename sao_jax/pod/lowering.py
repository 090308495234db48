"""Lowering and compiling one program for a TPU topology: its row of figures and verdict.

`compile_one` lowers an `aot_programs.Program` and compiles it with the TPU
compiler (libtpu, for a topology it knows by name). The compiler refuses a
program that does not fit a chip's HBM ("Ran out of memory on HBM"); that is
a DOES NOT FIT row carrying the compiler's message, not a crash. A program
that compiles gets its per-chip argument / output / temporary / aliased /
code bytes, their total against the chip's HBM, the headroom left, the
cross-chip collectives it runs (`collectives`), XLA's cost figures and FITS
when the headroom is at least `min_headroom`.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import time

from sao_jax.pod import chips
from sao_jax.pod.aot_programs import Program
from sao_jax.train import steptime

GIB = chips.GIB


def _gib_in(pattern: str, msg: str) -> float | None:
  m = re.search(pattern + r"\s*\(([\d.]+)([KMGT])\)", msg)
  if not m:
    return None
  return float(m.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]


@contextlib.contextmanager
def _heartbeat(name: str, start: float, every: int):
  """Prints a progress line every `every` seconds while a compile runs (they take minutes)."""
  done = threading.Event()

  def beat():
    while not done.wait(every):
      print(f"[compile] {name}: still compiling, {time.time() - start:.0f} s", flush=True)

  t = threading.Thread(target=beat, daemon=True)
  t.start()
  try:
    yield
  finally:
    done.set()
    t.join()


def _refused(row: dict, e: Exception, start: float, cpu_start: float) -> dict:
  """`row` for a compile that raised: DOES NOT FIT for the compiler's out-of-memory, else ERROR."""
  msg = str(e)
  row["compile_s"] = round(time.time() - start, 2)
  row["cpu_s"] = round(time.process_time() - cpu_start, 2)
  if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower():
    row.update(
      status="DOES NOT FIT",
      fits=False,
      message=chips.first_line(msg),
      required_bytes=_gib_in(r"HLO temporaries", msg),
      compiler_hbm_bytes=_gib_in(r"available HBM", msg),
    )
  else:
    row.update(status="ERROR", fits=False, message=f"{type(e).__name__}: {chips.first_line(msg)}")
  print(
    f"[compile] {row['program']}: {row['status']} after {row['compile_s']:.0f} s: {row['message']}",
    flush=True,
  )
  return row


def _memory(row: dict, compiled, hbm: float, min_headroom: float) -> None:
  """The compiled program's bytes a chip, their total, headroom and verdict, into `row`."""
  m = compiled.memory_analysis()
  arg, out = m.argument_size_in_bytes, m.output_size_in_bytes
  temp, alias = m.temp_size_in_bytes, m.alias_size_in_bytes
  code = m.generated_code_size_in_bytes
  # Donated arguments (alias) are counted in both argument and output bytes
  # but live once.
  total = arg + out - alias + temp + code
  headroom = 1.0 - total / hbm
  fits = headroom >= min_headroom
  row.update(
    argument_bytes=arg,
    output_bytes=out,
    temp_bytes=temp,
    alias_bytes=alias,
    code_bytes=code,
    total_bytes=total,
    peak_bytes=getattr(m, "peak_memory_in_bytes", None),
    headroom=headroom,
    fits=fits,
    status="FITS" if fits else "DOES NOT FIT",
  )
  if not fits:
    row["message"] = (
      f"{total / GIB:.2f} GiB of {hbm / GIB:.2f} GiB leaves "
      f"{headroom:.1%} headroom, less than --min_headroom={min_headroom:.0%}"
    )


def compile_one(
  p: Program, min_headroom: float, heartbeat_s: int = 60, dump_hlo: str | None = None
) -> dict:
  """Lowers and compiles `p`; its row: timings, per-chip bytes and the verdict.

  Prints progress lines ("[compile] NAME: ...", one every `heartbeat_s`
  seconds while compiling); with `dump_hlo` writes the compiled HLO text to
  `dump_hlo/NAME.hlo.txt`.
  """
  row = {"program": p.name, "shape": p.shape, "topology": p.topology, "hbm_bytes": p.hbm}
  start, cpu_start = time.time(), time.process_time()
  print(f"[compile] {p.name} ({p.shape}) on {p.topology}: lowering", flush=True)
  try:
    with _heartbeat(p.name, start, heartbeat_s):
      with p.context():
        lowered = p.fn.lower(*p.args)
      row["lower_s"] = round(time.time() - start, 2)
      print(f"[compile] {p.name}: lowered in {row['lower_s']:.1f} s; compiling", flush=True)
      compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001
    return _refused(row, e, start, cpu_start)
  row["compile_s"] = round(time.time() - start, 2)
  # CPU seconds of this process (all its threads): on a shared host the wall
  # time says more about the neighbours than about the program.
  row["cpu_s"] = round(time.process_time() - cpu_start, 2)
  hlo = compiled.as_text()
  row["collectives"] = collectives(hlo)
  # Per-chip FLOPs and HBM bytes as XLA's cost model counts them (each
  # while-loop body once): the RL step's time model (sao_jax/train/steptime.py).
  row["cost"] = steptime.cost(compiled)
  row["while_loops"] = steptime.while_loops(hlo)
  if dump_hlo:
    os.makedirs(dump_hlo, exist_ok=True)
    with open(os.path.join(dump_hlo, f"{p.name}.hlo.txt"), "w", encoding="utf-8") as f:
      f.write(hlo)
  _memory(row, compiled, p.hbm, min_headroom)
  print(
    f"[compile] {p.name}: compiled in {row['compile_s']:.0f} s ({row['cpu_s']:.0f} CPU s), "
    f"{row['total_bytes'] / GIB:.2f} GiB per chip: {row['status']}",
    flush=True,
  )
  return row


_COLLECTIVE = re.compile(
  r"= (.+?) (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)"
  r"(?:-start)?\("
)
_TYPED = re.compile(
  r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64)"
  r"\[([0-9,]*)\]"
)
_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "s16": 2,
  "u16": 2,
  "bf16": 2,
  "f16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}


def collectives(hlo_text: str) -> dict:
  """{op: {dtype: {"count", "bytes"}}} over the compiled program's cross-chip collectives.

  What each collective carries decides the precision of the sums crossing
  chips (a gradient reduce-scattered in bf16 is summed in bf16) and the
  bytes on the interconnect: the element types and sizes of each
  collective's result, per chip (an async "-start" op's result tuple holds
  its operand too, so its bytes count both).
  """
  out: dict = {}
  for m in _COLLECTIVE.finditer(hlo_text):
    for dtype, dims in _TYPED.findall(m.group(1)):
      size = math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
      entry = out.setdefault(m.group(2), {}).setdefault(dtype, {"count": 0, "bytes": 0})
      entry["count"] += 1
      entry["bytes"] += size
  return out
