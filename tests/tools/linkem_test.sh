#!/usr/bin/env bash
# The link emulator (dynamiq-linkem, scripts/lib/netns.sh's netns_emulate) measured from outside, in
# namespaces this test makes: refuses impossible settings; RTT by ping within 5% of what was set;
# loss over 100k UDP datagrams within its binomial bound (4 sigma); one TCP stream's rate on the
# wire within 5% of the tbf rate; Ctrl-C removes every namespace and the delay line; an all-reduce
# over the TCP transport at 5% loss is bit-identical to the lossless one. Needs root,
# iproute2, ethtool, iperf3, python3; exits 77 (skipped) without root or namespaces.
# Usage: linkem_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
SRC=$1 BUILD=$2
export DQ_LINKEM=$BUILD/bin/dynamiq-linkem
die() { echo "linkem_test: FAIL: $*" >&2; exit 1; }
note() { echo "linkem_test: $*" >&2; }
[[ $(id -u) == 0 ]] || { note "skipped: needs root"; exit 77; }
ip netns add "dqlt-probe-$$" 2>/dev/null || { note "skipped: no ip netns"; exit 77; }
ip netns del "dqlt-probe-$$"
for tool in ethtool iperf3 python3; do command -v $tool >/dev/null || die "$tool is missing (scripts/install-deps)"; done
# shellcheck source=../../scripts/lib/netns.sh
source "$SRC/scripts/lib/netns.sh"
trap 'netns_down' EXIT

# 1. Impossible settings are refused with a message naming them.
expect_refused() { # pattern args...
  local pattern=$1 out
  shift
  if out=$("$DQ_LINKEM" check "$@" 2>&1); then die "accepted: $*"; fi
  [[ $out == *"$pattern"* ]] || die "for $*: '$out' does not say '$pattern'"
}
expect_refused "negative" --delay_ab=-5ms
expect_refused "not a probability" --loss=1.5
expect_refused "not a probability" --loss=-0.1
expect_refused "ge:P_GB,P_BG" --loss=ge:0.1
expect_refused "never leaves the bad state" --loss=ge:0.1,0
expect_refused "not a duration" --jitter=fast
note "impossible settings refused"

# 2. RTT: 40 ms between two ranks (two links of 10 ms each way).
netns_init "dqlt-$$" 2 none
netns_emulate 40ms 0 0
netns_up
rtts=$(timeout 20 ip netns exec "$(netns_of 1)" ping -n -c 21 -i 0.1 "$(netns_ip 0)" | sed -n 's/.*time=\([0-9.]*\) ms/\1/p' | tail -n +2)
median=$(sort -n <<<"$rtts" | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
awk -v m="$median" 'BEGIN { exit !(m >= 38 && m <= 42) }' || die "median RTT $median ms, set 40 ms (5%: 38-42)"
note "RTT: median $median ms of 20 pings (set 40 ms)"
netns_down

# 3. Loss: 1% Bernoulli on every rank's egress; 100k datagrams from rank 1 to rank 0.
netns_init "dqlt-$$-l" 2 none
netns_emulate 0 0 0.01 42
netns_up
n=100000
timeout 60 ip netns exec "$(netns_of 0)" python3 - "$(netns_ip 0)" >"/tmp/dqlt-$$.got" <<'PY' &
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
s.bind((sys.argv[1], 9999))
s.settimeout(3.0)
got = 0
try:
    while True:
        s.recv(2048)
        got += 1
except socket.timeout:
    pass
print(got)
PY
receiver=$!
sleep 0.5
timeout 60 ip netns exec "$(netns_of 1)" python3 - "$(netns_ip 0)" "$n" <<'PY'
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[2])):
    s.sendto(b"x" * 64, (sys.argv[1], 9999))
    if i % 100 == 99:
        time.sleep(0.0005)  # paced: the receiver's buffer never overflows
PY
wait "$receiver"
got=$(cat "/tmp/dqlt-$$.got")
rm -f "/tmp/dqlt-$$.got"
lost=$((n - got))
awk -v l="$lost" -v n="$n" -v p=0.01 'BEGIN { m = n * p; s = sqrt(n * p * (1 - p)); exit !(l >= m - 4 * s && l <= m + 4 * s) }' ||
  die "lost $lost of $n datagrams at 1% loss (expected 1000 +- 4 sigma = 126)"
note "loss: $lost of $n datagrams lost at 1% (expected 1000 +- 126)"
netns_down

# 4. Rate: one TCP stream through a 100 Mbit/s link, counted on the wire (the sender's veth).
netns_init "dqlt-$$-r" 2 100mbit
netns_up
timeout 20 ip netns exec "$(netns_of 0)" iperf3 -s -1 -B "$(netns_ip 0)" >/dev/null 2>&1 &
server=$!
sleep 0.5
before=$(ip netns exec "$(netns_of 1)" cat /sys/class/net/dq0/statistics/tx_bytes)
seconds=$(timeout 30 ip netns exec "$(netns_of 1)" iperf3 -J -c "$(netns_ip 0)" -t 4 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["end"]["sum_sent"]["seconds"])')
after=$(ip netns exec "$(netns_of 1)" cat /sys/class/net/dq0/statistics/tx_bytes)
wait "$server" || true
rate=$(awk -v b=$((after - before)) -v s="$seconds" 'BEGIN { printf "%.1f", b * 8 / s / 1e6 }')
awk -v r="$rate" 'BEGIN { exit !(r >= 95 && r <= 105) }' || die "one TCP stream: $rate Mbit/s on the wire, set 100"
note "rate: one TCP stream $rate Mbit/s on the wire (set 100 Mbit/s)"
netns_down

# 5. Ctrl-C: a script that built an emulated network and waits is interrupted; nothing is left.
prefix="dqlt-$$-c"
# A background job starts with SIGINT ignored (and a shell cannot trap a signal ignored at entry):
# Python restores the default before it becomes the shell, as in a terminal.
python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp("bash", sys.argv[1:])' \
  bash -c "
  die() { echo \"\$*\" >&2; exit 1; }; note() { :; }
  source '$SRC/scripts/lib/netns.sh'
  netns_init '$prefix' 2 1gbit
  netns_emulate 20ms 1ms 0.001
  trap 'netns_down' EXIT
  trap 'exit 130' INT
  netns_up
  echo up
  sleep 60 & wait
" >"/tmp/$prefix.out" 2>&1 &
child=$!
for _ in $(seq 100); do grep -q up "/tmp/$prefix.out" && break; sleep 0.1; done
grep -q up "/tmp/$prefix.out" || die "the emulated network did not come up: $(cat "/tmp/$prefix.out")"
line=$(ip netns pids "$prefix-hub" | head -1)
[[ -n $line ]] || die "no delay line running in $prefix-hub"
kill -INT "$child"
wait "$child" || true
rm -f "/tmp/$prefix.out"
left=$(ip netns list | grep -c "^$prefix" || true)
((left == 0)) || die "$left namespace(s) of $prefix left after Ctrl-C"
! kill -0 "$line" 2>/dev/null || die "the delay line (pid $line) survived Ctrl-C"
note "Ctrl-C: namespaces and the delay line removed"
# 6. Loss never changes a result: the all-reduce over --transport=tcp at 5% loss gives the same bits
# as without loss (output_checksum), compressed and not.
checksums() { # LOSS
  BUILD_DIR=$(realpath --relative-to="$SRC" "$BUILD") timeout 300 "$SRC/scripts/bench-network" --ranks 2 --quick \
    --methods dynamiq-ring-5-tcp,none-ring-tcp --rtt 2ms --loss "$1" --json 2>/dev/null |
    python3 -c 'import json, sys; print(" ".join(json.loads(l)["output_checksum"] for l in sys.stdin))'
}
lossless=$(checksums 0) lossy=$(checksums 0.05)
[[ -n $lossless && $lossless == "$lossy" ]] || die "checksums without loss '$lossless', at 5% loss '$lossy'"
note "5% loss: the same bits as without ($lossless)"
echo "linkem_test: all passed"
