"""A local GCS emulator for the gs:// tests: gcp-storage-emulator on 127.0.0.1.

`start()` runs `gcp-storage-emulator` (in memory, one bucket; with the
generation headers of tests/gcs_emulator_serve.py) on a free loopback port and returns the environment that points every client of a
process at it: gcsfs (STORAGE_EMULATOR_HOST, anonymous), tensorstore (its
HTTP URL and a test token), google-cloud-storage (tensorboardX), with no
Google metadata-server probe (its addresses point at a closed loopback
port). The emulator is a test double of GCS's JSON API, not GCS: what
passes here shows the clients and the project's publication rules work
together, not GCS's consistency or speed.
"""

import importlib.util
import os
import socket
import subprocess
import sys
import time

import pytest
import runs

HERE = os.path.dirname(os.path.abspath(__file__))
BUCKET = "sao-test"
MISSING = []
if importlib.util.find_spec("gcsfs") is None:
  MISSING.append("gcsfs")
if importlib.util.find_spec("gcp_storage_emulator") is None:
  MISSING.append("gcp-storage-emulator")
needs_emulator = pytest.mark.skipif(
  bool(MISSING), reason=f"NOT TESTED: {', '.join(MISSING)} not installed (test extra)"
)


def client_env(port: int) -> dict:
  """The variables that send a process's GCS clients to the emulator."""
  url = f"http://127.0.0.1:{port}"
  closed = "127.0.0.1:9"  # the discard port: nothing listens
  return {
    "STORAGE_EMULATOR_HOST": url,  # gcsfs, google-cloud-storage
    "TENSORSTORE_GCS_HTTP_URL": url,
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # tensorstore: no credential search
    "FSSPEC_GS_TOKEN": "anon",  # gcsfs: no credential search
    # gcsfs's bucket-type probe speaks gRPC to Google's storage-control API.
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "NO_GCE_CHECK": "true",
    "GCE_METADATA_HOST": closed,
    "GCE_METADATA_IP": closed,
    "GCE_METADATA_ROOT": closed,
    "EPATH_USE_TF": "false",
  }


class Emulator:
  def __init__(self, port: int, proc: subprocess.Popen):
    self.port, self.proc = port, proc
    self.env = client_env(port)

  def url(self, *parts: str) -> str:
    return "/".join([f"gs://{BUCKET}", *parts])

  def apply_here(self) -> None:
    """Points this (the pytest) process's clients at the emulator, until `stop`."""
    import fsspec  # (its config reads the env once)

    self._saved = {k: os.environ.get(k) for k in self.env}
    self._saved_token = fsspec.config.conf.setdefault("gs", {}).get("token")
    os.environ.update(self.env)
    fsspec.config.conf["gs"]["token"] = "anon"

  def stop(self) -> None:
    for k, v in getattr(self, "_saved", {}).items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    if hasattr(self, "_saved_token"):
      import fsspec

      if self._saved_token is None:
        fsspec.config.conf["gs"].pop("token", None)
      else:
        fsspec.config.conf["gs"]["token"] = self._saved_token
    self.proc.terminate()
    try:
      self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()


def start(log_path: str) -> Emulator:
  port = runs.free_port()
  log = open(log_path, "w", encoding="utf-8")
  proc = subprocess.Popen(
    [sys.executable, os.path.join(HERE, "gcs_emulator_serve.py"), str(port), BUCKET],
    stdout=log,
    stderr=subprocess.STDOUT,
  )
  deadline = time.time() + 60
  while time.time() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"the GCS emulator exited ({proc.returncode}): {log_path}")
    try:
      with socket.create_connection(("127.0.0.1", port), timeout=1):
        return Emulator(port, proc)
    except OSError:
      time.sleep(0.2)
  proc.kill()
  raise RuntimeError("the GCS emulator did not listen within 60 s")
