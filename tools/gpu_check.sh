#!/usr/bin/env bash
# The GPU checks of precis, in stages that each fit one command of the lent GPU
# machine (at most 10 minutes; the machine starts bare: nvcc, gcc, torch, pytest,
# no Bazel, no network). Each stage builds what is missing, installs the wheels it
# needs from .whl/ (tools/gpu_prepare.sh downloads them where there is a network),
# writes its logs and one summary line to $OUT (else build/gpu/out), stops its steps
# at a deadline ($BUDGET_S seconds after the start, default 510: 8.5 minutes) and
# exits non-zero when anything in it failed or did not run.
#
#   tools/gpu_check.sh build        libprecis.so, libprecis_torch.so (gcc) and
#                                   libprecis_cuda.so (nvcc) into build/gpu
#   tools/gpu_check.sh cuda-tests   tools/fp8_cuda_check.cu, then the CUDA tests only:
#                                   pytest -m cuda tests/py (the marker of conftest.py;
#                                   tests/py/ops/test_cuda_selection.py checks what it
#                                   selects), a timeout per test, JUnit XML
#   tools/gpu_check.sh sanitize [memcheck] [initcheck] [racecheck]
#                                   compute-sanitizer's tools (all three by default)
#                                   over the CUDA tests of the kernels
#   tools/gpu_check.sh evidence [adam] [fidelity] [train] [release]
#                                   bench/adam_cuda.py (100M and 1B params; also in ~300
#                                   tensors), bench/moment_fidelity.py --device cuda
#                                   --check, and the longest bench/train_llm.py --size
#                                   125m that fits the time left (its table, JSON, PNG);
#                                   release (named only): train_llm's gradient-release
#                                   rows at 125m, 60 steps; graph (named only): the
#                                   CUDA graph tests (tests/py/optimizers/test_cuda_graph.py)
#                                   and bench/step_graph.py at 125m
#
# Through the device tool (a command run in the repository root of a copy of the
# working tree; ignored paths travel only when named in `carry`), after
# tools/gpu_prepare.sh here, one call per stage:
#
#   command: tools/gpu_check.sh cuda-tests    carry: [".whl"]
#   command: tools/gpu_check.sh sanitize      carry: [".whl"]
#   command: tools/gpu_check.sh evidence      carry: [".whl"]
#   command: CUDA_LIBRARY=libprecis_cuda12.so tools/gpu_check.sh cuda-tests
#                                             carry: [".whl", "build/gpu"]
#
# The build takes about 75 s of device time there (H200 host, 2026-11-27); the three
# libraries Bazel builds here (bazel-bin/libprecis.so, libprecis_torch.so,
# libprecis_cuda.so) copied into build/gpu and carried (carry: [".whl", "build/gpu"])
# are used as they are: every stage builds only what is missing.
#
# Python is $PYTHON, else /opt/torch/.venv/bin/python3 where it exists (the GPU
# image: torch 2.11, Python 3.12), else python3. Knobs: BUDGET_S (the deadline, s),
# TEST_TIMEOUT_S (per test, 180; 3x under the sanitizers), TRAIN_REGIMES (train_llm's
# --regimes, default pretrain). `evidence train` alone gives the training the whole
# budget.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build=$root/build/gpu
out=${OUT:-$build/out}
mkdir -p "$build" "$out"
deadline=$((SECONDS + ${BUDGET_S:-510}))
# The glue (libprecis_torch.so) finds libprecis.so (DT_NEEDED, rpath $ORIGIN) and
# libprecis_cuda.so beside itself; the variables say the same to the package.
export PRECIS_LIBRARY=$build/libprecis.so PRECIS_TORCH_LIBRARY=$build/libprecis_torch.so
# CUDA_LIBRARY=libprecis_cuda12.so: every stage runs libprecis_cuda12.so instead (the
# kernels for every driver from R530 on, built by tools/build_cuda12.py from PyPI's NVRTC,
# which the GPU machine cannot fetch: copy bazel-bin/libprecis_cuda12.so into build/gpu
# and carry it).
cuda_library=${CUDA_LIBRARY:-libprecis_cuda.so}
export PRECIS_CUDA_LIBRARY=$build/$cuda_library
export PYTHONPATH=$root/torch_ext:$build/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [[ -n ${PYTHON:-} ]]; then
  py=$PYTHON
elif [[ -x /opt/torch/.venv/bin/python3 ]]; then
  py=/opt/torch/.venv/bin/python3
else
  py=python3
fi
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)

# ---- status: every step's outcome is recorded; any failure fails the stage ----------
status=0
results=()

# record NAME RC: note a step's outcome.
record() {
  if [[ $2 -eq 0 ]]; then
    results+=("$1 ok")
  else
    results+=("$1 FAILED (exit $2)")
    status=1
  fi
}

# left: seconds to the deadline.
left() { echo $((deadline - SECONDS)); }

# step NAME LOG SECONDS CMD...: run CMD with its output in $out/LOG (and its last lines
# on the terminal), stopped by SIGINT after SECONDS (pytest then still writes its
# report) and killed 15 s later (a command, not a function of this script); record
# the outcome. A step with under 20 s left is not started and counts as failed.
step() {
  local name=$1 log=$out/$2 limit=$3 rc start=$SECONDS
  shift 3
  if ((limit < 20)); then
    echo "== $name: not run, the stage's time is spent" | tee "$log"
    record "$name (not run: out of time)" 1
    return 1
  fi
  echo "== $name ($limit s at most): $*"
  if declare -F "$1" >/dev/null; then
    "$@" >"$log" 2>&1  # a function of this script (the build): no time limit
  else
    timeout -s INT -k 15 "$limit" "$@" >"$log" 2>&1
  fi
  rc=$?
  tail -n "${TAIL_LINES:-15}" "$log"
  ((rc == 124 || rc == 137)) && echo "== $name: stopped at its time limit"
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  record "$name" "$rc"
  return $rc
}

# summary STAGE: the stage's one line, on the terminal and appended to $out/summary.txt.
summary() {
  local verdict=PASS line
  ((status == 0)) || verdict=FAIL
  line="$1: $verdict in ${SECONDS} s; $(IFS=';'; echo "${results[*]}" | sed 's/;/; /g')"
  echo "$line" | tee -a "$out/summary.txt"
}

# ---- build ----------------------------------------------------------------------------

# The flags of //:libprecis.so and //:libprecis_torch.so (C_COPTS, copts and
# linkopts in BUILD) and of the //:libprecis_cuda genrule (tools/build_cuda.sh):
# keep them in step.
C_COPTS=(-std=c11 -O3 -fopenmp -fvisibility=hidden -Wall -Wextra -Werror -pedantic)

# cc_all OBJDIR FLAGS... -- SOURCES...: compile the sources in parallel; fails if any fails.
cc_all() {
  local dir=$1 flags=() f pids=() rc=0 pid
  shift
  while [[ $1 != -- ]]; do flags+=("$1"); shift; done
  shift
  mkdir -p "$dir"
  for f in "$@"; do
    gcc "${flags[@]}" -c "$f" -o "$dir/$(basename "$f" .c).o" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  return $rc
}

# libprecis_cuda.so by nvcc; libprecis_cuda12.so only checked: NVRTC is not here.
build_cuda_library() {
  if [[ $cuda_library == libprecis_cuda12.so ]]; then
    [[ -f $PRECIS_CUDA_LIBRARY ]] && return 0
    echo "no $PRECIS_CUDA_LIBRARY: build it where PyPI is (bazel build //:libprecis_cuda12)," \
      "copy it into build/gpu and carry build/gpu"
    return 1
  fi
  rm -f "$PRECIS_CUDA_LIBRARY"
  NVCC=$nvcc tools/build_cuda.sh "$PRECIS_CUDA_LIBRARY" cuda/*.cu csrc/include/precis/precis.h \
    csrc/errors.c csrc/dtype.c csrc/exports.lds
}

build_libs() {
  echo "gcc: $(gcc --version | head -1); nvcc: $("$nvcc" --version | tail -1)"
  local obj=$build/obj cuda_pid
  rm -rf "$obj" "$PRECIS_LIBRARY" "$PRECIS_TORCH_LIBRARY"
  # the CUDA library (nvcc, the longest part) alongside gcc
  build_cuda_library &
  cuda_pid=$!
  # libprecis.so; its soname is what the glue's DT_NEEDED names.
  cc_all "$obj/core" "${C_COPTS[@]}" -fno-math-errno -fPIC -Icsrc/include -Icsrc -- csrc/*.c \
    && gcc -shared -fopenmp "$obj"/core/*.o -o "$PRECIS_LIBRARY" \
         -Wl,--version-script=csrc/exports.lds -Wl,-Bsymbolic -Wl,-soname,libprecis.so -lm \
    && cc_all "$obj/torch" "${C_COPTS[@]}" -fexceptions -pthread -fPIC -Icsrc/include -Icsrc \
         -- torch_ext/csrc/*.c \
    && gcc -shared "$obj"/torch/*.o "$PRECIS_LIBRARY" -o "$PRECIS_TORCH_LIBRARY" \
         -Wl,--version-script=torch_ext/csrc/exports.lds -Wl,-rpath,'$ORIGIN' -ldl -pthread
  local rc=$?
  wait "$cuda_pid" || rc=1
  ((rc == 0)) && ls -l "$PRECIS_LIBRARY" "$PRECIS_TORCH_LIBRARY" "$PRECIS_CUDA_LIBRARY"
  return $rc
}

# ensure_built: the libraries, built unless all three are there.
ensure_built() {
  if [[ -f $PRECIS_LIBRARY && -f $PRECIS_TORCH_LIBRARY && -f $PRECIS_CUDA_LIBRARY ]]; then
    return 0
  fi
  step build build.log "$(left)" build_libs
}

# ---- wheels the image lacks -----------------------------------------------------------

# wheels MODULE=DIST...: for each module that does not import, install the wheel of
# DIST (its name in the wheel's file name) from .whl/ into build/gpu/site, without
# dependencies (each is listed itself), so nothing the image has is replaced.
wheels() {
  local pair mod dist whl rc=0
  for pair in "$@"; do
    mod=${pair%%=*} dist=${pair#*=}
    "$py" -c "import $mod" 2>/dev/null && continue
    whl=$(compgen -G "$root/.whl/${dist}-[0-9]*.whl" | head -1)
    if [[ -z $whl ]]; then
      echo "$mod is missing and .whl/ has no $dist wheel: run tools/gpu_prepare.sh where" \
        "there is a network and carry .whl" >&2
      rc=1
      continue
    fi
    "$py" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
      --target "$build/site" "$whl" || rc=1
    "$py" -c "import $mod" || rc=1
  done
  record "wheels" "$rc"
  return $rc
}

# device: the CPU (every figure names it), the GPU, the driver, Python and torch, in
# $out/device.txt; fails without a CUDA device (then every CUDA test would be skipped
# and pass).
device() {
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c "import sys, torch; print(sys.executable, sys.version.split()[0], 'torch', \
torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
'no CUDA device'); sys.exit(0 if torch.cuda.is_available() else 1)"
}

# note TEXT: appended to the last step's outcome in the summary.
note() { if [[ -n $1 ]]; then results[${#results[@]}-1]+=" ($1)"; fi; }

# junit_counts XML: "P passed, F failed, S skipped" of a pytest JUnit file.
junit_counts() {
  "$py" - "$1" <<'PY' 2>/dev/null
import sys, xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).iter("testcase"))
bad = sum(c.find("failure") is not None or c.find("error") is not None for c in cases)
skipped = sum(c.find("skipped") is not None for c in cases)
print(f"{len(cases) - bad - skipped} passed, {bad} failed, {skipped} skipped")
PY
}

# sanitizer_counts LOG: compute-sanitizer's last error or hazard summary (not the line
# after it that counts the errors left unprinted).
sanitizer_counts() {
  grep -v "were not printed" "$1" | grep -Eo "(ERROR|RACECHECK) SUMMARY: [0-9]+ [a-z]+" | tail -1
}

# ---- stages -----------------------------------------------------------------------------

# The per-test limit: the slowest CUDA test (2^31 elements) takes well under a minute.
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-180}

cuda_tests() {
  ensure_built || return
  wheels expecttest=expecttest pytest_timeout=pytest_timeout
  step device device.txt "$(left)" device || return
  # The GPU's fp8 conversions against the CPU's, for every input (-fmad=false as
  # tools/build_cuda.sh).
  step fp8_cuda_check fp8_cuda_check.log "$(left)" bash -c "\"$nvcc\" -std=c++17 -O3 \
    -fmad=false -arch=sm_90 -Icsrc/include -Icsrc tools/fp8_cuda_check.cu \
    -o \"$build/fp8_cuda_check\" && \"$build/fp8_cuda_check\""
  # The fp8 Adam kernels' fast square roots and divisions against sqrt.rn and div.rn.
  step adam_fast_paths_check adam_fast_paths_check.log "$(left)" bash -c "\"$nvcc\" \
    -std=c++17 -O3 -fmad=false -arch=sm_90 -Icsrc/include -Icsrc -Icuda \
    tools/adam_fast_paths_check.cu -o \"$build/adam_fast_paths_check\" && \
    \"$build/adam_fast_paths_check\""
  step pytest cuda_tests.log "$(left)" "$py" -m pytest -q -rfEs -p no:cacheprovider -m cuda \
    --timeout="$TEST_TIMEOUT_S" --junitxml="$out/cuda_tests.xml" tests/py
  note "$(junit_counts "$out/cuda_tests.xml")"
}

# The tests of the kernels (the update, the bucket ops): the CUDA code precis owns.
KERNEL_TESTS=(tests/py/ops/test_cuda_adam.py tests/py/ops/test_accumulate.py
              tests/py/distributed/test_ddp_bucket_ops.py)

sanitize() {
  local tools=("$@") tool
  ((${#tools[@]})) || tools=(memcheck initcheck racecheck)
  for tool in "${tools[@]}"; do  # before the build: a misspelt tool costs no build
    case $tool in
      memcheck | initcheck | racecheck) ;;
      *) echo "sanitize: unknown tool $tool (memcheck, initcheck, racecheck)" >&2
         record "$tool" 2; return ;;
    esac
  done
  ensure_built || return
  wheels pytest_timeout=pytest_timeout
  step device device.txt "$(left)" device || return
  for tool in "${tools[@]}"; do
    "sanitize_$tool"
  done
}

# sanitize's parts: compute-sanitizer over the CUDA tests of the kernels (KERNEL_TESTS),
# pytest's per-test limit tripled. Not under the sanitizers: the 2^31-element test
# (minutes there; it runs in cuda-tests) and torch.compile (inductor's compilation, no
# precis kernel of its own).
SANITIZER=("$sanitizer" --error-exitcode 99 --target-processes all)
SANITIZED=("$py" -m pytest -q -rfE -p no:cacheprovider -m cuda --timeout=$((3 * TEST_TIMEOUT_S)))
SANITIZER_SKIP="not over_2_31 and not compile"

sanitize_memcheck() {
  # memcheck without torch's caching allocator, so that an access past a tensor's end
  # is outside any allocation (the allocator rounds blocks up and would hide it); CUDA
  # graphs need the allocator, so their tests are left to initcheck and racecheck.
  # About 40 s on the H100 over the kernel tests (2026-11-22); over 50 s on an H200
  # (2026-11-26: 90% of them in 47 s).
  step memcheck sanitize_memcheck.log "$(left)" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    "${SANITIZER[@]}" --tool memcheck "${SANITIZED[@]}" "${KERNEL_TESTS[@]}" -k "$SANITIZER_SKIP and not graph"
  note "$(sanitizer_counts "$out/sanitize_memcheck.log")"
}

sanitize_initcheck() {
  # initcheck: a kernel reading device memory nothing wrote (e.g. a scale not yet set).
  # Not the MLPs of bf16 params (the bf16 and fp8 policies; the CPU trajectory and the
  # CUDA graph tests): there torch's own bf16 tanh kernels read what its bf16 matmuls
  # wrote, and initcheck reports those reads (H100, 2026-11-24: 282,384 reports; every
  # one printed, and all 1,216 of the bf16 variant run alone, in at::native's tanh
  # kernels; 0 in the fp32 variants; H200, 2026-11-26: 94,848 from the CUDA graph
  # tests, all in the same tanh kernel). Their policies' kernels, fp8 block scales
  # included, run here in the other tests.
  step initcheck sanitize_initcheck.log "$(left)" \
    "${SANITIZER[@]}" --tool initcheck "${SANITIZED[@]}" "${KERNEL_TESTS[@]}" \
    -k "$SANITIZER_SKIP and not ((follows_the_cpu_trajectory or capturable_optimizer_step_in_a_cuda_graph) and not fp32)"
  note "$(sanitizer_counts "$out/sanitize_initcheck.log")"
}

sanitize_racecheck() {
  # racecheck over the kernels that share memory or synchronize a block
  # (count_nonfinite, check_finite, fp8 block scales): 89 s for their 566 tests on an
  # H200 (2026-11-26); over every test it takes over 10 minutes. Give it its own
  # budget: `sanitize racecheck`, or BUDGET_S above 150 for the three.
  step racecheck sanitize_racecheck.log "$(left)" \
    "${SANITIZER[@]}" --tool racecheck "${SANITIZED[@]}" "${KERNEL_TESTS[@]}" \
    -k "$SANITIZER_SKIP and (count or finite or fp8 or scale or nonfinite)"
  note "$(sanitizer_counts "$out/sanitize_racecheck.log")"
}

# train_steps: the steps of bench/train_llm.py --size 125m that fit the time left, from a
# 20-step run of the same rows (its tokens/s per row); at most the size's 2000.
train_steps() {
  "$py" - "$build/calibrate" "$(left)" <<'PY'
import json, pathlib, sys
runs = json.loads(next(pathlib.Path(sys.argv[1]).glob("train_llm_125m_*.json")).read_text())
tokens = runs["run"]["batch"] * runs["run"]["seq"]
seconds_per_step = sum(tokens / r["summary"]["tokens_per_s"] for r in runs["rows"]
                       if not r["skipped"])
# 60 s for starting the rows and writing the outputs; 5% for the evaluations (every 100 steps)
budget = int(sys.argv[2]) - 60
print(max(0, min(2000, int(budget / (1.05 * seconds_per_step)) // 100 * 100)))
PY
}

evidence() {
  ensure_built || return
  local parts=("$@") steps regimes=${TRAIN_REGIMES:-pretrain}
  ((${#parts[@]})) || parts=(adam fidelity train)
  wheels numpy=numpy matplotlib=matplotlib PIL=pillow kiwisolver=kiwisolver \
    contourpy=contourpy cycler=cycler fontTools=fonttools pyparsing=pyparsing \
    dateutil=python_dateutil tzdata=tzdata packaging=packaging
  step device device.txt "$(left)" device || return
  local part
  for part in "${parts[@]}"; do
    case $part in
      adam)
        # % of a device-to-device copy per policy; then the same params in ~300 tensors.
        step adam_cuda bench_adam_cuda.txt "$(left)" "$py" bench/adam_cuda.py --sizes 100M,1B \
          --iters 10
        step adam_cuda_300_tensors bench_adam_cuda_300_tensors.txt "$(left)" \
          "$py" bench/adam_cuda.py --sizes 100M,1B --tensors 300 --iters 10 ;;
      fidelity)
        step moment_fidelity moment_fidelity.txt "$(left)" "$py" bench/moment_fidelity.py \
          --device cuda --check --json "$out/moment_fidelity.json" ;;
      train)
        rm -rf "$build/calibrate"
        step train_llm_calibrate train_llm_calibrate.txt "$(left)" "$py" bench/train_llm.py \
          --size 125m --regimes "$regimes" --steps 20 --out "$build/calibrate" || continue
        steps=$(train_steps) || steps=0
        echo "== train_llm: $steps steps fit in the $(left) s left"
        if ((steps < 100)); then
          echo "== train_llm: not run, under 100 steps fit" | tee "$out/train_llm.txt"
          record "train_llm (not run: out of time)" 1
          continue
        fi
        step "train_llm $steps steps" train_llm.txt "$(left)" "$py" bench/train_llm.py \
          --size 125m --regimes "$regimes" --steps "$steps" --out "$out" ;;
      release)
        # Gradient release against the ordinary step and AMP at 125M: peak MiB and
        # tokens/s, one param at a time, in 25 MiB buckets, and capturable (no step call
        # waits for the device) (issue #45); 60 steps, about 4 minutes on an H200.
        step train_llm_release train_llm_release.txt "$(left)" "$py" bench/train_llm.py \
          --size 125m --regimes pretrain --steps 60 --out "$out/release" --rows \
          fp32,amp,precis,precis-release,precis-release-25mib,precis-release-capturable,precis-fp8-rem8,precis-release-fp8-rem8,precis-release-fp8-rem8-25mib,precis-release-fp8-rem8-capturable ;;
      graph)
        # The capturable step captured in a CUDA graph (issue #79 item 4): its bits against
        # the eager step's, a load between replays, torch.compile(mode="reduce-overhead");
        # then the 125M step eager and captured beside torch's fused AdamW captured.
        step cuda_graph_tests cuda_graph_tests.log "$(left)" "$py" -m pytest -q -rfEs \
          -p no:cacheprovider -m cuda --junitxml="$out/cuda_graph_tests.xml" \
          tests/py/optimizers/test_cuda_graph.py
        note "$(junit_counts "$out/cuda_graph_tests.xml")"
        step step_graph bench_step_graph.txt "$(left)" "$py" bench/step_graph.py --size 125m ;;
      *) echo "evidence: unknown part $part (adam, fidelity, train, release, graph)" >&2
         record "$part" 2 ;;
    esac
  done
}

stage=${1:-}
shift || true
case $stage in
  build) step build build.log "$(left)" build_libs ;;
  cuda-tests) cuda_tests ;;
  sanitize) sanitize "$@" ;;
  evidence) evidence "$@" ;;
  *) echo "usage: $0 build|cuda-tests|sanitize [memcheck] [initcheck] [racecheck]|evidence" \
       "[adam] [fidelity] [train] [release] [graph]" >&2; exit 2 ;;
esac
summary "$stage"
exit $status
