#!/usr/bin/env bash
# Re-resolve one environment from scratch and write what resolved as its constraints file.
#
#   scripts/refresh_constraints.sh OUT ENV_NAME TORCH_PIN PIP_INSTALL_ARGS...
#
# Called by `make constraints` with the Makefile's requirement lists, so the install and the
# refresh never disagree on what an environment holds. A temporary venv gets TORCH_PIN first
# (as every environment does), then PIP_INSTALL_ARGS in one resolve with no constraints: the
# newest releases the requirements allow. `pip check` must be clean; then every installed
# distribution except the editable checkouts, torch and torch's CUDA runtime packages
# (nvidia-c*, nvidia-n*, triton: the CPU and CUDA builds differ there) is written to OUT as
# NAME==VERSION.
set -euo pipefail
if [ $# -lt 4 ]; then
    echo "usage: $0 OUT ENV_NAME TORCH_PIN PIP_INSTALL_ARGS..." >&2
    exit 2
fi
out=$1 env_name=$2 torch_pin=$3
shift 3
python=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "refresh_constraints: resolving $env_name ($out) in $tmp" >&2
"$python" -m venv "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip)
"${pip[@]}" install --quiet --no-compile "$torch_pin"
"${pip[@]}" install --quiet --no-compile "$@"
"${pip[@]}" check
py_version=$("$tmp/venv/bin/python" -c 'import platform; print(platform.python_version())')
{
    echo "# Versions that $env_name resolved on $(date -u +%F) (Python $py_version, $torch_pin installed"
    echo "# first) for: $*"
    echo "# pip check was clean. Written by \`make constraints\` (scripts/refresh_constraints.sh); do not edit."
    "${pip[@]}" freeze --exclude-editable | grep -v -E '^(#|-e |torch==|triton==|nvidia-[cn])' | LC_ALL=C sort -f
} > "$tmp/constraints.txt"
mv "$tmp/constraints.txt" "$out"
echo "refresh_constraints: wrote $out ($(grep -vc '^#' "$out") pins)" >&2
