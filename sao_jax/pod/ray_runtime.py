"""Ray as the pod's job runtime: an actor a host, the driver supervising them.

Each host of `pod.plan` runs in a `HostProcess` actor, which starts the
host's command as a child process (the same `launch/train.py` or
`launch/rollout.py` line a user would type) and buffers its output lines.
The driver (`run`) polls every actor, prints each line prefixed with the
host's name, and hands exits to `pod.Supervisor`, whose decisions it
carries out: a rollout host starts again, the trainer group is stopped and
started again with a fresh coordinator port, or the job finishes or fails.

Placement: a host takes `pod.trainer_resources` / `pod.rollout_resources`
({} : one CPU). With "TPU" among them, each group is placed on a TPU slice
through Ray's slice placement groups (`ray.util.tpu.slice_placement_group`:
the training slice of `pod.trainer_topology`, one slice of
`pod.rollout_topology` a rollout host). The TPU placement has not run here
(no TPU is reachable from the project's machines); the CPU path is tested.

Without a cluster address `start_local` starts a local Ray instance;
`loopback` first moves the driver into a network namespace with only
loopback (sao_jax/pod/netns.py), since Ray's own servers listen on every
interface whatever `--node-ip-address` says. On GKE the cluster is a
KubeRay RayCluster (sao_jax/pod/raycluster.py) and the driver runs on its
head with `--ray_address=auto`.

Ray carries the control traffic (start, stop, output lines, exit codes);
trajectories and weights keep their own paths (the fleet's shared
directory), not Ray's object store.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import threading
import time

import ray

from sao_jax.config import sections
from sao_jax.pod import hosts as pod_lib

POLL_SECONDS = 0.5


def _die_with_parent():
  """In the child before exec: SIGKILL it when its actor's process dies
  (Linux's PR_SET_PDEATHSIG), so no host process outlives its actor."""
  try:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except OSError:
    pass


@ray.remote(max_restarts=0)
class HostProcess:
  """One host's process, started and watched from inside its Ray actor."""

  def __init__(self):
    self.proc = None
    self.lines = collections.deque()
    self.lock = threading.Lock()

  def address(self) -> str:
    """This node's IP and a port free on it now (jax.distributed's coordinator)."""
    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      s.bind(("", 0))
      return f"{ip}:{s.getsockname()[1]}"

  def start(self, argv: list[str], env: dict, cwd: str) -> int:
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    self.proc = subprocess.Popen(
      argv,
      env=full_env,
      cwd=cwd,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      errors="replace",
      start_new_session=True,
      preexec_fn=_die_with_parent,
    )
    threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
    return self.proc.pid

  def _read(self, proc):
    for line in proc.stdout:
      with self.lock:
        self.lines.append(line.rstrip("\n"))

  def poll(self) -> tuple[list[str], int | None]:
    """The output lines since the last poll, and the exit code once it ended."""
    code = self.proc.poll() if self.proc else None
    if code is not None:
      time.sleep(0.05)  # the reader drains what the process wrote last
    with self.lock:
      lines = list(self.lines)
      self.lines.clear()
    return lines, code

  def stop(self, grace_s: float = 10.0) -> int | None:
    """SIGTERM the process group, SIGKILL after `grace_s`."""
    if self.proc is None or self.proc.poll() is not None:
      return None if self.proc is None else self.proc.returncode
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
      try:
        os.killpg(self.proc.pid, sig)
      except ProcessLookupError:
        break
      try:
        return self.proc.wait(timeout=wait)
      except subprocess.TimeoutExpired:
        continue
    return self.proc.poll()


def start_local(num_cpus: int, loopback: bool = False) -> None:
  """Starts a local Ray instance of `num_cpus` logical CPUs for this driver.

  `loopback`: first move this process into a private network namespace with
  only loopback (sao_jax/pod/netns.py), so that every Ray server and every
  host process it starts is reachable from nowhere else; Ray's own options
  cannot do that (its gRPC servers listen on every interface)."""
  if loopback:
    from sao_jax.pod import netns

    netns.enter_loopback_only()
  ray.init(
    num_cpus=num_cpus,
    include_dashboard=False,
    dashboard_host="127.0.0.1",
    log_to_driver=False,
    configure_logging=False,
  )


def _tpu_version(tpu_type: str) -> str:
  """ "tpu-v5p-slice" -> "v5p" (GKE's accelerator names)."""
  parts = tpu_type.split("-")
  return parts[1] if len(parts) > 1 else tpu_type


def _placement(pod: sections.Pod, role: str):
  """(actor options, placement groups to remove at the end) for `role`'s hosts."""
  resources = dict(pod.trainer_resources if role == pod_lib.TRAINER else pod.rollout_resources)
  if "TPU" not in resources:
    cpus = resources.pop("CPU", 1)
    return [{"num_cpus": cpus, "resources": resources}], []
  from ray.util import tpu
  from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

  n = pod.trainer_hosts if role == pod_lib.TRAINER else pod.rollout_hosts
  topology = pod.trainer_topology if role == pod_lib.TRAINER else pod.rollout_topology
  slices = 1 if role == pod_lib.TRAINER else n
  spg = tpu.slice_placement_group(
    topology=topology, accelerator_version=_tpu_version(pod.tpu_type), num_slices=slices
  )
  group = spg.placement_group
  ray.get(group.ready())
  options = [
    {
      "num_cpus": 0,
      "resources": resources,
      "scheduling_strategy": PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=i
      ),
    }
    for i in range(n)
  ]
  return options, [group]


class Job:
  """The driver's view of a running pod job."""

  def __init__(
    self, hosts: list[pod_lib.Host], pod: sections.Pod, cwd: str = pod_lib.ROOT, log=print
  ):
    self.hosts = {h.name: h for h in hosts}
    self.pod = pod
    self.cwd = cwd
    self.log = log
    self.supervisor = pod_lib.Supervisor(pod)
    self.actors: dict[str, ray.actor.ActorHandle] = {}
    self.running: set[str] = set()
    self.options: dict[str, dict] = {}
    self.groups = []

  def _options(self):
    for role in (pod_lib.TRAINER, pod_lib.ROLLOUT):
      names = [n for n, h in self.hosts.items() if h.role == role]
      if not names:
        continue
      opts, groups = _placement(self.pod, role)
      self.groups += groups
      for i, name in enumerate(names):
        self.options[name] = opts[min(i, len(opts) - 1)]

  def _start(self, name: str, argv: tuple[str, ...], actor=None):
    """Starts host `name`'s process in a new actor (or in `actor`, just made)."""
    old = self.actors.pop(name, None)
    if old is not None and old is not actor:
      ray.kill(old, no_restart=True)
    actor = actor or HostProcess.options(**self.options[name]).remote()
    self.actors[name] = actor
    pid = ray.get(actor.start.remote(list(argv), self.hosts[name].env, self.cwd))
    self.running.add(name)
    self.log(f"[pod] {name} started (pid {pid})")

  def _trainer_names(self):
    return [n for n, h in self.hosts.items() if h.role == pod_lib.TRAINER]

  def _start_trainers(self):
    """Starts the trainer group, process 0's actor first: its node and a port
    free there are the group's jax.distributed coordinator."""
    names = self._trainer_names()
    for n in names:  # the old group's actors free their resources first
      old = self.actors.pop(n, None)
      if old is not None:
        ray.kill(old, no_restart=True)
    actors = {n: HostProcess.options(**self.options[n]).remote() for n in names}
    coordinator = self._coordinator(actors[names[0]])
    for name in names:
      argv = tuple(a.replace(pod_lib.COORDINATOR, coordinator) for a in self.hosts[name].argv)
      self._start(name, argv, actors[name])

  def _coordinator(self, actor) -> str:
    addr = ray.get(actor.address.remote())
    if self.pod.coordinator_port:
      addr = f"{addr.rsplit(':', 1)[0]}:{self.pod.coordinator_port}"
    return addr

  def _stop(self, names):
    refs = {n: self.actors[n].stop.remote() for n in names if n in self.actors}
    for n, ref in refs.items():
      try:
        ray.get(ref, timeout=120)
      except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        pass
      self.running.discard(n)

  def run(self) -> int:
    """Runs the job to its end: 0 when the trainer finished, 1 when it failed."""
    self._options()
    self._start_trainers()
    for name, h in self.hosts.items():
      if h.role == pod_lib.ROLLOUT:
        self._start(name, h.argv)
    finish_deadline = None
    try:
      while self.running:
        for name in sorted(self.running):
          try:
            lines, code = ray.get(self.actors[name].poll.remote(), timeout=60)
            died = False
          except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            lines, code, died = [], None, True
          for line in lines:
            self.log(f"[{name}] {line}")
          if code is None and not died:
            continue
          self.running.discard(name)
          decision = self.supervisor.on_exit(self.hosts[name], code)
          if decision.reason:
            self.log(f"[pod] {decision.reason}")
          if decision.action == pod_lib.Action.RESTART_ROLLOUT:
            self._start(name, self.hosts[name].argv)
          elif decision.action == pod_lib.Action.RESTART_TRAINERS:
            self._stop(self._trainer_names())
            self._start_trainers()
          elif decision.action == pod_lib.Action.FINISH:
            finish_deadline = time.time() + self.pod.finish_seconds
          elif decision.action == pod_lib.Action.FAIL:
            self._stop(list(self.running))
            self.log(f"[pod] job failed: {decision.reason}; {self._counts()}")
            return 1
        if finish_deadline is not None and time.time() > finish_deadline and self.running:
          self.log(
            f"[pod] stopping {sorted(self.running)}: still running "
            f"{self.pod.finish_seconds:g} s after the trainer finished"
          )
          self._stop(list(self.running))
        time.sleep(POLL_SECONDS)
    finally:
      for actor in self.actors.values():
        ray.kill(actor, no_restart=True)
      for group in self.groups:
        ray.util.remove_placement_group(group)
    self.log(f"[pod] job finished: {self._counts()}")
    return 0

  def _counts(self) -> str:
    c = self.supervisor.counters()
    return (
      f"{c['trainer_restarts']} trainer group restarts, {c['rollout_restarts']} rollout "
      "host restarts"
    )
