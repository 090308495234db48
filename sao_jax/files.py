"""Files written whole: a temporary name in the same directory, then a rename.

A reader (another process, a restarted run, a rollout host on shared
storage) sees the old file or the new one, never a partial write. The
temporary name carries the writer's pid, so two processes writing the same
path do not trample each other's temporary.
"""

from __future__ import annotations

import json
import os


def write_text(path: str, text: str) -> None:
  """`text` at `path`, atomically; creates the parent directory."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def write_json(path: str, value, **dump_kwargs) -> None:
  """`value` as JSON at `path`, atomically (`dump_kwargs` go to `json.dumps`)."""
  write_text(path, json.dumps(value, **dump_kwargs))
