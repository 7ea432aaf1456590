"""The benchmark scripts still run and print their tables (tiny sizes; no timing is
checked: bench/ measures, tests never assert speed). The reference check of
bench/adam_cpu.py is a real one: its remainders loop must give the bf16 loop's
master weights bit for bit, and its loops that see loads (element by element, and with
tile records) the plain loop's (a written param taken as the master), the tile records
the params' fingerprints; its DeepSpeed rows are checked where deepspeed is
installed and its op builds (not in CI, which installs no deepspeed, nor under Bazel,
whose sandbox keeps the op's build cache read-only), and their skip line whether it is
or not. bench/moment_fidelity.py prints a row of finite figures for every source x
beta2 x moment dtype x checkpoint (its targets are not checked here);
bench/compiled_step.py one per optimizer and mode, precis compiled into 2 graphs;
bench/arm_instructions.py counts fewer instructions per element for neon than for
scalar code, and for 256-bit sve than for 128-bit."""
import importlib.util
import json
import math
import re
import os
import shutil
import subprocess
import sys

import pytest

import ddp_worker as w

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "bench")
POLICIES = ("fp32", "bf16 default", "bf16 remainders", "bf16 fp8 moments")


def run_script(name, *args, env=None):
    script = os.path.join(BENCH, name)
    assert os.path.isfile(script), f"{script} is missing"
    # stderr apart: a spawned rank's teardown may print there (gloo's "terminate called
    # without an active exception", bench/two_ranks.py) amid the table on stdout.
    proc = subprocess.run([sys.executable, script, *args], env=env or w.child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + "\nstderr:\n" + proc.stderr[-3000:]
    return proc.stdout


def table_rows(out, label):
    return [line for line in out.splitlines() if line[:24].rstrip() == label]


def tile_checks(out):
    """(masters differing with nothing written, records differing from the params'
    fingerprints, masters differing after a write, records differing after it) of each
    check of a bf16 loop with tile records against the plain one."""
    return re.findall(r"bf16 loop with tile records vs the plain one: master (\d+) differ"
                      r"(?: \([^)]*\))? with nothing written \(records (\d+) of \d+ differ "
                      r"from the params' fingerprints\), (\d+) differ(?: \([^)]*\))? after a "
                      r"write into a third of the params \(records (\d+) of \d+ differ\)", out)


def test_adam_cpu_prints_every_row():
    out = run_script("adam_cpu.py", "--sizes", "3e4", "--small-tensors", "3", "--repeat", "1",
                     "--min-time-ms", "0", "--no-torch-bf16")
    assert "Remainders loop master vs bf16 loop master: bit-identical" in out, out
    # the bf16 loop that sees loads: the plain loop's masters with nothing written, and
    # a written param taken as the master
    assert ("bf16 loop seeing loads vs the plain one: master 0 differ with nothing written, "
            "0 differ after a write") in out, out
    # ... and the loop with tile records: the same, its records the params' fingerprints
    assert tile_checks(out) == [("0", "0", "0", "0")], out
    assert out.count("== ") >= 4, out  # two scenarios, at least two thread counts each
    assert "mem vs torch" in out and "arith ms" in out, out
    labels = [f"precis {policy}" for policy in POLICIES]
    if importlib.util.find_spec("deepspeed") is None:  # CI: tools/setup.sh without --bench
        assert "DeepSpeed CPUAdam rows skipped: ModuleNotFoundError" in out, out
        assert not table_rows(out, "DeepSpeed CPUAdam fp32"), out
    elif "DeepSpeed CPUAdam rows skipped: RuntimeError" in out:
        # installed, but its op cannot build or load here (under Bazel's sandbox its
        # build cache, ~/.cache/torch_extensions, is read-only): no rows
        assert not table_rows(out, "DeepSpeed CPUAdam fp32"), out
    else:  # installed and built: it must check out and time in every table
        # its bf16 params are its fp32 op's rounded to bf16, bit for bit (p: 0 differ)
        assert "rounding p to bf16 each step: 0/" in out, out
        labels += ["DeepSpeed CPUAdam fp32", "DeepSpeed CPUAdam bf16"]
    assert "warning: asked for" not in out, out  # every row got the scenario's thread count
    for label in labels:
        rows = table_rows(out, label)
        assert len(rows) == out.count("== "), (label, out)
        assert all("n/a" not in row for row in rows), rows
    # below each bf16 default row, timed with its plain loop: 22 B/param, a time, a ratio
    seeing = re.findall(r"^ref loop seeing loads +22 +([0-9.]+) .* ([0-9.]+)x +- +- +-$",
                        out, re.M)
    assert len(seeing) == out.count("== ") and all(float(t) > 0 for t, _ in seeing), out
    # below it, in the same round-robin: + a uint64 record per 4,096 params, read and written
    tiles = re.findall(r"^ref loop with tile records +22\.0039 +([0-9.]+) .* ([0-9.]+)x +- +- +-$",
                       out, re.M)
    assert len(tiles) == out.count("== ") and all(float(t) > 0 for t, _ in tiles), out
    assert "targets met:" in out, out


def test_adam_cpu_skips_deepspeed_that_does_not_import(tmp_path):
    """The skip path where deepspeed is installed too: a package of that name that fails
    to import stands before any installed one on PYTHONPATH."""
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    env = w.child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    out = run_script("adam_cpu.py", "--sizes", "", "--small-tensors", "2", "--repeat", "1",
                     "--min-time-ms", "0", "--no-torch-bf16", "--skip-precis", env=env)
    assert "DeepSpeed CPUAdam rows skipped: ImportError: hidden by the test" in out, out
    assert out.count("== ") >= 2 and len(table_rows(out, "torch fused fp32")) == out.count("== ")
    assert not table_rows(out, "DeepSpeed CPUAdam fp32"), out


def test_step_breakdown_prints_every_policy():
    out = run_script("step_breakdown.py", "--tensors", "4", "--numel", "100", "--steps", "2")
    for policy in POLICIES:
        assert any(line.startswith(policy) and len(line.split()) >= 7 + policy.count(" ")
                   for line in out.splitlines()), (policy, out)
    # a generic-kernel layout with amsgrad, as bench/RESULTS.md times them
    out = run_script("step_breakdown.py", "--tensors", "2", "--numel", "100", "--steps", "2",
                     "--amsgrad", "--policies", "fp32 bf16 moments,fp32 fp8 moments")
    assert "amsgrad;" in out.splitlines()[0], out
    assert [line.split()[:3] for line in out.splitlines()[2:]] == \
        [["fp32", "bf16", "moments"], ["fp32", "fp8", "moments"]], out


def test_compiled_step_prints_every_row():
    out = run_script("compiled_step.py", "--steps", "12", "--width", "16", "--depth", "1")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and
            not line.startswith("| row")]
    assert len(rows) == 10, out  # 5 optimizers x eager, compiled
    for cells in rows:
        name, mode, ms, graphs, breaks = (cells[i].strip() for i in (1, 2, 3, 5, 6))
        assert float(ms) > 0, cells
        if mode == "compiled" and name.startswith("precis"):
            assert (graphs, breaks) == ("2", "0"), cells  # test_compile.py's promise
    header = [line for line in out.splitlines() if line.startswith("# ")]
    assert header and "family" in header[0], out  # the CPU named with family and model


def test_moment_fidelity_prints_every_row(tmp_path):
    json_path = tmp_path / "fidelity.json"
    out = run_script("moment_fidelity.py", "--sources", "synthetic,real", "--numel", "4096",
                     "--steps", "60", "--size", "micro", "--batch", "4", "--threads", "1",
                     "--json", str(json_path))
    expected = [(step, beta2, dtype) for step in ("50", "60") for beta2 in ("0.95", "0.999")
                for dtype in ("fp32", "bf16", "fp16", "fp8")]
    for source in ("synthetic", "real"):
        assert f"== source {source}\n" in out, out
        section = out.split(f"== source {source}\n")[1].split("== source")[0]
        rows = [line.split("|") for line in section.splitlines()
                if line.count("|") == 4 and line.split()[0] != "step"]
        assert [tuple(cols[0].split()) for cols in rows] == expected, section
        for cols in rows:
            figures = [float(x) for col in cols[1:4] for x in col.split()]
            assert len(figures) == 8 and all(map(math.isfinite, figures)), cols
            assert cols[4].strip() in ("exact", "pass", "FAIL"), cols
    rows = json.loads(json_path.read_text())["rows"]
    assert len(rows) == 2 * len(expected), rows
    assert all(math.isfinite(v) for row in rows for v in row.values()
               if isinstance(v, float)), rows


def test_momentum_fidelity_prints_every_row(tmp_path):
    """bench/momentum_fidelity.py: a row of finite figures per rule x momentum dtype per
    source, the fp32 shadows exact (torch's SGD and Muon, fp32 Lion's torch ops)."""
    json_path = tmp_path / "momentum.json"
    out = run_script("momentum_fidelity.py", "--steps", "3", "--numel", "256", "--sources",
                     "synthetic,real", "--size", "micro", "--threads", "1", "--json",
                     str(json_path))
    for source in ("synthetic", "real"):
        section = out.split(f"== source {source}\n")[1].split("== source")[0]
        rows = [line.split("|") for line in section.splitlines()
                if line.count("|") == 5 and line.split()[0].isdigit()]
        assert [tuple(cols[0].split()[1:]) for cols in rows] == [
            (rule, dtype) for rule in ("sgd", "lion", "muon", "normuon", "nmrow")
            for dtype in ("fp32", "bf16", "fp16", "fp8")], section
        for cols in rows:
            figures = [float(x.rstrip("%")) for col in cols[1:5] for x in col.split()]
            if cols[0].split()[1] == "nmrow":  # a row moment has no steady elements: nan
                figures = figures[:-1]
            assert all(map(math.isfinite, figures)), cols
            want = ("exact",) if cols[0].split()[2] == "fp32" else ("pass", "FAIL")
            assert cols[5].strip() in want, cols
    assert json.loads(json_path.read_text())["rows"], out


def test_rules_cpu_prints_every_table():
    """bench/rules_cpu.py at a tiny size: a table per rule and the whole Muon step, each
    precis row with finite times and a verdict against its target."""
    out = run_script("rules_cpu.py", "--numel", "3e4", "--tensors", "3", "--threads", "1",
                     "--repeat", "1", "--min-time-ms", "0", "--muon-matrices", "2x16x16")
    titles = re.findall(r"^== (.+?),", out, re.M)
    assert len(titles) >= 4 and any("Muon whole step" in t for t in titles), out
    verdicts = re.findall(r"^precis .*>=\d\.\d\d (ok|MISS)$", out, re.M)
    assert len(verdicts) >= 6, out
    assert re.search(r"^targets met: \d+ of \d+$", out, re.M), out
    # the step's extras, timed in the same run: a fingerprint pass in SGD's and Lion's
    # tables, Muon's new directions in its element-wise ones, each with a time
    extras = {label: re.findall(rf"^{label} +2 +([0-9.]+) ", out, re.M)
              for label in ("fingerprint pass, bf16 params", "new bf16 direction, written")}
    fingerprint, direction = extras.values()
    assert len(direction) >= 1 and len(fingerprint) == 2 * len(direction), (extras, out)
    assert all(float(t) > 0 for times in extras.values() for t in times), extras
    # the planned op with its record, for each policy that keeps one (bf16 default, fp8 +
    # 8-bit rem) in SGD's and Lion's tables
    recorded = re.findall(r"^  op with its record +[0-9.]+ +([0-9.]+) ", out, re.M)
    assert len(recorded) == 2 * len(fingerprint) and all(float(t) > 0 for t in recorded), out
    # the bf16 reference loop that sees loads: a row beside each fingerprint pass, and its
    # check (nothing written: the plain loop's masters; a written param: taken as master)
    seeing = re.findall(r"^ref loop seeing loads, bf16 +18 +([0-9.]+) ", out, re.M)
    assert len(seeing) == len(fingerprint) and all(float(t) > 0 for t in seeing), out
    checks = re.findall(r"bf16 loop seeing loads vs the plain one: master (\d+) differ with "
                        r"nothing written, (\d+) differ after a write", out)
    assert checks == [("0", "0"), ("0", "0")], out
    # the bf16 reference loop with tile records: a row beside each of those, a time and a
    # ratio against the plain loop, and its check (the same; its records the fingerprints)
    tiles = re.findall(r"^ref loop with tile records +18\.0039 +([0-9.]+) .* ([0-9.]+)x$", out,
                       re.M)
    assert len(tiles) == len(fingerprint) and all(float(t) > 0 for t, _ in tiles), out
    assert tile_checks(out) == [("0", "0", "0", "0")] * 2, out


def test_release_prints_every_row():
    """bench/release.py on the tiny model: the ordinary loop, a release, a bucketed one
    and a capturable one, each with its times, its paired ratio and live gradient bytes;
    a release keeps fewer alive, and the ordinary row's ratio to itself is 1."""
    out = run_script("release.py", "--size", "tiny", "--threads", "1", "--warmup", "1",
                     "--repeat", "1", "--buckets", "0.25", "--capturable")
    rows = dict(re.findall(r"^\| (ordinary|release[^|]*) \| [0-9.]+ \| [0-9.]+ \| [0-9.]+x \| "
                           r"([0-9.]+) \|", out, re.M))
    assert list(rows) == ["ordinary", "release", "release, buckets of 0.25 MiB",
                          "release, capturable"], out
    assert float(rows["release, capturable"]) == float(rows["release"])
    assert float(rows["ordinary"]) == pytest.approx(2.0)
    assert float(rows["release"]) < float(rows["release, buckets of 0.25 MiB"]) < 2.0, rows
    assert re.search(r"^\| ordinary \| [0-9.]+ \| [0-9.]+ \| 1\.00x \|", out, re.M), out


@pytest.mark.parametrize("policy", [[], ["--policy", "fp8-rem8"], ["--mapping"]])
def test_release_host_part_prints_its_rows_and_the_ordinary_bits(policy):
    """bench/release.py --host, 9 tiny params on the device path (the default policy,
    fp8 m, v + 8-bit remainders, the default given as a mapping): the backward alone, the
    ordinary loop, the release, the release in one bucket and the release's op calls
    replayed, each with its time, the steps' parts per param, and both releases' params
    bit for bit the ordinary loop's (the script fails else); with --parts (the default policy), its timed parts: after the
    first backward every param's hook steps it alone by its kept call (_step_alone, one
    held call a param, no _step walk nor adam_step_'s conversion)."""
    parts_flag = [] if policy else ["--parts"]
    out = run_script("release.py", "--host", "--params", "9", "--warmup", "1",
                     "--repeat", "1", "--steps", "2", *policy, *parts_flag)
    assert ("precis AdamW fp8-rem8 (a mapping)" if policy and policy[0] == "--policy" else
            "precis AdamW default (a mapping)" if policy else "precis AdamW default,") in out
    assert re.search(r"^\| backward alone \(no step\) \| [0-9]+ \| \| \|$", out, re.M), out
    parts = re.findall(r"^\| (ordinary|release)[^|]* \| [0-9]+ \| -?[0-9]+ \| (-?[0-9.]+) \|$",
                       out, re.M)
    # (Only the rows' form: a row's step part is a difference of two timings, which a
    # loaded machine can make negative, so its sign is not the script's to promise.)
    assert [name for name, _ in parts] == ["ordinary", "release", "release"], out  # (one bucket)
    replayed = re.search(r"^\|   the release's op calls alone, replayed [^|]*\| [0-9]+ \| [0-9]+ "
                         r"\| ([0-9.]+) \|$", out, re.M)
    assert replayed and float(replayed.group(1)) > 0, out
    assert "release against the ordinary loop: bit for bit equal" in out, out
    assert "release, one bucket against the ordinary loop: bit for bit equal" in out, out
    if parts_flag:
        calls = dict(re.findall(r"^\| *([^|]*?) *\| [0-9.]+ \| ([0-9.]+) \|$", out, re.M))
        assert calls["_step_alone (a lone kept call)"] == "9", out
        assert calls["the held call (ops.HeldStep)"] == "9", out  # (held at the first)
        assert calls["the op call (ops.adam_step_)"] == "0", out
        assert calls["_step (the walk)"] == "0", out
        assert calls["the backward's end (verdicts read)"] == "1", out


def test_release_overlap_prints_each_variant_with_the_ordinary_bits():
    """bench/release_overlap.py on the tiny model, one process a variant: a row per
    variant, each released row's params equal to its ordinary row's (the worker thread
    steps the same bits), times and ratios > 0."""
    out = run_script("release_overlap.py", "--size", "tiny", "--threads", "1", "--warmup", "1",
                     "--repeat", "1", "--processes", "1")
    rows = re.findall(r"^\| (hook|thread|thread-1|idle) \| 1 \| ([0-9.]+) \| ([0-9.]+) "
                      r"\| ([0-9.]+)x \| (yes|NO) \|$", out, re.M)
    assert [r[0] for r in rows] == ["hook", "thread", "thread-1", "idle"], out
    assert all(r[4] == "yes" for r in rows), out
    assert all(float(x) > 0 for r in rows for x in r[1:4]), rows


def test_release_ops_counts_each_configurations_operations():
    """bench/release_ops.py on the CPU: a count for each of the 8 configurations; clipping
    adds operations to a hook (the norm, the estimate), and on the CPU a capturable hook
    takes the host's path, whose verdict it reads (not fewer operations than without
    capturable)."""
    out = run_script("release_ops.py")
    rows = {(c, m, g): float(n) for c, m, g, n in re.findall(
        r"^ +(True|False) +(1\.0|None) +(None|8\.0) +([0-9.]+)$", out, re.M)}
    assert len(rows) == 8, out
    for c in ("True", "False"):
        for g in ("None", "8.0"):
            assert rows[(c, "1.0", g)] > rows[(c, "None", g)] > 0, rows
            assert rows[("True", "1.0", g)] >= rows[("False", "1.0", g)], rows


def test_step_calls_prints_each_way_and_its_ops():
    """bench/step_calls.py on the tiny model: the ordinary step is one op call (its Plan),
    the release's way one a tensor, each beside its op calls alone, all times > 0."""
    out = run_script("step_calls.py", "--size", "tiny", "--threads", "1", "--repeat", "1")
    tensors = int(re.search(r" in (\d+) tensors,", out).group(1))
    rows = re.findall(r"^\| ([^|]+?) \| (\d+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$",
                      out, re.M)
    assert [(name.strip(), int(calls)) for name, calls, *_ in rows] == [
        ("ordinary step (Plan)", 1), ("its op calls alone", 1),
        ("one call a param (a release's)", tensors), ("its op calls alone", tensors)], out
    assert all(float(x) > 0 for row in rows for x in row[2:]), rows
    assert re.search(r"beyond their ops: -?[0-9.]+ ms", out), out


def test_release_clipping_replays_and_trains_each_decay():
    """bench/release_clipping.py, a few steps: the replay prints each decay's estimate
    error (finite, >= 0; the worst step at least the mean), and --train-seeds the
    ordinary row and a release row per decay with paired differences."""
    out = run_script("release_clipping.py", "--steps", "8", "--decays", "0,0.5")
    rows = re.findall(r"^\| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$", out, re.M)
    assert [d for d, _, _ in rows] == ["0", "0.5"], out
    assert all(0.0 <= float(mean) <= float(worst) for _, mean, worst in rows), out
    out = run_script("release_clipping.py", "--steps", "4", "--decays", "0.5",
                     "--train-seeds", "2")
    assert re.search(r"^\| ordinary \(exact clipping\) \| [0-9.]+ ± [0-9.]+ \| \|$", out,
                     re.M), out
    assert re.search(r"^\| release, SHARE_DECAY 0.5 \| [0-9.]+ ± [0-9.]+ \| [+-][0-9.]+ ± "
                     r"[0-9.]+ \|$", out, re.M), out


def test_fingerprint_speed_compares_the_pass_with_a_read(tmp_path):
    """bench/fingerprint_speed.c: built with the system's C compiler, it times the
    fingerprint pass, its four-sum form and a plain read, and checks that both forms give
    one fingerprint (its exit status)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "fingerprint_speed"
    subprocess.run([cc, "-O2", "-std=c11", "-o", str(exe),
                    os.path.join(BENCH, "fingerprint_speed.c")], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    rows = re.findall(r"^(.+?) +([0-9.]+) ms +([0-9.]+) GB/s$", out, re.M)
    assert len(rows) == 3 and all(float(ms) > 0 for _, ms, _ in rows), out
    assert "the two fingerprints agree: yes" in out, out


def test_moment_store_model_prints_every_scheme():
    """The numpy model behind docs/design.md section 4's table: a row per scheme with
    three finite ratios per beta2, and round-to-nearest bf16 v drifting up (the
    effect the model exists to show) while the chosen scheme does not; its table by
    place in the block: a row per block code, four finite bands beside the theory's,
    and round-to-nearest codes held (stalled) at beta2 0.999 where stochastic ones
    move; its m table: a row per m code, unbiased, E3M4 closer than E4M3."""
    out = run_script("moment_store_model.py", "--steps", "400", "--numel", "1024")
    v_table, place_table, m_table = out.split("\n\n")
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in v_table.splitlines()
            if line.startswith("| ") and "beta2" not in line}
    assert len(rows) == 21, out
    medians = {}
    for label, cells in rows.items():
        figures = [float(x) for cell in cells for x in cell.replace("(", " ").replace(")", " ")
                   .replace("-", " ").split()]
        assert len(figures) == 6 and all(map(math.isfinite, figures)), (label, cells)
        medians[label] = figures[0]  # beta2 0.999
    assert medians["bf16, nearest (before)"] > 1.003, out
    assert abs(medians["v8 (sqrt), stochastic, linear, Weyl (chosen)"] - 1) < 0.01, out
    places = {line.split("|")[1].strip(): line.split("|")[2:8]
              for line in place_table.splitlines()[3:]}
    assert len(places) == len([r for r in rows if not r.startswith("bf16")]), out
    held = {}
    for label, cells in places.items():
        figures = [float(x) for cell in cells[:4] for x in cell.replace("(", " ")
                   .replace(")", " ").replace("±", " ").replace("%", " ").replace("-", " ").split()]
        assert len(figures) == 12 and all(map(math.isfinite, figures)), (label, cells)
        held[label] = [float(cell.strip().rstrip("%")) for cell in cells[4:]]
        assert all(0 <= h <= 100 for h in held[label]), (label, cells)
    for code in ("fp8 E4M3 (sqrt)", "uint8 = E1M7"):
        nearest = [h for label, h in held.items() if label.startswith(code + ", nearest")]
        assert nearest and all(h[0] > 30 for h in nearest), out
    assert held["uint8 = E1M7, stochastic, Weyl, block 32"][0] < 20, out
    # m: every code unbiased (slope within 1%), and a mantissa bit more than E4M3's
    # (E3M4) cuts the median error (issue #34's lead)
    m_rows = {line.split("|")[1].strip(): line.split("|")[2:4]
              for line in m_table.splitlines()[3:]}
    assert len(m_rows) == 10, out
    errors = {label: float(cells[0].strip().rstrip("%")) for label, cells in m_rows.items()}
    assert all(abs(float(cells[1]) - 1) < 0.01 for cells in m_rows.values()), out
    assert errors["E3M4, stochastic, block 128"] < errors["E4M3, stochastic, block 128 (before)"], out


def test_m_code_fidelity_prints_every_code():
    """bench/m_code_fidelity.py on a few real steps: at each checkpoint a row for the
    kernel's fp8 m and one per chosen code, each error a finite fraction, each slope
    near 1 (unbiased codes)."""
    out = run_script("m_code_fidelity.py", "--size", "micro", "--batch", "2", "--steps", "3",
                     "--codes", "0,2")
    last = out.split("step 3")[1]
    rows = [line.split("|")[1:4] for line in last.splitlines() if line.startswith("| ")][1:]
    assert [r[0].strip() for r in rows] == [
        "precis fp8 m (m8: E2M5, stochastic, block 128: the kernel)",
        "E4M3, stochastic, block 128 (before)", "E3M4, stochastic, block 128"], out
    for _, error, slope in rows:
        assert 0 < float(error.strip().rstrip("%")) < 50, out
        assert abs(float(slope) - 1) < 0.1, out


def test_arm_instructions_counts_every_path():
    if not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")):
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (tools/setup.sh)")
    out = run_script("arm_instructions.py", "--numel", "4096", "--policies", "fp32,bf16 default")
    for name in ("fp32", "bf16 default"):
        rows = [line for line in out.splitlines() if line[:20].rstrip() == name]
        assert len(rows) == 1, out
        scalar, neon, sve128, sve256 = map(float, rows[0][20:].split()[:4])
        assert 0 < neon < scalar and 0 < sve256 < sve128, rows[0]


def test_fsdp_bytes_prints_every_row():
    """bench/fsdp_bytes.py: a row per optimizer for one process and each world size;
    the bytes summed over ranks do not depend on the world size, the remainders
    policy holds under FSDP2 what it holds in one process (within 0.1%: its few small
    tensors of its own), and offloaded, the state is all on the host."""
    out = run_script("fsdp_bytes.py", "--size", "micro", "--worlds", "1,2")
    rows = {}
    for line in out.splitlines()[2:]:
        name, world, *figures = line.rsplit(None, 8)
        rows.setdefault(name, {})[world] = [float(f) for f in figures]
    assert len(rows) == 7 and all(list(r) == ["alone", "1", "2"] for r in rows.values()), out
    for name, by_world in rows.items():
        assert by_world["1"][:5] == by_world["2"][:5], (name, out)
    remainders = rows["precis remainders (bf16 + int16, bf16 m, v)"]
    assert abs(remainders["2"][-1] - 1) <= 1e-3 and abs(remainders["2"][4] - 10) <= 1e-2, out
    for world, (params, grads, state, host, *_) in rows["precis fp8 m, v + remainders, "
                                                        "offload"].items():
        assert params == grads == 2 and state == 0 and host > 2, (world, out)
    # 8-bit remainders in one process: 1 byte of remainder + fp8 m, v (+ scales) beside
    # the bf16 grad (under FSDP2 the micro model's rows are no whole 128-blocks: bf16 m, v)
    params, grads, state, *_ = rows["precis fp8 m, v + 8-bit remainders"]["alone"]
    assert params == grads == 2 and 3 <= state < 3.1, out


def test_fsdp_train_llm_prints_every_world():
    """bench/fsdp_train_llm.py: a finite validation loss per world size and seed, and
    the summary rows (a gap of 0 for the first world size, which is the base)."""
    out = run_script("fsdp_train_llm.py", "--size", "tiny", "--worlds", "1,2", "--seeds", "1",
                     "--steps", "3")
    lines = out.splitlines()
    runs = [line.split() for line in lines[2:4]]
    assert [r[:2] for r in runs] == [["1", "0"], ["2", "0"]], out
    assert all(math.isfinite(float(r[2])) for r in runs), out
    summary = [line.split() for line in lines[-2:]]
    assert [s[0] for s in summary] == ["1", "2"] and float(summary[0][3]) == 0.0, out


def test_grad_sum_error_prints_every_reduction():
    """bench/grad_sum_error.py: three rows per world size; bf16 on the wire with fp32
    sums rounds once (p99 within bf16's relative spacing), where the bf16 all-reduce's
    rounded partial sums land further off; fp32 sums of these bf16 values are exact
    to the printed digits."""
    out = run_script("grad_sum_error.py", "--worlds", "2,3", "--numel", "4092")
    rows = {}
    for line in out.splitlines()[2:]:
        world, rest = line.split(None, 1)
        way, norm, median, p99 = rest.rsplit(None, 3)
        rows[(int(world), way.strip())] = (float(norm), float(median), float(p99))
    assert len(rows) == 6, out
    for world in (2, 3):
        assert rows[(world, "bf16 wire, fp32 sums")][2] <= 1.0, out
        assert rows[(world, "fp32 all-reduce")] == (0.0, 0.0, 0.0), out
    assert rows[(3, "bf16 all-reduce")][2] > rows[(3, "bf16 wire, fp32 sums")][2], out


@pytest.mark.parametrize("options", [(), ("--loop",), ("--replay",), ("--per-op",)])
def test_step_host_prints_each_row_with_its_calls(options):
    """bench/step_host.py, tiny (a GPU's path on the CPU), alone, in a training loop, and
    with the replays: torch's row and precis's two, each time > 0, no read a step, and
    precis's steady step one flat call for both groups (its compare and resync its own),
    a policy with remainders too (its op compares and records their blocks as it steps
    them: a partial write costs only the blocks it touched);
    with --replay each row's ops and its update op alone replayed, each time > 0; with
    --per-op each other op of 16 steps alone (torch's two step-count adds a step;
    precis's copy back of what its op kept, once in step_plan.KeptRows.ROWS steps: its op
    counts the steps itself)."""
    out = run_script("step_host.py", "--size", "tiny", "--steps", "3", *options)
    assert ("each after a forward and backward" in out) == ("--loop" in options), out
    rows = re.findall(r"^\| ([^|]+?) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+)x \| ([0-9.]+)x \| "
                      r"(\d+) \| ([^|]+?) \|$", out, re.M)
    names = ["torch fused AdamW, fp32 params (AMP)", "precis default (fp32 master, bf16 m, v)",
             "precis fp8 m, v + 8-bit remainders"]
    assert [r[0] for r in rows] == names, out
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), out
    assert [r[5] for r in rows] == ["0", "0", "0"], out
    assert [r[6] for r in rows[1:]] == ["adam_step_flat_ 1", "adam_step_flat_ 1"], out
    replays = re.findall(r"^\| ([^|]+?): (its ops replayed|its update op alone, replayed) \| "
                         r"([0-9.]+) \| ([0-9.]+) \| [0-9.]+x \| [0-9.]+x \| - \| - \|$",
                         out, re.M)
    if "--replay" in options:
        assert [r[:2] for r in replays] == [
            (name, what) for name in names
            for what in ("its ops replayed", "its update op alone, replayed")], out
        assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in replays), out
    else:
        assert replays == [], out
    alone = re.findall(r"^\| ([^|]+?): (aten\.[^ ]+) alone, replayed \((\d+) in 16 steps\) "
                       r"\| ([0-9.]+) \| ([0-9.]+) \| [0-9.]+x \| [0-9.]+x \| - \| - \|$",
                       out, re.M)
    if "--per-op" in options:
        assert [r[:3] for r in alone] == [(names[0], "aten._foreach_add_.Scalar", "32"),
                                          (names[1], "aten.clone.default", "1"),
                                          (names[2], "aten.clone.default", "1")], out
        assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in alone), out
    else:
        assert alone == [], out


def test_device_path_prints_both_paths_for_every_policy():
    """bench/device_path.py, tiny: a row per policy, each path's time > 0."""
    out = run_script("device_path.py", "--numel", "4097", "--repeat", "1")
    rows = re.findall(r"^\| ([^|]+?) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+)x \| "
                      r"([0-9.]+)x \|$", out, re.M)
    assert [name for name, *_ in rows] == ["bf16 default (fp32 master)",
                                           "bf16 int16 remainders"], out
    assert all(float(x) > 0 for row in rows for x in row[1:]), rows


def test_stale_words_prints_each_size_and_both_ways_agree():
    """bench/stale_words.py: a row per size (125m, 350m, 1B), its tensors and blocks, both
    ways' time a step > 0 (the script exits non-zero where the two ways' sums differ)."""
    out = run_script("stale_words.py", "--repeat", "2")
    rows = re.findall(r"^\| (\S+) \| ([0-9]+) \| ([0-9,]+) \| ([0-9]+) \| ([0-9]+) \| "
                      r"[0-9.]+x \|$", out, re.M)
    assert [r[0] for r in rows] == ["125m", "350m", "1B"], out
    assert [int(r[1]) for r in rows] == [129, 171, 180], out
    assert all(int(r[3]) > 0 and int(r[4]) > 0 for r in rows), out


def test_step_python_prints_each_row_warm_and_cold():
    """bench/step_python.py, small: a row per optimizer, torch's and precis's, each time
    > 0 (the script exits non-zero where a step after its timing writes nothing: its
    update ops not put back)."""
    out = run_script("step_python.py", "--numel", "4097", "--steps", "5")
    rows = re.findall(r"^\| ([^|]+?) \| ([0-9]+) \| ([0-9]+) \|$", out, re.M)
    assert [r[0] for r in rows] == ["torch fused SGD, fp32", "precis SGD, bf16 default",
                                    "torch fused AdamW, fp32", "precis AdamW, bf16 default"], out
    assert all(int(r[1]) > 0 and int(r[2]) > 0 for r in rows), out


def test_steady_step_prints_every_row_with_its_ratios():
    """bench/steady_step.py, small: a row per way (torch's _foreach_add_ and fused step,
    precis's steady step, its op call alone and its checks alone, the step before, the
    remainders' steady step, its op call alone and its step with a dict policy), each time
    and ratio > 0 (the script asserts the three steady steps took their call)."""
    out = run_script("steady_step.py", "--params", "9", "--steps", "5", "--repeat", "1")
    rows = re.findall(r"^\| ([^|]+?) \| ([0-9.]+) \| ([0-9.]+)x \| ([0-9.]+)x \|$", out, re.M)
    assert len(rows) == 9 and rows[0][0].startswith("torch._foreach_add_"), out
    assert rows[0][2] == "1.00" and rows[1][3] == "1.00", out
    assert all(float(x) > 0 for row in rows for x in row[1:]), rows


def test_step_sees_loads_prints_every_row_and_takes_the_writes():
    """bench/step_sees_loads.py, small: for AdamW, SGD and Lion its check line (the op
    seeing loads took exactly the elements written into param 0, and all of the param
    written whole: the script exits non-zero otherwise) and the seven rows at one thread
    (the full path's two too), each time > 0, the reference loop at 1.00x."""
    out = run_script("step_sees_loads.py", "--sizes", "1e6", "--repeat", "1",
                     "--min-time-ms", "1", "--threads", "1")
    checks = re.findall(r"check \((adam|sgd|lion)\): .* kept (\d+) of (\d+) \(taken (\d+), "
                        r"written (\d+)\); last param written whole: kept 0 of \d+", out)
    assert [c[0] for c in checks] == ["adam", "sgd", "lion"], out
    assert all(c[3] == c[4] and int(c[1]) + int(c[3]) == int(c[2]) for c in checks), out
    rows = re.findall(r"^(ref loop|ref loop seeing loads|op, no detection|"
                      r"op \+ compare \+ record \(before\)|op seeing loads|"
                      r"full path \+ compare \+ record \(before\)|full path seeing loads) +1 +"
                      r"([0-9.]+) +([0-9.]+)x", out, re.M)
    assert len(rows) == 21 and all(r[2] == "1.00" for r in rows[::7]), out
    assert all(float(ms) > 0 for _, ms, _ in rows), rows


def test_step_graph_says_why_without_a_gpu_and_checks_its_rows_on_the_cpu():
    """bench/step_graph.py: without a GPU its one line and exit 0; with --check-on-cpu
    (tiny, the GPU's path, no graph) every row, eager and captured, each time > 0 and
    its ratio to torch's fused AdamW captured (1.00x for that row itself)."""
    if torch_cuda_available():
        pytest.skip("a GPU is here: bench/step_graph.py measures (tools/gpu_check.sh)")
    assert "no CUDA device" in run_script("step_graph.py")
    out = run_script("step_graph.py", "--size", "tiny", "--steps", "2", "--repeats", "1",
                     "--check-on-cpu")
    rows = re.findall(r"^\| ([^|]+?) \| ([0-9.]+) \| ([0-9.]+)x \|$", out, re.M)
    assert [r[0] for r in rows] == [
        f"{who}: {how}" for who in ("torch fused AdamW, fp32 params", "precis default",
                                    "precis fp8 m, v + 8-bit remainders")
        for how in ("eager", "captured")], out
    assert all(float(ms) > 0 for _, ms, _ in rows), out
    assert rows[1][2] == "1.00", out


def torch_cuda_available():
    import torch
    return torch.cuda.is_available()
