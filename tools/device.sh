#!/usr/bin/env bash
# Runs on the H200 machine (the device tool): unpack the TileLang bundle, then each step named on
# the command line, logging everything under $OUT (STEP_TIMEOUT, default 400 s, bounds the bench,
# prewarm, sweep and sanitize steps so one stuck step cannot eat the whole call). Steps:
#   warmup      build the GPU tests' TileLang kernels missing from the carried cache here, in the
#               background (WARMUP_SHARDS processes, default 12; tools/warmup_tests.py) while the later
#               steps that time nothing run (tests, fa2build, peers); a timing step waits for them
#               first; the cache is packed as $OUT/tl-cache.tar.xz
#   tests       every gpu-marked test (TESTS_K: a pytest -k filter; FLASHDECODE_FA_GRID: the FA grid's size,
#               tests/test_fa_kvcache.py; FLASHDECODE_TEST_SHARD=I/N: the I-th of N shards, for a tier
#               longer than one call, e.g. TESTS_WORKERS=14 and 0/4 ... 3/4 for the default tier,
#               ~1,700 s on an H100 (tests/test_fa_kvcache.py's docstring))
#   beforeafter ARGS  flashdecode bench ARGS on .before/ (an earlier tree's flashdecode/) then on this tree
#   fa2build    build FlashAttention 2's kernels for the fa2 peer from the carried .fa2-src.tar.xz into
#               .fa2-build/ (tools/build_fa2.py, ~4 min on 16 cores) and pack it as
#               $OUT/fa2-build.tar.xz; copy that to .fa2-build.tar.xz here and carry it afterwards
#   peers       make the peers importable for the steps after it: FlashInfer from the carried
#               .fi-bundle/flashinfer-bundle.tar.xz (its JIT modules built now, in parallel, for
#               head dims PEERS_HEADDIMS, default 128; 64,128,256 for --matrix wide), FlashAttention 2
#               from .fa2-build/ (or the carried .fa2-build.tar.xz) through FLASHDECODE_FA2_PATH
#   bench ARGS  flashdecode bench with the given arguments (quote them as one word); its --json is
#               written after each case too, so a step cut by STEP_TIMEOUT keeps what it measured (the
#               six serving variants with FlashInfer over the 14 cases outlast 530 s: 2026-12-07;
#               --cases 1-7 then 8-14 on one machine took 390 s and 148 s on an H100, the same day;
#               merge the JSONs with python -m flashdecode.bench.report A.json B.json --json RUN.json)
#   prewarm ARGS  tools/prewarm.py with the given arguments (PREWARM_JOBS processes, default 12): the
#               host path's extension and the Triton kernels of a bench selection (ARGS: its --cases,
#               --variant, --backends) built before a bench step times anything; put it after peers
#               and before bench
#   sweep ARGS  tools/sweep.py with the given arguments
#   combos ARGS tools/fa_combos.py with the given arguments (a grid combo by id, --repeat, --value-checks),
#               then the same once under compute-sanitizer memcheck (COMBOS_MEMCHECK=0: not;
#               MEMCHECK_TIMEOUT, default 150 s)
#   sanitize    compute-sanitizer memcheck, racecheck, synccheck on a few cases (SANITIZE_BACKEND, default tilelang)
#   models ARGS flashdecode models-bench with the given arguments, transformers' flash_attention_2 from
#               .fa2-build/ (or the carried .fa2-build.tar.xz); rows in $OUT/model-decode.json
#   profile N[:VARIANT]  flashdecode profile --case N [--variant VARIANT] for PROFILE_BACKENDS (default
#               both) into $OUT/profiles.tar.gz
#
# Carried inputs, each made once on the CPU machine in the repository root (all git-excluded); a
# call has only those it names in its carry (a path carried by an earlier call to the same warm
# machine is gone when the next call does not name it: 2026-12-05):
#   bash ../shared/gpu-bundle/make-bundle.sh .gpu-bundle        # .gpu-bundle/tilelang-cp312.tar.xz, 33 MiB
#   bash ../shared/flashinfer-bundle/make-bundle.sh .fi-bundle  # .fi-bundle/flashinfer-bundle.tar.xz, 8 MiB
#   python tools/build_fa2.py prepare /tmp/fa/flash_attn-2.8.3.tar.gz  # .fa2-src.tar.xz, 0.4 MiB
# e.g. carry [".gpu-bundle", ".fi-bundle", ".fa2-src.tar.xz"] and run
#   bash tools/device.sh fa2build peers bench "--variant plain,paged16,paged256,q4,append --json $OUT/run.json"
set -uo pipefail
if [ $# -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then  # the comment above is the usage
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
export PYTHONUNBUFFERED=1
mkdir -p /tmp/tl && tar -xJf .gpu-bundle/tilelang-cp312.tar.xz -C /tmp/tl
export PYTHONPATH=$PWD:/tmp/tl/tilelang_site${PYTHONPATH:+:$PYTHONPATH} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
OUT=${OUT:-/tmp/out}
# Each Triton compile writes its stages' MLIR reproducers here, the last compile's stay (files from a
# call whose tests passed are no failure: 2026-12-07); one that fails in a pass (PassManager::run
# failed) leaves its own
export TRITON_REPRODUCER_PATH=${TRITON_REPRODUCER_PATH:-$OUT/triton-repro.mlir}
# Kernels prebuilt on the CPU machine (flashdecode warmup --cache-dir .tl-cache for the bench's,
# python tools/warmup_tests.py for the GPU tests'), carried as
# .tl-cache.tar.xz (XZ_OPT=-9e tar -cJf .tl-cache.tar.xz .tl-cache: the GPU tests' 272 kernels, 133 MB,
# pack to 5.7 MB; at xz's default level to 10.4 MB, which with .gpu-bundle's 48 MiB and the 7 MB
# tree goes over the 64 MiB carry limit: 2026-12-07),
# and any further .tl-cache-*.tar.xz of the same layout (e.g. one sample's kernels), unpacked into it.
for cache in .tl-cache.tar.xz .tl-cache-*.tar.xz; do [ -f "$cache" ] && tar -xJf "$cache"; done
[ -d .tl-cache ] && export TILELANG_CACHE_DIR=$PWD/.tl-cache
summary=()
warmups=()
# The background warm-up's shards (the warmup step), waited for once: its compiles would load the
# host while a step times, and its cache is packed when they are done.
wait_for_warmups() {
  [ ${#warmups[@]} -gt 0 ] || return 0
  local failed=0
  for pid in "${warmups[@]}"; do wait "$pid" || failed=$((failed + 1)); done
  tail -qn 1 /tmp/warmup_*.log > "$OUT/warmup.log"
  XZ_OPT=-T0 tar -cJf "$OUT/tl-cache.tar.xz" .tl-cache
  summary+=("warmup: ${#warmups[@]} shards, $failed failed; $(cat /tmp/warmup_*.log | grep -c '^built') built")
  warmups=()
}
while [ $# -gt 0 ]; do
  step=$1; shift
  case $step in
    warmup)
      shards=${WARMUP_SHARDS:-12}
      for ((i = 0; i < shards; i++)); do
        python3 tools/warmup_tests.py --cache-dir .tl-cache --shard "$i/$shards" > "/tmp/warmup_$i.log" 2>&1 &
        warmups+=($!)
      done;;
    tests)
      # Every gpu-marked test; FlashAttention's grid on FLASHDECODE_FA_GRID combos (default 240).
      # TESTS_FILES: the files in the order to run them (default: all of tests/; with workers, the
      # order is xdist's). TESTS_WORKERS=N:
      # N pytest-xdist processes (compiles run in parallel), installed from the carried .xdist/
      # wheels (pip download --no-deps pytest-xdist execnet -d .xdist), with
      # kernels==0.16.0, kernels-data and tomlkit for transformers 5.17's paged path (generate_batch).
      workers=()
      if [ -n "${TESTS_WORKERS:-}" ]; then
        if python3 -m pip install -q --no-deps --no-index .xdist/*.whl > "$OUT/xdist_install.log" 2>&1; then
          workers=(-n "$TESTS_WORKERS")
        else
          echo "TESTS_WORKERS: pytest-xdist did not install (see xdist_install.log): tests run one at a time"
        fi
      fi
      FLASHDECODE_FA_GRID_REPORT="$OUT/fa_grid.json" timeout -k 10 "${TESTS_TIMEOUT:-900}" python3 -m pytest \
        ${TESTS_FILES:-tests} -m gpu -v -p no:cacheprovider -rs --maxfail=50 "${workers[@]}" ${TESTS_K:+-k "$TESTS_K"} \
        > "$OUT/gpu_tests.log" 2>&1
      rc=$?
      grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | cut -c1-200 | head -30
      # per file and verdict, also when the time limit cut the run ("tests/f.py::t PASSED", or with
      # xdist "[gw0] [ 1%] PASSED tests/f.py::t")
      sed -nE "s/^(tests\/[a-z0-9_]+\.py)::.* (PASSED|FAILED|SKIPPED|ERROR).*/\1 \2/p; s/^\[gw[0-9]+\].* (PASSED|FAILED|SKIPPED|ERROR) (tests\/[a-z0-9_]+\.py)::.*/\2 \1/p" \
        "$OUT/gpu_tests.log" | sort | uniq -c
      if ls "$OUT"/fa_grid.json.gw* > /dev/null 2>&1; then  # one report per worker: merged
        python3 -c "import glob, json, sys; sys.path.insert(0, 'tests'); import fa_grid
paths = [p for p in sorted(glob.glob('$OUT/fa_grid.json.gw*')) if not p.endswith('.partial')]
json.dump(fa_grid.merge_reports([json.load(open(p)) for p in paths]), open('$OUT/fa_grid.json', 'w'), indent=1)" \
          && rm -f "$OUT"/fa_grid.json.gw*
      fi
      tail -2 "$OUT/gpu_tests.log"
      summary+=("tests rc=$rc");;
    beforeafter)
      wait_for_warmups
      # The same bench ARGS on the tree in .before/ (a `git archive` of the earlier commit's
      # flashdecode/) and on this tree, one after the other in one call.
      args=$1; shift
      mkdir -p .before/results  # the earlier bench records there by default
      for tree in before after; do
        root=$PWD; [ $tree = before ] && root=$PWD/.before
        (cd "$root" && PYTHONPATH=$root:/tmp/tl/tilelang_site timeout -k 30 -s ABRT "${STEP_TIMEOUT:-400}" \
          python3 -X faulthandler -m flashdecode bench $args --json "$OUT/bench-$tree.json" \
          2>"/tmp/bench-$tree-progress.log" > "$OUT/bench-$tree.log")
        summary+=("bench $tree rc=$?")
        tail -22 "$OUT/bench-$tree.log"
      done;;
    fa2build)
      python3 tools/build_fa2.py build --jobs "$(nproc)" > "$OUT/fa2_build.log" 2>&1
      rc=$?
      tail -3 "$OUT/fa2_build.log"
      [ $rc -eq 0 ] && tar -cJf "$OUT/fa2-build.tar.xz" .fa2-build
      summary+=("fa2build rc=$rc");;
    peers)
      mkdir -p /tmp/fi && tar -xJf .fi-bundle/flashinfer-bundle.tar.xz -C /tmp/fi
      export PYTHONPATH=/tmp/fi/fi_site:$PYTHONPATH LD_LIBRARY_PATH=$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
             FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=$(nproc) FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws \
             FLASHINFER_DISABLE_VERSION_CHECK=1
      [ -f .fa2-build.tar.xz ] && [ ! -d .fa2-build ] && tar -xJf .fa2-build.tar.xz
      [ -d .fa2-build ] && export FLASHDECODE_FA2_PATH=$PWD/.fa2-build
      warm=()
      for d in ${PEERS_HEADDIMS:-128}; do
        for peer in flashinfer-tc flashinfer-cc flashinfer-single; do
          python3 -c "from flashdecode.bench.peers import warm_up; warm_up('$peer', $d)" > "/tmp/warm_${peer}_$d.log" 2>&1 &
          warm+=($!)
        done
      done
      failed=0
      for pid in "${warm[@]}"; do wait "$pid" || failed=$((failed + 1)); done
      tail -n 3 /tmp/warm_*.log > "$OUT/peers_warm.log"
      summary+=("peers: ${#warm[@]} FlashInfer warm-ups, $failed failed; fa2 from ${FLASHDECODE_FA2_PATH:-an installed flash_attn, if any}");;
    bench)
      wait_for_warmups
      args=$1; shift
      # stderr carries the progress bar: kept, so a slow or stuck run shows where it was; on the
      # time limit SIGABRT makes faulthandler print every thread's Python stack there, and
      # nvidia-smi samples (every 10 s) show whether the GPU was busy meanwhile.
      nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 10 >> "$OUT/bench_smi.csv" &
      smi=$!
      trap 'kill $smi 2>/dev/null' EXIT
      timeout -k 30 -s ABRT "${STEP_TIMEOUT:-400}" python3 -X faulthandler -m flashdecode bench $args \
        2>"$OUT/bench_progress.log" | tee -a "$OUT/bench.log"
      summary+=("bench rc=${PIPESTATUS[0]}")
      kill $smi 2>/dev/null; trap - EXIT;;
    prewarm)
      wait_for_warmups
      args=$1; shift
      timeout -k 10 "${STEP_TIMEOUT:-400}" python3 tools/prewarm.py $args --jobs "${PREWARM_JOBS:-12}" \
        > "$OUT/prewarm.log" 2>&1
      rc=$?
      tail -1 "$OUT/prewarm.log"
      summary+=("prewarm rc=$rc");;
    sweep)
      wait_for_warmups
      args=$1; shift
      # As for the bench: on the time limit, every Python thread's stack (a sweep hung once).
      timeout -k 30 -s ABRT "${STEP_TIMEOUT:-400}" python3 -X faulthandler tools/sweep.py $args 2>&1 | tee -a "$OUT/sweep.log" | tail -20
      summary+=("sweep rc=${PIPESTATUS[0]}");;
    models)
      wait_for_warmups
      args=$1; shift
      [ -f .fa2-build.tar.xz ] && [ ! -d .fa2-build ] && tar -xJf .fa2-build.tar.xz
      [ -d .fa2-build ] && export FLASHDECODE_FA2_PATH=$PWD/.fa2-build
      # einops for FlashAttention's bert_padding (pip download einops --no-deps -d .xdist)
      python3 -m pip install -q --no-deps --no-index .xdist/einops-*.whl > "$OUT/einops_install.log" 2>&1
      timeout -k 30 -s ABRT "${STEP_TIMEOUT:-400}" python3 -X faulthandler -m flashdecode models-bench \
        --out "$OUT/model-decode.json" $args > "$OUT/models.log" 2>&1
      summary+=("models rc=$?")
      grep -v "^|" "$OUT/models.log" | grep -iE "error|skipped|memory" | head -5
      grep "^|" "$OUT/models.log" | cut -c1-150;;
    combos)
      wait_for_warmups
      args=$1; shift
      timeout -k 10 "${STEP_TIMEOUT:-400}" python3 tools/fa_combos.py $args > "$OUT/combos.log" 2>&1
      summary+=("combos rc=$?")
      # each FAIL line once, with its count (its time stripped)
      grep -E "FAIL|combos x" "$OUT/combos.log" | sed -E 's/ [0-9.]+s$//' | sort | uniq -c | head -10
      if [ "${COMBOS_MEMCHECK:-1}" = 1 ]; then  # once, without --repeat (MEMCHECK_TIMEOUT, default 150 s)
        timeout -k 10 "${MEMCHECK_TIMEOUT:-150}" compute-sanitizer --tool memcheck python3 tools/fa_combos.py \
          $(echo "$args" | sed -E 's/--repeat[= ][0-9]+//') > "$OUT/combos_memcheck.log" 2>&1
        summary+=("combos memcheck rc=$?")
        grep -E "ERROR SUMMARY|FAIL" "$OUT/combos_memcheck.log" | head -5
      fi;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        timeout "${STEP_TIMEOUT:-400}" compute-sanitizer --tool $tool python3 tools/sanitize_target.py \
          --backend "${SANITIZE_BACKEND:-tilelang}" 2>&1 | tee "$OUT/sanitize_$tool.log" | tail -6
        summary+=("sanitize $tool rc=${PIPESTATUS[0]}")
      done;;
    profile)
      wait_for_warmups
      n=$1; shift  # N, or N:VARIANT (e.g. 7:paged64)
      number=${n%%:*}; variant=plain; [ "$n" != "$number" ] && variant=${n#*:}
      for backend in ${PROFILE_BACKENDS:-tilelang triton}; do
        timeout 200 python3 -m flashdecode profile --case "$number" --variant "$variant" --backend $backend \
          --out "/tmp/prof/case$number-$variant-$backend" 2>&1 | tail -15
        summary+=("profile $n $backend rc=${PIPESTATUS[0]}")
      done
      tar -czf "$OUT/profiles.tar.gz" -C /tmp/prof .;;
    *) echo "unknown step $step"; exit 2;;
  esac
done
wait_for_warmups
printf '%s\n' "${summary[@]}"
