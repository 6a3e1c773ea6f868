#!/usr/bin/env bash
# One device-machine session: everything that needs the GPU, logs under $OUT, a short summary last.
# Usage (on the device machine, repo root):
#   bash scripts/gpu_session.sh checks|projection|decode-probe|cold-start|cold-profile|bench|dispatch|minimax|declared|recheck|floors|probe|variants|gputests|second-ops|peers|bundle-tests|extras|sweep|table-a|table-b|table-c|profile|sched
# and on the CPU machine, before the visit (no GPU; issue 30):
#   bash scripts/gpu_session.sh bundle-build   # tests/gpu's kernels for the device into .bundle/tests-gpu
#   bash scripts/gpu_session.sh sweep-build    # the tuning sweep's kernels into .bundle/sweep
#   bash scripts/gpu_session.sh sched-build    # issue 38's schedule sweep into .bundle/sched
#
# bundle-build makes .venv-device (the device image's Triton, $DEVICE_TRITON, beside CPU torch,
# from the package index, not the GPU image) and runs every file of tests/gpu there on meta
# tensors (FQR_GPU_TEST_DEVICE=meta): each launch is compiled for cuda:90 into the bundle instead
# of running (a build adds what the bundle lacks; its time is appended to build-time.txt in the
# bundle and to the log). Carry .bundle/tests-gpu.tar.xz (git ignores .bundle/) and run
# bundle-tests on the device: all of tests/gpu in 14 pytest-xdist workers, each test admitted
# when the GPU memory it needs is free, kernels loaded from the bundle; last lines: the per-file
# table, the kernels the suite needed, how many were compiled there (0 when the bundle is
# complete), the fqr kernels in Triton's cache.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/fqr_path && ln -sfn "$PWD/cli" /tmp/fqr_path/fqr_cli   # import name of cli/
export PYTHONPATH="$PWD:/tmp/fqr_path"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export FQR_CACHE_DIR=${FQR_CACHE_DIR:-/tmp/fqr-kernels}   # the image has no platformdirs
mkdir -p -m 700 "$FQR_CACHE_DIR"
fqr() { python3 -m fqr "$@"; }
summary=()
step() { local name=$1; shift; "$@" > "$OUT/$name.log" 2>&1; local rc=$?; summary+=("$name rc=$rc"); tail -n "${TAILN:-25}" "$OUT/$name.log"; }

BUNDLE=${FQR_TEST_BUNDLE:-$PWD/.bundle/tests-gpu}
# issue 38's table (and DeepSeek-V3's MLA kv beside V3.2's): the schedule sweep and its counters
# (those furthest from the copy at large T first: a sweep cut short keeps the presets it did)
SCHED_PRESETS=${SCHED_PRESETS:-deepseek-v3.2,minimax-m3-index-cache,deepseek-v3-q-rope,deepseek-v3,qwen3.5-27b,qwen3-8b}

case "${1:-checks}" in
bundle-build)
  DEVICE_TRITON=${DEVICE_TRITON:-3.6.0}
  VENV=${DEVICE_VENV:-.venv-device}
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || exit 2
    scripts/pip_install.sh "$VENV/bin/python" torch==2.13.0 "triton==$DEVICE_TRITON" pytest-xdist || exit 2
    scripts/pip_install.sh "$VENV/bin/python" -e '.[dev]' || exit 2
  fi
  mkdir -p -m 700 "$BUNDLE"   # kept between builds: a build compiles what the bundle lacks
  export FQR_GPU_TEST_DEVICE=meta TRITON_INTERPRET=0 FQR_BUNDLE_BUILD_DIR=$BUNDLE
  export FQR_CACHE_DIR=$(mktemp -d)
  start=$(date +%s)
  TAILN=${TAILN:-40} step bundle_build "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${BUILD_WORKERS:-2}" -rs tests/gpu
  took=$(( $(date +%s) - start ))
  line="bundle build $(date -u +%FT%TZ): ${took} s with ${BUILD_WORKERS:-2} workers on $(nproc) cores ($(grep -o 'fqr kernels: .*' "$OUT/bundle_build.log" | tail -n 1))"
  echo "$line" | tee -a "$OUT/bundle_build.log" >> "$BUNDLE/build-time.txt"
  # cubins of one emitter are alike: xz packs them about 12 to 1 (the carry limit is 64 MiB)
  tar -C "$(dirname "$BUNDLE")" -cJf "$BUNDLE.tar.xz" "$(basename "$BUNDLE")"
  echo "bundle: $(ls "$BUNDLE"/*.cubin 2>/dev/null | wc -l) kernels, $(du -sh "$BUNDLE" | cut -f1) in $BUNDLE, $(du -h "$BUNDLE.tar.xz" | cut -f1) packed"
  ;;
projection-build)
  # issue 40: the projected kernels fqr bench --projection times (fqr.bench.projection's
  # presets x TP 1, 8 x SCHEDULES, or the JSON object in $PROJ_SCHEDULES as `projection` takes
  # it), compiled for the device into the tests-gpu bundle
  mkdir -p -m 700 "$BUNDLE"
  FQR_GPU_TEST_DEVICE=meta TRITON_INTERPRET=0 FQR_BUNDLE_BUILD_DIR=$BUNDLE FQR_CACHE_DIR=$(mktemp -d) \
    TAILN=5 step projection_build "${DEVICE_VENV:-.venv-device}/bin/python" -c 'import os; from fqr.lowering.bundle import BundleWriter; from fqr.bench.projection import build_ahead
import json; named = os.environ.get("PROJ_SCHEDULES")
with BundleWriter(os.environ["FQR_BUNDLE_BUILD_DIR"]) as w: n = build_ahead(schedules=json.loads(named) if named else None)
print(n, "projected kernels launched on meta,", w.written, "compiled into the bundle")'
  tar -C "$(dirname "$BUNDLE")" -cJf "$BUNDLE.tar.xz" "$(basename "$BUNDLE")"
  echo "bundle: $(ls "$BUNDLE"/*.cubin 2>/dev/null | wc -l) kernels, $(du -h "$BUNDLE.tar.xz" | cut -f1) packed"
  ;;
sweep-build)
  # issue 31: every kernel the tuning sweep launches, compiled for the device on this machine
  VENV=${DEVICE_VENV:-.venv-device}
  mkdir -p -m 700 .bundle/sweep
  FQR_CACHE_DIR=$(mktemp -d) TRITON_INTERPRET=0 TAILN=20 step sweep_build "$VENV/bin/python" -m fqr.tools.tuning_sweep build -o .bundle/sweep
  tar -C .bundle -cJf .bundle/sweep.tar.xz sweep
  echo "sweep bundle: $(ls .bundle/sweep/*.cubin | wc -l) kernels, $(du -h .bundle/sweep.tar.xz | cut -f1) packed"
  ;;
sched-build)
  # issue 38: the schedule knobs' sweep (decode schedule at T = 1, 16; register budget,
  # pipelined loop, warps over tokens at 16,384 and 65,536) for the issue's presets, compiled
  # for the device here, with each preset's shipped kernels among them (the baselines)
  VENV=${DEVICE_VENV:-.venv-device}
  mkdir -p -m 700 .bundle/sched
  FQR_CACHE_DIR=$(mktemp -d) TRITON_INTERPRET=0 TAILN=20 step sched_build "$VENV/bin/python" -m fqr.tools.tuning_sweep build -o .bundle/sched --sets sched-decode,sched-wide --preset "$SCHED_PRESETS"
  tar -C .bundle -cJf .bundle/sched.tar.xz sched
  echo "sched bundle: $(ls .bundle/sched/*.cubin | wc -l) kernels, $(du -h .bundle/sched.tar.xz | cut -f1) packed"
  ;;
sched)
  # issue 38 on the device, one visit (each step bounded: at most 8 min 10 s): counters of the shipped kernels (before), the
  # schedule sweep from its bundle (decode, then wide rows joined: tuning.json regenerated and
  # put in the tree), the bench's issue-38 table with the copy floor, counters again (after)
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  [ -d .bundle/sched ] || tar -C .bundle -xJf .bundle/sched.tar.xz
  chmod -R go-w .bundle/sched
  export FQR_KERNEL_BUNDLE=$PWD/.bundle/sched TRITON_CACHE_DIR=$(mktemp -d)
  NCU=(ncu --clock-control none --kernel-name regex:fqr_ --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats)
  TAILN=3 step ncu_before timeout 60 "${NCU[@]}" python3 -m fqr.tools.tuning_sweep run --out "$OUT/profile" --launch-once --no-warmup --preset "$SCHED_PRESETS" --tokens 1,65536
  TAILN=14 step sched_decode timeout -s INT 70 python3 -m fqr.tools.tuning_sweep run --sets sched-decode --preset "$SCHED_PRESETS" --out "$OUT/sched-decode"
  WITH=(); [ -f "$OUT/sched-decode/sweep.json" ] && WITH=(--with-rows "$OUT/sched-decode/sweep.json")
  TAILN=30 step sched_wide timeout -s INT "${SWEEP_SECONDS:-140}" python3 -m fqr.tools.tuning_sweep run --sets sched-wide --preset "$SCHED_PRESETS" "${WITH[@]}" --out "$OUT/sched"
  if [ -f "$OUT/sched/tuning.json" ]; then cp "$OUT/sched/tuning.json" fqr/lowering/tuning.json; cp "$OUT/sched/tuning.json" "$OUT/tuning.json"; fi
  TAILN=40 step bench_sched timeout -s INT "${BENCH_SECONDS:-160}" python3 -m fqr bench --preset qwen3-8b,qwen3.5-27b,minimax-m3-index-cache,deepseek-v3.2,deepseek-v3-q-rope --tokens 1,16,16384,65536 --dtype bf16 --compare none --rep-ms 5 --warmup-ms 2 --check-rows 512 --save "$OUT/bench_sched.json"
  TAILN=3 step ncu_after timeout 60 "${NCU[@]}" python3 -m fqr.tools.tuning_sweep run --out "$OUT/profile" --launch-once --no-warmup --preset "$SCHED_PRESETS" --tokens 1,65536
  TAILN=40 step counters python3 -m fqr.tools.ncu_summary "$OUT/ncu_before.log" "$OUT/ncu_after.log" --json "$OUT/counters.json"
  echo "fqr kernels compiled into Triton's cache here: $(find "$TRITON_CACHE_DIR" -name 'fqr_*.cubin' | wc -l)"
  ;;
sweep)
  # issue 31 on the device: the copy kernel's GPU tests (exact bytes, graph capture), why a
  # same-size copy_ swings (--copy-probe), where T = 1's time goes, then the tuning sweep from
  # its bundle (nothing compiled here)
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  TAILN=6 step copy_tests timeout 60 python3 -m pytest -q -p no:cacheprovider tests/bench/test_bench_floors.py -m gpu
  TAILN=60 step copy_probe timeout 100 python3 -m fqr bench --copy-probe --save "$OUT/copy-probe-h200.json"
  [ -d .bundle/sweep ] || tar -C .bundle -xJf .bundle/sweep.tar.xz
  chmod -R go-w .bundle/sweep
  export FQR_KERNEL_BUNDLE=$PWD/.bundle/sweep TRITON_CACHE_DIR=$(mktemp -d)
  TAILN=20 step decode timeout 100 python3 -m fqr.tools.tuning_sweep run --out "$OUT/sweep" --decode
  TAILN=95 step tuning_sweep timeout -s INT "${SWEEP_SECONDS:-400}" python3 -m fqr.tools.tuning_sweep run --out "$OUT/sweep"
  echo "fqr kernels compiled into Triton's cache here: $(find "$TRITON_CACHE_DIR" -name 'fqr_*.cubin' | wc -l)"
  ;;
profile)
  # issue 31: where the MLA, MiniMax and q-rope kernels lose to the copy at 65,536 tokens, by
  # Nsight Compute's counters (the shipped kernels from the sweep's bundle; Qwen3-8B beside)
  [ -d .bundle/sweep ] || tar -C .bundle -xJf .bundle/sweep.tar.xz
  chmod -R go-w .bundle/sweep
  export FQR_KERNEL_BUNDLE=$PWD/.bundle/sweep
  # (issue 38: every family's shipped kernel at T = 1 and 65,536, the counters summarised)
  P=${PROFILE_PRESETS:-$SCHED_PRESETS,gemma4-31b-sliding,llama4-scout,qwen3-vl-8b,qwen3-8b-kv-insert,minimax-m3-kvcache}
  TAILN=5 step ncu timeout "${PROFILE_SECONDS:-300}" ncu --clock-control none --kernel-name regex:fqr_ --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats python3 -m fqr.tools.tuning_sweep run --out "$OUT/profile" --launch-once --preset "$P" --tokens "${PROFILE_TOKENS:-1,65536}"
  TAILN=40 step counters python3 -m fqr.tools.ncu_summary "$OUT/ncu.log" --json "$OUT/counters.json"
  ;;
table-a|table-b|table-c)
  # issue 31's table, in two calls of one visit. a: a decode sweep (more warps, smaller grid
  # chunks at T = 1 and 16) joins the full sweep's rows into tuning.json, then the bench's first
  # presets; b (after tuning.json from a is in the tree): the host-path audit on CUDA, the
  # text-only mRoPE bits, the hostile GPU tests, the bench's other presets
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  [ -d .bundle/sweep ] || tar -C .bundle -xJf .bundle/sweep.tar.xz
  chmod -R go-w .bundle/sweep
  export FQR_KERNEL_BUNDLE=$PWD/.bundle/sweep TRITON_CACHE_DIR=$(mktemp -d)
  BENCH=(--tokens 1,16,128,1024,16384,65536 --dtype bf16 --compare none --rep-ms 5 --warmup-ms 2 --check-rows 512)
  if [ "$1" = table-c ]; then
    # after the host function's alignment fix: the decode sweep joins the full sweep's rows,
    # then every preset's decode-bucket cells and dispatch rows again, and the host audit
    TAILN=20 step decode_sweep timeout -s INT 120 python3 -m fqr.tools.tuning_sweep run --sets decode --tokens 1,16 --with-rows docs/results/tuning-sweep-h200-issue31.json --out "$OUT/decode-sweep"
    [ -f "$OUT/decode-sweep/tuning.json" ] && cp "$OUT/decode-sweep/tuning.json" fqr/lowering/tuning.json
    TAILN=30 step fast_path_cuda timeout 100 python3 tests/backends/test_fast_path_aten.py --cuda
    TAILN=90 step bench_decode timeout -s INT "${BENCH_SECONDS:-240}" python3 -m fqr bench --preset qwen3-8b,qwen3-0.6b,qwen3-8b-kv-insert,qwen3-vl-8b,qwen3.5-27b,gemma4-31b-sliding,llama4-scout,minimax-m3,minimax-m3-kvcache,minimax-m3-index-cache,deepseek-v3,deepseek-v3.2,deepseek-v3-q-rope,llama3-8b-qk-rope,qwen3-vl-8b-qk-mrope --tokens 1,16,128 --dtype bf16 --compare none --rep-ms 5 --warmup-ms 2 --check-rows 512 --save "$OUT/bench_decode.json"
  elif [ "$1" = table-a ]; then
    TAILN=20 step decode_sweep timeout -s INT 120 python3 -m fqr.tools.tuning_sweep run --sets decode --tokens 1,16 --with-rows docs/results/tuning-sweep-h200-issue31.json --out "$OUT/decode-sweep"
    [ -f "$OUT/decode-sweep/tuning.json" ] && cp "$OUT/decode-sweep/tuning.json" fqr/lowering/tuning.json
    TAILN=70 step bench_a timeout -s INT "${BENCH_SECONDS:-400}" python3 -m fqr bench --preset qwen3-8b,qwen3-0.6b,qwen3-8b-kv-insert,qwen3-vl-8b,qwen3.5-27b,gemma4-31b-sliding,llama4-scout,minimax-m3 "${BENCH[@]}" --save "$OUT/bench_a.json"
  else
    TAILN=40 step fast_path_cuda timeout 100 python3 tests/backends/test_fast_path_aten.py --cuda
    TAILN=8 step text_only_mrope timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -m gpu -k text_only
    TAILN=8 step hostile timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_hostile.py -m gpu
    TAILN=70 step bench_b timeout -s INT "${BENCH_SECONDS:-330}" python3 -m fqr bench --preset minimax-m3-kvcache,minimax-m3-index-cache,deepseek-v3,deepseek-v3.2,deepseek-v3-q-rope,llama3-8b-qk-rope,qwen3-vl-8b-qk-mrope "${BENCH[@]}" --save "$OUT/bench_b.json"
  fi
  echo "fqr kernels compiled into Triton's cache here: $(find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name 'fqr_*.cubin' | wc -l)"
  ;;
extras)
  # issue 32's GPU file, every golden case through fqr verify on triton (the suite's bundle
  # loads what it holds), and the cold start, JIT against a bundle
  if [ ! -d "$BUNDLE" ] && [ -f "$BUNDLE.tar.xz" ]; then tar -C "$(dirname "$BUNDLE")" -xJf "$BUNDLE.tar.xz"; fi
  chmod -R go-w "$BUNDLE" 2>/dev/null
  TAILN=6 step pytest_mla_engines timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_mla_engines.py -m gpu
  TAILN=6 step verify_triton timeout 150 env FQR_KERNEL_BUNDLE="$BUNDLE" python3 -m fqr verify --backend triton
  TAILN=12 step cold_start timeout 200 python3 -m fqr bench --cold-start --preset qwen3-8b,deepseek-v3
  ;;
bundle-tests)
  # issue 37: all of tests/gpu in one call (10 minutes), nothing compiled here. The bundle
  # (.bundle/tests-gpu.tar.xz, from bundle-build on the CPU machine) is unpacked, then every
  # file runs in $WORKERS pytest-xdist workers: inputs drawn and float64 references computed on
  # the GPU, each test admitted when the GPU memory it needs is free (tests/support/
  # gpu_kernels.py). Last lines: the per-file table, the largest memory peaks, the slowest ten
  # tests, the kernels needed / loaded / compiled here (0 when the bundle is complete).
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  if [ ! -d "$BUNDLE" ] && [ -f "$BUNDLE.tar.xz" ]; then
    tar -C "$(dirname "$BUNDLE")" -xJf "$BUNDLE.tar.xz"
  fi
  [ -f "$BUNDLE/bundle.json" ] || { echo "no kernel bundle at $BUNDLE (carry .bundle/tests-gpu.tar.xz)"; exit 2; }
  chmod -R go-w "$BUNDLE"
  echo "bundle: $(ls "$BUNDLE"/*.cubin | wc -l) kernels; build: $(tail -n 1 "$BUNDLE/build-time.txt" 2>/dev/null)"
  export FQR_KERNEL_BUNDLE=$BUNDLE TRITON_CACHE_DIR=$(mktemp -d) FQR_GPU_MEMORY_REPORT=$OUT/gpu-memory.json
  TAILN=${TAILN:-90} step pytest_all timeout -s INT -k 20 "${TEST_SECONDS:-540}" python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-14}" --durations=10 --junitxml="$OUT/pytest_all.xml" tests/gpu -m gpu
  echo "fqr kernels compiled into Triton's cache here: $(find "$TRITON_CACHE_DIR" -name 'fqr_*.cubin' | wc -l)"
  ;;
projection)
  # issue 40: fqr bench --projection, bf16: cuBLAS GEMM alone, GEMM + fqr's op, the projected
  # kernel (the GEMM with the prologue as its epilogue) per schedule, the weights' copy; every
  # fused cell checked against float64 before it is timed. JSON in $OUT/projection.json.
  # PROJ_WRITE_DISPATCH=1: the projection dispatch table from this run in $OUT/proj_dispatch.json
  SCHED=${PROJ_SCHEDULES:-}   # default: fqr.bench.projection.SCHEDULES (built ahead by projection-build)
  export FQR_KERNEL_BUNDLE=$BUNDLE
  [ -d "$BUNDLE" ] || { [ -f "$BUNDLE.tar.xz" ] && tar -C "$(dirname "$BUNDLE")" -xJf "$BUNDLE.tar.xz"; }
  timeout "${PROJ_SECONDS:-480}" python3 -m fqr bench --projection --tp 1,8 --tokens "${PROJ_TOKENS:-1,2,16,1024,16384}" ${SCHED:+--schedules "$SCHED"} ${PROJ_WRITE_DISPATCH:+--write-dispatch "$OUT/proj_dispatch.json"} --rep-ms 20 --json > "$OUT/projection.json" 2> "$OUT/projection.log"
  summary+=("projection rc=$?")
  tail -n 5 "$OUT/projection.log"
  python3 scripts/projection_table.py "$OUT/projection.json" | tee "$OUT/projection-table.txt"
  ;;
projection-profile)
  # issue 40: Nsight Compute counters of the projected kernel beside cuBLAS + fqr's op
  # (scripts/projection_profile.py; PROF_PRESETS, PROF_TP, PROF_TOKENS, PROF_OPTIONS)
  export FQR_KERNEL_BUNDLE=$BUNDLE
  OPTS=${PROF_OPTIONS:-"{}"}
  for P in ${PROF_PRESETS:-qwen3-8b}; do
    TAILN=${TAILN:-8} step "ncu_proj_$P" timeout "${PROFILE_SECONDS:-120}" ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats python3 scripts/projection_profile.py --preset "$P" --tp "${PROF_TP:-1,8}" --tokens "${PROF_TOKENS:-1}" --options "$OPTS"
  done
  ;;
decode-probe)
  # issue 38: where a decode call's time goes (scripts/decode_floor_probe.py: empty, copy, table
  # gather, norm, norm+rope by hand, fqr; one warp a head; device us of graph replays)
  TAILN=14 step decode_probe timeout 200 python3 scripts/decode_floor_probe.py --tokens 1,16 --json "$OUT/decode-probe.json"
  ;;
cold-start)
  # issue 37: the first call from a bundle in parts (import, CUDA context, lowering, bundle open
  # and checks, module load, launch); fqr's part (after the CUDA context exists) <= 50 ms
  TAILN=14 step cold_start timeout 400 python3 -m fqr bench --cold-start --preset "${COLD_PRESETS:-qwen3-8b,deepseek-v3}"
  ;;
cold-profile)
  # issue 37: where the first call from a bundle goes (cProfile), with the bytecode cache as
  # the cold start's measured processes have it: one untimed run writes it (and Triton's
  # runtime pieces), the profiled run reads it. Carry .bundle/cold (fqr build --preset
  # qwen3-8b,deepseek-v3 with the device's Triton).
  python3 -c 'import os, sys; print("dont_write_bytecode", sys.flags.dont_write_bytecode, "PYTHONDONTWRITEBYTECODE", os.environ.get("PYTHONDONTWRITEBYTECODE"))'
  [ -f "$PWD/.bundle/cold/bundle.json" ] || { echo "no kernel bundle at .bundle/cold"; exit 2; }
  chmod -R go-w "$PWD/.bundle/cold"
  export FQR_KERNEL_BUNDLE=$PWD/.bundle/cold TRITON_CACHE_DIR=$(mktemp -d) PYTHONPYCACHEPREFIX=$(mktemp -d)
  FQR_CACHE_DIR=$(mktemp -d) env -u PYTHONDONTWRITEBYTECODE python3 scripts/profile_first_call.py "${COLD_PRESET:-qwen3-8b}" 1 5 > "$OUT/cold_profile_warmup.log" 2>&1
  echo "bytecode files written by the warm-up: $(find "$PYTHONPYCACHEPREFIX" -name '*.pyc' | wc -l)"
  FQR_CACHE_DIR=$(mktemp -d) TAILN=${TAILN:-60} step cold_profile python3 scripts/profile_first_call.py "${COLD_PRESET:-qwen3-8b}" 1 45
  ;;
checks)
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  step verify_triton fqr verify --backend triton
  step pytest_gpu python3 -m pytest -q -p no:cacheprovider tests/gpu tests/bench -m gpu
  step run_cuda fqr run --device cuda --dp 1 --tp 1 --backend triton --requests 32 --decode-steps 8
  step run_cuda_olmo2 fqr run --preset olmo2-7b --device cuda --dp 1 --tp 1 --backend triton
  step torchrun_cuda python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m fqr run --launcher torchrun --device cuda --backend triton
  step fuse_cuda fqr fuse --preset qwen3-8b --device cuda --tokens 256
  step bench_fp32 fqr bench --preset qwen3-8b --dtype fp32 --tokens 16384,65536 --compare eager,compile --save "$OUT/bench_fp32.json"
  ;;
bench)
  step pytest_fusion_gpu python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fusion_gpu.py -m gpu
  step fuse_cuda fqr fuse --preset qwen3-8b --device cuda --tokens 256
  TAILN=60 step bench fqr bench --dtype bf16,fp16 --compare eager,compile --save "$OUT/bench.json" --plot "$OUT/bench.png"
  ;;
dispatch)
  step pytest_gpu python3 -m pytest -q -p no:cacheprovider tests/gpu -m gpu
  TAILN=20 step bench_dispatch fqr bench --preset qwen3-8b --tokens 1,16,128,1024,4096,65536 --dtype bf16 --compare none --save "$OUT/bench_dispatch.json"
  step fuse_cuda fqr fuse --preset qwen3-8b --device cuda --tokens 256
  ;;
minimax)
  # MiniMax-M3's indexer heads and KV-cache insert (bf16 / FP8): device, wall and peers, one run
  TAILN=30 step bench_minimax fqr bench --preset minimax-m3-kvcache,minimax-m3,minimax-m3-kvcache-fp8,minimax-m3-fp8 --tokens 16384,65536 --dtype bf16 --compare eager,compile --rep-ms 20 --warmup-ms 5 --save "$OUT/bench_minimax.json"
  ;;
declared)
  # every declared op on the GPU: the goldens (MLA included) on triton, the MLA presets' and
  # OLMo2's GPU tests, the MLA bench rows (device, wall, dispatch; the eager peer) and every
  # variant's dispatch rows; each step bounded so that one visit holds them all
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  step verify_triton timeout 110 python3 -m fqr verify --backend triton
  TAILN=12 step pytest_gpu timeout 170 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/gpu/test_gpu.py tests/gpu/test_ascend_on_cuda_gpu.py -m gpu -k "deepseek or kimi or olmo2 or mla"
  TAILN=12 step pytest_gpu_hostile timeout 100 python3 -m pytest -q -p no:cacheprovider -rw tests/gpu/test_gpu_hostile.py tests/gpu/test_fusion_gpu.py -m gpu
  TAILN=45 step bench_mla timeout 150 python3 -m fqr bench --preset deepseek-v3,deepseek-v3-fp8,deepseek-v3.2,kimi-k2,deepseek-v3-q-rope --tokens 1,16,1024,16384 --dtype bf16 --compare eager --rep-ms 20 --warmup-ms 5 --save "$OUT/bench_mla.json"
  TAILN=45 step bench_variants timeout 70 python3 -m fqr bench --preset qwen3-8b,qwen3-vl-8b,qwen3.5-27b,gemma4-31b-sliding,llama4-scout,llama4-scout-nope,minimax-m3,minimax-m3-kvcache --tokens 1024 --dtype bf16 --compare none --rep-ms 20 --warmup-ms 5 --save "$OUT/bench_variants.json"
  ;;
recheck)
  # after the fast-path and alias fixes: dispatch rows, the hostile GPU tests, the ds_mla sweep
  TAILN=12 step pytest_gpu_hostile timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_hostile.py -m gpu
  TAILN=30 step bench_dispatch timeout 100 python3 -m fqr bench --preset qwen3-8b,minimax-m3-kvcache,deepseek-v3.2,kimi-k2,deepseek-v3-q-rope --tokens 1 --dtype bf16 --compare none --rep-ms 10 --warmup-ms 3 --save "$OUT/bench_dispatch.json"
  TAILN=8 step pytest_ds_mla timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -m gpu -k "deepseek-v3.2"
  ;;
floors)
  # issue 24: the same-size copy / GEMM floors in the bench with PDL after the GEMM (--pdl),
  # unfused bits against vLLM's and transformers' code on CUDA, PDL's bits after the GEMM
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  TAILN=12 step pytest_unfused_pdl timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_unfused_gpu.py tests/gpu/test_pdl_gpu.py -m gpu
  TAILN=40 step fast_path_cuda timeout 90 python3 tests/backends/test_fast_path_aten.py --cuda
  TAILN=80 step bench_floors timeout 330 python3 -m fqr bench --preset qwen3-8b,qwen3.5-27b,qwen3-vl-8b,minimax-m3-kvcache,minimax-m3-index-cache,deepseek-v3,deepseek-v3-q-rope --tokens 1,16,128,1024,16384,65536 --dtype bf16 --compare none --pdl --rep-ms 10 --warmup-ms 3 --save "$OUT/bench_floors.json"
  ;;
probe)
  # the declared ops' host dispatch on CUDA (profile of every op's repeat call, and the bench's
  # dispatch rows of one preset per variant at T = 1), unfused bits, PDL after the GEMM (its
  # bits in tests/gpu/test_pdl_gpu.py, its cost in the bench's floors with --pdl)
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  TAILN=40 step fast_path_cuda timeout 100 python3 tests/backends/test_fast_path_aten.py --cuda
  TAILN=45 step bench_dispatch timeout 230 python3 -m fqr bench --preset qwen3-8b,qwen3-8b-kv-insert,qwen3-vl-8b,qwen3.5-27b,gemma4-31b-full,llama4-scout,llama4-scout-nope,minimax-m3,minimax-m3-kvcache,minimax-m3-index-cache,deepseek-v3,deepseek-v3-q-rope --tokens 1 --dtype bf16 --compare none --rep-ms 10 --warmup-ms 3 --save "$OUT/bench_dispatch.json"
  TAILN=12 step pytest_unfused_pdl timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_unfused_gpu.py tests/gpu/test_pdl_gpu.py -m gpu
  TAILN=40 step bench_pdl timeout 150 python3 -m fqr bench --preset qwen3-8b,deepseek-v3-q-rope --tokens 1,16,128,1024,4096,16384,65536 --dtype bf16 --compare none --pdl --rep-ms 10 --warmup-ms 3 --save "$OUT/bench_pdl.json"
  ;;
variants)
  # issue 22: the goldens on triton, then device, wall and dispatch rows of one preset of every
  # variant (deepseek-v3.2 besides) next to the model's eager chain, one run
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  TAILN=6 step verify_triton timeout 130 python3 -m fqr verify --backend triton
  TAILN=70 step bench_variants timeout 420 python3 -m fqr bench --preset qwen3-8b,qwen3-8b-kv-insert,qwen3-vl-8b,qwen3.5-27b,gemma4-31b-sliding,llama4-scout,llama4-scout-nope,minimax-m3,minimax-m3-kvcache,minimax-m3-index-cache,deepseek-v3,deepseek-v3.2,deepseek-v3-q-rope,llama3-8b-qk-rope,qwen3-vl-8b-qk-mrope --tokens 1,1024,16384 --dtype bf16 --compare eager --rep-ms 10 --warmup-ms 3 --save "$OUT/bench_variants.json"
  ;;
gputests)
  # the GPU test files: the ported peer grids, then every other file of tests/gpu. Each peer
  # case compiles its own kernel (~4 s serially: 1,108 cases ~75 min), so the grids run in 12
  # pytest-xdist workers (the image has pytest-xdist) sharing the GPU and the caches
  TAILN=10 step pytest_peers timeout -s INT 380 python3 -m pytest -q -p no:cacheprovider -n 12 --durations=5 tests/gpu/test_gpu_peers_base.py tests/gpu/test_gpu_peers_mrope.py tests/gpu/test_gpu_peers_cache.py tests/gpu/test_gpu_peers_minimax.py -m gpu
  TAILN=10 step pytest_gpu timeout -s INT 190 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/gpu --ignore-glob='tests/gpu/test_gpu_peers_*.py' -m gpu
  ;;
second-ops)
  # after the dispatch-table fix: kv-insert's rows, the qk-rope / qk-mrope presets' bench rows
  # and their GPU tests against float64
  TAILN=40 step bench_second_ops timeout 120 python3 -m fqr bench --preset qwen3-8b-kv-insert,glm4-9b-qk-rope,qwen3.5-27b-qk-mrope --tokens 1,1024,16384 --dtype bf16 --compare eager --rep-ms 10 --warmup-ms 3 --save "$OUT/bench_second_ops.json"
  TAILN=12 step pytest_second_ops timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/gpu/test_gpu.py tests/gpu/test_gpu_hostile.py -m gpu -k "qk-rope or qk-mrope or kv-insert"
  ;;
peers)
  # issue 26: the ported peer grids in full on triton, the goldens (qk_rope / qk_mrope included)
  # and the hostile GPU tests after the strided-positions and short-slot changes
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  step verify_triton timeout 120 python3 -m fqr verify --backend triton
  TAILN=15 step pytest_peers timeout -s INT 420 python3 -m pytest -q -p no:cacheprovider -n 12 --durations=5 tests/gpu/test_gpu_peers_base.py tests/gpu/test_gpu_peers_mrope.py tests/gpu/test_gpu_peers_cache.py tests/gpu/test_gpu_peers_minimax.py -m gpu
  TAILN=12 step pytest_gpu_hostile timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_hostile.py -m gpu
  ;;
esac
printf '%s\n' "${summary[@]}"
