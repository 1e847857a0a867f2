#!/usr/bin/env bash
# `dynamiqctl top` in a real 80x24 terminal (tmux) fits its width (issue 23): a daemon on loopback,
# a worker whose job id is longer than top's job column, and top drawn in a tmux pane of 80
# columns. A line longer than the pane wraps; `capture-pane -J` joins wrapped lines back, so every
# joined line must still be at most 80 characters, and the table must be on screen.
# Usage: top_width_test.sh <build dir>
set -euo pipefail
BIN=$1/bin
WORK=$(mktemp -d /tmp/dqtop.XXXXXX)
SESSION="dqtop$$"
cleanup() {
  tmux kill-session -t "$SESSION" 2>/dev/null || true
  kill $(jobs -p) 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

: >"$WORK/daemon.log"
"$BIN/dynamiqd" --listen=127.0.0.1:0 --metrics_port=0 --worker_socket="$WORK/d.sock" >"$WORK/daemon.log" 2>&1 &
# "ready; operators on 127.0.0.1:PORT, ..."
DAEMON=""
for _ in $(seq 100); do
  DAEMON=$(sed -n 's/.*ready; operators on \([0-9.:]*\),.*/\1/p' "$WORK/daemon.log")
  [[ -n $DAEMON ]] && break
  sleep 0.1
done
[[ -n $DAEMON ]] || { echo "FAIL: dynamiqd did not start"; cat "$WORK/daemon.log"; exit 1; }
JOB=a-job-id-longer-than-the-column-of-top-has-room-for
DQ_SOCKET="$WORK/d.sock" DQ_JOB=$JOB DQ_LOCAL_RANK=0 DQ_LOCAL_WORLD_SIZE=1 \
  "$BIN/dynamiq-example-worker" --iterations=100000 --elements=4096 >"$WORK/worker.log" 2>&1 &
for _ in $(seq 100); do "$BIN/dynamiqctl" --daemon="$DAEMON" status 2>/dev/null | grep -q "a-job" && break; sleep 0.1; done

tmux -f /dev/null new-session -d -s "$SESSION" -x 80 -y 24 \
  "TERM=xterm $BIN/dynamiqctl --daemon=$DAEMON top --interval=0.2 --iterations=5; sleep 30"
screen=""
for _ in $(seq 50); do
  sleep 0.2
  screen=$(tmux capture-pane -p -J -t "$SESSION")
  grep -q "a-job" <<<"$screen" && break
done
echo "$screen"
width=$(tmux display-message -p -t "$SESSION" '#{pane_width}')
[[ $width == 80 ]] || { echo "FAIL: the pane is $width columns wide, not 80"; exit 1; }
grep -q "dynamiqctl top" <<<"$screen" || { echo "FAIL: no top header on screen"; exit 1; }
grep -q "a-job" <<<"$screen" || { echo "FAIL: the job is not on screen"; exit 1; }
longest=$(awk '{ if (length($0) > n) n = length($0) } END { print n + 0 }' <<<"$screen")
if ((longest > 80)); then
  echo "FAIL: a line of $longest characters wrapped in an 80-column terminal"
  exit 1
fi
echo "ok: the longest line is $longest characters"
