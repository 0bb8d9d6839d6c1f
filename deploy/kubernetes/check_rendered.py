#!/usr/bin/env python3
"""Reads rendered manifests (`kubectl kustomize DIR`) on stdin and prints,
as JSON, what the test suite checks against the binaries: the files of the
`tessera-config` ConfigMap, and each Tessera container's command line as
every pod of it would run it (`$(POD_NAME)` and `$(POD_INDEX)` filled in
for each ordinal of a StatefulSet).

Used by deploy/tests/kubernetes.rs; needs PyYAML (a dependency of
kubernetes-validate, which the test command installs)."""

import json
import sys

import yaml


def env_of(container, pod_name, pod_index):
    values = {}
    for var in container.get("env", []):
        if "value" in var:
            values[var["name"]] = var["value"]
        else:
            path = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
            if path == "metadata.name":
                values[var["name"]] = pod_name
            elif path == "metadata.labels['apps.kubernetes.io/pod-index']":
                values[var["name"]] = str(pod_index)
    return values


def expand(arg, values):
    for name, value in values.items():
        arg = arg.replace(f"$({name})", value)
    return arg


def main():
    files = {}
    commands = []
    for doc in yaml.safe_load_all(sys.stdin):
        if not doc:
            continue
        kind = doc.get("kind")
        name = doc.get("metadata", {}).get("name", "")
        if kind == "ConfigMap" and name.startswith("tessera-config"):
            files.update(doc.get("data", {}))
        if kind not in ("StatefulSet", "Job"):
            continue
        spec = doc["spec"]
        pods = spec.get("replicas", 1) if kind == "StatefulSet" else 1
        for container in spec["template"]["spec"]["containers"]:
            image = container.get("image", "")
            if not image.startswith("tessera"):
                continue
            binary = (container.get("command") or ["ps-server"])[0]
            for index in range(pods):
                pod = f"{name}-{index}"
                values = env_of(container, pod, index)
                args = [expand(a, values) for a in container.get("args", [])]
                commands.append({"workload": name, "pod": pod, "binary": binary, "args": args})
    json.dump({"files": files, "commands": commands}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
