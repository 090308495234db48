"""A manifest checked field by field against a CRD's published schema.

The schemas in crd_schemas/ are the CRDs' openAPIV3Schema at a named
release (crd_schemas/prune.py says how they were cut): every object that
lists its properties admits no other key (as a strict `kubectl apply`
would), types, enums, bounds and required keys are checked by jsonschema,
and each embedded Kubernetes type ({"x-k8s-model": "V1PodTemplateSpec"})
goes through the kubernetes client's model of it: the round trip must give
the manifest back unchanged, so an unknown or misspelt field (which the
model drops) or a wrong type fails. The CRDs' CEL rules are not evaluated:
those of these versions concern updates (immutability) and
startupPolicy / dependsOn, neither of which a new emitted job uses.
"""

import json
import os

import jsonschema
from kubernetes import client

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crd_schemas")


def load(name: str) -> dict:
  with open(os.path.join(HERE, name), encoding="utf-8") as f:
    return json.load(f)


def _strict(node):
  """additionalProperties: false wherever an object lists its properties."""
  if isinstance(node, dict):
    node = {k: _strict(v) for k, v in node.items()}
    if (
      "properties" in node
      and "additionalProperties" not in node
      and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
      node["additionalProperties"] = False
    return node
  if isinstance(node, list):
    return [_strict(v) for v in node]
  return node


def _model(validator, model, instance, schema):
  api = client.ApiClient()
  try:
    obj = api._ApiClient__deserialize(instance, model)
  except Exception as e:  # noqa: BLE001
    yield jsonschema.ValidationError(f"not a {model}: {e}")
    return
  back = api.sanitize_for_serialization(obj)
  if back != instance:
    yield jsonschema.ValidationError(f"{model} round trip changed it: {_diff(instance, back)}")


def _diff(a, b, where="") -> str:
  if isinstance(a, dict) and isinstance(b, dict):
    for k in sorted(set(a) | set(b)):
      if a.get(k) != b.get(k):
        return _diff(a.get(k), b.get(k), f"{where}.{k}")
  if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    for i, (x, y) in enumerate(zip(a, b)):
      if x != y:
        return _diff(x, y, f"{where}[{i}]")
  return f"{where or '.'}: {a!r} -> {b!r}"


Validator = jsonschema.validators.extend(jsonschema.Draft7Validator, {"x-k8s-model": _model})


def errors(manifest: dict, schema_file: str) -> list[str]:
  """Every way `manifest` breaks the CRD of `schema_file` (empty: none)."""
  crd = load(schema_file)
  out = (
    []
    if (manifest.get("apiVersion"), manifest.get("kind")) == (crd["apiVersion"], crd["kind"])
    else [f"not a {crd['kind']} {crd['apiVersion']}"]
  )
  validator = Validator(_strict(crd["schema"]))
  for e in validator.iter_errors(manifest):
    out.append(f"{'/'.join(str(p) for p in e.absolute_path)}: {e.message}")
  return out
