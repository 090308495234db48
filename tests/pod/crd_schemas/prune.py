"""Writes the CRD schemas the pod tests check manifests against (run by hand).

    python tests/pod/crd_schemas/prune.py CRD.yaml VERSION OUT.json SOURCE \
        PATH=MODEL ...

Reads a CustomResourceDefinition (e.g. JobSet's
config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml at a release tag),
takes VERSION's openAPIV3Schema, drops `status` and every description, and
replaces each embedded Kubernetes type at a dotted PATH ("[]" for a list's
items) by {"x-k8s-model": MODEL}: the test checks those through the
kubernetes client's own models (V1JobTemplateSpec, ...), whose field lists
are the API server's. SOURCE (repository, tag and commit) is kept beside the
schema. Both CRDs are Apache-2.0 (kubernetes-sigs/jobset, ray-project/kuberay).
"""

import json
import sys

import yaml


def strip(node):
  if isinstance(node, dict):
    return {k: strip(v) for k, v in node.items() if k != "description"}
  if isinstance(node, list):
    return [strip(v) for v in node]
  return node


def replace(schema: dict, path: str, model: str) -> None:
  node, parts = schema, path.split(".")
  for part in parts[:-1]:
    node = node["items"] if part == "[]" else node["properties"][part]
  last = parts[-1]
  node = node["items"] if last == "[]" else node["properties"]
  node[last] = {"x-k8s-model": model}


def main(argv):
  crd_path, version, out, source, *replacements = argv[1:]
  with open(crd_path, encoding="utf-8") as f:
    crd = yaml.safe_load(f)
  (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
  schema = strip(v["schema"]["openAPIV3Schema"])
  schema["properties"].pop("status", None)
  for item in replacements:
    path, model = item.split("=")
    replace(schema, path, model)
  group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
  with open(out, "w", encoding="utf-8") as f:
    json.dump(
      {"x-source": source, "apiVersion": f"{group}/{version}", "kind": kind, "schema": schema},
      f,
      indent=1,
      sort_keys=True,
    )
    f.write("\n")


if __name__ == "__main__":
  main(sys.argv)
