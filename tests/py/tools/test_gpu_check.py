"""tools/gpu_check.sh's bookkeeping, without a GPU: the script runs in a scratch copy
of the repository with stand-ins for nvidia-smi, nvcc and Python (the real Python
only for the script's own helpers), so that each step's outcome is chosen here:

* a failing step fails the stage even when the steps after it pass (the exit status
  is the stage's, not its last command's), and the summary line in $OUT says which;
* a stage whose steps all pass exits 0 with PASS and the JUnit counts;
* a step started too close to the deadline is not run and fails the stage; a step
  that outlives its limit is stopped and fails it;
* no CUDA device fails the stage (every CUDA test would be skipped and pass);
* the sanitize stage's summary gives compute-sanitizer's error total.
"""
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools",
                      "gpu_check.sh")

# Python's stand-in: `-c` snippets (imports, the device line) and `-m pytest` as the
# test says (FAKE_*); a script on stdin (the JUnit counter) goes to the real Python.
FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$1" in
  -c) [[ $2 == *cuda.is_available* ]] && { echo "fake torch, fake GPU"; exit "${FAKE_DEVICE_RC:-0}"; }
      exit 0 ;;
  -m) shift 2
      for a in "$@"; do [[ $a == --junitxml=* ]] && xml=${a#--junitxml=}; done
      cat > "$xml" <<XML
<testsuites><testsuite><testcase name="a"/><testcase name="b"/><testcase name="c"><skipped/></testcase></testsuite></testsuites>
XML
      echo "fake pytest: $*"
      sleep "${FAKE_PYTEST_SLEEP:-0}"
      exit "${FAKE_PYTEST_RC:-0}" ;;
  -) exec "$REAL_PYTHON" "$@" ;;
esac
exit 3
"""
FAKE_NVCC = """#!/usr/bin/env bash
# writes a program that exits FAKE_FP8_RC
for ((i = 1; i <= $#; i++)); do [[ ${!i} == -o ]] && { j=$((i + 1)); out=${!j}; }; done
printf '#!/bin/sh\\necho fake fp8 check\\nexit %s\\n' "${FAKE_FP8_RC:-0}" > "$out"
chmod +x "$out"
"""

# compute-sanitizer's stand-in: a run with more errors than it prints (FAKE_ERRORS;
# 100 printed), ending as the real one does: the total, then what went unprinted.
FAKE_SANITIZER = """#!/usr/bin/env bash
n=${FAKE_ERRORS:-0}
echo "========= ERROR SUMMARY: $n errors"
((n > 100)) && echo "========= ERROR SUMMARY: $((n - 100)) errors were not printed."
((n == 0))
"""


def executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def run_stage(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "tools" / "gpu_check.sh")
    (repo / "build" / "gpu").mkdir(parents=True)
    for lib in ("libprecis.so", "libprecis_torch.so", "libprecis_cuda.so"):
        (repo / "build" / "gpu" / lib).write_text("")  # built: no build step
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'Fake GPU, 0.0, 80 GiB'\n")
    executable(bin_dir / "compute-sanitizer", FAKE_SANITIZER)
    out = tmp_path / "out"

    def run(stage, *parts, **fake):
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out),
               "PYTHON": executable(tmp_path / "python", FAKE_PYTHON),
               "NVCC": executable(tmp_path / "nvcc", FAKE_NVCC), "REAL_PYTHON": sys.executable,
               **{k: str(v) for k, v in fake.items()}}
        start = time.monotonic()
        proc = subprocess.run(["bash", str(repo / "tools" / "gpu_check.sh"), stage, *parts],
                              env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=120)
        summary = (out / "summary.txt").read_text().splitlines()[-1]
        return proc.returncode, summary, proc.stdout, time.monotonic() - start

    return run


def test_a_failed_step_fails_the_stage_though_the_last_passes(run_stage):
    rc, summary, log, _ = run_stage("cuda-tests", FAKE_FP8_RC=1)
    assert rc == 1, log
    assert summary.startswith("cuda-tests: FAIL"), summary
    assert "fp8_cuda_check FAILED (exit 1)" in summary
    assert "pytest ok (2 passed, 0 failed, 1 skipped)" in summary


def test_a_stage_whose_steps_pass_passes(run_stage):
    rc, summary, log, _ = run_stage("cuda-tests")
    assert rc == 0, log
    assert summary.startswith("cuda-tests: PASS"), summary


def test_failed_tests_fail_the_stage(run_stage):
    rc, summary, _, _ = run_stage("cuda-tests", FAKE_PYTEST_RC=1)
    assert rc == 1 and "pytest FAILED (exit 1)" in summary, summary


def test_no_cuda_device_fails_the_stage(run_stage):
    rc, summary, _, _ = run_stage("cuda-tests", FAKE_DEVICE_RC=1)
    assert rc == 1 and "device FAILED" in summary, summary


def test_a_step_too_close_to_the_deadline_is_not_run(run_stage):
    rc, summary, _, _ = run_stage("cuda-tests", BUDGET_S=10)
    assert rc == 1, summary
    assert "not run: out of time" in summary


def test_a_step_past_its_limit_is_stopped(run_stage):
    rc, summary, log, seconds = run_stage("cuda-tests", BUDGET_S=25, FAKE_PYTEST_SLEEP=100)
    assert rc == 1, log
    assert "stopped at its time limit" in log
    assert "pytest FAILED (exit 124)" in summary, summary
    assert seconds < 60


def test_the_sanitizers_total_is_summed_up_not_the_unprinted_count(run_stage):
    rc, summary, log, _ = run_stage("sanitize", FAKE_ERRORS=282384)
    assert rc == 1, log
    assert "memcheck FAILED (exit 1) (ERROR SUMMARY: 282384 errors)" in summary, summary
    assert "282284" not in summary
    rc, summary, log, _ = run_stage("sanitize")
    assert rc == 0 and "initcheck ok (ERROR SUMMARY: 0 errors)" in summary, summary


def test_sanitize_runs_the_tools_named(run_stage):
    """`sanitize racecheck` runs racecheck alone (a call of its own: after the other two
    it ran out of time on the H200); an unknown tool fails the stage, naming it."""
    rc, summary, log, _ = run_stage("sanitize", "racecheck")
    assert rc == 0, log
    assert "racecheck ok" in summary and "memcheck" not in summary, summary
    assert "initcheck" not in summary, summary
    rc, summary, log, _ = run_stage("sanitize", "memcheck", "racecheck")
    assert rc == 0 and "memcheck ok" in summary and "racecheck ok" in summary, summary
    assert "initcheck" not in summary, summary
    rc, summary, log, _ = run_stage("sanitize", "leakcheck")
    assert rc == 1 and "leakcheck FAILED (exit 2)" in summary, summary
    assert "unknown tool leakcheck" in log, log


def test_evidence_release_runs_the_release_rows(run_stage):
    """`evidence release` (named only) runs train_llm's gradient-release rows at 125m
    beside the ordinary step and AMP; the stand-in Python fails any script (exit 3),
    which fails the stage, naming the step."""
    rc, summary, log, _ = run_stage("evidence", "release")
    assert rc == 1, log
    assert "train_llm_release FAILED (exit 3)" in summary, summary
    assert "precis-release-25mib" in log and "--size 125m" in log, log
    assert "adam_cuda" not in summary, summary


def test_evidence_graph_runs_the_cuda_graph_tests_and_bench(run_stage):
    """`evidence graph` (named only) runs the CUDA graph tests (their JUnit counts in the
    summary) and then bench/step_graph.py at 125m; the stand-in Python fails the script
    (exit 3), which fails the stage, naming the step."""
    rc, summary, log, _ = run_stage("evidence", "graph")
    assert rc == 1, log
    assert "cuda_graph_tests ok (2 passed, 0 failed, 1 skipped)" in summary, summary
    assert "step_graph FAILED (exit 3)" in summary, summary
    assert "tests/py/optimizers/test_cuda_graph.py" in log and "--size 125m" in log, log
    assert "adam_cuda" not in summary, summary
