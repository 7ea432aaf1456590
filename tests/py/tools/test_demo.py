"""examples/train_demo.py, the README's first command, at a toy size: it runs every
policy without a warning and draws its picture; without --steps it times a few steps
and fits its run to --budget. And the figures at the top of the README: every cell
links to a section of bench/RESULTS.md that exists, as does RESULTS.md's index."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..", "..")
DEMO = os.path.join(ROOT, "examples", "train_demo.py")
README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join(ROOT, "bench", "RESULTS.md")
TOY = ["--batch", "2", "--context", "8", "--d-model", "16", "--layers", "1", "--heads", "2"]


def demo_module():
    spec = importlib.util.spec_from_file_location("train_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_demo(tmp_path, *args):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    proc = subprocess.run([sys.executable, "-W", "error", DEMO, *TOY, "--text", str(text),
                           "--out", str(tmp_path / "picture.png"), *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    return proc.stdout


def progress_lines(stdout, name):
    """(step, steps) of each progress line of one training, which must give the time left."""
    found = re.findall(rf"\[\s*{re.escape(name)}\] step\s+(\d+)/(\d+)\s+loss \S+\s+"
                       r"\d+m\d\ds spent, \d+m\d\ds left, \d+m\d\ds until the last", stdout)
    return [(int(a), int(b)) for a, b in found]


def test_demo_runs_without_warnings_and_writes_its_picture(tmp_path):
    pytest.importorskip("matplotlib")
    out = run_demo(tmp_path, "--steps", "6", "--warmup", "2", "--average", "2")
    picture = tmp_path / "picture.png"
    assert picture.stat().st_size > 10_000 and picture.read_bytes()[:4] == b"\x89PNG"
    demo = demo_module()
    for name, label in demo.LABELS.items():  # every policy, fp8 + 8-bit remainders too
        assert label in out, out
        lines = progress_lines(out, name)
        assert lines and lines[-1] == (6, 6), (name, out)
    # the table's bytes per param of the smallest policy: fp8 m, v (1 + 1 + scales),
    # an 8-bit remainder and the bf16 gradient, measured
    row = next(line for line in out.splitlines() if line.startswith(demo.LABELS["fp8-r8"]))
    assert 5.0 <= float(row.split()[-3]) < 5.5, row


def test_demo_with_release_counts_the_gradients_alive_at_backwards_peak(tmp_path):
    """--release: every precis training steps inside backward; fp8 m, v + 8-bit remainders
    then keep 3.06 bytes/param of state + the gradients held at once (one param's, the
    largest: the embedding or the head), under the ordinary loop's 5.06."""
    pytest.importorskip("matplotlib")
    out = run_demo(tmp_path, "--steps", "3", "--warmup", "1", "--average", "1",
                   "--policies", "baseline,fp8-r8", "--release")
    demo = demo_module()
    row = next(line for line in out.splitlines() if line.startswith(demo.LABELS["fp8-r8"]))
    assert 3.06 <= float(row.split()[-3]) < 4.0, row
    base = next(line for line in out.splitlines() if line.startswith(demo.LABELS["baseline"]))
    assert float(base.split()[-3]) == 12.0, base  # torch's optimizer: not released


def test_choose_steps_fits_the_budget():
    demo = demo_module()
    assert demo.choose_steps(0.1, 240) == demo.FULL_STEPS  # 30 s for 300 steps
    assert demo.choose_steps(1.0, 240) == 240
    assert demo.choose_steps(4.5, 240) == 53
    assert demo.choose_steps(100.0, 240) == demo.MIN_STEPS  # never fewer


def test_demo_without_steps_times_itself_and_fits_its_budget(tmp_path):
    """The default run's path: a budget far below 300 steps of five toy trainings (each
    a forward, a backward and an optimizer step, well over 1 ms) gets fewer steps, says
    why, and runs that many in every training."""
    pytest.importorskip("matplotlib")
    out = run_demo(tmp_path, "--budget", "0.5")
    demo = demo_module()
    chosen = re.search(r"^(\d+) steps, not 300: 300 steps of 5 trainings take about "
                       r"\d+m\d\ds here \(the bf16 model's step is [\d.]+x the fp32 model's\), "
                       r"over the budget of \d+m\d\ds \(--budget\)", out, re.M)
    assert chosen, out
    steps = int(chosen.group(1))
    assert demo.MIN_STEPS <= steps < demo.FULL_STEPS, out
    for name in demo.POLICIES:
        assert progress_lines(out, name)[-1] == (steps, steps), (name, out)


def test_demo_without_steps_runs_300_when_they_fit(tmp_path):
    out = run_demo(tmp_path, "--budget", "100000", "--policies", "baseline")
    assert re.search(r"^300 steps: 300 steps of 1 training take about .* within the "
                     r"budget", out, re.M), out
    assert progress_lines(out, "baseline")[-1] == (300, 300), out


def github_anchor(heading):
    """The id GitHub gives a heading: lower case, spaces to hyphens, punctuation dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown):
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6} (.+)$", markdown, re.M):
        base = github_anchor(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def results_text():
    if not os.path.exists(RESULTS):
        pytest.skip("bench/RESULTS.md is not among this test's data files")
    return open(RESULTS, encoding="utf-8").read()


def test_readme_opens_with_figures_that_link_to_results():
    readme = open(README, encoding="utf-8").read()
    top = readme[:readme.index("\n## ")]  # before the first section
    rows = [line for line in top.splitlines() if line.startswith("| ")]
    assert len(rows) >= 6, "the README opens with a table of figures"  # header + 5 rows
    refs = dict(re.findall(r"^\[([^\]]+)\]: bench/RESULTS\.md#(\S+)", readme, re.M))
    used = set()
    for row in rows[1:]:  # the header has no figures
        for cell in [c.strip() for c in row.strip("|").split("|")][1:]:
            linked = re.findall(r"\]\[([^\]]+)\]", cell)
            assert linked, f"a figure without its RESULTS.md section: {cell!r} in {row}"
            used.update(linked)
    assert used <= refs.keys(), f"not links to bench/RESULTS.md: {used - refs.keys()}"
    missing = {refs[key] for key in used} - anchors(results_text())
    assert not missing, f"no such sections in bench/RESULTS.md: {missing}"


def test_results_index_links_every_section():
    results = results_text()
    index = results[:results.index("\n## ")]  # what precedes the first section
    refs = dict(re.findall(r"^\[([^\]]+)\]: #(\S+)$", index, re.M))
    used = set(re.findall(r"\]\[([^\]]+)\]", index))
    assert used and used <= refs.keys(), used - refs.keys()
    linked = {refs[key] for key in used}
    assert linked <= anchors(results), linked - anchors(results)
    sections = {github_anchor(h) for h in re.findall(r"^## (.+)$", results, re.M)}
    assert sections <= linked, f"sections missing from the index: {sections - linked}"
