#!/usr/bin/env bash
# Regenerates the real-gradient corpus of docs/codec_real_gradients.md: 8 DDP ranks, per-rank
# gradient buckets early (step 5) and late in training, for two byte-level transformer LMs (lm4:
# 4 layers, d 128; lmemb: 4 layers, d 160, 53% of the parameters in embeddings and head), an MLP and
# a CNN; each set also at the step before it (to plan one budget per step from). About 20 minutes
# on 2 CPU cores; ~1 GB, so keep it outside the repository.
#
#   bench/make_corpus.sh [OUT]        (default /work/corpus20; MODELS="mlp cnn" for a subset)
#   bench/corpus_table.py OUT         (dynamiq-bench codec over every set; see its --help)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/work/corpus20}
PY=${PYTHON:-/usr/bin/python3}  # Debian's, with torch
mkdir -p "$OUT"
MODELS=${MODELS:-mlp cnn lm4 lmemb}
run() {  # model steps dump-steps
  [[ " $MODELS " == *" $1 "* ]] || return 0
  echo "== $1: $2 steps, dumps at $3" >&2
  "$PY" bench/dump_gradients.py --model "$1" --workers 8 --steps "$2" --dump-steps "$3" --out "$OUT"
  # The layout dynamiq.torch's DDP hook sends (super-group aligned): ..._aligned_r<rank>.bin.
  "$PY" bench/dump_gradients.py --align "$OUT/$1_w8.json" > /dev/null
}
# Each set's preceding step is dumped too: a one-budget-per-step allocation plans step s from
# step s-1's statistics (corpus_table.py --step-budget).
run mlp 300 4,5,299,300
run cnn 300 4,5,299,300
run lm4 120 4,5,119,120
run lmemb 120 4,5,119,120
echo "corpus in $OUT; next: bench/corpus_table.py $OUT" >&2
