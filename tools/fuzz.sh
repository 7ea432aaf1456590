#!/usr/bin/env bash
# The libFuzzer harnesses of fuzz/: builds each with Debian's clang against the
# C sources of csrc/ under AddressSanitizer + UndefinedBehaviorSanitizer (every
# finding fatal), then runs it for a bounded time, starting from its seed
# corpus fuzz/corpus/<target>/. Exits 1 on any finding (a crash, a sanitizer
# report, a broken invariant, a timeout, a leak); the input that caused it is
# left in .fuzz/artifacts/.
#
#   tools/fuzz.sh [--time SECONDS] [--junit DIR] [TARGET...]
#
# --time: seconds per target (default 20). --junit: one DIR/<target>/test.xml
# per target (one test case each) for tools/count_tests.py. TARGET: names of
# fuzz/*.c (default: all). Inputs found along the way go to .fuzz/corpus/<target>/
# (not the repository); the next run starts from them too. Reproduce a finding:
#   .fuzz/bin/<target> .fuzz/artifacts/<target>-crash-...
set -uo pipefail
cd "$(dirname "$0")/.."

seconds=20
junit=""
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --time) seconds=$2; shift 2 ;;
    --junit) junit=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if [ ${#targets[@]} -eq 0 ]; then
  for f in fuzz/*.c; do targets+=("$(basename "$f" .c)"); done
fi
if ! command -v clang >/dev/null; then
  echo "fuzz.sh: clang is missing (tools/setup.sh installs it)" >&2
  exit 1
fi

out=.fuzz
mkdir -p "$out/obj" "$out/bin" "$out/logs" "$out/artifacts"
# No -fopenmp: the kernels run single-threaded here, which is what a fuzzer wants.
cflags=(-std=c11 -O1 -g -fno-omit-frame-pointer -Wall -Wextra -Werror -Wno-unknown-pragmas
        -fsanitize=address,undefined -fno-sanitize-recover=undefined
        -Icsrc -Icsrc/include)

# The library once, with coverage instrumentation; each harness links it.
objs=()
for src in csrc/*.c; do
  obj="$out/obj/$(basename "$src" .c).o"
  if [ ! -e "$obj" ] || [ -n "$(find csrc -name '*.[ch]' -newer "$obj" -print -quit)" ]; then
    clang "${cflags[@]}" -fsanitize=fuzzer-no-link -c "$src" -o "$obj" || exit 1
  fi
  objs+=("$obj")
done

export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

write_junit() {  # target, ok (0/1), seconds, log
  local dir="$junit/$1"
  mkdir -p "$dir"
  {
    echo '<?xml version="1.0" encoding="UTF-8"?>'
    echo "<testsuites><testsuite name=\"fuzz\" tests=\"1\" failures=\"$((1 - $2))\">"
    echo "<testcase name=\"$1\" classname=\"fuzz\" time=\"$3\">"
    if [ "$2" -eq 0 ]; then
      echo "<failure message=\"finding\"><![CDATA["
      tail -n 60 "$4" | sed 's/]]>/]] >/g'
      echo "]]></failure>"
    fi
    echo "</testcase></testsuite></testsuites>"
  } >"$dir/test.xml"
}

failed=0
for t in "${targets[@]}"; do
  if [ ! -f "fuzz/$t.c" ]; then
    echo "fuzz.sh: no harness fuzz/$t.c" >&2
    exit 2
  fi
  log="$out/logs/$t.log"
  mkdir -p "$out/corpus/$t"
  ok=1
  if ! clang "${cflags[@]}" -fsanitize=fuzzer -Ifuzz "fuzz/$t.c" "${objs[@]}" -lm \
      -o "$out/bin/$t" >"$log" 2>&1; then
    ok=0
  else
    dict=()
    [ -f "fuzz/corpus/$t.dict" ] && dict=("-dict=fuzz/corpus/$t.dict")
    start=$SECONDS
    "$out/bin/$t" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="$out/artifacts/$t-" "${dict[@]}" \
        "$out/corpus/$t" "fuzz/corpus/$t" >"$log" 2>&1 || ok=0
  fi
  elapsed=$((SECONDS - ${start:-$SECONDS}))
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  if [ "$ok" -eq 1 ]; then
    echo "fuzz $t: passed, ${runs:-?} inputs in ${elapsed}s"
  else
    failed=1
    echo "fuzz $t: FAILED (log: $log)"
    tail -n 30 "$log"
  fi
  [ -n "$junit" ] && write_junit "$t" "$ok" "$elapsed" "$log"
done
exit $failed
