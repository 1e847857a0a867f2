#!/usr/bin/env bash
# Runs command blocks of README.md and docs/operations.md as they are written (issue 23: the
# documented commands must work), from the repository root with the build's binaries:
#   README.md          "## An all-reduce between processes"   (two dynamiq-bench ranks)
#   README.md          "## Python / PyTorch"                  (examples/train.py, 2 nodes x 2 workers, dynamiq and gloo)
#   docs/operations.md "### Single node"                      (daemon, worker, status, metrics, flight recorder)
# Each block runs under bash -e with a time limit; background processes are killed afterwards.
# Usage: doc_commands_test.sh <repo root> <build dir> [python]
#   python: only the README's Python block (ctest doc_commands_python; it needs the Python module,
#   which a sanitizer build cannot load into CPython), else every other block.
set -euo pipefail
REPO=$1
BUILD=$2
ONLY=${3:-}
WORK=$(mktemp -d /tmp/dqdocs.XXXXXX)
trap 'pkill -P $$ 2>/dev/null || true; rm -rf "$WORK"' EXIT

# block <file> <heading>: the first ```sh block after the line equal to <heading>.
block() {
  awk -v h="$2" '$0 == h { found = 1; next }
                 found && /^```sh$/ { inside = 1; next }
                 inside && /^```$/ { exit }
                 inside { print }' "$1"
}

# run <name> <file> <heading> <seconds> <wait|kill>: the block, with build/bin pointing at the
# build; afterwards its background commands are waited for (they end by themselves) or killed
# (daemons).
run() {
  local name=$1 text end
  text=$(block "$2" "$3")
  if [[ -z "$text" ]]; then echo "FAIL $name: no \`\`\`sh block after '$3' in $2"; return 1; fi
  mkdir -p "$WORK/$name/build"
  ln -s "$BUILD/bin" "$WORK/$name/build/bin"
  ln -s "$BUILD/python" "$WORK/$name/build/python"
  ln -s "$REPO/examples" "$WORK/$name/examples"
  if [[ $5 == wait ]]; then end='wait'; else end='kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true'; fi
  printf 'set -e\n%s\n%s\n' "$text" "$end" >"$WORK/$name/block.sh"
  echo "== $name ($2, '$3'):"
  sed 's/^/   | /' <<<"$text"
  if (cd "$WORK/$name" && timeout "$4" bash "$WORK/$name/block.sh") >"$WORK/$name/out" 2>&1; then
    echo "ok $name"
    sed "s/^/   > /" "$WORK/$name/out" | grep -v "^   > iteration" | sed -n 1,30p  # reads all: no SIGPIPE
  else
    echo "FAIL $name (exit $?):"
    sed 's/^/   > /' "$WORK/$name/out" | tail -40
    return 1
  fi
}

status=0
if [[ $ONLY == python ]]; then
  run readme_python "$REPO/README.md" "## Python / PyTorch" 300 wait || status=1
  for want in "comm=dynamiq codec=dynamiq bits=5 world=4" "comm=gloo" "final test accuracy"; do
    grep -q "$want" "$WORK/readme_python/out" || { echo "FAIL readme_python: no '$want'"; status=1; }
  done
  exit $status
fi
run readme_allreduce "$REPO/README.md" "## An all-reduce between processes" 120 wait || status=1
grep -q '"method"' "$WORK/readme_allreduce/out" || { echo "FAIL readme_allreduce: no JSON line"; status=1; }
run operations_single_node "$REPO/docs/operations.md" "### Single node" 120 kill || status=1
for want in "JOB" "myjob" "dynamiq_collectives_total" "SEQ"; do
  grep -q "$want" "$WORK/operations_single_node/out" || { echo "FAIL operations_single_node: no '$want'"; status=1; }
done
exit $status
