"""Checks Kubernetes manifests against KServe's and Kubernetes' own generated models.

Run by :mod:`.kserve_check` with the Python of the KServe environment (``kserve`` and the
``kubernetes`` client it pulls in), never imported by tfgraph: it imports only what is
installed there. Reads a JSON list of manifests (each a mapping, or YAML text) on stdin, writes
a JSON list with each one's problems (an empty list: it passed).

- ``serving.kserve.io/v1beta1`` ``InferenceService``: walked field by field through the
  ``kserve`` SDK's OpenAPI-generated models (``openapi_types``, ``attribute_map``): a key that
  is not a field of its model, a value of the wrong type, a required field left out or a value
  outside an enum (the models' client-side validation, run by building each model) is a
  problem. Kubernetes types inside it (``V1ObjectMeta``, ``V1Container``, …) go to the
  ``kubernetes`` client's models, which forbid unknown keys and check types.
- ``apps/v1`` ``Deployment``, ``v1`` ``Service``: the ``kubernetes`` client's models.
"""

import json
import sys

import kserve
import yaml
from kubernetes import client as k8s

_PRIMITIVES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,),
               "date": (str,), "datetime": (str,), "object": (object,)}  # fmt: skip
_KUBERNETES = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service"}


def _model(name: str):
    found = getattr(kserve, name, None) or getattr(k8s, name, None)
    if found is None:
        raise LookupError(f"no model {name} in kserve or kubernetes")
    return found


def _pydantic(cls, value, where: str, problems: list) -> None:
    try:
        cls.model_validate(value)
    except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError, one problem each
        errors = exc.errors() if hasattr(exc, "errors") else [{"loc": (), "msg": str(exc)}]
        for error in errors:
            loc = ".".join(str(p) for p in error.get("loc", ()))
            problems.append(f"{where}.{loc}: {error.get('msg')}")


def walk(value, kind: str, where: str, problems: list) -> None:
    """``value`` against the model or type ``kind``; what is wrong goes to ``problems``."""
    if kind.startswith("list["):
        if not isinstance(value, list):
            problems.append(f"{where}: a list expected, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            walk(item, kind[5:-1], f"{where}[{i}]", problems)
        return
    if kind.startswith("dict("):
        if not isinstance(value, dict):
            problems.append(f"{where}: a mapping expected, got {type(value).__name__}")
            return
        for key, item in value.items():
            walk(item, kind[5:-1].split(", ", 1)[1], f"{where}.{key}", problems)
        return
    if kind in _PRIMITIVES:
        wrong = isinstance(value, bool) and kind in ("int", "float")
        if wrong or not isinstance(value, _PRIMITIVES[kind]):
            problems.append(f"{where}: {kind} expected, got {value!r}")
        return
    cls = _model(kind)
    if hasattr(cls, "model_validate"):  # a kubernetes client model (pydantic)
        _pydantic(cls, value, where, problems)
        return
    if not isinstance(value, dict):
        problems.append(f"{where}: a {kind} mapping expected, got {value!r}")
        return
    fields = {key: attr for attr, key in cls.attribute_map.items()}
    for key, item in value.items():
        if key not in fields:
            problems.append(f"{where}.{key}: not a field of {kind}")
        else:
            walk(item, cls.openapi_types[fields[key]], f"{where}.{key}", problems)
    try:  # required fields and enums: the generated setters' client-side validation
        cls(**{fields[k]: v for k, v in value.items() if k in fields})
    except (ValueError, TypeError) as exc:
        problems.append(f"{where}: {exc}")


def check(manifest) -> list:
    if isinstance(manifest, str):
        try:
            manifest = yaml.safe_load(manifest)
        except yaml.YAMLError as exc:
            return [f"not YAML: {' '.join(str(exc).split())}"]
    if not isinstance(manifest, dict):
        return [f"a manifest is a mapping, not {type(manifest).__name__}"]
    api, kind = manifest.get("apiVersion"), manifest.get("kind")
    problems: list = []
    if (api, kind) == ("serving.kserve.io/v1beta1", "InferenceService"):
        walk(manifest, "V1beta1InferenceService", kind, problems)
        if "predictor" not in (manifest.get("spec") or {}):
            problems.append("InferenceService.spec.predictor: required")
    elif (api, kind) in _KUBERNETES:
        _pydantic(_model(_KUBERNETES[(api, kind)]), manifest, kind, problems)
    else:
        problems.append(f"apiVersion {api!r} kind {kind!r}: not a kind this check knows")
    return problems


if __name__ == "__main__":
    print(json.dumps([check(m) for m in json.load(sys.stdin)]))
