"""A local Ray job that nothing off the machine can reach: a private network namespace.

`launch/pod.py --ray_loopback` calls `enter_loopback_only()` before it
starts its local Ray instance. Ray itself offers no way to keep its
servers on loopback: its GCS, raylet, object manager and every worker
serve gRPC on all interfaces ("::"), and `ray start
--node-ip-address=127.0.0.1` / `ray.init(_node_ip_address="127.0.0.1")`
only change the address Ray advertises (Ray even replaces 127.0.0.1 by the
machine's own address: `ray._private.services.resolve_ip_for_localhost`);
`--dashboard-host` covers the dashboard alone. As tests/pod/test_netns.py
checks (Ray 2.60): with `_node_ip_address="127.0.0.1"`, the GCS,
raylet and worker sockets listen on "::" and its runtime-env agent on the
machine's address.

So the driver moves itself, before Ray starts, into a network namespace of
its own whose only interface is an up loopback (unshare(CLONE_NEWNET) as
root; elsewhere a user namespace first, where the kernel allows
unprivileged ones). Every process Ray and the job then start inherits it:
"all interfaces" is loopback, and nothing outside the namespace, the rest
of this machine included, can connect. The price: the job cannot reach out
either (no gs:// workdir, no W&B online, no downloads); `launch/pod.py`
refuses a gs:// workdir with it.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

from sao_jax.config import sections
from sao_jax.data import files

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sh14x"  # struct ifreq: the interface name, then ifr_flags


def _unshare(flags: int) -> int:
  """unshare(2); 0 or the errno."""
  libc = ctypes.CDLL("libc.so.6", use_errno=True)
  return 0 if libc.unshare(flags) == 0 else ctypes.get_errno()


def _map_ids(uid: int, gid: int) -> None:
  """In a new user namespace: this process keeps its uid and gid."""
  for name, text in (
    ("setgroups", "deny"),
    ("uid_map", f"{uid} {uid} 1"),
    ("gid_map", f"{gid} {gid} 1"),
  ):
    with open(f"/proc/self/{name}", "w", encoding="ascii") as f:
      f.write(text)


def _loopback_up() -> None:
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def interfaces() -> list[str]:
  """The network interfaces this process sees."""
  with open("/proc/net/dev", encoding="ascii") as f:
    return [line.split(":")[0].strip() for line in f.readlines()[2:]]


def enter_loopback_only() -> None:
  """Moves this process into a new network namespace with only loopback, up.

  Raises OSError (one line) where the kernel allows neither (not root and no
  unprivileged user namespaces)."""
  uid, gid = os.getuid(), os.getgid()
  error = _unshare(CLONE_NEWNET)
  if error:
    error_user = _unshare(CLONE_NEWUSER | CLONE_NEWNET)
    if error_user:
      raise OSError(
        error_user,
        "--ray_loopback: cannot make a private network namespace "
        f"(unshare: {os.strerror(error)}; with a user namespace: "
        f"{os.strerror(error_user)}); run as root or where unprivileged user "
        "namespaces are allowed",
      )
    _map_ids(uid, gid)
  _loopback_up()


def check(ray_address: str | None, workdir: str) -> None:
  """Refuses (one line) --ray_loopback where the job needs the network."""
  if ray_address or files.is_url(workdir):
    raise sections.ConfigError(
      f"--ray_loopback: a local Ray instance and a local workdir only, the namespace has no "
      f"network (--ray_address={ray_address}, --workdir={workdir})"
    )
