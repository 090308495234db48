"""A pod job: which processes run where, with what command, and what happens when one dies.

`launch/pod.py` turns a config into hosts (`plan`): `pod.trainer_hosts`
trainer processes (`launch/train.py`, joined by `jax.distributed` when
there are several, process 0 the coordinator) and `pod.rollout_hosts`
rollout processes (`launch/rollout.py`, each its own `--rollout_id`). Every
host runs the very command a user would type on it (README "Running on a
TPU pod", the low-level path): the same config file and `--config.*`
overrides, plus its own distributed or rollout-id flags. Two runtimes
start them:

  * Ray (`sao_jax/pod/ray_runtime.py`): one actor a host, placed by its resources
    (TPU hosts by slice placement groups), its output streamed to the
    driver with the host named, supervised by `Supervisor` below;
  * Kubernetes (`sao_jax/pod/jobset.py`): a JobSet with a trainer and a
    rollout replicated job, the same commands with the host index taken
    from the pod's completion index; or Ray on Kubernetes, a KubeRay
    RayCluster (`sao_jax/pod/raycluster.py`) whose head runs the Ray path.
    What every emitted pod carries: `sao_jax/pod/kube.py`.

`Supervisor` is the restart policy, a pure state machine over host exits
(no Ray in it, so it is tested by itself):

  * a rollout host that dies is restarted with the same rollout_id (it
    resumes its shard sequence: the fleet's resume rules), up to
    `pod.max_rollout_restarts` times each;
  * a trainer process that dies takes the trainer group down (one SPMD
    program cannot lose a process): every trainer process is stopped and
    the group restarts from the last checkpoint (the trainer resumes from
    its workdir), up to `pod.max_trainer_restarts` times; then the job fails
    with the reason;
  * the job succeeds when every trainer process exits 0; rollout hosts
    then see the fleet's DONE marker and exit (stopped after
    `pod.finish_seconds` if they do not).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
from typing import Sequence

from sao_jax.config import sections

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER, ROLLOUT = "trainer", "rollout"
# Where a trainer's command names jax.distributed's coordinator until the
# runtime knows it (Ray: process 0's node and a free port, new at each start).
COORDINATOR = "{coordinator}"


@dataclasses.dataclass(frozen=True)
class Host:
  """One process of the job: its role, index, command line and environment."""

  role: str
  index: int
  argv: tuple[str, ...]
  env: dict = dataclasses.field(default_factory=dict, hash=False)

  @property
  def name(self) -> str:
    return f"{self.role}{self.index}"


def rollout_id(index) -> str:
  return f"rollout{index}"


def host_argv(
  role: str,
  index,
  config_file: str,
  workdir: str,
  overrides: Sequence[str],
  pod: sections.Pod,
  coordinator: str,
  python: str = "python",
) -> list[str]:
  """The command of host `index` of `role` (`index` and `coordinator` may be
  placeholders a runtime expands, e.g. Kubernetes' "$(PROCESS_ID)")."""
  base = [f"--config={config_file}", f"--workdir={workdir}", *overrides]
  if role == TRAINER:
    argv = [python, "launch/train.py", *base]
    if pod.trainer_hosts == 1:  # one process: no jax.distributed, whatever the config says
      return argv + ["--config.distributed.enabled=False"]
    return argv + [
      "--config.distributed.enabled=True",
      f"--config.distributed.coordinator_address={coordinator}",
      f"--config.distributed.num_processes={pod.trainer_hosts}",
      f"--config.distributed.process_id={index}",
    ]
  if role == ROLLOUT:
    return [python, "launch/rollout.py", *base, f"--rollout_id={rollout_id(index)}"]
  raise ValueError(f"unknown role {role!r}")


def plan(
  config_file: str,
  workdir: str,
  overrides: Sequence[str],
  pod: sections.Pod,
  coordinator: str = COORDINATOR,
  python: str = sys.executable,
) -> list[Host]:
  """Every host of the job, trainers first (process 0 is the coordinator)."""
  hosts = []
  for role, n in ((TRAINER, pod.trainer_hosts), (ROLLOUT, pod.rollout_hosts)):
    for i in range(n):
      argv = host_argv(role, i, config_file, workdir, overrides, pod, coordinator, python)
      hosts.append(Host(role, i, tuple(argv), dict(pod.host_env)))
  return hosts


def check(config, pod: sections.Pod) -> None:
  """Config rules of a pod job (one line each, before anything starts)."""
  if pod.rollout_hosts and config.rl.mode != "fleet":
    raise sections.ConfigError(
      f'pod.rollout_hosts = {pod.rollout_hosts}: rollout hosts serve rl.mode = "fleet" '
      f"(this config's rl.mode is {config.rl.mode!r})"
    )
  if config.rl.mode == "fleet" and config.rl.steps and not pod.rollout_hosts:
    raise sections.ConfigError(
      'pod.rollout_hosts = 0: rl.mode = "fleet" trains on rollout hosts\' trajectories; '
      "set pod.rollout_hosts >= 1"
    )
  d = config.distributed
  if d.coordinator_address or d.num_processes or d.process_id != -1:
    raise sections.ConfigError(
      "distributed.coordinator_address / num_processes / process_id are set: launch/pod.py "
      "hands them out itself (pod.trainer_hosts); leave them at their defaults"
    )


# ------------------------------------------------------------ supervision
class Action(enum.Enum):
  WAIT = "wait"  # nothing to do
  RESTART_ROLLOUT = "restart_rollout"  # start this rollout host again
  RESTART_TRAINERS = "restart_trainers"  # stop every trainer process, start the group again
  FINISH = "finish"  # the trainer is done: let the rollout hosts exit, then stop
  FAIL = "fail"  # stop everything; the job failed (reason)


@dataclasses.dataclass(frozen=True)
class Decision:
  action: Action
  host: str = ""
  reason: str = ""


def describe_exit(code: int | None) -> str:
  if code is None:
    return "its Ray actor died"
  if code < 0:
    return f"killed by signal {-code}"
  return f"exit status {code}"


class Supervisor:
  """The restart policy over host exits; counts what it did."""

  def __init__(self, pod: sections.Pod):
    self.pod = pod
    self.trainer_restarts = 0
    self.rollout_restarts: dict[str, int] = {}
    self.trainers_done: set[str] = set()
    self.rollouts_done: set[str] = set()
    self.finished = False

  def on_exit(self, host: Host, code: int | None) -> Decision:
    """What to do when `host`'s process ended with `code` (None: the actor died)."""
    if host.role == TRAINER:
      if code == 0:
        self.trainers_done.add(host.name)
        if len(self.trainers_done) == self.pod.trainer_hosts:
          self.finished = True
          return Decision(Action.FINISH, host.name, "every trainer process exited 0")
        return Decision(Action.WAIT, host.name)
      if self.trainer_restarts >= self.pod.max_trainer_restarts:
        return Decision(
          Action.FAIL,
          host.name,
          f"{host.name} failed ({describe_exit(code)}) after the trainer group "
          f"was restarted {self.trainer_restarts} times "
          f"(pod.max_trainer_restarts = {self.pod.max_trainer_restarts})",
        )
      self.trainer_restarts += 1
      self.trainers_done.clear()
      return Decision(
        Action.RESTART_TRAINERS,
        host.name,
        f"{host.name} failed ({describe_exit(code)}): restarting the trainer "
        f"group from its last checkpoint ({self.trainer_restarts} of "
        f"{self.pod.max_trainer_restarts})",
      )
    if code == 0 or self.finished:
      self.rollouts_done.add(host.name)
      return Decision(Action.WAIT, host.name)
    n = self.rollout_restarts.get(host.name, 0)
    if n >= self.pod.max_rollout_restarts:
      return Decision(
        Action.FAIL,
        host.name,
        f"{host.name} failed ({describe_exit(code)}) after {n} restarts "
        f"(pod.max_rollout_restarts = {self.pod.max_rollout_restarts})",
      )
    self.rollout_restarts[host.name] = n + 1
    return Decision(
      Action.RESTART_ROLLOUT,
      host.name,
      f"{host.name} failed ({describe_exit(code)}): restarting it "
      f"({n + 1} of {self.pod.max_rollout_restarts})",
    )

  def counters(self) -> dict:
    return {
      "trainer_restarts": self.trainer_restarts,
      "rollout_restarts": sum(self.rollout_restarts.values()),
    }
