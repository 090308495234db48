"""Import strings: how a config names a user's object (`pkg.module:attr`, `path/file.py:attr`).

The one resolver of every registry that takes a user's name (env.name,
env.reward, a dataset's verifier and tool functions, user estimators and
losses): a name that does not resolve is one ValueError line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from typing import Any


def is_import_string(name: str) -> bool:
  return isinstance(name, str) and ":" in name


def resolve(target: str, what: str = "env.name") -> Any:
  """The object an import string names: `pkg.module:attr` or `path/file.py:attr`.

  Raises ValueError with one line saying what could not be found. A file is
  loaded under a module name derived from its absolute path, so loading it
  twice (or in two threads' worth of builds) gives the same module.
  """
  module_name, sep, attr = target.rpartition(":")
  if not sep or not module_name or not attr:
    raise ValueError(
      f"{what} = {target!r}: an import string is 'pkg.module:name' or 'path/to/file.py:name'"
    )
  if module_name.endswith(".py"):
    path = os.path.abspath(module_name)
    if not os.path.isfile(path):
      raise ValueError(f"{what} = {target!r}: no file {path}")
    key = "sao_jax_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = sys.modules.get(key)
    if module is None:
      spec = importlib.util.spec_from_file_location(key, path)
      module = importlib.util.module_from_spec(spec)
      sys.modules[key] = module
      try:
        spec.loader.exec_module(module)
      except Exception as e:  # noqa: BLE001  # the user's code: one line
        del sys.modules[key]
        raise ValueError(f"{what} = {target!r}: loading {path} failed: {one_line(e)}") from None
      except BaseException:
        del sys.modules[key]
        raise
  else:
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      if e.name and module_name.startswith(e.name):  # the module itself is missing
        raise ValueError(f"{what} = {target!r}: cannot import {module_name!r} ({e})") from None
      raise ValueError(
        f"{what} = {target!r}: importing {module_name!r} failed: {one_line(e)}"
      ) from None
    except Exception as e:  # noqa: BLE001  # the user's code: one line
      raise ValueError(
        f"{what} = {target!r}: importing {module_name!r} failed: {one_line(e)}"
      ) from None
  if not hasattr(module, attr):
    raise ValueError(f"{what} = {target!r}: module {module_name!r} has no {attr!r}")
  return getattr(module, attr)


def one_line(e: BaseException) -> str:
  """`Type: message (file:line)` of an error in a user's code, on one line: the
  line is the SyntaxError's own, else the innermost frame of the traceback."""
  if isinstance(e, SyntaxError):
    where = f" ({e.filename}:{e.lineno})" if e.filename else ""
    message = e.msg
  else:
    frames = traceback.extract_tb(e.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = str(e)
  message = " ".join(message.split())
  if len(message) > 300:
    message = message[:300] + "..."
  return f"{type(e).__name__}: {message}{where}" if message else f"{type(e).__name__}{where}"
