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
# 2. What this project's GPU check needs beyond the tool's set (the host has none of
#    it for sure): pytest + hypothesis (stage gpu-tests collects every test module),
#    requests (the bench and server harness), psutil; versions from requirements/cpu.txt.
# 3. This project's own wheel, built from a clean copy of the work tree (tracked and
#    untracked-but-not-ignored files) so build/ and egg-info never land in the repo.
# 4. Prints the wheel count, the wheelhouse size and the carry total (work tree +
#    wheelhouse), which must stay under 64 MiB: both travel to the GPU host.
# Needs network access (PyPI) on the machine that runs it, not on the GPU host.
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac

REPO=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$REPO"
DEST=${1:-.cache/wheelhouse}
RAW=${2:-.cache/wheelhouse-raw}
TOOL=${GPU_WHEELHOUSE_TOOL:-/work/shared/tools/gpu-wheelhouse/build.sh}
LIMIT_MIB=64
PY_BUILD=${PY_BUILD:-python3}

P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
EXTRA=(pytest==8.4.2 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0
       hypothesis==6.140.0 attrs==26.1.0 sortedcontainers==2.4.0
       requests==2.34.2 urllib3==2.8.0 idna==3.20 charset-normalizer==3.5.3
       certifi==2026.10.19.post1 psutil==7.2.2
       prometheus-client==0.26.0)  # test_kvcr_metrics imports it at collection

[ -x "$TOOL" ] || [ -f "$TOOL" ] || { echo "build_wheelhouse: no wheelhouse tool at $TOOL" >&2; exit 2; }
mkdir -p "$DEST" "$RAW"
DEST=$(cd "$DEST" && pwd); RAW=$(cd "$RAW" && pwd)
rm -f "$DEST"/*.whl

echo "== pinned wheels: $TOOL $DEST $RAW"
bash "$TOOL" "$DEST" "$RAW"

echo "== extra wheels for gpu_check.sh"
"$PY_BUILD" -m pip download -q --disable-pip-version-check "${P[@]}" -d "$DEST" "${EXTRA[@]}"

echo "== project wheel from a clean copy of the work tree"
SRC=$(mktemp -d "${TMPDIR:-/tmp}/sglang-kvcr-src.XXXXXX")
trap 'rm -rf "$SRC"' EXIT
# Tracked + untracked non-ignored files that exist (a deleted tracked file is skipped).
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf - | tar -xf - -C "$SRC"
"$PY_BUILD" -m pip wheel -q --disable-pip-version-check --no-deps -w "$DEST" "$SRC"
ls "$DEST"/sglang_kvcr-*.whl >/dev/null

echo "== wheelhouse"
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
