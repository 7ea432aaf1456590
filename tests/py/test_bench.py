"""The benchmark scripts still run and print their tables (tiny sizes; no timing is
checked: bench/ measures, tests never assert speed). The reference check of
bench/adam_cpu.py is a real one: its remainders loop must give the bf16 loop's
master weights bit for bit."""
import os
import subprocess
import sys

import ddp_worker as w

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
POLICIES = ("fp32", "bf16 default", "bf16 remainders", "bf16 fp8 moments")


def run_script(name, *args):
    script = os.path.join(BENCH, name)
    assert os.path.isfile(script), f"{script} is missing"
    proc = subprocess.run([sys.executable, script, *args], env=w.child_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def test_adam_cpu_prints_every_row():
    out = run_script("adam_cpu.py", "--sizes", "3e4", "--small-tensors", "3", "--repeat", "1",
                     "--min-time-ms", "0", "--no-torch-bf16")
    assert "Remainders loop master vs bf16 loop master: bit-identical" in out, out
    assert out.count("== ") >= 4, out  # two scenarios, at least two thread counts each
    assert "mem vs torch" in out, out
    for policy in POLICIES:
        rows = [line for line in out.splitlines() if line[:24].rstrip() == f"precis {policy}"]
        assert len(rows) == out.count("== "), (policy, out)
        assert all("n/a" not in row for row in rows), rows
    assert "targets met:" in out, out


def test_step_breakdown_prints_every_policy():
    out = run_script("step_breakdown.py", "--tensors", "4", "--numel", "100", "--steps", "2")
    for policy in POLICIES:
        assert any(line.startswith(policy) and len(line.split()) >= 5 + policy.count(" ")
                   for line in out.splitlines()), (policy, out)
