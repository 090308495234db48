"""The answer verifier: extraction, the integer fast path, math-verify in workers.

Nothing here depends on timing beyond "a hang is seen after timeout_s": the
hanging worker blocks on an event that is never set, the calls that must
succeed get a timeout far from any machine's speed, and concurrency is made
certain with a barrier.
"""

import concurrent.futures as cf
import os
import sys
import threading

import pytest

from sao_jax.envs import verify
from sao_jax.envs.verify import MathVerifier, Verdict, exact_match, extract_answer

try:
  import math_verify  # noqa: F401

  HAVE_MATH_VERIFY = True
except ImportError:
  HAVE_MATH_VERIFY = False
needs_math_verify = pytest.mark.skipif(
  not HAVE_MATH_VERIFY, reason="math-verify not installed (extra [math])"
)

SLOW_OK = 120.0  # a timeout no check on any machine comes near


def fake_worker(handler_source: str) -> list[str]:
  """The real worker loop with a test handler `h(request) -> reply`.

  `check` (math-verify) and `hang` (blocks forever) are in scope.
  """
  boot = (
    "import os, runpy, sys, threading, time\n"
    "ns = runpy.run_path(sys.argv[1])\n"
    "check = ns['_check']\n"
    "hang = threading.Event().wait\n"
    f"{handler_source}\n"
    "ns['_serve'](h)\n"
  )
  return [sys.executable, "-c", boot, verify.__file__]


# --- extraction --------------------------------------------------------------------


@pytest.mark.parametrize(
  "text, answer",
  [
    (r"so the answer is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{\sqrt{\frac{a}{b}}}", r"\sqrt{\frac{a}{b}}"),
    (r"first \boxed{3}, then \boxed{4}", "4"),
    (r"\boxed{ 12. }", "12"),
    (r"\boxed{5} and a stray } brace", "5"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    ("work\n#### 72\n", "72"),
    ("#### 1\n#### 2", "2"),
    ("#### 3\nAnswer: 4", "3"),  # #### before Answer:, whatever the order
    ("blah\nAnswer: x = 5.\n", "x = 5"),
    (r"#### 9 then \boxed{10}", "10"),  # a box before ####
    ("no answer here", None),
    (r"\boxed{}", None),
    (r"\boxed {7}", "7"),  # spaces before the brace
    ("\\boxed \t{8}", "8"),
    (r"\boxed x{7}", None),  # anything else between: not a box
    (r"\boxed{3} then \boxed{\frac{1}{2}", "3"),  # the last box never closes
    (r"\boxed{\frac{1}{2}", None),  # unbalanced and nothing else
    ("Answer:   \n", None),
  ],
)
def test_extract_answer(text, answer):
  assert extract_answer(text) == answer


def test_extract_answer_caps():
  assert extract_answer(r"\boxed{" + "1" * 1000 + "}") == "1" * 1000
  assert extract_answer(r"\boxed{" + "1" * 1001 + "}") is None
  # Only the tail is read: a box 20000 characters before the end is out of it.
  assert extract_answer(r"\boxed{7}" + " " * 20_000) is None
  assert extract_answer(r"\boxed{7}" + " " * 19_000) == "7"


def test_extract_answer_degenerate_response_is_linear():
  # A megabyte of openings: a quadratic rescan would take minutes here.
  assert extract_answer("\\boxed{" * 150_000) is None
  assert extract_answer("{" * 500_000 + r"\boxed{8}") == "8"


def test_exact_match():
  assert exact_match(r"\boxed{x  +  1}", "x + 1") == Verdict(True, "exact")
  assert exact_match(r"\boxed{073}", "73") == Verdict(False, "mismatch")
  assert exact_match("nothing", "73") == Verdict(False, "no_answer")


# --- the integer fast path -----------------------------------------------------------


@pytest.mark.parametrize(
  "answer, gold, verdict",
  [
    ("073", "73", Verdict(True, "exact")),
    ("+5", "5", Verdict(True, "exact")),
    ("-5", "5", Verdict(False, "mismatch")),
    ("-0", "0", Verdict(True, "exact")),
    ("41", " 42 ", Verdict(False, "mismatch")),
    (r"1\,000", "1000", Verdict(True, "exact")),  # LaTeX digit groups
    (r"1{,}000", "1000", Verdict(True, "exact")),
    (r"-12\,345\,678", "-12345678", Verdict(True, "exact")),
    (r"1\,000", "1001", Verdict(False, "mismatch")),
  ],
)
def test_integers_need_no_worker(answer, gold, verdict):
  # Every worker dies at once: an answer that reached one would be "error".
  with MathVerifier(worker_command=[sys.executable, "-c", "raise SystemExit(3)"]) as v:
    assert v.verify(rf"\boxed{{{answer}}}", gold) == verdict
    assert v.verify(f"Answer: {answer}", int(gold)) == verdict
    assert v.counts == {verdict.reason: 2}


def test_deep_nesting_never_reaches_the_worker():
  # Every worker dies at once: an answer that reached one would be "error".
  deep = r"\boxed{" + "(" * (verify.MAX_NESTING + 1) + "x" + ")" * (verify.MAX_NESTING + 1) + "}"
  mixed = r"\boxed{" + "([{" * 4 + "x" + "}])" * 4 + "}"
  with MathVerifier(worker_command=[sys.executable, "-c", "raise SystemExit(3)"]) as v:
    assert v.verify(deep, "x") == v.verify(mixed, "x") == Verdict(False, "too_nested")
    assert v.counts == {"too_nested": 2}
    at_limit = r"\boxed{" + "(" * verify.MAX_NESTING + "x" + ")" * verify.MAX_NESTING + "}"
    with pytest.warns(RuntimeWarning, match="worker failed"):
      assert v.verify(at_limit, "y") == Verdict(False, "error")  # it did reach the worker


def test_a_dead_worker_is_an_error_not_a_mismatch():
  with MathVerifier(worker_command=[sys.executable, "-c", "raise SystemExit(3)"]) as v:
    with pytest.warns(RuntimeWarning, match="worker failed"):
      assert v.verify(r"\boxed{x}", "y") == Verdict(False, "error")
    assert v.counts == {"error": 1}


# --- math-verify -----------------------------------------------------------------------


EQUIVALENCES = [
  (r"\frac{10}{12}", "5/6", Verdict(True, "equivalent")),
  (r"\sqrt{12}", r"2\sqrt3", Verdict(True, "equivalent")),
  ("0.5", r"\frac12", Verdict(True, "equivalent")),
  ("(x+1)^2", "x^2+2x+1", Verdict(True, "equivalent")),
  (r"\frac{1}{3}", "0.5", Verdict(False, "mismatch")),
  ("41.0", "42", Verdict(False, "mismatch")),
  ("x", "y", Verdict(False, "mismatch")),
]


@pytest.fixture(scope="module")
def verifier():
  if not HAVE_MATH_VERIFY:
    pytest.skip("math-verify not installed (extra [math])")
  with MathVerifier(timeout_s=SLOW_OK, workers=4) as v:
    yield v


@pytest.mark.parametrize("answer, gold, verdict", EQUIVALENCES)
def test_math_verify(verifier, answer, gold, verdict):
  assert verifier.verify(rf"so \boxed{{{answer}}}.", gold) == verdict


def test_no_answer(verifier):
  assert verifier.verify("I give up", "5") == Verdict(False, "no_answer")


@needs_math_verify
def test_four_threads_at_once():
  cases = EQUIVALENCES
  barrier = threading.Barrier(4)
  results, errors = {}, []

  def run(t):
    try:
      barrier.wait()
      for i in range(len(cases)):
        j = (i + t) % len(cases)  # each thread takes the cases in its own order
        results[t, j] = v.verify(rf"\boxed{{{cases[j][0]}}}", cases[j][1])
    except Exception as e:  # noqa: BLE001
      errors.append(e)

  with MathVerifier(timeout_s=SLOW_OK, workers=4) as v:
    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert not errors
    assert len(results) == 4 * len(cases)
    for (_, j), verdict in results.items():
      assert verdict == cases[j][2]
    expected = sum(4 for case in cases if case[2].correct)
    assert v.counts == {"equivalent": expected, "mismatch": 4 * len(cases) - expected}


@needs_math_verify  # the fake worker's ready line says if it can import it
def test_four_calls_run_in_four_workers_at_once(tmp_path):
  # Each worker's handler waits until four have arrived: only a pool that
  # runs the four calls at once can answer (one at a time would time out).
  command = fake_worker(
    "def h(r):\n"
    f"  open(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close()\n"
    f"  while len(os.listdir({str(tmp_path)!r})) < 4: time.sleep(0.01)\n"
    "  return {'equal': True}"
  )
  barrier = threading.Barrier(4)
  results = []
  with MathVerifier(timeout_s=SLOW_OK, workers=4, worker_command=command) as v:

    def run():
      barrier.wait()
      results.append(v.verify(r"\boxed{a}", "b"))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert results == [Verdict(True, "equivalent")] * 4
    assert len(os.listdir(tmp_path)) == 4


@needs_math_verify  # the fake worker's ready line says if it can import it
def test_a_hang_times_out_and_the_next_call_works():
  command = fake_worker(
    "def h(r):\n  if 'hang' in r['gold']: hang()\n  return {'equal': 'same' in r['gold']}"
  )
  with MathVerifier(timeout_s=2.0, workers=1, worker_command=command) as v:
    assert v.verify(r"\boxed{a}", "same") == Verdict(True, "equivalent")
    hung = v._all[0]._proc
    assert v.verify(r"\boxed{a}", "hang") == Verdict(False, "timeout")
    assert hung.poll() is not None  # killed, not left running
    assert v.counts["timeout"] == 1
    assert v.verify(r"\boxed{a}", "same") == Verdict(True, "equivalent")
    assert v._all[0]._proc.pid != hung.pid
    assert v.verify(r"\boxed{a}", "other") == Verdict(False, "mismatch")
    assert v.counts == {"equivalent": 2, "timeout": 1, "mismatch": 1}


@needs_math_verify
def test_a_handler_error_is_an_error():
  command = fake_worker("def h(r):\n  raise ZeroDivisionError('boom')")
  with MathVerifier(timeout_s=SLOW_OK, worker_command=command) as v:
    assert v.verify(r"\boxed{a}", "b") == Verdict(False, "error")
    assert v.verify(r"\boxed{a}", "b") == Verdict(False, "error")  # same worker, still up
    assert v.counts == {"error": 2}


def test_unavailable_is_counted_and_warned_once():
  command = [
    sys.executable,
    "-c",
    "import runpy, sys; sys.modules['math_verify'] = None; "
    "runpy.run_path(sys.argv[1], run_name='__main__')",
    verify.__file__,
  ]
  with MathVerifier(timeout_s=SLOW_OK, worker_command=command) as v:
    with pytest.warns(RuntimeWarning, match="math-verify is unavailable"):
      assert v.verify(r"\boxed{\frac12}", "0.5") == Verdict(False, "unavailable")
    import warnings

    with warnings.catch_warnings():
      warnings.simplefilter("error")
      assert v.verify(r"\boxed{\frac12}", "0.5") == Verdict(False, "unavailable")
    assert v.verify(r"\boxed{3}", "3") == Verdict(True, "exact")  # integers still work
    assert v.counts == {"unavailable": 2, "exact": 1}
    assert not any(w.running for w in v._all)


@needs_math_verify
def test_close_kills_the_workers():
  v = MathVerifier(timeout_s=SLOW_OK, workers=2)
  assert v.verify(r"\boxed{\frac{2}{4}}", "1/2") == Verdict(True, "equivalent")
  (proc,) = [w._proc for w in v._all if w.running]  # the one call started one
  v.close()
  assert proc.poll() is not None
  assert not any(w.running for w in v._all)
  with pytest.raises(RuntimeError, match="after close"):
    v.verify(r"\boxed{x}", "y")
  v.close()  # idempotent


@needs_math_verify
def test_worker_exits_when_its_stdin_closes():
  v = MathVerifier(timeout_s=SLOW_OK, workers=1)
  assert v.verify(r"\boxed{0.25}", r"\frac14") == Verdict(True, "equivalent")
  proc = v._all[0]._proc
  proc.stdin.close()  # as when the parent dies
  assert proc.wait(timeout=SLOW_OK) == 0
  v.close()


def test_64_concurrent_verifications_none_lost(verifier):
  # The load test of the grading paths: 64 calls from 16 threads, of every
  # kind (integer fast path, exact string, math-verify, no answer, too
  # nested); each verdict is the one it gets alone.
  kinds = [
    (r"\boxed{1\,000}", "1000", Verdict(True, "exact")),
    (r"\boxed{x + 1}", "x + 1", Verdict(True, "exact")),
    (r"\boxed{\frac{1}{2}}", "0.5", Verdict(True, "equivalent")),
    (r"\boxed{\frac{1}{3}}", "0.5", Verdict(False, "mismatch")),
    ("no answer", "3", Verdict(False, "no_answer")),
    (r"\boxed{" + "(" * 12 + "x" + ")" * 12 + "}", "x", Verdict(False, "too_nested")),
    (r"\boxed {7}", "7", Verdict(True, "exact")),
    (r"\boxed{73}", "073", Verdict(True, "exact")),
  ]
  cases = [kinds[i % len(kinds)] for i in range(64)]
  with cf.ThreadPoolExecutor(16) as pool:
    got = list(pool.map(lambda c: verifier.verify(c[0], c[1]), cases))
  assert got == [c[2] for c in cases]
