"""The emitted JobSet and RayCluster would start on GKE: storage, privilege, size, identity,
queue, grace, names (sao_jax/pod/kube.py, jobset.py, raycluster.py).

No cluster ran them: the manifests are checked against the kubernetes
client's models and the CRDs' published schemas (crd_check.py).
"""

import copy
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import runs

from configs import sao_moe
from sao_jax.config import sections
from sao_jax.pod import jobset as pod_jobset
from sao_jax.pod import kube, raycluster

needs_kubernetes = pytest.mark.skipif(
  importlib.util.find_spec("kubernetes") is None or importlib.util.find_spec("jsonschema") is None,
  reason="NOT TESTED: the kubernetes client or jsonschema is not installed (pod extra)",
)

WORKDIR = "/mnt/run/sao-moe"
VOLUMES = ("/mnt/run=pvc:sao-runs", "/data=gcs:sao-data:ro")


def moe(**kw):
  """sao_moe's config and its pod section with GKE's settings (and `kw`)."""
  config = sao_moe.get_config()
  pod = sections.load(config).pod.replace(
    **{
      "volumes": VOLUMES,
      "service_account": "sao-runner",
      "queue": "tpu-v5p",
      "trainer_resources": {"TPU": 4},
      "rollout_resources": {"TPU": 4},
      **kw,
    }
  )
  return config, pod


def pod_templates(manifest):
  """(role, PodTemplateSpec dict) of every pod template in a JobSet or RayCluster."""
  if manifest["kind"] == "JobSet":
    return [
      (j["name"], j["template"]["spec"]["template"]) for j in manifest["spec"]["replicatedJobs"]
    ]
  return [("head", manifest["spec"]["headGroupSpec"]["template"])] + [
    (g["groupName"], g["template"]) for g in manifest["spec"]["workerGroupSpecs"]
  ]


@needs_kubernetes
def test_the_jobset_and_raycluster_pass_their_crd_schemas_and_kubernetes_models():
  import crd_check

  _, pod = moe()
  name = kube.job_name("sao-moe", WORKDIR)
  js = pod_jobset.jobset(name, "configs/sao_moe.py", WORKDIR, [], pod)
  rc = raycluster.raycluster(name, pod, ray_version="2.60.0")
  assert crd_check.errors(js, "jobset_v1alpha2.json") == []
  assert crd_check.errors(rc, "raycluster_v1.json") == []
  # The check can fail: a misspelt field, a wrong type, a field the CRD lacks.
  bad = copy.deepcopy(js)
  bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
    "terminationGracePeriod"
  ] = 600
  assert "terminationGracePeriod: 600 -> None" in " ".join(
    crd_check.errors(bad, "jobset_v1alpha2.json")
  )
  bad = copy.deepcopy(rc)
  bad["spec"]["workerGroupSpecs"][0]["numOfHosts"] = "32"
  bad["spec"]["headGroupSpec"]["rayStartParam"] = {}
  assert len(crd_check.errors(bad, "raycluster_v1.json")) == 2

  assert js["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "tpu-v5p"}
  assert rc["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "tpu-v5p"}
  groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
  assert (groups["trainer"]["replicas"], groups["trainer"]["numOfHosts"]) == (1, 32)
  assert (groups["rollout"]["replicas"], groups["rollout"]["numOfHosts"]) == (8, 1)
  for role, template in pod_templates(js) + pod_templates(rc):
    spec = template["spec"]
    (container,) = spec["containers"]
    assert spec["serviceAccountName"] == "sao-runner", role
    assert spec["terminationGracePeriodSeconds"] == 600  # 300 s a save x margin 2
    assert template["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    assert {m["mountPath"]: m["readOnly"] for m in container["volumeMounts"]} == {
      "/mnt/run": False,
      "/data": True,
    }
    assert {
      v["name"]: v.get("persistentVolumeClaim", {}).get("claimName")
      or v["csi"]["volumeAttributes"]["bucketName"]
      for v in spec["volumes"]
    } == {"pvc-0": "sao-runs", "gcs-1": "sao-data"}
    requests = container["resources"]["requests"]
    limits = container["resources"]["limits"]
    assert limits["memory"] == requests["memory"] and "cpu" not in limits
    if role == "head":  # the driver: no TPU, no sandbox
      assert "securityContext" not in container and "google.com/tpu" not in limits
      assert requests == pod.head_requests
      continue
    assert requests == {**pod.trainer_requests, "google.com/tpu": "4"}
    assert container["securityContext"] == {
      "capabilities": {"add": ["SYS_ADMIN"]},
      "seccompProfile": {"type": "RuntimeDefault"},
      "appArmorProfile": {"type": "Unconfined"},
    }
    assert "privileged" not in container["securityContext"]


def test_emit_refuses_a_job_whose_pods_would_not_share_its_files():
  config, pod = moe(volumes=(), service_account="")
  with pytest.raises(
    sections.ConfigError,
    match=r"^--workdir = '/mnt/run/sao-moe': on no "
    r"volume of pod.volumes = \(\), so each pod would write its own disk",
  ):
    kube.check_storage(config, WORKDIR, pod)
  config, pod = moe()
  kube.check_storage(config, WORKDIR, pod)
  config.env.kwargs = {"path": "/scratch/train.jsonl"}  # a dataset on no volume
  with pytest.raises(
    sections.ConfigError,
    match=r"^env.kwargs.path = '/scratch/train.jsonl'"
    r": on no volume .* would read its own disk",
  ):
    kube.check_storage(config, WORKDIR, pod)
  config.env.kwargs = {
    "path": "/data/train.jsonl",
    "heldout_path": "data/in_image.jsonl",
    "rule": "/attn/(q|k)$",
  }  # a pattern, not a path
  config.sft.init_from_hf = "/data/qwen3-30b-a3b"
  kube.check_storage(config, WORKDIR, pod)  # read-only volume, relative path in the image
  config.fleet.root = "/data/fleet"
  with pytest.raises(
    sections.ConfigError,
    match=r"^fleet.root = '/data/fleet': the job "
    r"writes there, but its volume /data is mounted read-only",
  ):
    kube.check_storage(config, WORKDIR, pod)
  config.fleet.root = ""
  # GCS needs an identity (Workload Identity): a gs:// workdir, or a gcsfuse volume.
  for workdir, kw in (("gs://bucket/run", {"volumes": ()}), (WORKDIR, {})):
    config, pod = moe(service_account="", **kw)
    with pytest.raises(
      sections.ConfigError,
      match=r"^pod.service_account = '': the job "
      r"uses GCS",
    ):
      kube.check_storage(config, workdir, pod)
  kube.check_storage(config, "gs://bucket/run", pod.replace(volumes=(), service_account="sa"))


def test_names_are_unique_per_workdir_and_valid_dns_labels():
  a, b = kube.job_name("run", "gs://team-a/run"), kube.job_name("run", "gs://team-b/run")
  assert a != b and a.startswith("run-") and b.startswith("run-")
  assert kube.job_name("run", "gs://team-a/run/") == a  # the same workdir, the same name
  long = kube.job_name("A very_long Experiment name " * 4, "/mnt/run/x")
  assert len(long) == kube.NAME_LENGTH
  # The longest pod hostname JobSet derives (<name>-<job>-<job index>-<pod index>).
  hostname = f"{long}-rollout-999-0"
  assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", hostname) and len(hostname) <= 63


def test_the_sandbox_privilege_follows_pod_sandbox():
  _, pod = moe(sandbox="gvisor", trainer_hosts=1)
  js = pod_jobset.jobset("x", "c.py", WORKDIR, [], pod)
  for _, template in pod_templates(js):
    assert template["spec"]["runtimeClassName"] == "gvisor"
    assert "appArmorProfile" not in template["spec"]["containers"][0]["securityContext"]
  with pytest.raises(
    sections.ConfigError,
    match=r"^pod.sandbox = 'gvisor': the trainer slice "
    r"has 32 hosts",
  ):
    pod_jobset.jobset("x", "c.py", WORKDIR, [], pod.replace(trainer_hosts=32))
  js = pod_jobset.jobset("x", "c.py", WORKDIR, [], pod.replace(sandbox="none"))
  for _, template in pod_templates(js):
    assert "securityContext" not in template["spec"]["containers"][0]
    assert "runtimeClassName" not in template["spec"]
  with pytest.raises(sections.ConfigError, match=r"^pod.sandbox = 'root'"):
    pod.replace(sandbox="root")


def test_the_raycluster_refuses_hosts_that_ray_would_place_anywhere():
  _, pod = moe(trainer_resources={})
  with pytest.raises(
    sections.ConfigError,
    match=r"^pod.trainer_resources = \{\}: on a "
    r"RayCluster .* set \{'TPU': 4\}",
  ):
    raycluster.raycluster("x", pod)


def test_launch_pod_emits_a_named_jobset_or_refuses_in_one_line(tmp_path):
  out = tmp_path / "job.json"
  cmd = [
    sys.executable,
    os.path.join(runs.ROOT, "launch", "pod.py"),
    f"--config={os.path.join(runs.ROOT, 'configs', 'sao_moe.py')}",
    f"--workdir={WORKDIR}",
    "--emit=jobset",
    f"--out={out}",
  ]
  bad = subprocess.run(
    cmd,
    cwd=runs.ROOT,
    env=runs.child_env(1),
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert bad.returncode == 2 and not out.exists(), bad.stderr[-2000:]
  assert (
    bad.stderr.strip()
    .splitlines()[-1]
    .startswith("error: --workdir = '/mnt/run/sao-moe': on no volume")
  )
  good = subprocess.run(
    cmd + ["--config.pod.volumes=('/mnt/run=pvc:sao-runs',)"],
    cwd=runs.ROOT,
    env=runs.child_env(1),
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert good.returncode == 0, good.stderr[-2000:]
  name = kube.job_name("sao-moe", WORKDIR)
  assert f"[pod] wrote JobSet {name!r} (32 trainer, 8 rollout hosts)" in good.stdout
  assert f'"name": "{name}"' in out.read_text(encoding="utf-8")
