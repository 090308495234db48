"""The pod job's plan, restart policy and JobSet (sao_jax/pod/hosts.py, jobset.py), without Ray."""

import importlib.util

import pytest

from configs import sao_moe, sao_tiny
from sao_jax.config import sections
from sao_jax.pod import hosts as pod
from sao_jax.pod import jobset as pod_jobset

OVERRIDES = ["--config.rl.steps=5", "--config.env.kwargs={'path': '/data/a b.jsonl'}"]


def pod_section(**kw):
  return sections.Pod(**{"trainer_hosts": 2, "rollout_hosts": 2, **kw})


def test_every_host_runs_the_command_a_user_would_type():
  hosts = pod.plan(
    "/c/sao_moe.py", "/run", OVERRIDES, pod_section(), coordinator="h0:123", python="py"
  )
  assert [h.name for h in hosts] == ["trainer0", "trainer1", "rollout0", "rollout1"]
  base = ["--config=/c/sao_moe.py", "--workdir=/run", *OVERRIDES]
  assert list(hosts[1].argv) == [
    "py",
    "launch/train.py",
    *base,
    "--config.distributed.enabled=True",
    "--config.distributed.coordinator_address=h0:123",
    "--config.distributed.num_processes=2",
    "--config.distributed.process_id=1",
  ]
  assert list(hosts[3].argv) == ["py", "launch/rollout.py", *base, "--rollout_id=rollout1"]
  # One trainer process: no jax.distributed, whatever the config says.
  one = pod.plan("/c.py", "/run", [], pod_section(trainer_hosts=1), python="py")[0]
  assert one.argv[-1] == "--config.distributed.enabled=False"


def test_pod_rules_are_one_line_errors():
  tiny = sao_tiny.get_config()
  with pytest.raises(sections.ConfigError, match="^pod.rollout_hosts = 2: .*'async'"):
    pod.check(tiny, pod_section())
  tiny.rl.mode = "fleet"
  with pytest.raises(sections.ConfigError, match="^pod.rollout_hosts = 0: "):
    pod.check(tiny, pod_section(rollout_hosts=0))
  tiny.distributed.process_id = 3
  with pytest.raises(sections.ConfigError, match="hands them out itself"):
    pod.check(tiny, pod_section())
  with pytest.raises(sections.ConfigError, match=r"^pod.trainer_resources = .*Ray resource"):
    sections.Pod(trainer_resources={"TPU": -1})
  pod.check(sao_moe.get_config(), sections.load(sao_moe.get_config()).pod)


def test_a_dead_rollout_host_restarts_until_its_budget_is_spent():
  sup = pod.Supervisor(pod_section(max_rollout_restarts=2))
  r0, r1 = (pod.Host(pod.ROLLOUT, i, ()) for i in (0, 1))
  for n in (1, 2):
    d = sup.on_exit(r0, -9)
    assert d.action == pod.Action.RESTART_ROLLOUT and f"({n} of 2)" in d.reason
    assert "killed by signal 9" in d.reason
  assert sup.on_exit(r1, None).action == pod.Action.RESTART_ROLLOUT  # each host its own budget
  d = sup.on_exit(r0, 1)
  assert (
    d.action == pod.Action.FAIL and "rollout0 failed (exit status 1) after 2 restarts" in d.reason
  )
  assert sup.counters() == {"trainer_restarts": 0, "rollout_restarts": 3}


def test_a_dead_trainer_restarts_the_group_then_fails_the_job_with_the_reason():
  sup = pod.Supervisor(pod_section(max_trainer_restarts=1))
  t0, t1 = (pod.Host(pod.TRAINER, i, ()) for i in (0, 1))
  assert sup.on_exit(t0, 0).action == pod.Action.WAIT  # one process done, the other not
  d = sup.on_exit(t1, -9)
  assert d.action == pod.Action.RESTART_TRAINERS and "(1 of 1)" in d.reason
  # A restarted group must finish whole again: t0's earlier exit 0 no longer counts.
  assert sup.on_exit(t0, 0).action == pod.Action.WAIT
  d = sup.on_exit(t1, 1)
  assert d.action == pod.Action.FAIL
  assert d.reason == (
    "trainer1 failed (exit status 1) after the trainer group was restarted "
    "1 times (pod.max_trainer_restarts = 1)"
  )


def test_the_job_finishes_when_every_trainer_process_exits_0():
  sup = pod.Supervisor(pod_section())
  t0, t1, r0 = (
    pod.Host(pod.TRAINER, 0, ()),
    pod.Host(pod.TRAINER, 1, ()),
    pod.Host(pod.ROLLOUT, 0, ()),
  )
  sup.on_exit(t0, 0)
  assert sup.on_exit(t1, 0).action == pod.Action.FINISH
  # After the trainer is done a rollout host's exit, clean or not, restarts nothing.
  assert sup.on_exit(r0, -15).action == pod.Action.WAIT


@pytest.mark.skipif(
  importlib.util.find_spec("kubernetes") is None,
  reason="NOT TESTED: the kubernetes client is not installed (pod extra)",
)
def test_the_jobset_runs_the_ray_paths_commands_and_loads_as_kubernetes_jobs():
  from kubernetes import client

  section = sections.load(sao_moe.get_config()).pod
  manifest = pod_jobset.jobset("sao-moe", "configs/sao_moe.py", "/mnt/run", OVERRIDES, section)
  assert manifest["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and manifest["kind"] == "JobSet"
  jobs = {j["name"]: j for j in manifest["spec"]["replicatedJobs"]}
  api = client.ApiClient()
  coordinator = pod_jobset.coordinator_address("sao-moe", section)
  assert coordinator == "sao-moe-trainer-0-0.sao-moe:8476"
  ray_hosts = {
    h.name: h
    for h in pod.plan(
      "configs/sao_moe.py", "/mnt/run", OVERRIDES, section, coordinator=coordinator, python="python"
    )
  }
  seen = set()
  for role, job in jobs.items():
    template = job["template"]
    # Every field is one the Kubernetes Job API has: a round trip through the
    # client's models drops what it does not know.
    model = api._ApiClient__deserialize(template, "V1JobTemplateSpec")
    assert api.sanitize_for_serialization(model) == template
    spec = model.spec
    assert spec.completion_mode == "Indexed"
    pods = spec.parallelism * job["replicas"]
    assert pods == (section.trainer_hosts if role == "trainer" else section.rollout_hosts)
    (container,) = spec.template.spec.containers
    assert container.resources.limits["google.com/tpu"] == "4"
    topology = spec.template.spec.node_selector["cloud.google.com/gke-tpu-topology"]
    assert topology == (section.trainer_topology if role == "trainer" else section.rollout_topology)
    env = {e.name: e.value for e in container.env if e.value is not None}
    for i in range(pods):
      argv = pod_jobset.expand(container.command, {**env, "PROCESS_ID": str(i)})
      assert argv == list(ray_hosts[f"{role}{i}"].argv), (role, i)
      seen.add(f"{role}{i}")
  assert seen == set(ray_hosts) and len(seen) == 40
  # A trainer pod's failure restarts the JobSet (budgeted); a rollout pod is
  # replaced within its own Job; the trainer's success ends the job.
  assert jobs["trainer"]["template"]["spec"]["backoffLimit"] == 0
  assert jobs["rollout"]["template"]["spec"]["backoffLimit"] == section.max_rollout_restarts
  assert manifest["spec"]["failurePolicy"] == {"maxRestarts": section.max_trainer_restarts}
  assert manifest["spec"]["successPolicy"]["targetReplicatedJobs"] == ["trainer"]
