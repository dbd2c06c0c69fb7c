#!/usr/bin/env bash
# gpu_check.sh: GPU validation + benchmark of the KVCR direct linker in one command,
# for an AIR-GAPPED CUDA host (one H200; Python 3.12 at plain `python3` with torch
# 2.11.0+cu130, triton, transformers, numpy, pytest and the rest of
# device_packages.txt preinstalled; no registry, no model hub). Everything else
# comes from a wheelhouse (build_wheelhouse.sh) that carries only what the host lacks.
#
# Usage:
#   test/manual/kvcr_direct_linker/gpu_check.sh --wheelhouse DIR [options]   # GPU host
#   test/manual/kvcr_direct_linker/gpu_check.sh --dry-run [options]          # this CPU box
#   test/manual/kvcr_direct_linker/gpu_check.sh --emulate-host [options]     # this CPU box
#
#   --wheelhouse DIR  pip install --no-index --no-deps --target SITE DIR/*.whl over the
#                     host's own packages (a wheel of a package the host has, listed in
#                     device_packages.txt, is refused), then run with SITE on
#                     PYTHONPATH. SITE: $GPU_CHECK_SITE or .cache/gpu_check_site.
#   --dry-run         every stage on CPU with the existing .venv: no install,
#                     --device cpu, scaled-down geometries, CPU timeouts.
#   --emulate-host    the GPU host rebuilt here: a Python 3.12 env with the host's
#                     packages at the host's versions (emulate_host_env.sh, cached in
#                     --emulate-dir), the wheelhouse (--wheelhouse, else .cache/
#                     wheelhouse, built by build_wheelhouse.sh when missing) installed
#                     exactly as on the host, then the stages env, warmup (a CPU
#                     server with the linker) and the gpu tests' collection.
#   --emulate-dir DIR caches of --emulate-host, outside the repository (default
#                     $GPU_CHECK_EMULATE_DIR, else .cache-emulate beside the checkout)
#   --stages LIST     comma-separated subset of: env,warmup,gpu-tests,
#                     gpu-tests-sanitizer,microbench,bench,bench-families
#   --part NAME       a named subset that fits one device call (560 s):
#                     kernels = env,gpu-tests,gpu-tests-sanitizer,microbench;
#                     serving = warmup,bench,bench-families
#   --list-stages     print the plan (mode, python, caches, steps, stages, timeouts,
#                     budget); exit 0
#   --report-dir DIR  logs and reports (default: $OUT/gpu_check when $OUT is set, else
#                     .cache/gpu_check)
#   --python PY       interpreter (default: python3; --dry-run: .venv/bin/python;
#                     --emulate-host: the emulated host's)
#   -h, --help        this text
#
# Typical GPU calls: build the wheelhouse here (build_wheelhouse.sh -> .cache/wheelhouse,
# ~38 MiB), carry .cache/wheelhouse with the work tree (64 MiB in all), and run
#   test/manual/kvcr_direct_linker/gpu_check.sh --wheelhouse .cache/wheelhouse --part kernels
#   test/manual/kvcr_direct_linker/gpu_check.sh --wheelhouse .cache/wheelhouse --part serving
# Each part fits one call of at most 560 s (all stages do not: the first H200 run,
# 2026-12-04, timed them): the install and every stage keep their own timeout, and on
# the GPU a stage never runs past the 560 s budget counted from the start
# (GPU_CHECK_DEADLINE_S; a stage with no time left fails at once). The reports come
# back under $OUT/gpu_check.
#
# Stages: each runs under `timeout`, prints one `STAGE <name> PASS|FAIL ...` line and
# writes <report dir>/<name>.log; a failed stage does not stop the later ones.
#   env         python/torch/CUDA device + driver (nvidia-smi), imports: sgl_kernel
#               (Python-only + start-up hook), IPython.display, sglang, kvcr, nixl,
#               sglang.srt.mem_cache.storage.kvcr (+ entry point), SGLang's server
#               modules; a NIXL UCX DRAM loopback WRITE; with a wheelhouse the carry
#               size (work tree + wheelhouse <= 64 MiB) and that it holds nothing the
#               host has.
#   warmup      kvcr_warmup.py: every bench model's server (Qwen3-0.6B, DeepSeek-V2-Lite
#               MLA and sliding-window geometries, --load-format dummy, the linker on)
#               started at once, one request each, so SGLang's JIT (nvcc) and Triton
#               compile once into the caches below and later stages start warm. Off
#               the GPU: a CPU server start with the linker (dry run: all three).
#   gpu-tests   python -m pytest -m gpu over the kvcr test modules that mention the
#               gpu marker (grep), not the whole directory (where torch
#               sees no CUDA device: their collection, cpu_harness/gpu_collection.py,
#               which passes when gpu tests were found and every module imported).
#   gpu-tests-sanitizer  the same under PyTorch's CUDA sanitizer
#               (TORCH_CUDA_SANITIZER=1: unsynchronized accesses across streams,
#               among the kernels the test's main thread launches: the sanitizer's
#               dispatch mode is per thread, so the copier's, loader's and
#               stager's kernels are not checked; the fence tests and their
#               negative controls cover those).
#               Without a device the sanitizer cannot run (a CUDA build without a
#               driver fails every tensor operation under it): the stage checks it
#               is there and collects the tests without it.
#   microbench  kvcr_microbench.py --device cuda (dry run: --device cpu --quick)
#   bench       kvcr_bench.py --device cuda, configs none vs kvcr, workloads zero_hit,
#               evict_replay and decode_itl, a Qwen3-0.6B-geometry model served with
#               --load-format dummy, page 64, 3000-token prompts, 1 output token.
#   bench-families  kvcr_family_bench.py: an MLA (DeepSeek-V2-Lite geometry) and a
#               sliding-window model, each evicted and replayed from KVCR, the replay's
#               greedy output equal to a recompute's.
# Serving without the stock kernels (the wheelhouse's sgl_kernel has no .so):
# SGLANG_KVCR_PY_ONLY_SGL_KERNEL=1 (test/cpu_harness/gpu_pythonpath/sitecustomize.py
# makes `import sgl_kernel` succeed), SGLANG_FORCE_FUSED_OP_BACKEND=torch,
# --attention-backend triton, --sampling-backend pytorch, CUDA graphs disabled.
# Absolute TTFT is inflated by that stack: only ratios between arms mean anything.
# Caches (cold start paid once, by warmup): SGLANG_JIT_CACHE_DIR, TRITON_CACHE_DIR,
# CUDA_CACHE_PATH, XDG_CACHE_HOME, SGLANG_CACHE_DIR, HF_HOME, all under
# $SGLANG_KVCR_CACHE_DIR/gpu_check_home (default .cache/ in the work tree).
#
# Overrides: GPU_CHECK_TIMEOUT_<STEP OR STAGE> (HOST_ENV, WHEELHOUSE, INSTALL, ENV,
# WARMUP, GPU_TESTS, GPU_TESTS_SANITIZER, MICROBENCH, BENCH, BENCH_FAMILIES) in
# seconds; GPU_CHECK_DEADLINE_S (0: none); GPU_CHECK_BENCH_ARGS /
# GPU_CHECK_MICROBENCH_ARGS / GPU_CHECK_FAMILY_ARGS append script flags,
# GPU_CHECK_SERVER_ARGS appends launch_server flags, GPU_CHECK_ATTENTION_BACKEND
# replaces triton (e.g. torch_native, should Triton not compile on the host).
# Exit: 0 all stages passed, 1 a stage failed, 2 bad usage.
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/../../.." && pwd)
HARNESS=$REPO/test/cpu_harness
MANUAL=$REPO/test/manual/kvcr_direct_linker
ALL_STAGES=(env warmup gpu-tests gpu-tests-sanitizer microbench bench bench-families)
EMULATE_STAGES=(env warmup gpu-tests gpu-tests-sanitizer)
CARRY_LIMIT_MIB=64
GPU_DEADLINE_S=560 # one device call (at most 600 s): the install and every stage, from the start
STOP_GRACE_S=25    # timeout's SIGKILL grace (20 s) + the leftover sweep (5 s)

usage() { sed -n '2,/^set -euo pipefail$/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//'; }
die_usage() { echo "gpu_check: $*" >&2; echo "run with --help for usage" >&2; exit 2; }

# Per-step and per-stage timeouts (seconds): GPU run, dry run, emulated host.
stage_timeout() { # NAME
  local name=$1 var gpu dry emu
  case "$name" in
    host-env) gpu=0 dry=0 emu=1800 ;;
    wheelhouse) gpu=0 dry=0 emu=600 ;;
    # GPU: from the H200 runs (cold imports: env 27-33 s; 36 gpu tests 62 s of
    # pytest, 83 s in all; sanitizer 94 s; microbench 56-72 s; three servers
    # started at once: MLA ready in 72 s, Qwen3 in about 80 s, cold).
    install) gpu=45 dry=0 emu=180 ;;
    env) gpu=60 dry=120 emu=180 ;;
    warmup) gpu=170 dry=600 emu=420 ;;
    gpu-tests) gpu=130 dry=180 emu=240 ;;
    gpu-tests-sanitizer) gpu=130 dry=180 emu=240 ;;
    microbench) gpu=110 dry=540 emu=540 ;;
    bench) gpu=190 dry=420 emu=420 ;;
    bench-families) gpu=120 dry=600 emu=600 ;;
    *) echo 0; return ;;
  esac
  var=GPU_CHECK_TIMEOUT_$(echo "$name" | tr 'a-z-' 'A-Z_')
  if [ -n "${!var:-}" ]; then echo "${!var}"
  elif [ "$MODE" = dry-run ]; then echo "$dry"
  elif [ "$MODE" = emulate-host ]; then echo "$emu"
  else echo "$gpu"; fi
}

deadline_s() { # the whole run's budget in seconds; 0: none
  if [ -n "${GPU_CHECK_DEADLINE_S:-}" ]; then echo "$GPU_CHECK_DEADLINE_S"
  elif [ "$MODE" = gpu ]; then echo "$GPU_DEADLINE_S"
  else echo 0; fi
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

gpu_server_flags() { # launch_server flags of every GPU server (no stock kernels)
  echo "--attention-backend ${GPU_CHECK_ATTENTION_BACKEND:-triton} --sampling-backend pytorch --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled${GPU_CHECK_SERVER_ARGS:+ $GPU_CHECK_SERVER_ARGS}"
}

cpu_server_flags() {
  echo "--sampling-backend pytorch --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled${GPU_CHECK_SERVER_ARGS:+ $GPU_CHECK_SERVER_ARGS}"
}

stage_env() {
  local rc=0 args=(--report "$REPORTS/env.json")
  [ "$MODE" = gpu ] && args+=(--expect-cuda)
  "$PY" "$HARNESS/gpu_env_check.py" "${args[@]}" || rc=1
  if [ -n "$WHEELHOUSE" ]; then
    carry_size "$WHEELHOUSE" || rc=1
    if "$PY" "$HARNESS/wheelhouse_rule.py" check "$WHEELHOUSE"; then
      echo "WHEELHOUSE OK nothing in it that the host has (device_packages.txt)"
    else
      echo "WHEELHOUSE FAIL it carries packages the host has"; rc=1
    fi
  fi
  return $rc
}

stage_warmup() {
  cd "$REPO"
  local args
  if [ "$MODE" = gpu ]; then
    args=(--device cuda --scale full --models qwen3,mla,swa --page-size 64
      --prompt-len 1024 --output-len 8 --startup-timeout 120 --request-timeout 40
      --server-args "$(gpu_server_flags) --mem-fraction-static 0.25")
  else
    local models=qwen3
    [ "$MODE" = dry-run ] && models=qwen3,mla,swa
    args=(--device cpu --scale dry-run --models "$models" --page-size 16
      --prompt-len 256 --output-len 4 --startup-timeout 400 --request-timeout 120
      --server-args "$(cpu_server_flags)")
  fi
  "$PY" "$MANUAL/kvcr_warmup.py" "${args[@]}" --report "$REPORTS/kvcr_warmup.json"
}

GPU_TEST_DIR=test/registered/unit/mem_cache/kvcr

gpu_test_modules() { # the test modules that mention the gpu marker (collected alone:
  # importing every kvcr test module takes longer than the gpu tests themselves)
  grep -rl --include='test_*.py' 'mark\.gpu' "$GPU_TEST_DIR" | sort
}

run_gpu_tests() { # JUNIT_NAME [ENV=VALUE...]: the gpu tests, or their collection
  cd "$REPO"
  local junit=$1 rc=0 modules
  shift
  mapfile -t modules < <(gpu_test_modules)
  if [ "${#modules[@]}" -eq 0 ]; then echo "gpu-tests: no module mentions the gpu marker"; return 1; fi
  if [ "$MODE" = gpu ]; then
    env "$@" "$PY" -m pytest -m gpu "${modules[@]}" -p no:cacheprovider -q \
      --junitxml "$REPORTS/$junit.xml" || rc=$?
    if [ "$rc" -eq 5 ]; then echo "gpu-tests: pytest exit 5: no gpu tests ran on the GPU host"; return 1; fi
    return "$rc"
  fi
  # No CUDA here: every gpu test is deselected; collect them under this interpreter.
  # The sanitizer needs a device (on a CUDA build without a driver it fails every
  # tensor operation): check it is there, and collect without it.
  if [ "$junit" = gpu_tests_sanitizer ]; then
    "$PY" -c 'import torch, torch.cuda._sanitizer as s; assert callable(s.enable_cuda_sanitizer); print(f"gpu-tests: CUDA sanitizer present in torch {torch.__version__}; TORCH_CUDA_SANITIZER=1 needs a CUDA device, not set here")' || return 1
  fi
  PYTHONPATH="$REPO/test:$PYTHONPATH" \
    "$PY" -m pytest -m gpu "${modules[@]}" --collect-only \
    -p no:cacheprovider -q -p cpu_harness.gpu_collection
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
  [ "$rc" -ne 0 ] && [ "$MODE" != gpu ] || return "$rc"
  # Off the GPU this tests the script's plumbing on a small, often shared CPU: a
  # complete report with missed performance targets is informational there.
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
      f"missed or errored on this CPU (informational off the GPU): {missed}")
PYEOF
}

stage_bench() {
  cd "$REPO"
  local model server_args args
  if [ "$MODE" = gpu ]; then
    model=$REPO/.cache/gpu_check_models/qwen3-0.6b-geometry
    "$PY" "$HARNESS/qwen3_geometry_model.py" "$model"
    server_args="--load-format dummy $(gpu_server_flags) --mem-fraction-static 0.5"
    args=(--device cuda --model-path "$model" --page-size 64 --prompt-len 3000 --output-len 1
      --max-total-tokens 7000 --reps 1 --zero-hit-per-rep 2 --warmup 1
      --itl-rounds 2 --itl-output-len 64
      --startup-timeout 60 --request-timeout 30 --stats-wait-s 32
      --report "$REPORTS/kvcr_bench_cuda.json")
  else
    # Qwen3 architecture, vocab and tokenizer as on the GPU, geometry scaled down.
    model=$REPO/.cache/gpu_check_models/qwen3-dry-run
    "$PY" "$HARNESS/qwen3_geometry_model.py" "$model" --layers 2 --hidden 64 --heads 4 \
      --kv-heads 2 --head-dim 16 --intermediate 128 --max-positions 8192
    server_args="--load-format dummy $(cpu_server_flags)"
    # The servers take turns (each SIGSTOPped while the other runs its rep): on a
    # busy CPU a turn outlasts the default 10 s operation timeout, and KVCR, seeing
    # its progress stall that long, restarts empty and every replay misses.
    args=(--device cpu --model-path "$model" --page-size 16 --prompt-len 256 --output-len 1
      --reps 1 --zero-hit-per-rep 2 --warmup 1 --itl-rounds 2 --itl-output-len 64
      --operation-timeout-ms 60000 --startup-timeout 150
      --request-timeout 60 --stats-wait-s 35 --report "$REPORTS/kvcr_bench_cpu.json")
  fi
  local report=${args[-1]} rc=0
  rm -f "$report"
  # shellcheck disable=SC2086
  "$PY" "$MANUAL/kvcr_bench.py" "${args[@]}" --configs none,kvcr \
    --workloads zero_hit,evict_replay,decode_itl --server-args "$server_args" \
    ${GPU_CHECK_BENCH_ARGS:-} || rc=$?
  [ "$rc" -ne 0 ] && [ "$MODE" != gpu ] || return "$rc"
  # As for the microbench: off the GPU a ratio target missed on a small shared
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
print(f"bench: exit {rc}; ratio targets missed on this CPU (informational off "
      f"the GPU): {missed}")
PYEOF
}

stage_bench_families() {
  cd "$REPO"
  local args
  if [ "$MODE" = gpu ]; then
    args=(--device cuda --scale full --prompt-len 1024 --startup-timeout 80
      --server-args "$(gpu_server_flags) --mem-fraction-static 0.3")
  else
    args=(--device cpu --scale dry-run --startup-timeout 400
      --server-args "$(cpu_server_flags)")
  fi
  # shellcheck disable=SC2086
  "$PY" "$MANUAL/kvcr_family_bench.py" "${args[@]}" \
    --report "$REPORTS/kvcr_family_bench.json" ${GPU_CHECK_FAMILY_ARGS:-}
}

# Everything below runs from main(), parsed whole before it starts: editing this file
# during a run cannot change the run.
main() {
  if [ "${1:-}" = __stage ]; then # internal entry point: run one stage body
    case "${2:-}" in
      env) stage_env ;;
      warmup) stage_warmup ;;
      gpu-tests) run_gpu_tests gpu_tests ;;
      gpu-tests-sanitizer) run_gpu_tests gpu_tests_sanitizer TORCH_CUDA_SANITIZER=1 ;;
      microbench) stage_microbench ;;
      bench) stage_bench ;;
      bench-families) stage_bench_families ;;
      *) echo "gpu_check: unknown internal stage ${2:-}" >&2; exit 2 ;;
    esac
    exit $?
  fi

  # ---- arguments ----------------------------------------------------------------------

  MODE=gpu WHEELHOUSE="" STAGES_ARG="" STAGES_SET=0 LIST=0 REPORTS="" PY="" MODES=0
  EMULATE_DIR=${GPU_CHECK_EMULATE_DIR:-$(dirname "$REPO")/.cache-emulate}
  while [ $# -gt 0 ]; do
    case "$1" in
      -h|--help) usage; exit 0 ;;
      --dry-run) MODE=dry-run; MODES=$((MODES + 1)) ;;
      --emulate-host) MODE=emulate-host; MODES=$((MODES + 1)) ;;
      --emulate-dir) [ $# -ge 2 ] || die_usage "--emulate-dir needs a directory"; EMULATE_DIR=$2; shift ;;
      --emulate-dir=*) EMULATE_DIR=${1#*=} ;;
      --wheelhouse) [ $# -ge 2 ] || die_usage "--wheelhouse needs a directory"; WHEELHOUSE=$2; shift ;;
      --wheelhouse=*) WHEELHOUSE=${1#*=} ;;
      --stages) [ $# -ge 2 ] || die_usage "--stages needs a list"; STAGES_ARG=$2; STAGES_SET=1; shift ;;
      --stages=*) STAGES_ARG=${1#*=}; STAGES_SET=1 ;;
      --part|--part=*)
        if [ "$1" = --part ]; then [ $# -ge 2 ] || die_usage "--part needs a name"; part=$2; shift; else part=${1#*=}; fi
        case "$part" in
          kernels) STAGES_ARG=env,gpu-tests,gpu-tests-sanitizer,microbench ;;
          serving) STAGES_ARG=warmup,bench,bench-families ;;
          *) die_usage "--part: unknown part '$part' (kernels or serving)" ;;
        esac
        STAGES_SET=1 ;;
      --list-stages) LIST=1 ;;
      --report-dir) [ $# -ge 2 ] || die_usage "--report-dir needs a directory"; REPORTS=$2; shift ;;
      --report-dir=*) REPORTS=${1#*=} ;;
      --python) [ $# -ge 2 ] || die_usage "--python needs an interpreter"; PY=$2; shift ;;
      --python=*) PY=${1#*=} ;;
      *) die_usage "unknown argument: $1" ;;
    esac
    shift
  done

  [ "$MODES" -le 1 ] || die_usage "choose one of --dry-run and --emulate-host"
  if [ "$MODE" = dry-run ] && [ -n "$WHEELHOUSE" ]; then
    die_usage "--dry-run uses .venv and installs nothing: drop --wheelhouse"
  fi
  if [ "$MODE" = gpu ] && [ -z "$WHEELHOUSE" ] && [ "$LIST" = 0 ]; then
    die_usage "the GPU run needs --wheelhouse DIR (or use --dry-run or --emulate-host here)"
  fi
  if [ "$MODE" = emulate-host ]; then
    case "$EMULATE_DIR" in /*) ;; *) EMULATE_DIR=$PWD/$EMULATE_DIR ;; esac
    case "$EMULATE_DIR/" in "$REPO"/*) die_usage "--emulate-dir $EMULATE_DIR lies in the repository (it would travel)" ;; esac
    BUILD_WHEELHOUSE=0
    if [ -z "$WHEELHOUSE" ]; then
      WHEELHOUSE=$REPO/.cache/wheelhouse
      compgen -G "$WHEELHOUSE/*.whl" >/dev/null || BUILD_WHEELHOUSE=1
    fi
  fi
  if [ -n "$WHEELHOUSE" ] && [ "${BUILD_WHEELHOUSE:-0}" = 0 ]; then
    [ -d "$WHEELHOUSE" ] || die_usage "--wheelhouse $WHEELHOUSE: no such directory"
    WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
    if [ "$LIST" = 0 ] && ! compgen -G "$WHEELHOUSE/*.whl" >/dev/null; then
      die_usage "--wheelhouse $WHEELHOUSE: no *.whl in it"
    fi
  fi

  STAGES=()
  if [ "$STAGES_SET" = 0 ]; then
    if [ "$MODE" = emulate-host ]; then STAGES=("${EMULATE_STAGES[@]}"); else STAGES=("${ALL_STAGES[@]}"); fi
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
    case "$MODE" in
      dry-run) PY=$REPO/.venv/bin/python ;;
      emulate-host) PY=$EMULATE_DIR/host-py312/bin/python ;;
      *) PY=python3 ;;
    esac
  fi
  if [ -z "$REPORTS" ]; then
    if [ -n "${OUT:-}" ]; then REPORTS=$OUT/gpu_check; else REPORTS=$REPO/.cache/gpu_check; fi
  fi
  case "$REPORTS" in /*) ;; *) REPORTS=$PWD/$REPORTS ;; esac
  SITE=${GPU_CHECK_SITE:-$REPO/.cache/gpu_check_site}
  STEPS=()
  if [ "$MODE" = emulate-host ]; then
    STEPS+=(host-env)
    [ "${BUILD_WHEELHOUSE:-0}" = 1 ] && STEPS+=(wheelhouse)
  fi
  [ -n "$WHEELHOUSE" ] && STEPS+=(install)
  DEADLINE=$(deadline_s)
  export SGLANG_KVCR_CACHE_DIR=${SGLANG_KVCR_CACHE_DIR:-$REPO/.cache}
  HOME_SCRATCH=$SGLANG_KVCR_CACHE_DIR/gpu_check_home

  if [ "$LIST" = 1 ]; then
    echo "mode: $MODE"
    echo "python: $PY"
    echo "report dir: $REPORTS"
    echo "caches: $HOME_SCRATCH"
    [ "$MODE" = emulate-host ] && echo "emulate dir: $EMULATE_DIR"
    [ -n "$WHEELHOUSE" ] && echo "wheelhouse: $WHEELHOUSE -> $SITE"
    total=0
    for s in "${STEPS[@]}"; do
      t=$(stage_timeout "$s"); total=$((total + t))
      echo "step $s timeout ${t}s"
    done
    for s in "${STAGES[@]}"; do
      t=$(stage_timeout "$s"); total=$((total + t))
      echo "stage $s timeout ${t}s"
    done
    echo "total timeout ${total}s"
    if [ "$DEADLINE" -gt 0 ]; then
      echo "budget ${DEADLINE}s"
      [ "$total" -le "$DEADLINE" ] || echo "warning: the timeouts add up to more than the ${DEADLINE}s budget: the last stages get what is left"
    fi
    exit 0
  fi

  # ---- environment --------------------------------------------------------------------

  START=$(date +%s)
  mkdir -p "$REPORTS"
  REPORTS=$(cd "$REPORTS" && pwd)
  : > "$REPORTS/summary.txt"
  export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
  export HOME_SCRATCH
  mkdir -p "$HOME_SCRATCH"
  # Every cache a cold start fills, in the work tree (warmup fills them once).
  export SGLANG_CACHE_DIR=${SGLANG_CACHE_DIR:-$HOME_SCRATCH/sglang}
  export SGLANG_JIT_CACHE_DIR=${SGLANG_JIT_CACHE_DIR:-$HOME_SCRATCH/sglang-jit}
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME_SCRATCH/triton}
  export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-$HOME_SCRATCH/cuda-compute-cache}
  export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$HOME_SCRATCH/xdg}
  export HF_HOME=${HF_HOME:-$HOME_SCRATCH/hf} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export PYTHONUNBUFFERED=1
  export SGLANG_KVCR_PY_ONLY_SGL_KERNEL=1 SGLANG_FORCE_FUSED_OP_BACKEND=torch
  unset SGLANG_USE_CPU_ENGINE # the CPU harness sets it per server; never globally
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

  budgeted() { # NAME: its timeout, cut to what the run's budget has left ("" if none)
    local t left
    t=$(stage_timeout "$1")
    [ "$DEADLINE" -gt 0 ] || { echo "$t"; return; }
    left=$((DEADLINE - ($(date +%s) - START) - STOP_GRACE_S))
    [ "$left" -ge 10 ] || { echo ""; return; }
    [ "$left" -lt "$t" ] && t=$left
    echo "$t"
  }

  run_stage() { # NAME: the stage body under timeout, in a child bash (functions included)
    local name=$1 t rc=0 t0 secs note=""
    t=$(budgeted "$name")
    if [ -z "$t" ]; then
      echo "== stage $name: no time left in the ${DEADLINE}s budget"
      : > "$REPORTS/$name.log"
      record "$name" FAIL 124 0 "not run: no time left in the ${DEADLINE}s budget"
      return
    fi
    echo "== stage $name (timeout ${t}s) $(date -u +%H:%M:%S)"
    t0=$(date +%s)
    # SIGINT first: the Python drivers then stop the servers they started (their
    # finally blocks run); SIGKILL 20 s later; then sweep() ends anything left.
    MODE=$MODE PY=$PY REPORTS=$REPORTS WHEELHOUSE=$WHEELHOUSE GPU_CHECK_RUN="$$-$name" \
      timeout -s INT -k 20 "$t" bash "$SELF" __stage "$name" > "$REPORTS/$name.log" 2>&1 || rc=$?
    secs=$(( $(date +%s) - t0 ))
    sweep "$$-$name"
    grep -E '^(REPORT|CARRY|WHEELHOUSE|NIXL_LOOPBACK|microbench:|bench:|gpu-tests:|warmup |family |\[env\] (PASS|FAIL))|^(FAILED|ERROR) |passed|failed' \
      "$REPORTS/$name.log" | tail -n 8 | sed 's/^/   /' || true
    case "$rc" in 124|137) note="timed out after ${t}s" ;; esac
    if [ "$rc" -eq 0 ]; then record "$name" PASS 0 "$secs"
    else record "$name" FAIL "$rc" "$secs" "${note:-see log}"; tail -n 15 "$REPORTS/$name.log" | sed 's/^/   | /'; fi
  }

  step() { # NAME COMMAND...: a preparation step under its timeout, logged like a stage
    local name=$1 t rc=0 t0
    shift
    t=$(budgeted "$name")
    [ -n "$t" ] || t=1
    echo "== $name (timeout ${t}s) $(date -u +%H:%M:%S)"
    t0=$(date +%s)
    timeout -k 10 "$t" "$@" > "$REPORTS/$name.log" 2>&1 || rc=$?
    grep -vE '^WARNING: Location' "$REPORTS/$name.log" | tail -n 4 | sed 's/^/   /' || true
    if [ "$rc" -eq 0 ]; then record "$name" PASS 0 $(( $(date +%s) - t0 ))
    else record "$name" FAIL "$rc" $(( $(date +%s) - t0 )); tail -n 15 "$REPORTS/$name.log" | sed 's/^/   | /'; fi
    return "$rc"
  }

  # The GPU start-up shim (gpu_pythonpath) puts the CPU harness's directory at the END
  # of sys.path when it needs it: ahead of site-packages, its torchvision stand-in
  # would shadow the host's torchvision. The dry run's .venv has no torchvision.
  PP=("$HARNESS/gpu_pythonpath")
  [ "$MODE" = dry-run ] && PP+=("$HARNESS/pythonpath")
  if [ "$MODE" = emulate-host ]; then
    if ! step host-env bash "$MANUAL/emulate_host_env.sh" "$EMULATE_DIR"; then
      echo "GPU_CHECK FAIL: host-env (no emulated host environment)" | tee -a "$REPORTS/summary.txt"
      exit 1
    fi
    if [ "${BUILD_WHEELHOUSE:-0}" = 1 ]; then
      step wheelhouse bash "$MANUAL/build_wheelhouse.sh" "$WHEELHOUSE" "$EMULATE_DIR/wheelhouse-raw" || true
    fi
  fi
  if [ -n "$WHEELHOUSE" ]; then
    t=$(budgeted install); [ -n "$t" ] || t=1
    echo "== install $WHEELHOUSE -> $SITE (timeout ${t}s)"
    wheels=()
    while IFS= read -r line; do
      case "$line" in
        refusing\ *) echo "   $line" ;;
        *) wheels+=("$line") ;;
      esac
    done < <(python3 "$HARNESS/wheelhouse_rule.py" split "$WHEELHOUSE"/*.whl 2>/dev/null \
      || "$PY" "$HARNESS/wheelhouse_rule.py" split "$WHEELHOUSE"/*.whl)
    rm -rf "$SITE"; mkdir -p "$SITE"
    t0=$(date +%s); rc=0
    if [ "${#wheels[@]}" -eq 0 ]; then
      echo "no wheel to install" > "$REPORTS/install.log"; rc=1
    elif timeout 60 "$PY" -m pip --version > "$REPORTS/install.log" 2>&1; then
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
    # Byte-compile the site once, on every core: installed with --no-compile, the
    # first import of each module compiles it (the first H200 run's env stage spent
    # over 25 s importing sglang cold). A file compileall refuses (code for
    # another Python) is only compiled on import, as before: not a failure.
    # It gets what is left of the install's timeout (at least 5 s).
    left=$(( t - ($(date +%s) - t0) ))
    if [ "$rc" -eq 0 ] && [ "$left" -ge 5 ]; then
      timeout -k 2 "$left" "$PY" -m compileall -q -j 0 "$SITE" >> "$REPORTS/install.log" 2>&1 \
        || echo "   byte-compiling $SITE did not finish cleanly (see install.log)"
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
  # The servers the drivers start run under the same interpreter (not the .venv's).
  export SGLANG_KVCR_SERVER_PYTHON=$PY
  echo "gpu_check: mode=$MODE python=$PY reports=$REPORTS stages=${STAGES[*]}"
  echo "gpu_check: PYTHONPATH=$PYTHONPATH"
  budget_note=""
  [ "$DEADLINE" -gt 0 ] && budget_note=", budget ${DEADLINE}s from the start"
  echo "gpu_check: caches under $HOME_SCRATCH$budget_note"

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
