#!/usr/bin/env bash
# Build the offline wheelhouse that gpu_check.sh --wheelhouse installs on the
# air-gapped GPU host (CPython 3.12, torch 2.11.0+cu130 already there).
#
#   test/manual/kvcr_direct_linker/build_wheelhouse.sh [DEST] [RAW_CACHE]
#
#   DEST       where the wheels go (default: .cache/wheelhouse; emptied of *.whl first)
#   RAW_CACHE  untrimmed downloads kept for a rebuild (default: .cache/wheelhouse-raw)
#
# 1. /work/shared/tools/gpu-wheelhouse/build.sh DEST RAW_CACHE (pinned, trimmed wheels;
#    override the tool's location with GPU_WHEELHOUSE_TOOL=/path/to/build.sh).
# 2. This project's own wheel, built from a clean copy of the work tree (tracked and
#    untracked-but-not-ignored files) so build/ and egg-info never land in the repo.
# 3. Only what the host lacks: a wheel of a package the host already has
#    (device_packages.txt: pytest, hypothesis, requests, psutil, prometheus-client,
#    typing-extensions, ...) is moved to RAW_CACHE/left-behind/ (test/cpu_harness/
#    wheelhouse_rule.py): a second copy on PYTHONPATH would shadow the host's.
# 4. Lists every wheel with its size, the wheelhouse size and the carry total (work
#    tree + wheelhouse), which must stay under 64 MiB: both travel to the GPU host.
# Needs network access (PyPI) on the machine that runs it, not on the GPU host.
set -euo pipefail

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac

REPO=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$REPO"
DEST=${1:-.cache/wheelhouse}
RAW=${2:-.cache/wheelhouse-raw}
TOOL=${GPU_WHEELHOUSE_TOOL:-/work/shared/tools/gpu-wheelhouse/build.sh}
LIMIT_MIB=64
PY_BUILD=${PY_BUILD:-python3}

[ -x "$TOOL" ] || [ -f "$TOOL" ] || { echo "build_wheelhouse: no wheelhouse tool at $TOOL" >&2; exit 2; }
mkdir -p "$DEST" "$RAW"
DEST=$(cd "$DEST" && pwd); RAW=$(cd "$RAW" && pwd)
rm -f "$DEST"/*.whl

echo "== pinned wheels: $TOOL $DEST $RAW"
bash "$TOOL" "$DEST" "$RAW"

echo "== project wheel from a clean copy of the work tree"
SRC=$(mktemp -d "${TMPDIR:-/tmp}/sglang-kvcr-src.XXXXXX")
trap 'rm -rf "$SRC"' EXIT
# Tracked + untracked non-ignored files that exist (a deleted tracked file is skipped).
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf - | tar -xf - -C "$SRC"
"$PY_BUILD" -m pip wheel -q --disable-pip-version-check --no-deps -w "$DEST" "$SRC"
ls "$DEST"/sglang_kvcr-*.whl >/dev/null

echo "== wheelhouse: only what the host lacks (device_packages.txt)"
rm -rf "$RAW/left-behind"
"$PY_BUILD" "$REPO/test/cpu_harness/wheelhouse_rule.py" prune "$DEST" "$RAW/left-behind"
n=$(find "$DEST" -maxdepth 1 -name '*.whl' | wc -l)
wh_bytes=$(find "$DEST" -maxdepth 1 -name '*.whl' -printf '%s\n' | awk '{s+=$1} END {print s+0}')
tree_bytes=$(git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
  | xargs -0 -r stat -c %s | awk '{s+=$1} END {print s+0}')
total=$((wh_bytes + tree_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "wheels: $n  wheelhouse: $wh_bytes bytes ($(mib "$wh_bytes") MiB)  at $DEST"
echo "carry: work tree $(mib "$tree_bytes") MiB + wheelhouse $(mib "$wh_bytes") MiB = $(mib "$total") MiB (limit $LIMIT_MIB MiB)"
if [ "$total" -ge $((LIMIT_MIB << 20)) ]; then
  echo "build_wheelhouse: FAIL carry total $(mib "$total") MiB >= $LIMIT_MIB MiB" >&2
  exit 1
fi
