"""A disk that a test fills on purpose, for the full-disk tests of tests/faults.

`small_disk` is a fixture: a tmpfs of 32 MiB mounted in the test's tmp_path
(root and mount(8) needed), which `fill()` fills to the last byte and
`free()` empties again, so every write the run makes meets the real ENOSPC
of the real writers (orbax and tensorstore, the metrics file). Where no
tmpfs can be mounted it falls back to injecting that error,
OSError(ENOSPC), at the run's writes: orbax's save and the metrics appends.
"""

import errno
import os
import subprocess

import orbax.checkpoint as ocp
import pytest

from sao_jax.data import files


class SmallDisk:
  """`path`: the filesystem's root; `fill()` / `free()` as above."""

  def __init__(self, path: str, mounted: bool):
    self.path, self.mounted, self.full = path, mounted, False
    self._filler = os.path.join(path, "filler")

  def fill(self, leave: int = 0) -> None:
    """Fills the disk, then frees `leave` bytes of it again (mounted only)."""
    self.full = not leave
    if self.mounted:
      try:
        with open(self._filler, "ab", buffering=0) as f:
          while True:
            f.write(b"\0" * 65536)
      except OSError:
        pass
      try:  # the last blocks, smaller than a write
        with open(self._filler, "ab", buffering=0) as f:
          while True:
            f.write(b"\0" * 512)
      except OSError:
        pass
      if leave:
        os.truncate(self._filler, os.path.getsize(self._filler) - leave)

  def free(self) -> None:
    self.full = False
    if self.mounted and os.path.exists(self._filler):
      os.remove(self._filler)


def raise_when_full(disk: SmallDisk, write):
  def wrapped(*args, **kwargs):
    if disk.full:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write(*args, **kwargs)

  return wrapped


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
  mnt = tmp_path / "disk"
  mnt.mkdir()
  mounted = (
    os.geteuid() == 0
    and subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True
    ).returncode
    == 0
  )
  disk = SmallDisk(str(mnt), mounted)
  if not mounted:
    monkeypatch.setattr(
      ocp.CheckpointManager, "save", raise_when_full(disk, ocp.CheckpointManager.save)
    )
    monkeypatch.setattr(files.Appender, "write", raise_when_full(disk, files.Appender.write))
  try:
    yield disk
  finally:
    if mounted:
      subprocess.run(["umount", "-l", str(mnt)], check=False)
