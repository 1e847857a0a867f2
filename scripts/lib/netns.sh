# shellcheck shell=bash
# A private network of Linux network namespaces with rate-limited links, shared by the network
# benchmarks (scripts/bench-network, scripts/bench-train-network). Sourced, not run. Needs root,
# iproute2 (ip, tc, ss) and iputils-ping; the caller defines die() and note() (messages to stderr).
#
#   netns_init PREFIX RANKS RATE   set the layout (below); fails on a bad RATE
#   netns_emulate RTT JITTER LOSS [SEED]
#                                  optional, between init and up: wide-area links (below); fails
#                                  (with the emulator's message) on impossible settings
#   netns_link_settings PROFILE RTT JITTER LOSS SEED
#                                  the benchmarks' --profile/--rtt/--jitter/--loss/--seed: a
#                                  profile fills what is empty (and the rate unless RATE_GIVEN=1),
#                                  then netns_emulate; netns_link_flags_help prints their --help
#   netns_up                       create it; the caller traps EXIT to call netns_down
#   netns_down                     delete what netns_up created (idempotent); never touches a name
#                                  outside PREFIX-*; the delay line's counters are left in
#                                  NETNS_DELAY_STATS (one JSON line per direction)
#   netns_tc_stats                 every shaped link's tbf counters (sent, dropped, overlimits)
#   netns_of I / netns_ip I        rank I's namespace / address
#   netns_wait_listen PORT PID [I] wait (60 s at most) until PORT listens in rank I's namespace
#                                  (default 0); 1 if PID exited first or it never did
#   netns_stop PID...              TERM, 5 s grace, then KILL of each PID's process group (PIDs
#                                  started as `timeout ... &`, which lead their own group), reaped
#
# Layout (every name derived from PREFIX, which the caller makes unique, e.g. dqbn-$$):
#   namespaces  PREFIX-hub and PREFIX-<i> for rank i = 0..RANKS-1
#   hub         Linux bridge dqbr0 in PREFIX-hub
#   links       veth pair per rank: dq0 in rank i's namespace <-> dqp<i> on the bridge, MTU 1500;
#               rank i is 10.77.S.<i+1>/24 (S = 1 + $$ mod 254); loopback up everywhere
#   shaping     tc tbf on BOTH ends of every veth (rank egress = what the rank sends, bridge-port
#               egress = what it receives): rate RATE, burst max(128 KiB, 2 ms at RATE), latency
#               25 ms (tail-drop queue); RATE "none": no shaping at all (veths as fast as the CPU
#               moves packets; NETNS_RATE_BPS is 0). Every rank pings rank 0 before netns_up returns.
#   emulation   (netns_emulate; docs/testing.md "Wide-area links"; needs build/bin/dynamiq-linkem or
#               $DQ_LINKEM) RTT and JITTER: rank i's veth ends in the hub at dqx<i>, a second pair
#               dqy<i> <-> dqp<i> (on the bridge) leads on, and one dynamiq-linkem delay line in the
#               hub moves frames between dqx<i> and dqy<i> with RTT/4 each way (a path between two
#               ranks crosses two such links: RTT/2 one way) and jitter JITTER/sqrt(2) per link
#               (JITTER per path, one way; FIFO, never reordered). LOSS (P, or ge:... bursts): an
#               eBPF filter drops packets where every rank receives (dq0's ingress), so each
#               direction of a path loses LOSS; the bridge port segments what it sends the rank
#               (offload off on dqp<i>, GRO off on dq0): a drop is one packet, not a 64 KiB
#               aggregate, while senders and the delay line keep 64 KiB frames. RTT 0, JITTER 0 and LOSS 0 build the plain layout. With a delay
#               line, every rank's TCP buffers may grow (autotuning) to 4 x the bandwidth-delay
#               product (NETNS_TCP_BUFFER; net.ipv4.tcp_wmem/tcp_rmem in its namespace).
# After netns_init: NETNS_RATE, NETNS_RATE_BPS (bytes/s), NETNS_BURST (bytes), NETNS_LATENCY,
# NETNS_SUBNET, NETNS_CREATED_NS and NETNS_CREATED_LINKS ("namespace link" pairs) are set.

# tc rate -> bytes/s (tc's units: *bit are bits/s, *bps are BYTES/s; k/m/g/t = 10^3.., ki/mi/gi = 2^10..).
netns_rate_bps() {
  awk -v r="$1" 'BEGIN {
    if (!match(r, /^[0-9]+(\.[0-9]+)?/)) exit 1
    n = substr(r, 1, RLENGTH); u = tolower(substr(r, RLENGTH + 1))
    m["bit"]=1/8; m["kbit"]=1e3/8; m["mbit"]=1e6/8; m["gbit"]=1e9/8; m["tbit"]=1e12/8
    m["kibit"]=2^10/8; m["mibit"]=2^20/8; m["gibit"]=2^30/8; m["tibit"]=2^40/8
    m["bps"]=1; m["kbps"]=1e3; m["mbps"]=1e6; m["gbps"]=1e9; m["tbps"]=1e12
    m["kibps"]=2^10; m["mibps"]=2^20; m["gibps"]=2^30; m["tibps"]=2^40
    if (!(u in m) || n * m[u] < 1000) exit 1
    printf "%.0f\n", n * m[u] }'
}

netns_init() { # PREFIX RANKS RATE
  NETNS_PREFIX=$1 NETNS_RANKS=$2 NETNS_RATE=$3
  if [[ $NETNS_RATE == none ]]; then
    NETNS_RATE_BPS=0
  else
    NETNS_RATE_BPS=$(netns_rate_bps "$NETNS_RATE") ||
      die "--rate '$NETNS_RATE': need a number and a tc unit (e.g. 1gbit, 100mbit, 50mbps), at least 8kbit, or none"
  fi
  NETNS_BURST=$(awk -v b="$NETNS_RATE_BPS" 'BEGIN { x = b * 0.002; if (x < 131072) x = 131072; printf "%.0f\n", x }')
  NETNS_LATENCY=25ms
  NETNS_SUBNET=$((1 + $$ % 254))
  NETNS_CREATED_NS=()    # namespaces this run created (only these are ever deleted)
  NETNS_CREATED_LINKS=() # "namespace link" pairs this run created
  NETNS_DOWN=0
  NETNS_RTT=0 NETNS_JITTER=0 NETNS_LOSS=0 NETNS_SEED=1 NETNS_DELAY_PID=""
}

netns_linkem() {
  local build=${BUILD_DIR:-build}
  [[ $build == /* ]] || build=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/$build
  echo "${DQ_LINKEM:-$build/bin/dynamiq-linkem}"
}

netns_emulate() { # RTT JITTER LOSS [SEED]
  NETNS_RTT=$1 NETNS_JITTER=$2 NETNS_LOSS=$3 NETNS_SEED=${4:-1}
  local linkem err
  linkem=$(netns_linkem)
  [[ -x $linkem ]] || die "the link emulator $linkem is not built (scripts/build; needs clang and libbpf-dev)"
  err=$("$linkem" check --delay_ab="$NETNS_RTT" --jitter="$NETNS_JITTER" --loss="$NETNS_LOSS" 2>&1) ||
    die "${err#dynamiq-linkem: }"
  NETNS_RTT_MS=$("$linkem" check --delay_ab="$NETNS_RTT" --print_ms) || die "bad --rtt '$NETNS_RTT'"
  NETNS_JITTER_MS=$("$linkem" check --delay_ab="$NETNS_JITTER" --print_ms) || die "bad --jitter '$NETNS_JITTER'"
  # TCP buffer ceiling: 4 x bandwidth-delay product, at least 4 MiB, at most 256 MiB (unshaped: as if
  # 10 Gbit/s).
  NETNS_TCP_BUFFER=$(awk -v b="$NETNS_RATE_BPS" -v r="$NETNS_RTT_MS" -v j="$NETNS_JITTER_MS" 'BEGIN {
    if (b <= 0) b = 1.25e9
    x = 4 * b * (r + 4 * j) / 1000; if (x < 4194304) x = 4194304; if (x > 268435456) x = 268435456
    printf "%.0f\n", x }')
}

# The wide-area flags the network benchmarks share: --profile NAME sets --rate (unless given),
# --rtt, --jitter and --loss (each unless given) from dynamiq-linkem's profiles.
netns_link_flags_help() {
  cat <<'EOF'
  --rtt DURATION     round-trip time added between any two ranks (e.g. 30ms; default 0): a user-space
                     delay line (dynamiq-linkem) holds every frame RTT/4 on each of the two links a
                     path crosses, each way
  --jitter DURATION  standard deviation of the one-way delay (default 0; frames are never reordered)
  --loss P           random loss of each direction of a path (default 0): P (Bernoulli, e.g. 0.001)
                     or ge:P_GB,P_BG[,LOSS_BAD[,LOSS_GOOD]] (Gilbert-Elliott bursts); an eBPF filter
                     where every rank receives, on packets segmented by the bridge (per-packet loss;
                     costs CPU at high rates, docs/testing.md)
  --seed N           seed of the loss and jitter generators (default 1)
  --profile NAME     a named network (given flags win): lan (1gbit), cross-region (1gbit, 30ms RTT,
                     0.01% loss), cross-continent (1gbit, 150ms RTT, 2ms jitter, 0.1% loss),
                     consumer (100mbit, 40ms RTT, 0.5% loss)
EOF
}

# Resolves --profile into RATE, RTT, JITTER and LOSS (only those the caller left empty; the rate
# is replaced unless RATE_GIVEN=1), then sets the emulation up (netns_emulate). Call after
# netns_init with the caller's --profile/--rtt/--jitter/--loss/--seed values.
netns_link_settings() { # PROFILE RTT JITTER LOSS SEED
  local profile=$1 rtt=$2 jitter=$3 loss=$4 seed=${5:-1} linkem line
  linkem=$(netns_linkem)
  if [[ -n $profile ]]; then
    [[ -x $linkem ]] || die "the link emulator $linkem is not built (scripts/build; needs clang and libbpf-dev)"
    line=$("$linkem" profile "$profile" 2>&1) || die "${line#dynamiq-linkem: }"
    local p_rate p_rtt p_jitter p_loss
    p_rate=$(sed -n 's/.*rate=\([^ ]*\).*/\1/p' <<<"$line")
    p_rtt=$(sed -n 's/.*rtt_ms=\([^ ]*\).*/\1/p' <<<"$line")ms
    p_jitter=$(sed -n 's/.*jitter_ms=\([^ ]*\).*/\1/p' <<<"$line")ms
    p_loss=$(sed -n 's/.*loss=\([^ ]*\).*/\1/p' <<<"$line")
    rtt=${rtt:-$p_rtt} jitter=${jitter:-$p_jitter} loss=${loss:-$p_loss}
    if [[ ${RATE_GIVEN:-0} != 1 && $NETNS_RATE != "$p_rate" ]]; then netns_init "$NETNS_PREFIX" "$NETNS_RANKS" "$p_rate"; fi
  fi
  rtt=${rtt:-0} jitter=${jitter:-0} loss=${loss:-0}
  [[ $rtt == 0ms ]] && rtt=0
  [[ $jitter == 0ms ]] && jitter=0
  if [[ $rtt != 0 || $jitter != 0 || $loss != 0 ]]; then netns_emulate "$rtt" "$jitter" "$loss" "$seed"; fi
}

# Whether the layout has a delay line (RTT or jitter set).
netns_delayed() { awk -v r="${NETNS_RTT_MS:-0}" -v j="${NETNS_JITTER_MS:-0}" 'BEGIN { exit !(r > 0 || j > 0) }'; }

netns_of() { echo "$NETNS_PREFIX-$1"; }
netns_ip() { echo "10.77.$NETNS_SUBNET.$(($1 + 1))"; }

_netns_make() {
  [[ ! -e /var/run/netns/$1 ]] || die "namespace $1 already exists; not touching it"
  timeout 10 ip netns add "$1" || die "ip netns add $1 failed"
  NETNS_CREATED_NS+=("$1")
  timeout 10 ip -n "$1" link set lo up
}

_netns_shape() { # namespace device
  [[ $NETNS_RATE != none ]] || return 0
  timeout 10 tc -n "$1" qdisc add dev "$2" root tbf rate "$NETNS_RATE" burst "$NETNS_BURST" latency "$NETNS_LATENCY" ||
    die "tc qdisc add on $2 in $1 failed (kernel module sch_tbf?)"
}

netns_up() {
  local hub=$NETNS_PREFIX-hub i ns ok
  local shaping="links ${NETNS_RATE} each way (tbf burst ${NETNS_BURST} B, latency $NETNS_LATENCY)"
  [[ $NETNS_RATE != none ]] || shaping="links not shaped (CPU-bound)"
  note "network: $NETNS_RANKS ranks, $shaping, 10.77.$NETNS_SUBNET.0/24, namespaces $NETNS_PREFIX-*"
  _netns_make "$hub"
  timeout 10 ip -n "$hub" link add dqbr0 type bridge || die "cannot create a bridge (kernel module bridge?)"
  NETNS_CREATED_LINKS+=("$hub dqbr0")
  timeout 10 ip -n "$hub" link set dqbr0 up
  for ((i = 0; i < NETNS_RANKS; i++)); do
    ns=$(netns_of "$i")
    _netns_make "$ns"
    if netns_delayed; then # rank <-> dqx<i> ~delay line~ dqy<i> <-> dqp<i> (bridge)
      timeout 10 ip -n "$hub" link add "dqx$i" type veth peer name dq0 netns "$ns" || die "cannot create veth for rank $i"
      NETNS_CREATED_LINKS+=("$hub dqx$i")
      timeout 10 ip -n "$hub" link add "dqp$i" type veth peer name "dqy$i" || die "cannot create veth for rank $i"
      NETNS_CREATED_LINKS+=("$hub dqp$i")
      for dev in "dqx$i" "dqy$i"; do
        timeout 10 ip netns exec "$hub" sysctl -qw "net.ipv6.conf.$dev.disable_ipv6=1" || true
        timeout 10 ip -n "$hub" link set "$dev" up
      done
    else
      timeout 10 ip -n "$hub" link add "dqp$i" type veth peer name dq0 netns "$ns" || die "cannot create veth for rank $i"
      NETNS_CREATED_LINKS+=("$hub dqp$i")
    fi
    timeout 10 ip -n "$hub" link set "dqp$i" master dqbr0
    timeout 10 ip -n "$hub" link set "dqp$i" up
    timeout 10 ip -n "$ns" addr add "$(netns_ip "$i")/24" dev dq0
    timeout 10 ip -n "$ns" link set dq0 up
    _netns_shape "$ns" dq0
    _netns_shape "$hub" "dqp$i"
    if netns_delayed; then
      # A long fat pipe needs TCP windows of its bandwidth-delay product: let autotuning grow the
      # buffers to 4 x BDP (the namespace's defaults stop the send buffer at 4 MiB: 213 Mbit/s at
      # 150 ms). Every method run here gets the same.
      # And a connection idle between two steps keeps its window (by default it restarts from slow
      # start after one RTO idle: at 150 ms every ring step would pay several round trips again).
      timeout 10 ip netns exec "$ns" sysctl -qw "net.ipv4.tcp_wmem=4096 16384 $NETNS_TCP_BUFFER" \
        "net.ipv4.tcp_rmem=4096 131072 $NETNS_TCP_BUFFER" net.ipv4.tcp_slow_start_after_idle=0 ||
        die "cannot size TCP buffers in $ns"
    fi
    if [[ $NETNS_LOSS != 0 ]]; then
      # Loss where a rank receives: the bridge port segments what it sends to the rank (offload off
      # there) and the rank does not re-aggregate (GRO off), so each drop is one MTU packet, while
      # senders keep TSO and the delay line moves 64 KiB frames (its packet rate would not carry
      # 1 Gbit/s x N ranks of MTU packets).
      timeout 10 ip netns exec "$hub" ethtool -K "dqp$i" tso off gso off >/dev/null 2>&1 ||
        die "cannot turn segmentation offload off on rank $i's bridge port (ethtool)"
      timeout 10 ip netns exec "$ns" ethtool -K dq0 gro off >/dev/null 2>&1 || true
      timeout 10 ip netns exec "$ns" "$(netns_linkem)" loss --dev=dq0 --ingress --loss="$NETNS_LOSS" \
        --seed=$((NETNS_SEED + i)) || die "cannot attach the loss filter to rank $i's link"
    fi
  done
  if netns_delayed; then
    local pairs="" one_way jitter
    for ((i = 0; i < NETNS_RANKS; i++)); do pairs+="${pairs:+,}dqx$i:dqy$i"; done
    one_way=$(awk -v r="$NETNS_RTT_MS" 'BEGIN { printf "%.6fms", r / 4 }')
    jitter=$(awk -v j="$NETNS_JITTER_MS" 'BEGIN { printf "%.6fms", j / sqrt(2) }')
    NETNS_DELAY_LOG=$(mktemp "/tmp/$NETNS_PREFIX-delay.XXXXXX")
    timeout -s TERM 86400 ip netns exec "$hub" "$(netns_linkem)" delay --pairs="$pairs" --delay_ab="$one_way" \
      --delay_ba="$one_way" --jitter="$jitter" --seed="$NETNS_SEED" >"$NETNS_DELAY_LOG" 2>&1 &
    NETNS_DELAY_PID=$!
    for _ in $(seq 50); do grep -q "delay line up" "$NETNS_DELAY_LOG" && break; sleep 0.1; done
    grep -q "delay line up" "$NETNS_DELAY_LOG" || die "the delay line did not start: $(cat "$NETNS_DELAY_LOG")"
  fi
  for ((i = 1; i < NETNS_RANKS; i++)); do
    ok=0
    for _ in 1 2 3 4 5; do
      if timeout 5 ip netns exec "$(netns_of "$i")" ping -q -c 1 -W 1 "$(netns_ip 0)" >/dev/null 2>&1; then ok=1; break; fi
      sleep 0.5
    done
    ((ok)) || die "rank $i ($(netns_ip "$i")) cannot ping rank 0 ($(netns_ip 0))"
  done
}

netns_tc_stats() {
  local entry ns link
  for entry in "${NETNS_CREATED_LINKS[@]}"; do
    ns=${entry%% *} link=${entry#* }
    [[ $link == dqp* ]] || continue
    echo "== $ns $link (bridge side: what rank ${link#dqp} receives)"
    timeout 5 tc -s -n "$ns" qdisc show dev "$link" 2>&1 || true
    echo "== $NETNS_PREFIX-${link#dqp} dq0 (rank side: what rank ${link#dqp} sends)"
    timeout 5 tc -s -n "$NETNS_PREFIX-${link#dqp}" qdisc show dev dq0 2>&1 || true
  done
}

netns_down() {
  local i entry ns link
  ((NETNS_DOWN)) && return 0
  NETNS_DOWN=1
  if [[ -n ${NETNS_DELAY_PID:-} ]]; then # its counters, one JSON line per direction, land in NETNS_DELAY_STATS
    netns_stop "$NETNS_DELAY_PID"
    NETNS_DELAY_PID=""
    NETNS_DELAY_STATS=$(grep '^{' "$NETNS_DELAY_LOG" 2>/dev/null || true)
    rm -f -- "${NETNS_DELAY_LOG:-}"
  fi
  for ((i = ${#NETNS_CREATED_LINKS[@]} - 1; i >= 0; i--)); do
    entry=${NETNS_CREATED_LINKS[i]} ns=${entry%% *} link=${entry#* }
    [[ $ns == "$NETNS_PREFIX"-* ]] || continue # never touch anything outside our own namespaces
    timeout 10 ip -n "$ns" link del "$link" 2>/dev/null || true
  done
  for ((i = ${#NETNS_CREATED_NS[@]} - 1; i >= 0; i--)); do
    ns=${NETNS_CREATED_NS[i]}
    [[ $ns == "$NETNS_PREFIX"-* ]] || continue
    timeout 10 ip netns del "$ns" 2>/dev/null || note "warning: could not delete namespace $ns"
  done
  for ns in "${NETNS_CREATED_NS[@]}"; do
    [[ -e /var/run/netns/$ns ]] && note "warning: namespace $ns still exists"
  done
  return 0
}

netns_wait_listen() { # PORT PID [RANK]
  local port=$1 pid=$2 ns t
  ns=$(netns_of "${3:-0}")
  for ((t = 0; t < 600; t++)); do # 60 s
    kill -0 "$pid" 2>/dev/null || return 1
    ip netns exec "$ns" ss -Hltn "sport = :$port" 2>/dev/null | grep -q . && return 0
    sleep 0.1
  done
  return 1
}

netns_stop() { # PID...
  local pid t alive
  (($# > 0)) || return 0
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  for ((t = 0; t < 50; t++)); do # up to 5 s for them to exit
    alive=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  # `timeout` made each wrapper a process-group leader: kill its group if still there.
  for pid in "$@"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  for pid in "$@"; do wait "$pid" 2>/dev/null || true; done
}
