"""verify: score a model's final answer against a ground truth.

    extract_answer(response)            -> the answer text, or None
    exact_match(response, ground_truth) -> Verdict (string compare, no subprocess)
    MathVerifier().verify(response, ground_truth) -> Verdict

The answer is the last balanced `\\boxed{...}`, else the text after the last
`####` (GSM8K), else after the last `Answer:` (DAPO / Minerva style).
Extraction is one linear pass over at most the last `MAX_TAIL_CHARS` of the
response, so a degenerate response (a megabyte of `\\boxed{`) costs
milliseconds, not a quadratic rescan per opening brace; an answer longer
than `MAX_ANSWER_CHARS` is refused rather than handed to a parser.

`MathVerifier` decides in three steps, cheapest first. Canonical integers
(AIME's "073" is 73) are compared exactly, with no parser and no
subprocess: most math rewards end here. Identical strings are "exact".
Everything else goes to math-verify (sympy underneath), in a worker process:

  * why a process: sympy can take unbounded time (a huge power, a
    pathological simplify) and cannot be interrupted from another thread.
    math-verify's own timeout is `signal.alarm`, which works only in the
    main thread and raises in the environment pool's worker threads, so it
    is turned off (`parsing_timeout=None, timeout_seconds=None`) and the
    parent bounds the call instead;
  * why a wall clock in the parent: a worker stuck in C code, or in a loop
    that never checks a flag, is only stopped by killing it. Past
    `timeout_s` the worker is killed, the verdict is `Verdict(False,
    "timeout")`, and a fresh worker is started for the next call, so one
    hostile answer costs one timeout, never a wedged trainer;
  * why a pool: environment steps call `verify` from several threads at
    once. Each call takes an idle worker from a small pool (started lazily,
    so an idle verifier costs no process) and is alone on it; the process
    speaks JSON lines over its stdin / stdout.

The worker is this file run by path (not `-m sao_jax...`), so it needs no
import of the package and works wherever the parent's interpreter can
import math-verify. Workers exit when their stdin closes, when their parent
dies (a watchdog thread), and are killed by `close()` and at interpreter
exit. Without math-verify every non-integer comparison is "unavailable",
counted and warned about once, never a silent 0.

Before math-verify, an answer is bounded in cost: at most
`MAX_ANSWER_CHARS`, and brackets nested at most `MAX_NESTING` deep (deeper:
"too_nested", no worker call; math-verify's parse grows steeply with
nesting). `\boxed {x}` (spaces before the brace) is a box, and an integer
written in LaTeX digit groups (`1\\,000`, `1{,}000`) is compared as one.

Verdict reasons: "exact", "mismatch", "no_answer", "equivalent" (math-verify
said yes), "timeout", "too_nested", "error" (the worker failed or the
ground truth does not parse), "unavailable". `counts` tallies them.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Sequence

MAX_TAIL_CHARS = 20_000
MAX_ANSWER_CHARS = 1_000
# Generous: the worker imports sympy before it says it is ready, which takes
# seconds on a loaded machine. Not part of `timeout_s`, which bounds a check.
STARTUP_TIMEOUT_S = 120.0

_BRACES = re.compile(r"[{}]")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER = re.compile(r"Answer:[ \t]*([^\n]*)")
# ASCII digits only (`\d` matches any Unicode digit); leading zeros allowed.
_INTEGER = re.compile(r"[+-]?[0-9]{1,1000}")
# Digit groups written with LaTeX spacing or a braced comma: 1\,000, 1{,}000, 1\ 000.
_GROUPED = re.compile(r"[+-]?[0-9]{1,3}(?:(?:\\[,;:! ]|\{,\}|~)[0-9]{3})+")
_GROUP_MARKS = re.compile(r"\\[,;:! ]|\{,\}|~")
# Brackets ((), [], {}) nested deeper than this are not handed to
# math-verify: its parse time grows steeply with nesting, past a worker's
# timeout (a worker restart) at depths far above what any answer needs.
MAX_NESTING = 10


def _integer(answer: str) -> str | None:
  """`answer` as plain digits if it is an integer (digit groups allowed), else None."""
  if _INTEGER.fullmatch(answer):
    return answer
  if _GROUPED.fullmatch(answer):
    return _GROUP_MARKS.sub("", answer)
  return None


def _nesting(text: str) -> int:
  """The deepest nesting of (), [] and {} in `text` (one pass; unbalanced closes ignored)."""
  depth = deepest = 0
  for c in text:
    if c in "([{":
      depth += 1
      deepest = max(deepest, depth)
    elif c in ")]}" and depth:
      depth -= 1
  return deepest


@dataclasses.dataclass(frozen=True)
class Verdict:
  correct: bool
  reason: str


def _clean(answer: str) -> str | None:
  answer = answer.strip()
  if answer.endswith("."):
    answer = answer[:-1].rstrip()
  if not answer or len(answer) > MAX_ANSWER_CHARS:
    return None
  return answer


def _last_box(text: str) -> str | None:
  """The content of the balanced `\\boxed{` that opens last, else None.

  One pass with a stack of open braces: a `}` closes the latest open one,
  a stray `}` is ignored, and a box still open at the end is no answer.
  """
  stack: list[int] = []  # content start of a box's brace, or -1
  best = None
  for m in _BRACES.finditer(text):
    i = m.start()
    if text[i] == "{":
      j = i  # `\boxed {x}` too: spaces between the command and its brace
      while j > 0 and text[j - 1] in " \t":
        j -= 1
      stack.append(i + 1 if text.endswith("\\boxed", 0, j) else -1)
    elif stack:
      start = stack.pop()
      if start >= 0 and (best is None or start > best[0]):
        best = (start, i)
  return None if best is None else text[best[0] : best[1]]


def extract_answer(text: str) -> str | None:
  """The final answer of `text` (module docstring), stripped, or None.

  Only the last `MAX_TAIL_CHARS` are read; a trailing period is dropped;
  an empty answer or one over `MAX_ANSWER_CHARS` is None.
  """
  text = text[-MAX_TAIL_CHARS:]
  box = _last_box(text)
  if box is not None:
    return _clean(box)
  for pattern in (_HASHES, _ANSWER):
    last = None
    for m in pattern.finditer(text):
      if m.group(1).strip():
        last = m.group(1)
    if last is not None:
      return _clean(last)
  return None


def _normalise(s: str) -> str:
  return " ".join(s.split())


def exact_match(response: str, ground_truth: Any) -> Verdict:
  """The extracted answer equals the ground truth, up to runs of whitespace."""
  answer = extract_answer(response)
  if answer is None:
    return Verdict(False, "no_answer")
  if _normalise(answer) == _normalise(str(ground_truth)):
    return Verdict(True, "exact")
  return Verdict(False, "mismatch")


def _boxed(s: str) -> str:
  return s if "\\boxed" in s else "\\boxed{" + s + "}"


# --- the worker process --------------------------------------------------------


def _check(request: dict) -> dict:
  """One comparison, in the worker: math-verify with its own timeouts off."""
  import math_verify

  gold = math_verify.parse(request["gold"], parsing_timeout=None)
  if not gold:
    return {"error": "the ground truth does not parse"}
  pred = math_verify.parse(request["pred"], parsing_timeout=None)
  return {"equal": bool(pred) and bool(math_verify.verify(gold, pred, timeout_seconds=None))}


def _watch_parent() -> None:
  parent = os.getppid()
  while True:
    time.sleep(1.0)
    if os.getppid() != parent:
      os._exit(0)


def _serve(handler: Callable[[dict], dict] = _check) -> None:
  """The worker's loop: a ready line, then one JSON reply per request line."""
  # Protocol on a private copy of stdout; anything printed (a library's
  # chatter) goes to stderr instead of corrupting the stream.
  out = os.fdopen(os.dup(1), "w", encoding="utf-8")
  os.dup2(2, 1)
  threading.Thread(target=_watch_parent, daemon=True).start()
  try:
    import logging

    import math_verify  # noqa: F401

    # It warns once that its timeouts are off: they are, on purpose.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    ready = {"ready": True, "available": True}
  except Exception as e:  # noqa: BLE001
    ready = {"ready": True, "available": False, "error": f"{type(e).__name__}: {e}"}
  out.write(json.dumps(ready) + "\n")
  out.flush()
  for line in sys.stdin:
    try:
      reply = handler(json.loads(line))
    except Exception as e:  # noqa: BLE001
      reply = {"error": f"{type(e).__name__}: {e}"[:500]}
    out.write(json.dumps(reply) + "\n")
    out.flush()


# Run this file by path, with no '' (the working directory) on sys.path, so a
# stray sympy.py next to the user's script cannot shadow the real one.
_BOOT = (
  "import runpy, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
  "runpy.run_path(sys.argv[1], run_name='__main__')"
)


def default_worker_command() -> list[str]:
  return [sys.executable, "-c", _BOOT, os.path.abspath(__file__)]


class _Dead(Exception):
  pass


class _TimedOut(Exception):
  pass


class _Worker:
  """One worker process, used by one caller at a time (the pool sees to it)."""

  def __init__(self, command: Sequence[str]):
    self._command = list(command)
    self._proc: subprocess.Popen | None = None
    self._buf = b""

  def start(self) -> dict:
    self._proc = subprocess.Popen(
      self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
    )
    self._buf = b""
    try:
      return self._read(time.monotonic() + STARTUP_TIMEOUT_S)
    except _TimedOut as e:
      raise _Dead(f"not ready after {STARTUP_TIMEOUT_S} s") from e

  def request(self, message: dict, timeout_s: float) -> dict:
    assert self._proc is not None
    try:
      self._proc.stdin.write((json.dumps(message) + "\n").encode())
    except OSError as e:
      raise _Dead(f"write: {e}") from e
    return self._read(time.monotonic() + timeout_s)

  def _read(self, deadline: float) -> dict:
    fd = self._proc.stdout.fileno()
    while b"\n" not in self._buf:
      left = deadline - time.monotonic()
      if left <= 0:
        raise _TimedOut()
      ready, _, _ = select.select([fd], [], [], left)
      if ready:
        chunk = os.read(fd, 65536)
        if not chunk:
          raise _Dead(f"worker exited (status {self._proc.poll()})")
        self._buf += chunk
    line, self._buf = self._buf.split(b"\n", 1)
    try:
      return json.loads(line)
    except ValueError as e:
      raise _Dead(f"bad reply {line[:100]!r}") from e

  @property
  def running(self) -> bool:
    return self._proc is not None

  def kill(self) -> None:
    proc, self._proc = self._proc, None
    if proc is None:
      return
    proc.kill()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass
    for pipe in (proc.stdin, proc.stdout):
      try:
        pipe.close()
      except OSError:
        pass


_LIVE: "weakref.WeakSet[MathVerifier]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
  for verifier in list(_LIVE):
    verifier.close()


class MathVerifier:
  """Thread-safe math answer checking (module docstring).

  `workers`: the most worker processes, i.e. concurrent math-verify calls
  (more callers wait for an idle one). `worker_command`: the argv of a
  worker (tests substitute one that hangs on demand).
  """

  def __init__(
    self, timeout_s: float = 5.0, workers: int = 4, worker_command: Sequence[str] | None = None
  ):
    if not timeout_s > 0:
      raise ValueError(f"timeout_s = {timeout_s}: must be > 0")
    if workers < 1:
      raise ValueError(f"workers = {workers}: must be >= 1")
    self.timeout_s = timeout_s
    self.counts: collections.Counter[str] = collections.Counter()
    self._lock = threading.Lock()
    self._command = list(worker_command or default_worker_command())
    # Last in, first out: the warm worker is reused, the rest never start.
    self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
    self._all = [_Worker(self._command) for _ in range(workers)]
    for w in self._all:
      self._idle.put(w)
    self._unavailable = ""  # why math-verify cannot run, once known
    self._closed = False
    _LIVE.add(self)

  def verify(self, response: str, ground_truth: Any) -> Verdict:
    verdict = self._verify(response, str(ground_truth).strip())
    with self._lock:
      self.counts[verdict.reason] += 1
    return verdict

  __call__ = verify

  def stats(self) -> dict[str, int]:
    """A copy of `counts`, safe to read while other threads verify."""
    with self._lock:
      return dict(self.counts)

  def _verify(self, response: str, gold: str) -> Verdict:
    answer = extract_answer(response)
    if answer is None:
      return Verdict(False, "no_answer")
    whole, whole_gold = _integer(answer), _integer(gold)
    if whole is not None and whole_gold is not None:
      return Verdict(True, "exact") if int(whole) == int(whole_gold) else Verdict(False, "mismatch")
    if _normalise(answer) == _normalise(gold):
      return Verdict(True, "exact")
    if _nesting(answer) > MAX_NESTING:
      return Verdict(False, "too_nested")
    if self._unavailable:
      return Verdict(False, "unavailable")
    worker = self._idle.get()
    try:
      if self._closed:
        raise RuntimeError("MathVerifier.verify after close()")
      return self._ask(worker, {"pred": _boxed(answer), "gold": _boxed(gold)})
    finally:
      self._idle.put(worker)

  def _ask(self, worker: _Worker, message: dict) -> Verdict:
    try:
      if not worker.running:
        ready = worker.start()
        if not ready.get("available", False):
          worker.kill()
          self._mark_unavailable(ready.get("error", "math-verify not importable"))
          return Verdict(False, "unavailable")
      reply = worker.request(message, self.timeout_s)
    except _TimedOut:
      worker.kill()  # the next call on this slot starts a fresh one
      return Verdict(False, "timeout")
    except (_Dead, OSError) as e:
      worker.kill()
      warnings.warn(
        f"MathVerifier: worker failed ({e}); restarting it", RuntimeWarning, stacklevel=2
      )
      return Verdict(False, "error")
    if "error" in reply:
      return Verdict(False, "error")
    return Verdict(True, "equivalent") if reply.get("equal") else Verdict(False, "mismatch")

  def _mark_unavailable(self, why: str) -> None:
    with self._lock:
      first, self._unavailable = not self._unavailable, why
    if first:
      warnings.warn(
        f"MathVerifier: math-verify is unavailable ({why}); non-integer answers score "
        "0 with reason 'unavailable'. Install it with `pip install sao-jax[math]` "
        "(math-verify==0.9.0).",
        RuntimeWarning,
        stacklevel=4,
      )

  def close(self) -> None:
    """Kills the workers (waiting for calls in flight to give theirs back)."""
    self._closed = True
    for _ in self._all:
      self._idle.get()
    for w in self._all:
      w.kill()
    for w in self._all:
      self._idle.put(w)

  def __enter__(self) -> "MathVerifier":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


if __name__ == "__main__":
  _serve()
