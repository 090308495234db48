"""One command for a pod job: starts, places and supervises every trainer and rollout host.

    # on a Ray cluster (or a laptop: a local Ray instance is started)
    python launch/pod.py --config=configs/sao_moe.py --workdir=/mnt/shared/run \
        [--ray_address=auto] [--config.pod.rollout_hosts=8] [--config.FIELD=VALUE ...]

    # GKE without Ray: write the same job as a Kubernetes JobSet
    python launch/pod.py --config=configs/sao_moe.py --workdir=/mnt/shared/run \
        --config.pod.volumes="('/mnt/shared=pvc:CLAIM',)" \
        --emit=jobset --out=sao_moe.jobset.json [--name=sao-moe]

    # GKE with Ray: a KubeRay RayCluster; the driver then runs on its head
    python launch/pod.py ... --emit=raycluster --out=sao_moe.raycluster.json

Every host runs the command a user would type on it (launch/train.py on
each trainer process with its jax.distributed flags, launch/rollout.py on
each rollout host with its own --rollout_id), with this command's config
file and --config.* overrides; sao_jax/pod/hosts.py has the plan and the restart
policy, sao_jax/pod/ray_runtime.py the Ray runtime, sao_jax/pod/jobset.py the
JobSet, sao_jax/pod/raycluster.py the RayCluster, sao_jax/pod/kube.py what
every emitted pod carries (volumes, privilege, requests, identity, grace).
The `pod` config section sets the hosts, their resources and the restart
budgets.
"""

import importlib.metadata
import json
import os
import sys

from absl import flags
from ml_collections import config_flags

from sao_jax.config import sections
from sao_jax.data import files
from sao_jax.pod import hosts as pod
from sao_jax.train import configuration

# --config files import the repository's `configs` package, which is not
# installed: this checkout's root joins sys.path, whatever the working directory.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Run directory every host sees: a shared POSIX path or gs://BUCKET/run."
)
_EMIT = flags.DEFINE_enum(
  "emit",
  "ray",
  ["ray", "jobset", "raycluster"],
  "ray: run the job on Ray; jobset: write a Kubernetes JobSet; raycluster: write a KubeRay "
  "RayCluster to run the Ray path on GKE.",
)
_OUT = flags.DEFINE_string(
  "out", None, "--emit=jobset/raycluster: write it here (default: stdout)."
)
_NAME = flags.DEFINE_string(
  "name",
  None,
  "--emit=jobset/raycluster: the name's prefix "
  "(default: the workdir's last component); a hash of the workdir "
  "follows it, so runs in different workdirs never share a name.",
)
_RAY_ADDRESS = flags.DEFINE_string(
  "ray_address",
  None,
  "Ray cluster to join ('auto': the one this host belongs to); unset: a local Ray instance.",
)
_RAY_LOOPBACK = flags.DEFINE_bool(
  "ray_loopback",
  False,
  "Local Ray only: run Ray and every host in a private network "
  "namespace with only loopback, so nothing off this machine reaches Ray's ports (Ray "
  "itself listens on every interface whatever --node-ip-address says); the job then "
  "cannot reach the network either (sao_jax/pod/netns.py).",
)
flags.mark_flags_as_required(["config", "workdir"])


def config_overrides(argv) -> list[str]:
  """The --config.FIELD=VALUE flags of this command, in order: every host gets them."""
  out = []
  args = iter(argv[1:])
  for a in args:
    if a.startswith("--config.") and "=" in a:
      out.append(a)
    elif a.startswith("--config.") and not a.startswith("--config="):
      out.append(f"{a}={next(args, '')}")
  return out


def emit(config, section, config_file: str, overrides: list[str]) -> None:
  """Writes the job as a JobSet or a RayCluster, refusing one whose pods would not start."""
  from sao_jax.pod import kube

  workdir = _WORKDIR.value
  kube.check_storage(config, workdir, section)
  rel = os.path.relpath(os.path.abspath(config_file), pod.ROOT)
  config_file = rel if not rel.startswith("..") else config_file
  name = kube.job_name(_NAME.value or os.path.basename(os.path.normpath(workdir)), workdir)
  if _EMIT.value == "jobset":
    from sao_jax.pod import jobset as pod_jobset

    manifest = pod_jobset.jobset(name, config_file, workdir, overrides, section)
    then = f"kubectl apply -f {_OUT.value or 'FILE'}"
  else:
    from sao_jax.pod import raycluster

    manifest = raycluster.raycluster(name, section, _ray_version())
    then = "kubectl apply, then on its head: " + " ".join(
      raycluster.driver_command(config_file, workdir, overrides)
    )
  text = json.dumps(manifest, indent=2) + "\n"
  if not _OUT.value:
    sys.stdout.write(text)
    return
  with open(_OUT.value, "w", encoding="utf-8") as f:
    f.write(text)
  print(
    f"[pod] wrote {manifest['kind']} {name!r} ({section.trainer_hosts} trainer, "
    f"{section.rollout_hosts} rollout hosts) to {_OUT.value}; then: {then}"
  )


def _ray_version() -> str | None:
  try:
    return importlib.metadata.version("ray")
  except importlib.metadata.PackageNotFoundError:
    return None


def main(argv):
  config = _CONFIG.value
  section = sections.load(config).pod
  pod.check(config, section)
  overrides = config_overrides(sys.argv)
  config_file = config_flags.get_config_filename(flags.FLAGS["config"])
  if _EMIT.value != "ray":
    emit(config, section, config_file, overrides)
    return
  if _RAY_LOOPBACK.value:
    from sao_jax.pod import netns

    netns.check(_RAY_ADDRESS.value, _WORKDIR.value)
  try:
    import ray
  except ImportError:
    raise sections.ConfigError("--emit=ray needs Ray: pip install -e '.[pod]'") from None
  from sao_jax.pod import ray_runtime as pod_ray

  workdir = files.absolute(_WORKDIR.value)
  hosts = pod.plan(os.path.abspath(config_file), workdir, overrides, section)
  if _RAY_ADDRESS.value:
    ray.init(
      address=_RAY_ADDRESS.value,
      include_dashboard=False,
      log_to_driver=False,
      configure_logging=False,
    )
  else:
    # A local instance gets a logical CPU a host: the actors only watch their
    # host's process (what the processes compute is not Ray's to schedule).
    pod_ray.start_local(len(hosts), loopback=_RAY_LOOPBACK.value)
  print(
    f"[pod] {len(hosts)} hosts on Ray ({section.trainer_hosts} trainer, "
    f"{section.rollout_hosts} rollout); workdir {workdir}",
    flush=True,
  )
  try:
    code = pod_ray.Job(hosts, section, log=lambda line: print(line, flush=True)).run()
  finally:
    ray.shutdown()
  sys.exit(code)


if __name__ == "__main__":
  configuration.run(main)
