"""repo_repair's judge: the hidden tests run here, the repository's code in another process.

The grader (`repo_repair.RepoRepair.grade`) writes this file into the graded
copy as .sao_grader/judge.py and runs it as the test sandbox's one command,

    exec python3 -I -S -B .sao_grader/judge.py

so the judge *is* the sandbox's model process, and its exit status, which
the sandbox's supervisor reports, is the verdict:

    0 (PASSED)       every test ran and passed, and as many ran as the row says
    10 (FAILED)      a test failed or errored, or too few ran
    11 (BROKEN)      the judge itself crashed (scored 0, never "passed")
    12 (UNPROTECTED) before any repository code ran: the judge could not make
                     itself undumpable or read its job (the grader retries)

Any other status (a signal, say) is no verdict, scored 0. Nothing the
repository's code prints, writes or exits with is read.

What happens, in order (the repository's code runs from step 4 on):

  1. the judge makes itself not dumpable (and ignores SIGINT);
  2. it reads its job, .sao_grader/job.json (the hidden test modules' text,
     their names, the number of tests, the repository's top-level names),
     and deletes it;
  3. it starts the *server*, the repository's process: this file again
     (`... serve FD`, exec'd in /repo), requests on stdin, replies on one
     more pipe, output to /dev/null;
  4. it loads the hidden test modules behind an import hook (`_Finder`):
     the repository's modules are proxies (`_RemoteModule`) of the server's,
     and unittest runs the tests here, every use of the repository's code
     one request;
  5. it writes a short report to stdout and exits with the verdict.

Values cross the pipes as tagged JSON (`encode` / `decode`, both ends): null,
booleans, numbers and strings as themselves, ["float", "nan" | "inf" |
"-inf"], ["list" | "tuple" | "set" | "frozenset", item, ...], ["dict",
[key, value], ...], and ["ref", id, type name] for any other object, which
stays in the server (`Remote`). Types are matched exactly; a ref equals only
itself. A failure raised by the repository's code comes back as the nearest
built-in exception class in its MRO, with its message. A reply that is not
one (garbage, a wrong sequence number, over `MAX_REPLY` bytes, none) breaks
the server: that and every later request raise `RepositoryError`.

Not supported (the test errors, the row scores 0): passing the test's own
functions or objects to the repository's code, in-place changes to
arguments (a call gets copies), and the repository's classes used as types
on the test's side (`assertRaises(repo.Error)`, `isinstance(x, repo.Thing)`).

The standard library only, and no sao_jax: the file runs on its own in the
sandbox's system Python. Importing it runs nothing. Why it is built this
way, and what the repository's process can and cannot do:
docs/design/graders.md.
"""

import builtins
import importlib
import importlib.machinery
import json
import operator
import os
import sys
import types

PASSED, FAILED, BROKEN, UNPROTECTED = 0, 10, 11, 12
JOB = ".sao_grader/job.json"
# The longest reply line the judge reads; the deepest value either end encodes.
MAX_REPLY = 1 << 20
MAX_DEPTH = 50
_SEQUENCES = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_BUILDERS = {tag: kind for kind, tag in _SEQUENCES.items()}
_SPECIAL_FLOATS = (["nan"], ["inf"], ["-inf"])


# --- values on the pipes ---------------------------------------------------------------


def encode(value, ref, depth=0):
  """`value` as tagged JSON data; anything else (or deeper than MAX_DEPTH) as
  ["ref", ref(value), type name] (`ref` raises TypeError where that is refused)."""
  kind = type(value)
  if value is None or kind is bool or kind is int or kind is str:
    return value
  if kind is float:
    return value if value - value == 0 else ["float", repr(value)]  # nan, inf, -inf
  if depth < MAX_DEPTH:
    if kind in _SEQUENCES:
      return [_SEQUENCES[kind]] + [encode(x, ref, depth + 1) for x in value]
    if kind is dict:
      return ["dict"] + [
        [encode(k, ref, depth + 1), encode(x, ref, depth + 1)] for k, x in value.items()
      ]
  return ["ref", ref(value), kind.__name__]


def decode(data, ref, depth=0):
  """The value of tagged JSON `data` (from `json.loads`); `ref(id, type name)`
  gives a ref's object. ValueError (or TypeError: an unhashable key) if it is
  not tagged data."""
  kind = type(data)
  if data is None or kind is bool or kind is int or kind is float or kind is str:
    return data
  if kind is not list or not data or type(data[0]) is not str or depth >= MAX_DEPTH:
    raise ValueError("not tagged data")
  tag, rest = data[0], data[1:]
  if tag == "float" and rest in _SPECIAL_FLOATS:
    return float(rest[0])
  if tag == "ref" and len(rest) == 2 and type(rest[0]) is int and type(rest[1]) is str:
    return ref(rest[0], rest[1])
  if tag == "dict" and all(type(pair) is list and len(pair) == 2 for pair in rest):
    return {decode(k, ref, depth + 1): decode(v, ref, depth + 1) for k, v in rest}
  if tag in _BUILDERS:
    return _BUILDERS[tag](decode(x, ref, depth + 1) for x in rest)
  raise ValueError("not tagged data")


# --- the server: the repository's process ------------------------------------------------


def _call(function, /, *args, **kwargs):
  return function(*args, **kwargs)


OPERATIONS = {
  "import": importlib.import_module,
  "getattr": getattr,
  "call": _call,
  "bool": bool,
  "len": len,
  "iter": iter,
  "next": next,
  "str": str,
  "getitem": operator.getitem,
  "contains": operator.contains,
}


def _builtin_base(error):
  """The name of the nearest built-in class in the MRO of `error`'s type."""
  for cls in type(error).__mro__:
    if getattr(builtins, cls.__name__, None) is cls:
      return cls.__name__
  return "BaseException"


def serve(reply_fd):
  """Answers the judge's requests until stdin ends: [seq, op, args, kwargs] ->
  [seq, "value", tagged] or [seq, "raised", built-in class name, message]."""
  requests, replies = os.fdopen(0, "rb"), os.fdopen(reply_fd, "wb")
  sys.path.insert(0, os.getcwd())
  objects = []

  def keep(value):
    objects.append(value)
    return len(objects) - 1

  def get(ref, _):
    return objects[ref]

  for line in requests:
    seq, op, args, kwargs = json.loads(line)
    try:
      value = OPERATIONS[op](
        *[decode(a, get) for a in args], **{k: decode(v, get) for k, v in kwargs}
      )
      try:
        reply = json.dumps([seq, "value", encode(value, keep)])
      except ValueError:  # an int too long for str(), say
        reply = json.dumps([seq, "value", ["ref", keep(value), type(value).__name__]])
    except BaseException as e:  # noqa: BLE001  # the judge's to judge
      try:
        message = str(e)[:500]
      except BaseException:  # noqa: BLE001
        message = ""
      reply = json.dumps([seq, "raised", _builtin_base(e), message])
    replies.write(reply.encode() + b"\n")
    replies.flush()


# --- the judge's side ------------------------------------------------------------------------


class RepositoryError(Exception):
  """The repository's process gave no valid answer (it exited, or wrote garbage)."""


class Server:
  """The repository's process and the judge's requests to it."""

  def __init__(self):
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    sink = _sink()
    import subprocess  # the judge's only

    self.process = subprocess.Popen(
      [
        sys.executable,
        "-I",
        "-S",
        "-B",
        "-X",
        "pycache_prefix=/nonexistent",
        os.path.abspath(sys.argv[0]),
        "serve",
        str(reply_w),
      ],
      stdin=request_r,
      stdout=sink,
      stderr=sink,
      pass_fds=(reply_w,),
      close_fds=True,
    )
    for fd in (request_r, reply_w, sink):
      os.close(fd)
    self.requests, self.replies = os.fdopen(request_w, "wb"), os.fdopen(reply_r, "rb")
    self.seq, self.broken = 0, ""

  def request(self, op, /, *args, **kwargs):
    """The value of `op` on `args` in the server, or the exception it raised there."""
    if self.broken:
      raise RepositoryError(self.broken)
    message = json.dumps(
      [
        self.seq + 1,
        op,
        [encode(a, self._ref) for a in args],
        [[k, encode(v, self._ref)] for k, v in kwargs.items()],
      ]
    )
    self.seq += 1
    try:
      self.requests.write(message.encode() + b"\n")
      self.requests.flush()
      line = self.replies.readline(MAX_REPLY + 1)
    except OSError as e:
      self._break(f"the repository's process is gone ({e.strerror})")
    if not line.endswith(b"\n"):
      self._break("the repository's process ended" if not line else "a reply over the limit")
    try:
      reply = json.loads(line)
      if type(reply) is not list or len(reply) < 3 or reply[0] != self.seq:
        raise ValueError("not a reply to this request")
      if reply[1] == "value" and len(reply) == 3:
        return decode(reply[2], self._remote)
      if reply[1] != "raised" or len(reply) != 4 or not all(type(x) is str for x in reply[2:]):
        raise ValueError("not a reply")
    except (ValueError, TypeError, RecursionError, MemoryError) as e:
      self._break(f"a reply that is not one ({type(e).__name__})")
    raise _exception(reply[2], reply[3][:500])

  def _break(self, why):
    self.broken = why
    raise RepositoryError(why)

  def _ref(self, value):
    if type(value) is Remote and value._sao_server is self:
      return value._sao_id
    raise TypeError(f"a {type(value).__name__} cannot be passed to the repository's code")

  def _remote(self, ref, type_name):
    return Remote(self, ref, type_name[:80])


def _exception(name, message):
  """The built-in exception class `name` (an Exception) with `message`, else RepositoryError."""
  cls = getattr(builtins, name, None)
  if isinstance(cls, type) and issubclass(cls, Exception):
    try:
      return cls(message)
    except Exception:  # noqa: BLE001  # one that needs other arguments
      pass
  return RepositoryError(f"{name}: {message}")


def _sink():
  try:
    return os.open("/dev/null", os.O_WRONLY)
  except OSError:  # a sandbox without the device
    return os.open("/tmp/repository_output", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


class Remote:
  """An object of the repository's, kept in the server: each use is a request."""

  __slots__ = ("_sao_server", "_sao_id", "_sao_type")

  def __init__(self, server, ref, type_name):
    object.__setattr__(self, "_sao_server", server)
    object.__setattr__(self, "_sao_id", ref)
    object.__setattr__(self, "_sao_type", type_name)

  def _sao(self, op, /, *args, **kwargs):
    return self._sao_server.request(op, self, *args, **kwargs)

  def __getattr__(self, name):
    if name.startswith("_sao_"):
      raise AttributeError(name)
    return self._sao("getattr", name)

  def __call__(self, *args, **kwargs):
    return self._sao("call", *args, **kwargs)

  def __bool__(self):
    return self._sao("bool")

  def __len__(self):
    return self._sao("len")

  def __iter__(self):
    return self._sao("iter")

  def __next__(self):
    return self._sao("next")

  def __str__(self):
    return self._sao("str")

  def __getitem__(self, key):
    return self._sao("getitem", key)

  def __contains__(self, item):
    return self._sao("contains", item)

  def __repr__(self):
    return f"<the repository's {self._sao_type} #{self._sao_id}>"


class _RemoteModule(types.ModuleType):
  """A module of the repository's: its attributes are the server's."""

  def __getattr__(self, name):
    if name.startswith("__") and name != "__all__":
      raise AttributeError(name)
    return getattr(self.__dict__["_sao_module"], name)


class _Finder:
  """Hidden test modules from their text, the repository's as proxies (module
  docstring, 4): the meta path finder and the loader of both."""

  def __init__(self, server, hidden, repository):
    self.server, self.hidden = server, hidden  # {module name: (path, text)}
    self.repository = {n for n in repository if n not in sys.stdlib_module_names}
    # Directories of hidden tests without an __init__.py of their own.
    self.packages = {
      name.rsplit(".", k)[0] for name in hidden for k in range(1, name.count(".") + 1)
    } - set(hidden)

  def find_spec(self, name, path=None, target=None):
    if name in self.hidden:
      path, _ = self.hidden[name]
      spec = importlib.machinery.ModuleSpec(
        name, self, origin=os.path.abspath(path), is_package=path.endswith("/__init__.py")
      )
      spec.has_location = True  # __file__: data files of the tests lie beside it
      return spec
    if name in self.packages or name.partition(".")[0] in self.repository:
      return importlib.machinery.ModuleSpec(name, self, is_package=True)
    return None

  def create_module(self, spec):
    if spec.name in self.hidden or spec.name in self.packages:
      return None
    remote = self.server.request("import", spec.name)
    if type(remote) is not Remote:
      raise ImportError(f"the repository's process did not give module {spec.name}")
    module = _RemoteModule(spec.name)
    module.__dict__["_sao_module"] = remote
    return module

  def exec_module(self, module):
    if module.__name__ in self.hidden:
      origin, text = self.hidden[module.__name__]
      code = compile(text, origin, "exec", dont_inherit=True)
      exec(code, module.__dict__)  # noqa: S102


def _undumpable():
  """PR_SET_DUMPABLE 0, confirmed by PR_GET_DUMPABLE; False where it cannot be had."""
  try:
    import ctypes  # the judge's only

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(4, 0, 0, 0, 0) == 0 and libc.prctl(3, 0, 0, 0, 0) == 0
  except (ImportError, OSError, AttributeError):
    return False


def judge():
  """Steps 1-5 of the module docstring; returns the exit status."""
  import signal  # (module docstring, 3)

  signal.signal(signal.SIGINT, signal.SIG_IGN)
  if not _undumpable():
    print("judge: cannot make this process undumpable; no repository code was run")
    return UNPROTECTED
  try:
    with open(JOB, "rb") as f:
      job = json.loads(f.read())
    os.unlink(JOB)
  except (OSError, ValueError) as e:
    print(f"judge: no job: {e}")
    return UNPROTECTED
  hidden = {
    path[: -len(".py")].replace("/", ".").removesuffix(".__init__"): (path, text)
    for path, text in job["files"]
  }
  server = Server()
  import io
  import unittest

  sys.meta_path.insert(0, _Finder(server, hidden, job["repository"]))
  suite = unittest.defaultTestLoader.loadTestsFromNames(job["modules"])
  log = io.StringIO()
  result = unittest.TextTestRunner(stream=log, verbosity=2).run(suite)
  expected = job["num_tests"] or result.testsRun
  passed = result.wasSuccessful() and result.testsRun == expected > 0
  bad = [test.id() for test, _ in result.failures + result.errors]
  print(
    f"judge: run={result.testsRun} expected={expected} failures={len(result.failures)} "
    f"errors={len(result.errors)}" + "".join(f"\n  {name}" for name in bad[:10])
  )
  if server.broken:
    print(f"judge: {server.broken}")
  return PASSED if passed else FAILED


def main():
  if sys.argv[1:2] == ["serve"]:
    serve(int(sys.argv[2]))
    return
  try:
    status = judge()
  except BaseException as e:  # noqa: BLE001  # never "passed" by accident
    print(f"judge: crashed: {type(e).__name__}: {str(e)[:200]}")
    status = BROKEN
  sys.stdout.flush()
  os._exit(status)


if __name__ == "__main__":
  main()
