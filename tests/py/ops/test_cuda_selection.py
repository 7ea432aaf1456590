"""What `tools/gpu_check.sh cuda-tests` runs: `pytest -m cuda tests/py`, the tests
marked `cuda` (conftest.py). Checked here by collecting, without a GPU:

* the selection holds the CUDA tests of every file that has some: the CUDA kernels
  (test_cuda_adam, CUDA graphs and capturable steps included), the bucket ops,
  offload from CUDA params, torch.compile on CUDA params, the moment drift on CUDA,
  torch's optimizer tests on CUDA, gradient release under FSDP2's CPUOffloadPolicy and
  what a released backward waits for on a GPU;
* no CPU variant of a test rides along (a "cpu" parameter), and no CUDA variant is
  left out (a "cuda" parameter without the marker), so a GPU's minutes go to the
  tests only a GPU can run.
"""
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # tests/py: this file is in tests/py/ops

# file -> a pattern some selected test id of that file must match
MUST_SELECT = {
    "test_cuda_adam.py": r"::test_matches_cpu_bitwise\[",
    "test_accumulate.py": r"::test_cuda_matches_cpu\[",
    "test_ddp_bucket_ops.py": r"::test_cuda_cast_matches_cpu\[",
    "test_offload.py": r"::test_cuda_offloaded_run_follows_the_on_device_run_bit_for_bit\[",
    "test_compile.py": r"::test_compiled_step_gives_the_eager_bits\[.*-cuda\]",
    "test_moment_drift.py": r"::test_second_moment_tracks_adamw\[.*cuda",
    "test_torch_optim_db.py": r"-cuda",
    "test_release_fsdp.py": r"::test_fsdp2_cpu_offload_policy_release_reads_the_reduced_gradient\[",
    "test_release.py": r"::test_a_released_backward_compares_once_and_waits_for_no_verdict\[",
    "test_device_path.py": r"::test_a_cuda_step_reads_what_the_emulated_one_reads\[",
}


def collect(marker):
    """Node ids that `pytest -m marker` selects in tests/py."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", marker, TESTS],
        cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    assert run.returncode == 0, run.stdout[-3000:]
    return ids


def params(node_id):
    """The parameter tokens of an id: 'f.py::t[a-cuda-1]' -> {'a', 'cuda', '1'}."""
    m = re.search(r"\[(.*)\]$", node_id)
    return set(re.split(r"[-_]", m.group(1))) if m else set()


@pytest.fixture(scope="module")
def selected():
    return collect("cuda")


def test_selection_has_the_cuda_tests_of_every_file(selected):
    for name, pattern in MUST_SELECT.items():
        mine = [i for i in selected if os.path.basename(i.split("::")[0]) == name]
        assert any(re.search(pattern, i) for i in mine), \
            f"{name}: nothing selected matches {pattern!r} ({len(mine)} selected)"
    assert any(re.search(r"::test_cuda_graph_replay_equals_eager\[", i) for i in selected)
    assert any(re.search(r"::test_capturable_optimizer_step_in_a_cuda_graph\[", i)
               for i in selected)


def test_selection_has_no_cpu_variant(selected):
    cpu = [i for i in selected if "cpu" in params(i)]
    assert not cpu, f"CPU variants marked cuda: {cpu[:5]}"


def test_no_cuda_variant_is_left_out():
    left = [i for i in collect("not cuda") if "cuda" in params(i)]
    assert not left, f"CUDA variants without the cuda marker: {left[:5]}"
