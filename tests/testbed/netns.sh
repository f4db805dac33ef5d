#!/usr/bin/env bash
# A multi-node testbed on one machine: N "nodes" as network namespaces, each with its own IP and its
# own hostname, wired to one switch, plus a head namespace that runs mpirun.
#
# Why: meshtrain picks shared memory between ranks of one node and the network (TCP, libfabric)
# between nodes; without several machines the inter-node paths, partitions and node-local ranks can
# only be tested if one machine pretends to be several. meshtrain's node key is the hostname (read
# from /proc/sys/kernel/hostname) plus the kernel boot id, and Open MPI's shared-memory split follows
# its daemons: a rank started inside node k's namespaces counts as node k for both.
#
# Layout (nothing is added to the root namespace; every address lives only inside the namespaces):
#   mt-sw              namespace holding the bridges `br0` (management) and `br1` (data)
#   mt-node1..N        one namespace per node: `eth0` = 10.213.77.<k>/24 (veth peer `n<k>` on br0),
#                      `eth1` = 10.213.78.<k>/24 (veth peer `d<k>` on br1)
#   mt-head            runs mpirun: `eth0` = 10.213.77.100/24 (veth peer `head` on br0)
# Open MPI's daemons talk over eth0, meshtrain over eth1 (MESHTRAIN_SOCKET_IFNAME=eth1 and, for the
# libfabric tcp provider, FI_TCP_IFACE=eth1 are passed to every rank), so a partition of the data
# network (`link K down`) leaves mpirun able to collect every rank's output and exit status.
# Hostnames: each command runs in a fresh UTS namespace (`unshare --uts`) named mtnode<k> / mthead.
#
# Launching one MPI job across the nodes: mpirun runs in mt-head with a hostfile of mtnode<k> names
# and `--mca plm_rsh_agent tests/testbed/netns.sh agent`; Open MPI calls the agent as an ssh stand-in
# (`agent HOST COMMAND...`), which runs the daemon's command inside HOST's namespaces. The agent is a
# local child of mpirun, so the environment (MESHTRAIN_*, FI_*) reaches every rank as it is.
#
# Usage (root; needs iproute2, util-linux unshare, Open MPI):
#   netns.sh up N                  create N nodes (tears an old testbed down first)
#   netns.sh down                  remove everything (idempotent)
#   netns.sh exec K CMD...         run CMD on node K (K=head for the head)
#   netns.sh mpirun NP ARGS...     mpirun of NP ranks over all nodes, round robin by node (rank r on
#                                  node r mod N + 1; MT_NETNS_MAP=slot fills node 1 first); ARGS go
#                                  to mpirun; MT_NETNS_ORDER=1,2,2,1 places rank r on the r-th
#                                  node listed instead (one entry per rank: shuffled layouts)
#   netns.sh link K up|down        bring node K's data cable up or down (a partition)
#   netns.sh shape K RATE|off      limit node K's data cable to RATE (tc syntax: 1gbit, 500mbit)
#                                  in both directions (token bucket), or remove the limit
#   netns.sh run N CMD...          up N, run CMD (in the root namespace, with this script in
#                                  $NETNS), down on exit whatever happens
# MT_NETNS_MPI_NET (default: the management /24) is the network of MPI's own messages (set it to
# the data network's to compare MPI's collectives with meshtrain's over the same link).
# Environment: MT_NETNS_SUBNET (default 10.213.77) and MT_NETNS_DATA (default 10.213.78) pick the
# /24 networks used inside the namespaces.
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
SUBNET=${MT_NETNS_SUBNET:-10.213.77}
STATE=/run/meshtrain-testbed
DATA=${MT_NETNS_DATA:-10.213.78}
HEAD_IP=$SUBNET.100

ns_of() { [ "$1" = head ] && echo mt-head || echo "mt-node$1"; }
host_of() { [ "$1" = head ] && echo mthead || echo "mtnode$1"; }
nodes() { cat "$STATE/nodes" 2>/dev/null || echo 0; }

down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^mt-(node[0-9]+|head|sw)$/ {print $1}'); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$STATE"
}

# cable NS DEV PORT BRIDGE IP: a veth pair from NS's DEV to PORT on BRIDGE in the switch.
cable() {
  ip link add "$3" netns mt-sw type veth peer name "$2" netns "$1"
  ip -n mt-sw link set "$3" master "$4" up
  ip -n "$1" addr add "$5/24" dev "$2"
  ip -n "$1" link set "$2" up
}

# reachable IP: a TCP connect from the head to a closed port is refused at once when IP answers and
# times out when it does not (no ping needed).
reachable() {
  local out
  out=$(ip netns exec mt-head timeout 3 bash -c "exec 3<>/dev/tcp/$1/9" 2>&1) && return 0
  [[ "$out" == *refused* ]]
}

up() {
  local n=$1 k br
  [[ "$n" =~ ^[1-9][0-9]?$ ]] || { echo "netns.sh up: node count must be 1..99, got '$n'" >&2; exit 2; }
  down
  mkdir -p "$STATE"
  ip netns add mt-sw
  for br in br0 br1; do
    ip -n mt-sw link add "$br" type bridge
    ip -n mt-sw link set "$br" up
  done
  ip netns add mt-head
  ip -n mt-head link set lo up
  cable mt-head eth0 head br0 "$HEAD_IP"
  : >"$STATE/hostfile"
  for k in $(seq 1 "$n"); do
    ip netns add "mt-node$k"
    ip -n "mt-node$k" link set lo up
    cable "mt-node$k" eth0 "n$k" br0 "$SUBNET.$k"
    cable "mt-node$k" eth1 "d$k" br1 "$DATA.$k"
    echo "$(host_of "$k") slots=64" >>"$STATE/hostfile"
  done
  echo "$n" >"$STATE/nodes"
  # Every node must reach every other one (and the head) before anything is launched.
  for k in $(seq 1 "$n"); do
    reachable "$SUBNET.$k" || { echo "netns.sh: node $k unreachable from the head" >&2; exit 1; }
  done
}

# in_node K CMD...: CMD inside node K's network namespace and a new UTS namespace with its hostname.
in_node() {
  local k=$1
  shift
  ip netns exec "$(ns_of "$k")" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "$(host_of "$k")" "$@"
}

# Open MPI's rsh agent: `agent [ssh options] HOST COMMAND...`, COMMAND being one shell string.
agent() {
  while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
  local host=$1
  shift
  [[ "$host" =~ ^mtnode([0-9]+)$ ]] || { echo "netns.sh agent: unknown host '$host'" >&2; exit 1; }
  in_node "${BASH_REMATCH[1]}" sh -c "$*"
}

launch() {
  local np=$1 n
  shift
  [[ "$np" =~ ^[1-9][0-9]*$ ]] || { echo "netns.sh mpirun: rank count must be a positive number, got '$np'" >&2; exit 2; }
  n=$(nodes)
  [ "$n" -gt 0 ] || { echo "netns.sh mpirun: no testbed (run 'netns.sh up N' first)" >&2; exit 1; }
  local place=(--hostfile "$STATE/hostfile" --map-by "${MT_NETNS_MAP:-node}")
  if [ -n "${MT_NETNS_ORDER:-}" ]; then
    local order k
    IFS=, read -ra order <<<"$MT_NETNS_ORDER"
    [ "${#order[@]}" -eq "$np" ] || { echo "netns.sh mpirun: MT_NETNS_ORDER lists ${#order[@]} nodes for $np ranks" >&2; exit 2; }
    : >"$STATE/order"
    for k in "${order[@]}"; do
      [[ "$k" =~ ^[0-9]+$ ]] && [ "$k" -ge 1 ] && [ "$k" -le "$n" ] || { echo "netns.sh mpirun: MT_NETNS_ORDER: no node '$k' (nodes 1..$n)" >&2; exit 2; }
      host_of "$k" >>"$STATE/order"
    done
    place=(--hostfile "$STATE/order" --mca rmaps seq)
  fi
  in_node head mpirun --allow-run-as-root --oversubscribe --bind-to none \
    "${place[@]}" -np "$np" \
    --mca plm_rsh_agent "$SELF agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca oob_tcp_if_include "$SUBNET.0/24" --mca btl_tcp_if_include "${MT_NETNS_MPI_NET:-$SUBNET.0/24}" \
    -x MESHTRAIN_SOCKET_IFNAME=eth1 -x FI_TCP_IFACE=eth1 "$@"
}

link() {
  [[ "$2" =~ ^(up|down)$ ]] || { echo "netns.sh link: expected up or down, got '$2'" >&2; exit 2; }
  [[ "$1" =~ ^[0-9]+$ ]] || { echo "netns.sh link: node must be a number, got '$1'" >&2; exit 2; }
  ip -n mt-sw link set "d$1" "$2"
}

# shape K RATE|off: a token-bucket limit on both ends of node K's data cable (the node's eth1 sends
# to the switch, the switch's d<K> sends to the node), so that cable is the job's bottleneck link.
shape() {
  [[ "${1:-}" =~ ^[0-9]+$ ]] || { echo "netns.sh shape: node must be a number, got '${1:-}'" >&2; exit 2; }
  local rate=${2:-}
  if [ "$rate" = off ]; then
    tc -n "mt-node$1" qdisc del dev eth1 root 2>/dev/null || true
    tc -n mt-sw qdisc del dev "d$1" root 2>/dev/null || true
    return
  fi
  [[ "$rate" =~ ^[0-9]+(\.[0-9]+)?[kmg]?bit$ ]] || { echo "netns.sh shape: rate like 1gbit or 500mbit, got '$rate'" >&2; exit 2; }
  tc -n "mt-node$1" qdisc replace dev eth1 root tbf rate "$rate" burst 256kb latency 100ms
  tc -n mt-sw qdisc replace dev "d$1" root tbf rate "$rate" burst 256kb latency 100ms
}

cmd=${1:-}
shift || true
case "$cmd" in
  up) up "$@" ;;
  down) down ;;
  exec) in_node "$@" ;;
  agent) agent "$@" ;;
  mpirun) launch "$@" ;;
  link) link "$@" ;;
  shape) shape "$@" ;;
  run)
    trap down EXIT INT TERM
    up "$1"
    shift
    NETNS=$SELF "$@"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
