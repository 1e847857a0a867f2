#!/usr/bin/env bash
# scripts/gpu-bundle makes a complete bundle: every library its binaries load resolves inside the
# bundle or to what every GPU machine has (glibc, the NVIDIA driver) or brings (NCCL); it fits the
# 60 MiB limit; and scripts/gpu-check runs from it (here without a GPU: the GPU tests skip).
# Usage: gpu_bundle_test.sh <repo> <build dir>
set -euo pipefail
REPO=$1
BUILD=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
BUILD_DIR=$BUILD "$REPO/scripts/gpu-bundle" --out "$TMP/bundle"
status=0
(( $(du -sb "$TMP/bundle" | cut -f1) <= 60 << 20 )) || { echo "FAIL: bundle over 60 MiB"; status=1; }
for bin in "$TMP"/bundle/bin/*; do
  while read -r name arrow path _; do
    [[ "$arrow" == "=>" ]] || continue
    case "$name" in
      linux-vdso.so.*|ld-linux*|libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|libresolv.so.*|\
      libutil.so.*|libcuda.so.*|libnvidia*|libnccl.so.*) continue ;;
    esac
    if [[ "$path" != "$TMP/bundle/lib/"* ]]; then
      echo "FAIL: $(basename "$bin") loads $name from $path, not from the bundle"
      status=1
    fi
  done < <(LD_LIBRARY_PATH="$TMP/bundle/lib" ldd "$bin")
done
LD_LIBRARY_PATH="$TMP/bundle/lib" "$TMP/bundle/bin/dynamiqd" --help > /dev/null || { echo "FAIL: dynamiqd --help"; status=1; }
# The check itself, run from inside the bundle as on a GPU machine.
if ! timeout 300 "$TMP/bundle/scripts/gpu-check" "$TMP/report" > "$TMP/check.log" 2>&1; then
  echo "FAIL: gpu-check"; cat "$TMP/check.log"; status=1
fi
grep -q "gpu-check: every step passed" "$TMP/report/report.md" || { echo "FAIL: no report"; status=1; }
# --python-include: the Python package with its extension compiled for a given Python's headers
# (here this machine's own, so that it can be imported here from the bundle).
PYINC=$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
if [[ -f "$PYINC/Python.h" && -f "$BUILD/compile_commands.json" ]] && ls "$BUILD"/python/dynamiq/_dynamiq*.so >/dev/null 2>&1; then
  BUILD_DIR=$BUILD "$REPO/scripts/gpu-bundle" --out "$TMP/pybundle" --python-include "$PYINC" > /dev/null
  [[ -f "$TMP/pybundle/tests/python/test_torch_cuda.py" ]] || { echo "FAIL: no Python tests in the bundle"; status=1; }
  if ! (cd "$TMP" && PYTHONPATH="$TMP/pybundle/python" LD_LIBRARY_PATH="$TMP/pybundle/lib" /usr/bin/python3 -c \
        'import dynamiq, dynamiq._dynamiq as m; assert m.__file__.startswith("'"$TMP"'/pybundle/"), m.__file__; print(dynamiq.Client)'); then
    echo "FAIL: the bundled Python package does not import"; status=1
  fi
fi
[[ $status -eq 0 ]] && echo "gpu bundle: complete, $(du -sh "$TMP/bundle" | cut -f1)"
exit $status
