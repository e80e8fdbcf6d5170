"""Validates rendered KEDA and Prometheus Operator objects against models generated from the
projects' published CRDs (the cloudcoil model packages on PyPI, pinned with hashes in
scripts/requirements/crd-models.txt; which CRD versions and why: schemas/README.md).

A model checks each field's type, enum, pattern, bounds and required fields; a field the
CRD does not define is found by comparing the object with what the model kept of it. The
CRDs' CEL rules are not in the models: the ones the chart can break are checked here
explicitly (`cel_rules`).

    python check_custom_resources.py RENDERED.yaml...

Exits 1 listing what fails; first checks that the checks refuse what the CRDs refuse.
"""

import copy
import sys

import pydantic
import yaml
from cloudcoil.models.keda import v1alpha1 as keda
from cloudcoil.models.prometheus_operator import v1 as monitoring

MODELS = {
    ("keda.sh/v1alpha1", "ScaledObject"): keda.ScaledObject,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): monitoring.ServiceMonitor,
    ("monitoring.coreos.com/v1", "PodMonitor"): monitoring.PodMonitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): monitoring.PrometheusRule,
}


def cel_rules(kind, obj):
    """The CRDs' x-kubernetes-validations the chart's values can break."""
    spec = obj.get("spec") or {}
    if kind == "ScaledObject":
        low, high = spec.get("minReplicaCount"), spec.get("maxReplicaCount")
        if low is not None and high is not None and low > high:
            yield f"spec: minReplicaCount {low} is above maxReplicaCount {high}"


def unknown_fields(given, kept, path=""):
    """Paths in `given` that the model did not keep (fields the CRD does not define)."""
    if isinstance(given, dict):
        kept = kept if isinstance(kept, dict) else {}
        for key, value in given.items():
            if key not in kept:
                if value is not None:
                    yield f"{path}/{key}"
            else:
                yield from unknown_fields(value, kept[key], f"{path}/{key}")
    elif isinstance(given, list) and isinstance(kept, list):
        for i, (a, b) in enumerate(zip(given, kept)):
            yield from unknown_fields(a, b, f"{path}/{i}")


def problems(obj):
    """What the CRD would refuse in one object; None when it is no kind checked here."""
    kind = obj.get("kind")
    model = MODELS.get((obj.get("apiVersion"), kind))
    if model is None:
        return None
    try:
        parsed = model.model_validate(obj)
    except pydantic.ValidationError as e:
        return [f"{'/'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    kept = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    found = [f"{p}: not a field of the CRD" for p in unknown_fields(obj, kept)]
    return found + list(cel_rules(kind, obj))


def check_files(paths):
    failures, checked = [], 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            objects = [o for o in yaml.safe_load_all(f) if o]
        for obj in objects:
            found = problems(obj)
            if found is None:
                continue
            checked += 1
            name = f"{path}: {obj['kind']} {obj.get('metadata', {}).get('name')}"
            failures += [f"{name}: {p}" for p in found]
    return checked, failures


def self_test():
    """Objects the CRDs refuse must fail, and their valid originals pass."""
    scaled = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "t"},
        "spec": {
            "scaleTargetRef": {"name": "t"},
            "minReplicaCount": 1,
            "maxReplicaCount": 2,
            "triggers": [{"type": "cpu", "metadata": {"value": "50"}}],
        },
    }
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "t"},
        "spec": {"selector": {}, "endpoints": [{"port": "admin", "interval": "15s"}]},
    }
    assert problems(scaled) == [], problems(scaled)
    assert problems(monitor) == [], problems(monitor)
    bad = []
    for edit in (
        lambda o: o["spec"].update(minReplicaCount=3),
        lambda o: o["spec"].update(minReplicas=1),
        lambda o: o["spec"]["triggers"][0]["metadata"].update(value=50),
        lambda o: o["spec"].pop("scaleTargetRef"),
    ):
        obj = copy.deepcopy(scaled)
        edit(obj)
        bad.append(obj)
    for edit in (
        lambda o: o["spec"]["endpoints"][0].update(interval="15 seconds"),
        lambda o: o["spec"]["endpoints"][0].update(honorLabel=True),
    ):
        obj = copy.deepcopy(monitor)
        edit(obj)
        bad.append(obj)
    for obj in bad:
        assert problems(obj), f"accepted: {obj}"


def main(args):
    self_test()
    checked, failures = check_files(args)
    if failures:
        print("\n".join(failures), file=sys.stderr)
        return 1
    if checked == 0:
        print("no KEDA or Prometheus Operator objects in the renders", file=sys.stderr)
        return 1
    print(f"ok  {checked} custom resources")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
