"""A shell call's disk limits, held while it runs: a tmpfs, else a watchdog.

Part of the sandbox's runner: `sandbox._runner` appends this file's text to
sandbox_runner.py's, and the supervisor calls `mount_disk`, `disk_watchdog`
and `finish_disk` by name. Like the runner: the standard library only, no
sao_jax, no `from __future__`, and importing the file runs nothing.

A shell's writable filesystem is its workspace (at /repo) and its /tmp.
Together they hold at most `max_disk_bytes` bytes, counted as allocated
(a one-byte file takes a page, a hole takes nothing), and `max_disk_files`
entries (files, directories, links; a second hard link counts too). Two
mechanisms, the first wherever the machine allows it:

* "tmpfs" (the supervisor may mount one: root, or a user namespace). In the
  call's mount namespace the supervisor mounts a tmpfs with size= and
  nr_inodes= at the limits, copies the workspace in, and binds the tmpfs's
  repo/ and tmp/ over the workspace's place and /tmp in the chroot. A write
  past a limit fails at once with ENOSPC ("No space left on device"): the
  kernel holds the limit, whatever the timing. A workspace already larger
  than the limits when the call starts gets a tmpfs of its own size: no
  room to grow. Once every process of the call is gone the supervisor
  replaces the workspace directory's contents by the tmpfs's repo/, holes
  and hard links kept, so the host's disk gets no more than the tmpfs held
  (plus a block per directory); /tmp ends with the namespace.
* "watchdog" (no tmpfs: mounts refused, or `isolate=False`): the workspace
  and /tmp stay on the host's disk; the supervisor measures them every
  WATCH_SECONDS and SIGKILLs the call once they are over a limit, and
  RLIMIT_FSIZE bounds any one file. How far a writer gets past the limit
  before the kill depends on its speed and the machine's load; a last
  measure after the call reports an excess however fast it came.

The call is reported at the limit when it ended with the tmpfs full (no
free page or inode: "disk_limit full"), the watchdog killed it ("killed"),
or the last measure found it over ("over"). Copies
work by file descriptor, without recursion: any depth, any path length.
"""

import errno
import os
import resource
import stat
import time

WATCH_SECONDS = 0.01
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MNT_DETACH = 2, 4, 32, 4096, 2


def mount_disk(call):
  """The tmpfs (module docstring), in the supervisor's mount namespace after
  the binds; why it could not be made ("": it was, `call.tmpfs` is True)."""
  disk, libc = call.lim["disk"], call.libc
  top, mounted = disk["top"], []
  _more_files()
  try:
    host = os.open(disk["host"], _DIR)
    try:
      have_bytes, have_files = measure([host])  # room for the copy first, then resized
      room = "size=%d,nr_inodes=%d,mode=0700" % (
        disk["bytes"] + have_bytes + (1 << 20),
        disk["files"] + have_files + 3,
      )
      if _mount(libc, b"tmpfs", top, b"tmpfs", MS_NOSUID | MS_NODEV, room):
        return "tmpfs refused: " + call.strerror()
      mounted.append(top)
      os.mkdir(top + "/repo", 0o700)
      os.mkdir(top + "/tmp", 0o700)
      os.chmod(top + "/tmp", 0o1777)
      repo = os.open(top + "/repo", _DIR)
      try:
        copy_tree(host, repo, call.uid)
      finally:
        os.close(repo)
    finally:
      os.close(host)
    st = os.statvfs(top)  # the limits, or the copy's own size if it is larger
    size = max(disk["bytes"], (st.f_blocks - st.f_bfree) * st.f_frsize)
    inodes = max(disk["files"] + 3, st.f_files - st.f_ffree)  # + the root, repo/, tmp/
    if _mount(
      libc,
      None,
      top,
      None,
      MS_REMOUNT | MS_NOSUID | MS_NODEV,
      "size=%d,nr_inodes=%d" % (size, inodes),
    ):
      return "tmpfs resize refused: " + call.strerror()
    for source, target in ((top + "/repo", disk["target"]), (top + "/tmp", disk["tmp"])):
      if _mount(libc, source.encode(), target, None, MS_BIND, None):
        return "binding the tmpfs failed: " + call.strerror()
      mounted.append(target)
      if _mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV, None):
        return "binding the tmpfs failed: " + call.strerror()
    libc.umount2(top.encode(), MNT_DETACH)  # its binds stay; the model never sees it
    mounted.clear()
    call.tmpfs = True
    return ""
  except OSError as e:
    return "tmpfs: " + str(e)
  finally:
    for path in reversed(mounted):  # a failure: back to the workspace's bind
      libc.umount2(path.encode(), MNT_DETACH)


def _mount(libc, source, target, fstype, flags, data):
  """mount(2); nonzero on failure (errno set)."""
  return libc.mount(source, target.encode(), fstype, flags, None if data is None else data.encode())


def _more_files():
  """The supervisor's open-file limit up to its hard limit: copies hold a few
  descriptors per directory level."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if soft != hard:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- the watchdog -------------------------------------------------------------------


class Watchdog:
  """The fallback's check (module docstring), which the supervisor's wait calls
  every WATCH_SECONDS from its alarm (a thread cannot start once the
  supervisor has unshared its PID namespace): True, and remembered in
  `fired`, once the watched directories are over a limit. A large tree is
  measured less often: the supervisor spends at most a third of its time on it."""

  def __init__(self, disk):
    self.disk, self.fired, self.due = disk, False, 0.0

  def __call__(self):
    start = time.monotonic()
    if not self.fired and start >= self.due:
      self.fired = over_limits(self.disk)
      self.due = start + 3 * (time.monotonic() - start)
    return self.fired


def disk_watchdog(call):
  """A shell's Watchdog, or None where a tmpfs holds its limits (or for Python)."""
  disk = call.lim["disk"]
  if not disk or call.tmpfs:
    return None
  _more_files()
  return Watchdog(disk)


def over_limits(disk):
  """Whether the watched directories (workspace, /tmp) are over a limit."""
  fds = []
  try:
    for path in (disk["host"], disk["tmp"]):
      if path:
        try:
          fds.append(os.open(path, _DIR))
        except OSError:
          pass
    size, files = measure(fds, disk["bytes"], disk["files"])
  finally:
    for fd in fds:
      os.close(fd)
  return size > disk["bytes"] or files > disk["files"]


def measure(dir_fds, max_bytes=None, max_files=None):
  """(allocated bytes, entries) under the directories `dir_fds`, nothing
  followed, each inode's blocks once; stops early once over `max_bytes` or
  `max_files`. Entries that vanish meanwhile are skipped."""
  size = files = 0
  seen = set()
  stack = [os.dup(fd) for fd in dir_fds]
  try:
    while stack:
      fd = stack.pop()
      try:
        names = os.listdir(fd)
        for name in names:
          files += 1
          try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
              stack.append(os.open(name, _DIR, dir_fd=fd))
            elif (st.st_dev, st.st_ino) not in seen:
              seen.add((st.st_dev, st.st_ino))
              size += st.st_blocks * 512
          except OSError:
            continue
          if (max_bytes is not None and size > max_bytes) or (
            max_files is not None and files > max_files
          ):
            return size, files
      except OSError:
        pass
      finally:
        os.close(fd)
  finally:
    for fd in stack:
      os.close(fd)
  return size, files


# --- after the call -----------------------------------------------------------------


def finish_disk(call, watchdog):
  """After every process of the call is gone: whether it ended at the limit,
  and with the tmpfs, the workspace copied back. The report's lines."""
  disk = call.lim["disk"]
  if not disk:
    return ""
  error = ""
  if call.tmpfs:
    st = os.statvfs(disk["target"])
    at_limit = "full" if st.f_bfree == 0 or st.f_ffree == 0 else "no"
    try:
      _more_files()
      copy_back(disk["target"], disk["host"])
    except OSError as e:
      error = "copying the workspace back failed: " + str(e)
  elif watchdog.fired:
    at_limit = "killed"
  else:  # however fast it got there
    at_limit = "over" if over_limits(disk) else "no"
  return "disk_mode %s\ndisk_limit %s\ndisk_error %s\ntmpfs_error %s\n" % (
    "tmpfs" if call.tmpfs else "watchdog",
    at_limit,
    " ".join(error.split()),
    " ".join(call.tmpfs_error.split()),
  )


def copy_back(source, host):
  """Replaces the contents of directory `host` by those of `source`."""
  src, dst = os.open(source, _DIR), os.open(host, _DIR)
  try:
    clear(dst)
    copy_tree(src, dst, None)
  finally:
    os.close(src)
    os.close(dst)


def clear(dir_fd):
  """Removes everything in directory `dir_fd` (not the directory); nothing followed."""
  stack = [(os.dup(dir_fd), os.listdir(dir_fd), "")]  # (fd, names left, its name)
  try:
    while stack:
      fd, names, _ = stack[-1]
      if names:
        name = names.pop()
        if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
          child = os.open(name, _DIR, dir_fd=fd)
          stack.append((child, os.listdir(child), name))
        else:
          os.unlink(name, dir_fd=fd)
        continue
      _, _, own = stack.pop()
      os.close(fd)
      if stack:
        os.rmdir(own, dir_fd=stack[-1][0])
  finally:
    for fd, _, _ in stack:
      os.close(fd)


def copy_tree(src_fd, dst_fd, uid):
  """Copies the contents of directory `src_fd` into the empty directory `dst_fd`.

  Regular files (their holes kept), directories and symlinks; a hard link
  stays a link; fifos, sockets and devices are left out; nothing is
  followed. Modes keep their permission bits only (no setuid, setgid or
  sticky bit), modification times are kept. `uid`: the copies' owner (None:
  whoever copies). `dst_fd` takes `src_fd`'s mode and time.
  """
  linked = {}  # (st_dev, st_ino) of a source with other links -> its copy, open
  stack = [(os.dup(src_fd), os.dup(dst_fd), os.listdir(src_fd), os.fstat(src_fd))]
  if uid is not None:
    os.fchown(dst_fd, uid, uid)
  try:
    while stack:
      sfd, dfd, names, st_dir = stack[-1]
      if not names:
        stack.pop()
        os.fchmod(dfd, stat.S_IMODE(st_dir.st_mode) & 0o777)
        os.utime(dfd, ns=(st_dir.st_atime_ns, st_dir.st_mtime_ns))
        os.close(sfd)
        os.close(dfd)
        continue
      name = names.pop()
      st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
      if stat.S_ISDIR(st.st_mode):
        os.mkdir(name, 0o700, dir_fd=dfd)
        child_s = os.open(name, _DIR, dir_fd=sfd)
        child_d = os.open(name, _DIR, dir_fd=dfd)
        stack.append((child_s, child_d, os.listdir(child_s), st))
        if uid is not None:
          os.fchown(child_d, uid, uid)
      elif stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=sfd), name, dir_fd=dfd)
        if uid is not None:
          os.chown(name, uid, uid, dir_fd=dfd, follow_symlinks=False)
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dfd, follow_symlinks=False)
      elif stat.S_ISREG(st.st_mode):
        _copy_file(sfd, dfd, name, st, uid, linked)
  finally:
    for sfd, dfd, _, _ in stack:
      os.close(sfd)
      os.close(dfd)
    for fd in linked.values():
      os.close(fd)


def _copy_file(sfd, dfd, name, st, uid, linked):
  """One regular file of `copy_tree`: linked to an earlier copy of its inode, else copied."""
  key = (st.st_dev, st.st_ino)
  if key in linked:
    try:  # a hard link to the copy, through its descriptor (no path, no privilege)
      os.link("/proc/self/fd/%d" % linked[key], name, dst_dir_fd=dfd, follow_symlinks=True)
      return
    except OSError:
      pass  # no /proc: a copy of its own
  fd_in = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sfd)
  try:
    fd_out = os.open(
      name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd
    )
    try:
      if stat.S_ISREG(os.fstat(fd_in).st_mode):
        copy_data(fd_in, fd_out, os.fstat(fd_in).st_size)
      if uid is not None:
        os.fchown(fd_out, uid, uid)
      os.fchmod(fd_out, stat.S_IMODE(st.st_mode) & 0o777)
      os.utime(fd_out, ns=(st.st_atime_ns, st.st_mtime_ns))
    except BaseException:
      os.close(fd_out)
      raise
    if st.st_nlink > 1 and key not in linked:
      linked[key] = fd_out
    else:
      os.close(fd_out)
  finally:
    os.close(fd_in)


def copy_data(fd_in, fd_out, size):
  """Copies `size` bytes of a regular file, its holes left as holes."""
  pos = 0
  while pos < size:
    try:
      start = os.lseek(fd_in, pos, os.SEEK_DATA)
      end = min(size, os.lseek(fd_in, start, os.SEEK_HOLE))
    except OSError as e:
      if e.errno == errno.ENXIO:  # nothing but a hole left
        break
      if e.errno != errno.EINVAL:
        raise
      start, end = pos, size  # no SEEK_DATA here: all of it
    os.lseek(fd_out, start, os.SEEK_SET)
    while start < end:
      sent = os.sendfile(fd_out, fd_in, start, end - start)
      if not sent:  # shorter than it was
        end = size
        break
      start += sent
    pos = max(end, pos + 1)
  os.ftruncate(fd_out, size)
