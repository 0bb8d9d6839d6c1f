#!/usr/bin/env bash
# A multi-host test cluster on one machine: hosts are network namespaces,
# each with one link (a veth pair) to a switch namespace that holds a
# bridge. Nothing is added to the machine's own namespace, so its routes
# and interfaces are untouched, and `down` removes everything.
#
#   cluster.sh up NAME N [NET]   hosts NAME-h1..NAME-hN at 10.NET.0.1..N/24
#                                (NET default 77), switch NAME-sw
#   cluster.sh link NAME I down|up      the host's link (switch side)
#   cluster.sh rate NAME I RATE         token-bucket limit both ways
#                                       (`tc tbf`, e.g. 10mbit); `off` clears
#   cluster.sh exec NAME I CMD...       run CMD on host I
#   cluster.sh down NAME                remove the hosts and the switch
#
# Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2. Delay and
# loss are not here (`tc netem` is not in every kernel): the test harness
# has a user-space proxy for them. Every generator of traffic the tests run
# targets only these addresses.
set -euo pipefail

usage() { sed -n '2,19p' "$0" >&2; exit 2; }

[ $# -ge 2 ] || usage
cmd=$1 name=$2
shift 2
sw="$name-sw"

host_ns() { echo "$name-h$1"; }
# Interface names are at most 15 bytes: the switch side is "<name>-<i>".
sw_if() { echo "${name:0:9}-$1"; }

case "$cmd" in
    up)
        n=${1:?N}; net=${2:-77}
        ip netns add "$sw"
        ip -n "$sw" link set lo up
        ip -n "$sw" link add br0 type bridge
        ip -n "$sw" link set br0 up
        for i in $(seq 1 "$n"); do
            ns=$(host_ns "$i")
            ip netns add "$ns"
            ip -n "$ns" link set lo up
            ip link add "$(sw_if "$i")" netns "$sw" type veth peer name eth0 netns "$ns"
            ip -n "$sw" link set "$(sw_if "$i")" master br0 up
            ip -n "$ns" addr add "10.$net.0.$i/24" dev eth0
            ip -n "$ns" link set eth0 up
        done
        ;;
    link)
        i=${1:?I}; state=${2:?down|up}
        ip -n "$sw" link set "$(sw_if "$i")" "$state"
        ;;
    rate)
        i=${1:?I}; rate=${2:?RATE}
        ns=$(host_ns "$i")
        if [ "$rate" = off ]; then
            tc -n "$sw" qdisc del dev "$(sw_if "$i")" root 2>/dev/null || true
            tc -n "$ns" qdisc del dev eth0 root 2>/dev/null || true
        else
            tc -n "$sw" qdisc replace dev "$(sw_if "$i")" root tbf rate "$rate" burst 32kbit latency 50ms
            tc -n "$ns" qdisc replace dev eth0 root tbf rate "$rate" burst 32kbit latency 50ms
        fi
        ;;
    exec)
        i=${1:?I}; shift
        exec ip netns exec "$(host_ns "$i")" "$@"
        ;;
    down)
        for ns in $(ip netns list | awk '{print $1}' | grep -E "^$name-(sw|h[0-9]+)$" || true); do
            # Whatever still runs in it goes first.
            for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
            ip netns del "$ns"
        done
        ;;
    *)
        usage
        ;;
esac
