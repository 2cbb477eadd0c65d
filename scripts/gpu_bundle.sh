#!/usr/bin/env bash
# Assemble what scripts/gpu_check.py needs on the device machine (issue 17 item 7), which has
# Python 3.12 with torch (CUDA), numpy, xxhash and nvidia-ml-py, no network, and takes at most
# 64 MiB of working tree and carried paths together:
#   wheels/  cp312 manylinux wheels of cairn's dependencies that image lacks (blake3,
#            cryptography and what cryptography needs), downloaded from PyPI here;
#   criu/    the CRIU binary with its shared libraries except glibc's, behind a wrapper that
#            points LD_LIBRARY_PATH at them for CRIU alone (the restored workload gets its own
#            environment back from the images, not CRIU's);
#   activate.sh  unpacks the wheels into /tmp/cairn-site (CAIRN_BUNDLE_SITE) and sets
#            PYTHONPATH and CAIRN_CRIU.
# The bundle is checked to fit the 64 MiB beside the tracked tree, or the script fails.
#
#   scripts/gpu_bundle.sh [DEST]        (default DEST: .cache/gpu-bundle, ignored by git)
#
# How the lead runs the device check with it (one call; the run tool's carry takes the
# ignored bundle along, the tree travels anyway; 300 s leaves room for one rerun in 15 min):
#   scripts/gpu_bundle.sh
#   run(carry=[".cache/gpu-bundle"], timeout_s=300,
#       command="source .cache/gpu-bundle/activate.sh && python3 scripts/gpu_check.py --out $OUT")
# then give_back. gpu_check writes one JSON per phase to $OUT and ends with one JSON line; on
# gVisor (kernel 4.4.0) CRIU cannot run and the process phases say so (skipped), which is a
# finding, not a failure. The CRIU build needs a glibc at least as new as this machine's
# (Debian 12: 2.36; the device image's Python 3.12.3 is Ubuntu 24.04's, glibc 2.39).
#
# Environment: PYTHON (a python with pip; default .venv/bin/python), CAIRN_CRIU (the CRIU
# binary; default criu on PATH, else /usr/local/sbin/criu), GPU_BUNDLE_LIMIT (bytes, default
# 64 MiB).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${1:-$ROOT/.cache/gpu-bundle}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
CRIU=${CAIRN_CRIU:-$(command -v criu || echo /usr/local/sbin/criu)}
LIMIT=${GPU_BUNDLE_LIMIT:-$((64 * 1024 * 1024))}
# cairn's runtime dependencies (pyproject.toml) that the device image does not hold, and what
# they need in turn; numpy, xxhash and nvidia-ml-py are there (.library/device/KINDS.md).
WHEELS=("blake3>=0.4" "cryptography>=45" "cffi>=1.14" "pycparser")

[ -x "$CRIU" ] || { echo "gpu_bundle: no CRIU binary at $CRIU (make criu, or set CAIRN_CRIU)" >&2; exit 2; }
rm -rf "$DEST"
mkdir -p "$DEST/wheels" "$DEST/criu/lib"

"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --dest "$DEST/wheels" "${WHEELS[@]}"

# CRIU and every shared library it loads but glibc's own (the device has a newer glibc).
cp "$CRIU" "$DEST/criu/criu.bin"
ldd "$CRIU" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
        libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*) ;;
        *) cp -L "$lib" "$DEST/criu/lib/" ;;
    esac
done
cat > "$DEST/criu/criu" <<'EOF'
#!/bin/sh
# CRIU from scripts/gpu_bundle.sh, with the libraries it was built against.
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/criu.bin" "$@"
EOF
chmod 755 "$DEST/criu/criu"

cat > "$DEST/activate.sh" <<'EOF'
# Source on the device machine from the repository root: unpacks the bundle's wheels (zip
# files: no pip or network needed) and points cairn at them and at the bundled CRIU.
_bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_site=${CAIRN_BUNDLE_SITE:-/tmp/cairn-site}
mkdir -p "$_site"
for _whl in "$_bundle"/wheels/*.whl; do python3 -m zipfile -e "$_whl" "$_site"; done
export PYTHONPATH="$PWD:$_site${PYTHONPATH:+:$PYTHONPATH}"
export CAIRN_CRIU="$_bundle/criu/criu" PYTHONUNBUFFERED=1
unset _bundle _site _whl
EOF

bundle=$(du -sb "$DEST" | cut -f1)
if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then  # what the run tool sends
    tree=$(cd "$ROOT" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
else  # a copy without git: all of it but the usual ignored folders
    tree=$(du -sb --exclude=.git --exclude=.cache --exclude='.venv*' "$ROOT" | cut -f1)
fi
total=$((bundle + tree))
echo "gpu_bundle: $DEST holds $((bundle / 1024)) KiB ($(ls "$DEST/wheels" | wc -l) wheels," \
     "CRIU with $(ls "$DEST/criu/lib" | wc -l) libraries); with the tracked tree" \
     "$((total / 1024)) KiB of the $((LIMIT / 1024)) KiB the run tool carries"
if [ "$total" -gt "$LIMIT" ]; then
    echo "gpu_bundle: over the limit by $(((total - LIMIT) / 1024)) KiB" >&2
    exit 1
fi
