#!/usr/bin/env bash
# Rebuild the GPU host's Python environment on this CPU machine, for
# gpu_check.sh --emulate-host (which runs this first).
#
#   test/manual/kvcr_direct_linker/emulate_host_env.sh DIR
#
#   DIR/wheels      wheel cache: emulated_host_requirements.txt downloaded once (about
#                   2.7 GB: torch 2.11.0 is the CUDA 13.0 build with its nvidia-* wheels)
#   DIR/host-py312  a venv of Python 3.12 with exactly those packages, installed from
#                   the cache (--no-index); reused while its stamp matches the
#                   requirements file, rebuilt otherwise
# DIR must lie outside the repository (what lies in the work tree travels to the GPU
# host). Python 3.12: $EMULATE_PYTHON312, else python3.12 on PATH, else pyenv's newest
# 3.12. After installing it checks that every installed package is one the host has
# (device_packages.txt): anything else would let a check pass here that fails there.
# The last line is "EMULATED_PYTHON <interpreter>".
set -euo pipefail

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h|--help) usage; exit 0 ;; "") usage >&2; exit 2 ;; esac

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
REQS=$HERE/emulated_host_requirements.txt
DIR=$(realpath -m "$1")
case "$DIR/" in "$REPO"/*) echo "emulate_host_env: $DIR is inside the repository" >&2; exit 2 ;; esac
mkdir -p "$DIR"
WHEELS=$DIR/wheels
VENV=$DIR/host-py312
STAMP=$VENV/.emulated-host-stamp

find_py312() {
  if [ -n "${EMULATE_PYTHON312:-}" ]; then echo "$EMULATE_PYTHON312"; return; fi
  # (a pyenv shim may be on PATH without a 3.12 selected: it must run)
  if python3.12 -c '' >/dev/null 2>&1; then command -v python3.12; return; fi
  local newest
  newest=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.* 2>/dev/null | sort -V | tail -n 1)
  [ -n "$newest" ] && [ -x "$newest/bin/python" ] && { echo "$newest/bin/python"; return; }
  echo "emulate_host_env: no Python 3.12 (set EMULATE_PYTHON312)" >&2
  return 1
}

want=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "emulate_host_env: reusing $VENV"
else
  PY312=$(find_py312)
  echo "emulate_host_env: base interpreter $PY312 ($("$PY312" -V 2>&1))"
  t0=$(date +%s)
  mkdir -p "$WHEELS"
  # Downloads only what the cache lacks (pip skips files already there).
  "$PY312" -m pip download -q --disable-pip-version-check --only-binary=:all: \
    --find-links "$WHEELS" -d "$WHEELS" -r "$REQS"
  t1=$(date +%s)
  echo "emulate_host_env: wheel cache ready in $((t1 - t0)) s ($(du -sh "$WHEELS" | cut -f1))"
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index \
    --find-links "$WHEELS" -r "$REQS"
  t2=$(date +%s)
  echo "emulate_host_env: installed in $((t2 - t1)) s ($(du -sh "$VENV" | cut -f1))"
  echo "$want" > "$STAMP"
fi

# Nothing the host lacks: the emulation would hide a missing package.
"$VENV/bin/python" - "$REPO/test/cpu_harness" <<'PYEOF'
import importlib.metadata as md, sys
sys.path.insert(0, sys.argv[1])
import wheelhouse_rule
host = wheelhouse_rule.device_packages()
extra = sorted({wheelhouse_rule.normalize(d.metadata["Name"]) for d in md.distributions()} - set(host))
pinned = {n: v for n, v in host.items() if v}
wrong = sorted(
    f"{d.metadata['Name']} {d.version} (host {pinned[n]})"
    for d in md.distributions()
    if (n := wheelhouse_rule.normalize(d.metadata["Name"])) in pinned and d.version.split("+")[0] != pinned[n]
)
if extra or wrong:
    print(f"emulate_host_env: FAIL not on the host: {extra}; other versions: {wrong}")
    sys.exit(1)
print(f"emulate_host_env: {sum(1 for _ in md.distributions())} packages, all on the host, host versions where known")
PYEOF
echo "EMULATED_PYTHON $VENV/bin/python"
