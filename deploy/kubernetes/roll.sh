#!/usr/bin/env bash
# Rolls a changed template (image, ConfigMap) out to the ps-servers one pod
# at a time: each pod is deleted (its StatefulSet recreates it from the new
# template: updateStrategy OnDelete), then every server must be ready (its
# shards served, which for a restarted replica means caught up) before the
# next goes. The other copy of each shard serves meanwhile, and a stopping
# server hands its shards over and writes a last checkpoint.
#
#   deploy/kubernetes/roll.sh [kubectl flags, e.g. -n NAMESPACE]
set -euo pipefail
selector=app.kubernetes.io/name=tessera-ps-server
pods=$(kubectl "$@" get pods -l "$selector" -o name | sort)
for pod in $pods; do
    echo "rolling $pod" >&2
    kubectl "$@" delete "$pod" --wait=true
    # The new pod has the same name; wait until it exists, then until every
    # server is ready.
    until kubectl "$@" get "$pod" >/dev/null 2>&1; do sleep 1; done
    kubectl "$@" wait --for=condition=Ready pod -l "$selector" --timeout=30m
done
