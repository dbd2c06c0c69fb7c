#!/usr/bin/env bash
# gpu_check.sh: GPU validation + benchmark of the KVCR direct linker in one command,
# for an AIR-GAPPED CUDA host (one H200; Python 3.12 at plain `python3` with torch
# 2.11.0+cu130, triton, transformers, numpy, msgpack preinstalled; no registry, no
# model hub). Everything else comes from a wheelhouse (build_wheelhouse.sh).
#
# Usage:
#   test/manual/kvcr_direct_linker/gpu_check.sh --wheelhouse DIR [options]   # GPU host
#   test/manual/kvcr_direct_linker/gpu_check.sh --dry-run [options]          # this CPU box
#
#   --wheelhouse DIR  pip install --no-index --no-deps --target SITE DIR/*.whl over the
#                     host's own torch (torch/triton/nvidia wheels are refused), then
#                     run with SITE on PYTHONPATH. SITE: $GPU_CHECK_SITE or
#                     .cache/gpu_check_site (never under the report dir).
#   --dry-run         the same stages on CPU with the existing .venv: no install,
#                     --device cpu, a scaled-down Qwen3 geometry, short timeouts.
#   --stages LIST     comma-separated subset of: env,gpu-tests,microbench,bench
#   --list-stages     print the plan (mode, python, report dir, stages, timeouts); exit 0
#   --report-dir DIR  logs and reports (default: $OUT/gpu_check when $OUT is set, else
#                     .cache/gpu_check)
#   --python PY       interpreter (default: python3; with --dry-run: .venv/bin/python)
#   -h, --help        this text
#
# Typical GPU call: build the wheelhouse here (build_wheelhouse.sh -> .cache/wheelhouse,
# ~41 MiB), carry .cache/wheelhouse with the work tree (64 MiB in all), and run
#   test/manual/kvcr_direct_linker/gpu_check.sh --wheelhouse .cache/wheelhouse
# (about 8 minutes at most; the reports come back under $OUT/gpu_check).
#
# Stages: each runs under `timeout`, prints one `STAGE <name> PASS|FAIL ...` line and
# writes <report dir>/<name>.log; a failed stage does not stop the later ones.
#   env         python/torch/CUDA device + driver (nvidia-smi), imports: sgl_kernel
#               (Python-only + start-up hook), IPython.display, sglang, kvcr, nixl,
#               sglang.srt.mem_cache.storage.kvcr (+ entry point), SGLang's server
#               modules; a NIXL UCX DRAM loopback WRITE; with --wheelhouse the carry
#               size (work tree + wheelhouse <= 64 MiB).
#   gpu-tests   python -m pytest -m gpu test/registered/unit/mem_cache/kvcr (no CUDA: the
#               tests are deselected, pytest exits 5, expected only in --dry-run)
#   microbench  kvcr_microbench.py --device cuda (dry run: --device cpu --quick)
#   bench       kvcr_bench.py --device cuda, configs none vs kvcr, workloads zero_hit,
#               evict_replay and decode_itl, a Qwen3-0.6B-geometry model served with
#               --load-format dummy, page 64, 3000-token prompts, 1 output token.
# Serving without the stock kernels (the wheelhouse's sgl_kernel has no .so):
# SGLANG_KVCR_PY_ONLY_SGL_KERNEL=1 (test/cpu_harness/gpu_pythonpath/sitecustomize.py
# makes `import sgl_kernel` succeed), SGLANG_FORCE_FUSED_OP_BACKEND=torch,
# --attention-backend triton, --sampling-backend pytorch, CUDA graphs disabled.
# Absolute TTFT is inflated by that stack: only ratios between arms mean anything.
#
# Overrides: GPU_CHECK_TIMEOUT_<STAGE> (ENV, GPU_TESTS, MICROBENCH, BENCH, INSTALL) in
# seconds; GPU_CHECK_BENCH_ARGS / GPU_CHECK_MICROBENCH_ARGS append script flags,
# GPU_CHECK_SERVER_ARGS appends launch_server flags, GPU_CHECK_ATTENTION_BACKEND
# replaces triton (e.g. torch_native, should Triton not compile on the host).
# Exit: 0 all stages passed, 1 a stage failed, 2 bad usage.
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/../../.." && pwd)
HARNESS=$REPO/test/cpu_harness
MANUAL=$REPO/test/manual/kvcr_direct_linker
ALL_STAGES=(env gpu-tests microbench bench)
CARRY_LIMIT_MIB=64
TOTAL_BUDGET_S=480 # the stages' timeouts together on the GPU (install excluded)

usage() { sed -n '2,/^set -euo pipefail$/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//'; }
die_usage() { echo "gpu_check: $*" >&2; echo "run with --help for usage" >&2; exit 2; }

# Per-stage timeouts (seconds): GPU run, dry run.
stage_timeout() { # NAME
  local name=$1 var gpu dry
  case "$name" in
    install) gpu=60 dry=0 ;;
    env) gpu=60 dry=120 ;;
    gpu-tests) gpu=90 dry=180 ;;
    microbench) gpu=100 dry=540 ;;
    bench) gpu=220 dry=420 ;;
    *) echo 0; return ;;
  esac
  var=GPU_CHECK_TIMEOUT_$(echo "$name" | tr 'a-z-' 'A-Z_')
  if [ -n "${!var:-}" ]; then echo "${!var}"
  elif [ "$MODE" = dry-run ]; then echo "$dry"
  else echo "$gpu"; fi
}

# ---- internal: one stage body, run by run_stage under `timeout` --------------------

carry_size() { # prints one CARRY line; exit 1 when over the limit
  local wh=$1 tree_bytes wh_bytes total wh_rel
  wh=$(cd "$wh" && pwd)
  wh_rel=${wh#"$REPO"/}
  if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    tree_bytes=$(cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
      | while IFS= read -r -d '' f; do
          case "$f" in "$wh_rel"/*) continue ;; esac
          [ -f "$f" ] && printf '%s\0' "$f"
        done | xargs -0 -r stat -c %s | awk '{s+=$1} END {print s+0}')
  else # a copy without .git: everything but caches, venvs and the wheelhouse
    tree_bytes=$(cd "$REPO" && find . \( -path ./.git -o -path ./.cache -o -name '.venv*' \
      -o -name __pycache__ -o -path "./$wh_rel" \) -prune -o -type f -printf '%s\n' \
      | awk '{s+=$1} END {print s+0}')
  fi
  wh_bytes=$(find "$wh" -maxdepth 1 -name '*.whl' -printf '%s\n' | awk '{s+=$1} END {print s+0}')
  total=$((tree_bytes + wh_bytes))
  local verdict=OK
  [ "$total" -lt $((CARRY_LIMIT_MIB << 20)) ] || verdict=OVER
  awk -v t="$tree_bytes" -v w="$wh_bytes" -v l="$CARRY_LIMIT_MIB" -v v="$verdict" 'BEGIN {
    printf "CARRY %s work tree %.1f MiB + wheelhouse %.1f MiB = %.1f MiB (limit %d MiB)\n",
      v, t / 1048576, w / 1048576, (t + w) / 1048576, l }'
  [ "$verdict" = OK ]
}

stage_env() {
  local rc=0 args=(--report "$REPORTS/env.json")
  [ "$MODE" = gpu ] && args+=(--expect-cuda)
  "$PY" "$HARNESS/gpu_env_check.py" "${args[@]}" || rc=1
  if [ -n "$WHEELHOUSE" ]; then carry_size "$WHEELHOUSE" || rc=1; fi
  return $rc
}

stage_gpu_tests() {
  cd "$REPO"
  local rc=0
  "$PY" -m pytest -m gpu test/registered/unit/mem_cache/kvcr -p no:cacheprovider -q \
    --junitxml "$REPORTS/gpu_tests.xml" || rc=$?
  if [ "$rc" -eq 5 ]; then
    if [ "$MODE" = dry-run ]; then
      echo "gpu-tests: pytest exit 5 (no gpu tests collected without CUDA): expected in --dry-run"
      return 0
    fi
    echo "gpu-tests: pytest exit 5: no gpu tests ran on the GPU host"
    return 1
  fi
  return "$rc"
}

stage_microbench() {
  cd "$REPO"
  local script=$MANUAL/kvcr_microbench.py help args
  help=$("$PY" "$script" --help 2>&1) || { echo "$help"; return 1; }
  for flag in --device --quick; do
    if ! grep -q -- "$flag" <<<"$help"; then
      echo "gpu-check: kvcr_microbench.py has no $flag option (not merged yet?)"
      return 1
    fi
  done
  local report rc=0
  if [ "$MODE" = gpu ]; then
    report=$REPORTS/kvcr_microbench_cuda.json
    args=(--device cuda --quiet-wait-s 5 --report "$report")
  else
    report=$REPORTS/kvcr_microbench_cpu.json
    args=(--device cpu --quick --report "$report")
  fi
  rm -f "$report"
  # shellcheck disable=SC2086
  "$PY" "$script" "${args[@]}" ${GPU_CHECK_MICROBENCH_ARGS:-} || rc=$?
  [ "$rc" -ne 0 ] && [ "$MODE" = dry-run ] || return "$rc"
  # The dry run tests this script's plumbing on a small, often shared CPU: a complete
  # report with missed performance targets is informational there, not a failure.
  "$PY" - "$report" "$rc" <<'PYEOF'
import json, sys
path, rc = sys.argv[1], sys.argv[2]
try:
    metrics = json.load(open(path))["metrics"]
except (OSError, ValueError, KeyError) as exc:
    print(f"microbench: exit {rc} and no complete report ({exc})")
    sys.exit(1)
missed = [m["name"] for m in metrics if m.get("passed") is False or m.get("error")]
print(f"microbench: exit {rc} with a complete report ({len(metrics)} metrics); "
      f"missed or errored on this CPU (informational in --dry-run): {missed}")
PYEOF
}

stage_bench() {
  cd "$REPO"
  local model server_args args
  local no_graphs="--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled"
  if [ "$MODE" = gpu ]; then
    model=$REPO/.cache/gpu_check_models/qwen3-0.6b-geometry
    "$PY" "$HARNESS/qwen3_geometry_model.py" "$model"
    server_args="--load-format dummy --attention-backend ${GPU_CHECK_ATTENTION_BACKEND:-triton} --sampling-backend pytorch $no_graphs --mem-fraction-static 0.5"
    args=(--device cuda --model-path "$model" --page-size 64 --prompt-len 3000 --output-len 1
      --max-total-tokens 7000 --reps 2 --zero-hit-per-rep 2 --warmup 1
      --itl-rounds 4 --itl-output-len 96
      --startup-timeout 100 --request-timeout 60 --stats-wait-s 35
      --report "$REPORTS/kvcr_bench_cuda.json")
  else
    # Qwen3 architecture, vocab and tokenizer as on the GPU, geometry scaled down.
    model=$REPO/.cache/gpu_check_models/qwen3-dry-run
    "$PY" "$HARNESS/qwen3_geometry_model.py" "$model" --layers 2 --hidden 64 --heads 4 \
      --kv-heads 2 --head-dim 16 --intermediate 128 --max-positions 8192
    server_args="--load-format dummy --sampling-backend pytorch $no_graphs"
    args=(--device cpu --model-path "$model" --page-size 16 --prompt-len 256 --output-len 1
      --reps 1 --zero-hit-per-rep 2 --warmup 1 --itl-rounds 2 --itl-output-len 64
      --startup-timeout 150
      --request-timeout 60 --stats-wait-s 35 --report "$REPORTS/kvcr_bench_cpu.json")
  fi
  server_args+=${GPU_CHECK_SERVER_ARGS:+ $GPU_CHECK_SERVER_ARGS}
  local report=${args[-1]} rc=0
  rm -f "$report"
  # shellcheck disable=SC2086
  "$PY" "$MANUAL/kvcr_bench.py" "${args[@]}" --configs none,kvcr \
    --workloads zero_hit,evict_replay,decode_itl --server-args "$server_args" \
    ${GPU_CHECK_BENCH_ARGS:-} || rc=$?
  [ "$rc" -ne 0 ] && [ "$MODE" = dry-run ] || return "$rc"
  # As for the microbench: in the dry run a ratio target missed on a small shared
  # CPU is informational; a functional check or a failed configuration is not.
  "$PY" - "$report" "$rc" <<'PYEOF'
import json, sys
path, rc = sys.argv[1], sys.argv[2]
try:
    body = json.load(open(path))
except (OSError, ValueError) as exc:
    print(f"bench: exit {rc} and no complete report ({exc})")
    sys.exit(1)
checks = body.get("checks", [])
broken = [c["name"] for c in checks if not c.get("passed") and "target" not in c]
missed = [c["name"] for c in checks if not c.get("passed") and "target" in c]
hard = [f for f in body.get("failures", []) if "(target" not in f]
if broken or hard:
    print(f"bench: exit {rc}: failed checks {broken}, failures {hard}")
    sys.exit(1)
print(f"bench: exit {rc}; ratio targets missed on this CPU (informational in "
      f"--dry-run): {missed}")
PYEOF
}

# Everything below runs from main(), parsed whole before it starts: editing this file
# during a run cannot change the run.
main() {
  if [ "${1:-}" = __stage ]; then # internal entry point: run one stage body
    case "${2:-}" in
      env) stage_env ;;
      gpu-tests) stage_gpu_tests ;;
      microbench) stage_microbench ;;
      bench) stage_bench ;;
      *) echo "gpu_check: unknown internal stage ${2:-}" >&2; exit 2 ;;
    esac
    exit $?
  fi

  # ---- arguments ----------------------------------------------------------------------

  MODE=gpu WHEELHOUSE="" STAGES_ARG="" STAGES_SET=0 LIST=0 REPORTS="" PY=""
  while [ $# -gt 0 ]; do
    case "$1" in
      -h|--help) usage; exit 0 ;;
      --dry-run) MODE=dry-run ;;
      --wheelhouse) [ $# -ge 2 ] || die_usage "--wheelhouse needs a directory"; WHEELHOUSE=$2; shift ;;
      --wheelhouse=*) WHEELHOUSE=${1#*=} ;;
      --stages) [ $# -ge 2 ] || die_usage "--stages needs a list"; STAGES_ARG=$2; STAGES_SET=1; shift ;;
      --stages=*) STAGES_ARG=${1#*=}; STAGES_SET=1 ;;
      --list-stages) LIST=1 ;;
      --report-dir) [ $# -ge 2 ] || die_usage "--report-dir needs a directory"; REPORTS=$2; shift ;;
      --report-dir=*) REPORTS=${1#*=} ;;
      --python) [ $# -ge 2 ] || die_usage "--python needs an interpreter"; PY=$2; shift ;;
      --python=*) PY=${1#*=} ;;
      *) die_usage "unknown argument: $1" ;;
    esac
    shift
  done

  if [ "$MODE" = dry-run ] && [ -n "$WHEELHOUSE" ]; then
    die_usage "--dry-run uses .venv and installs nothing: drop --wheelhouse"
  fi
  if [ "$MODE" = gpu ] && [ -z "$WHEELHOUSE" ] && [ "$LIST" = 0 ]; then
    die_usage "the GPU run needs --wheelhouse DIR (or use --dry-run here)"
  fi
  if [ -n "$WHEELHOUSE" ]; then
    [ -d "$WHEELHOUSE" ] || die_usage "--wheelhouse $WHEELHOUSE: no such directory"
    WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
    if [ "$LIST" = 0 ] && ! compgen -G "$WHEELHOUSE/*.whl" >/dev/null; then
      die_usage "--wheelhouse $WHEELHOUSE: no *.whl in it"
    fi
  fi

  STAGES=()
  if [ "$STAGES_SET" = 0 ]; then
    STAGES=("${ALL_STAGES[@]}")
  else
    wanted=()
    IFS=, read -r -a wanted <<<"$STAGES_ARG" || true
    [ "${#wanted[@]}" -gt 0 ] || die_usage "--stages: empty list"
    for w in "${wanted[@]}"; do
      case " ${ALL_STAGES[*]} " in *" $w "*) ;; *) die_usage "--stages: unknown stage '$w' (choose from ${ALL_STAGES[*]})" ;; esac
    done
    for s in "${ALL_STAGES[@]}"; do # keep the canonical order
      for w in "${wanted[@]}"; do [ "$s" = "$w" ] && { STAGES+=("$s"); break; }; done
    done
  fi

  if [ -z "$PY" ]; then
    if [ "$MODE" = dry-run ]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
  fi
  if [ -z "$REPORTS" ]; then
    if [ -n "${OUT:-}" ]; then REPORTS=$OUT/gpu_check; else REPORTS=$REPO/.cache/gpu_check; fi
  fi
  case "$REPORTS" in /*) ;; *) REPORTS=$PWD/$REPORTS ;; esac
  SITE=${GPU_CHECK_SITE:-$REPO/.cache/gpu_check_site}

  if [ "$LIST" = 1 ]; then
    echo "mode: $MODE"
    echo "python: $PY"
    echo "report dir: $REPORTS"
    [ -n "$WHEELHOUSE" ] && echo "wheelhouse: $WHEELHOUSE -> $SITE"
    total=0
    [ -n "$WHEELHOUSE" ] && echo "step install timeout $(stage_timeout install)s"
    for s in "${STAGES[@]}"; do
      t=$(stage_timeout "$s"); total=$((total + t))
      echo "stage $s timeout ${t}s"
    done
    echo "total stage timeout ${total}s"
    if [ "$MODE" = gpu ] && [ "$total" -gt "$TOTAL_BUDGET_S" ]; then
      echo "warning: over the ${TOTAL_BUDGET_S}s GPU budget"
    fi
    exit 0
  fi

  # ---- environment --------------------------------------------------------------------

  mkdir -p "$REPORTS"
  REPORTS=$(cd "$REPORTS" && pwd)
  : > "$REPORTS/summary.txt"
  export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
  export SGLANG_KVCR_CACHE_DIR=${SGLANG_KVCR_CACHE_DIR:-$REPO/.cache}
  export HOME_SCRATCH=$SGLANG_KVCR_CACHE_DIR/gpu_check_home
  mkdir -p "$HOME_SCRATCH"
  export SGLANG_CACHE_DIR=${SGLANG_CACHE_DIR:-$HOME_SCRATCH/sglang}
  export HF_HOME=${HF_HOME:-$HOME_SCRATCH/hf} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME_SCRATCH/triton}
  export PYTHONUNBUFFERED=1
  export SGLANG_KVCR_PY_ONLY_SGL_KERNEL=1 SGLANG_FORCE_FUSED_OP_BACKEND=torch
  unset SGLANG_USE_CPU_ENGINE # the CPU harness sets it per server; never globally
  START=$(date +%s)
  FAILED=()

  # End the processes a stage left behind, found by the GPU_CHECK_RUN token in their
  # environment (SGLang servers run in their own sessions, out of timeout's reach).
  sweep() { # TOKEN
    local token=$1 pids=() e p
    for e in /proc/[0-9]*/environ; do
      p=${e#/proc/}; p=${p%/environ}
      [ "$p" = "$$" ] && continue
      if { tr '\0' '\n' < "$e"; } 2>/dev/null | grep -qx "GPU_CHECK_RUN=$token"; then pids+=("$p"); fi
    done
    [ "${#pids[@]}" -gt 0 ] || return 0
    echo "   ending ${#pids[@]} leftover process(es) of the stage: ${pids[*]}"
    kill -TERM "${pids[@]}" 2>/dev/null || true
    sleep 5
    kill -KILL "${pids[@]}" 2>/dev/null || true
  }

  record() { # NAME VERDICT RC SECONDS DETAIL
    local line="STAGE $1 $2 rc=$3 ${4}s log=$REPORTS/$1.log${5:+ ($5)}"
    echo "$line"
    echo "$line" >> "$REPORTS/summary.txt"
    [ "$2" = PASS ] || FAILED+=("$1")
  }

  run_stage() { # NAME: the stage body under timeout, in a child bash (functions included)
    local name=$1 t rc=0 t0 secs note=""
    t=$(stage_timeout "$name")
    echo "== stage $name (timeout ${t}s) $(date -u +%H:%M:%S)"
    t0=$(date +%s)
    # SIGINT first: the Python drivers then stop the servers they started (their
    # finally blocks run); SIGKILL 20 s later; then sweep() ends anything left.
    MODE=$MODE PY=$PY REPORTS=$REPORTS WHEELHOUSE=$WHEELHOUSE GPU_CHECK_RUN="$$-$name" \
      timeout -s INT -k 20 "$t" bash "$SELF" __stage "$name" > "$REPORTS/$name.log" 2>&1 || rc=$?
    secs=$(( $(date +%s) - t0 ))
    sweep "$$-$name"
    grep -E '^(REPORT|CARRY|NIXL_LOOPBACK|microbench:|gpu-tests:|\[env\] (PASS|FAIL))|^(FAILED|ERROR) |passed|failed' \
      "$REPORTS/$name.log" | tail -n 8 | sed 's/^/   /' || true
    case "$rc" in 124|137) note="timed out after ${t}s" ;; esac
    if [ "$rc" -eq 0 ]; then record "$name" PASS 0 "$secs"
    else record "$name" FAIL "$rc" "$secs" "${note:-see log}"; tail -n 15 "$REPORTS/$name.log" | sed 's/^/   | /'; fi
  }

  PP=("$HARNESS/gpu_pythonpath" "$HARNESS/pythonpath")
  if [ -n "$WHEELHOUSE" ]; then
    t=$(stage_timeout install)
    echo "== install $WHEELHOUSE -> $SITE (timeout ${t}s)"
    wheels=()
    for w in "$WHEELHOUSE"/*.whl; do
      case "$(basename "$w")" in
        torch-*|triton-*|nvidia_*|torchvision-*|torchaudio-*) echo "   refusing $(basename "$w"): the host's own build stays" ;;
        *) wheels+=("$w") ;;
      esac
    done
    rm -rf "$SITE"; mkdir -p "$SITE"
    t0=$(date +%s); rc=0
    if timeout 60 "$PY" -m pip --version > "$REPORTS/install.log" 2>&1; then
      timeout -k 10 "$t" "$PY" -m pip install --disable-pip-version-check --no-index --no-deps --no-compile \
        --target "$SITE" "${wheels[@]}" >> "$REPORTS/install.log" 2>&1 || rc=$?
    else # no pip on the host: a --no-deps --target install is an unzip (+ .data/*lib)
      echo "no pip for $PY: unpacking the wheels with zipfile" >> "$REPORTS/install.log"
      timeout -k 10 "$t" "$PY" "$HARNESS/unpack_wheels.py" "$SITE" "${wheels[@]}" \
        >> "$REPORTS/install.log" 2>&1 || rc=$?
    fi
    # The wheel may predate the work tree (python/ changed after build_wheelhouse.sh):
    # run the tree's plugin code, keeping the wheel's metadata (entry point).
    local_pkg=$REPO/python/sglang/srt/mem_cache/storage/kvcr
    site_pkg=$SITE/sglang/srt/mem_cache/storage/kvcr
    if [ "$rc" -eq 0 ] && [ -d "$site_pkg" ] && ! diff -rq -x __pycache__ "$local_pkg" "$site_pkg" >/dev/null 2>&1; then
      rm -rf "$site_pkg" && cp -r "$local_pkg" "$site_pkg" && rm -rf "$site_pkg/__pycache__" || rc=$?
      echo "   the wheel's plugin differs from the work tree: installed the work tree's python/ package over it" \
        | tee -a "$REPORTS/install.log"
    fi
    if [ "$rc" -eq 0 ]; then record install PASS 0 $(( $(date +%s) - t0 )) "${#wheels[@]} wheels"
    else record install FAIL "$rc" $(( $(date +%s) - t0 )); tail -n 15 "$REPORTS/install.log" | sed 's/^/   | /'; fi
    PP+=("$SITE")
  fi
  # IPython: sglang.utils imports IPython.display; the host has no IPython. The dry run
  # always uses the stand-in, so the stand-in is what gets tested here.
  if [ "$MODE" = dry-run ] || ! PYTHONPATH=$(IFS=:; echo "${PP[*]}") timeout 60 "$PY" -c 'import IPython.display' >/dev/null 2>&1; then
    PP+=("$HARNESS/ipython_standin")
  fi
  PYTHONPATH=$(IFS=:; echo "${PP[*]}")${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONPATH
  echo "gpu_check: mode=$MODE python=$PY reports=$REPORTS stages=${STAGES[*]}"
  echo "gpu_check: PYTHONPATH=$PYTHONPATH"

  for s in "${STAGES[@]}"; do run_stage "$s"; done

  elapsed=$(( $(date +%s) - START ))
  if [ "${#FAILED[@]}" -eq 0 ]; then
    echo "GPU_CHECK PASS (${elapsed}s, mode $MODE) summary: $REPORTS/summary.txt" | tee -a "$REPORTS/summary.txt"
    exit 0
  fi
  echo "GPU_CHECK FAIL: ${FAILED[*]} (${elapsed}s, mode $MODE) summary: $REPORTS/summary.txt" | tee -a "$REPORTS/summary.txt"
  exit 1
}

main "$@"
