"""--ray_loopback: a local Ray job in a network namespace that only loopback reaches
(sao_jax/pod/netns.py, ray_runtime.start_local).

A server in the namespace that binds every interface (as Ray's gRPC servers
do) answers its own loopback and nothing outside; the slow test starts the
real local Ray instance there and finds every process Ray started in that
namespace, whose only interface is loopback (and, without the flag, Ray's
ports answering from outside).
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import runs

TOKEN = b"inner"

# Enters the namespace, serves TOKEN on every interface, reports what it sees.
SERVER = f"""
import json, socket, sys, threading
from sao_jax.pod import netns
try:
  netns.enter_loopback_only()
except OSError as e:
  print(json.dumps({{"error": str(e)}}), flush=True)
  sys.exit(0)
s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.bind(("::", 0))
s.listen()
def serve():
  while True:
    c, _ = s.accept()
    c.sendall({TOKEN!r})
    c.close()
threading.Thread(target=serve, daemon=True).start()
port = s.getsockname()[1]
inside = socket.create_connection(("127.0.0.1", port), timeout=5).recv(16).decode()
print(json.dumps({{"interfaces": netns.interfaces(), "port": port, "inside": inside}}),
      flush=True)
sys.stdin.readline()
"""

# Starts a local Ray instance as launch/pod.py does (--ray_loopback: argv[1]
# "1"), runs a task, reports the namespace's listening TCP ports, its
# interfaces and the network namespace of every process Ray started, and
# holds Ray up until its stdin closes.
RAY = """
import json, os, sys
import psutil, ray
from sao_jax.pod import netns, ray_runtime
ray_runtime.start_local(1, loopback=sys.argv[1] == "1")
ray.get(ray.remote(lambda: 1).remote())
ports = []
for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
  with open(name) as f:
    for line in f.readlines()[1:]:
      local, state = line.split()[1], line.split()[3]
      if state == "0A":
        ports.append(int(local.rsplit(":", 1)[1], 16))
children = psutil.Process().children(recursive=True)
print(json.dumps({"ports": sorted(set(ports)), "interfaces": netns.interfaces(),
                  "netns": os.readlink("/proc/self/ns/net"),
                  "ray": [(p.name(), os.readlink(f"/proc/{p.pid}/ns/net")) for p in children]}),
      flush=True)
sys.stdin.readline()
ray.shutdown()
"""


def answers_from_outside(port: int) -> bool:
  """Whether the namespace's server on `port` answers a connection from here."""
  for host in ("127.0.0.1", _own_address()):
    try:
      with socket.create_connection((host, port), timeout=2) as c:
        if c.recv(16) == TOKEN:
          return True
    except OSError:
      pass
  return False


def _own_address() -> str:
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
      s.connect(("192.0.2.1", 9))  # no packet is sent: only the route's source address
      return s.getsockname()[0]
    except OSError:
      return "127.0.0.1"


def listening_here() -> set[int]:
  ports = set()
  for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
    with open(name, encoding="ascii") as f:
      for line in f.readlines()[1:]:
        if line.split()[3] == "0A":
          ports.add(int(line.split()[1].rsplit(":", 1)[1], 16))
  return ports


def test_loopback_is_refused_where_the_job_needs_the_network():
  from sao_jax.config import sections
  from sao_jax.pod import netns

  netns.check(None, "/tmp/run")
  for address, workdir in (("auto", "/tmp/run"), (None, "gs://bucket/run")):
    with pytest.raises(sections.ConfigError, match=r"^--ray_loopback: a local Ray instance "):
      netns.check(address, workdir)


def test_a_server_on_every_interface_in_the_namespace_answers_only_its_loopback():
  proc = subprocess.Popen(
    [sys.executable, "-c", SERVER],
    cwd=runs.ROOT,
    env=runs.child_env(1),
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    report = json.loads(proc.stdout.readline())
    if "error" in report:
      pytest.skip(f"NOT TESTED: {report['error']}")
    assert report["interfaces"] == ["lo"] and report["inside"] == TOKEN.decode()
    assert not answers_from_outside(report["port"])
  finally:
    proc.stdin.close()
    proc.wait(timeout=30)


def local_ray(loopback: bool) -> tuple[dict, list[int]]:
  """(what a local Ray instance's driver reports, its ports a connection from
  outside its namespace reaches)."""
  outside = listening_here()
  proc = subprocess.Popen(
    [sys.executable, "-c", RAY, "1" if loopback else "0"],
    cwd=runs.ROOT,
    env=runs.child_env(1),
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
  )
  try:
    line = proc.stdout.readline()
    while line and not line.startswith("{"):
      line = proc.stdout.readline()
    assert line, "the local Ray instance did not start"
    report = json.loads(line)
    reached = []
    for port in report["ports"]:
      if port in outside:  # held before Ray started: another process's
        continue
      for host in ("127.0.0.1", _own_address()):
        try:
          socket.create_connection((host, port), timeout=2).close()
          reached.append(port)
          break
        except OSError:
          pass
    return report, reached
  finally:
    proc.stdin.close()
    proc.wait(timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(
  importlib.util.find_spec("ray") is None, reason="NOT TESTED: Ray is not installed (pod extra)"
)
def test_local_ray_with_loopback_is_unreachable_from_outside_its_namespace():
  own = os.readlink("/proc/self/ns/net")
  report, _ = local_ray(loopback=True)
  # Every Ray process (GCS, raylet, agents, workers) lives in the driver's
  # namespace, whose only interface is loopback: nothing outside can connect.
  # (A connection from here could only reach this namespace's listeners.)
  names = {name for name, _ in report["ray"]}
  assert {"gcs_server", "raylet"} <= names, names
  assert report["netns"] != own and report["interfaces"] == ["lo"]
  assert {ns for _, ns in report["ray"]} == {report["netns"]}, report["ray"]
  assert len(report["ports"]) >= 3, report["ports"]  # GCS, raylet, a worker at least
  # Without it Ray's servers share this namespace and answer from outside.
  report, reached = local_ray(loopback=False)
  assert {ns for _, ns in report["ray"]} == {own}
  assert len(reached) >= 3, (report["ports"], reached)
