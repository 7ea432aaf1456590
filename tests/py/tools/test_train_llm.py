"""bench/train_llm.py --size tiny, as CI runs it: every row of the issue's list is in
the table, run or with the reason it did not run; every loss of the rows that ran is
finite; the optimizer-state + gradient bytes per parameter it measures are the ones
each optimizer's dtypes give. No timing is checked."""
import json
import math
import os
import subprocess
import sys

import pytest

import ddp_worker as w

TRAIN_LLM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "bench",
                         "train_llm.py")

# The rows of issue #21 (and #34's 6b): 1-6b run on every machine, 7 needs torchao, 8 a GPU.
ROW_NUMBERS = ["1", "2", "3", "4", "5", "6", "6b", "7a", "7b", "7c", "8a", "8b"]
ALWAYS_RUN = {"fp32", "amp", "bf16", "precis", "precis-remainders", "precis-fp8",
              "precis-fp8-rem8"}
# gradient + moments (+ master or remainders) bytes per parameter, by row
EXPECTED_BYTES_PER_PARAM = {
    "fp32": 4 + 4 + 4,
    "amp": 4 + 4 + 4,
    "bf16": 2 + 2 + 2,
    "precis": 2 + 4 + 2 + 2,
    "precis-remainders": 2 + 2 + 2 + 2,
    "precis-fp8": 2 + 2 + 1 + 1,  # + the fp8 moments' block scales
    "precis-fp8-rem8": 2 + 1 + 1 + 1,  # 8-bit remainders (issue #34: at most 5.1)
}


def load_train_llm():
    """bench/train_llm.py as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_llm", TRAIN_LLM)
    train_llm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_llm)
    return train_llm


def test_tiny_table_is_complete_and_finite(tmp_path):
    proc = subprocess.run([sys.executable, TRAIN_LLM, "--size", "tiny", "--threads", "1",
                           "--out", str(tmp_path)], env=w.child_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    for regime in ("pretrain", "finetune"):
        result = json.loads((tmp_path / f"train_llm_tiny_{regime}.json").read_text())
        rows = {row["name"]: row for row in result["rows"]}
        assert ALWAYS_RUN <= {name for name, row in rows.items() if not row["skipped"]}, rows

        table = (tmp_path / f"train_llm_tiny_{regime}.md").read_text()
        table_rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
        assert [line.split()[1] for line in table_rows] == ROW_NUMBERS, table
        for line, row in zip(table_rows, result["rows"]):
            if row["skipped"]:
                assert f"not run: {row['skipped']}" in line, line
                assert f"{row['label']}: not run: {row['skipped']}" in out, out
                continue
            for run in row["runs"]:
                losses = run["train_losses"] + run["val_losses"]
                assert len(run["train_losses"]) == result["run"]["steps"], run
                assert losses and all(map(math.isfinite, losses)), (row["name"], losses)
            measured = row["runs"][0]["state_and_grad_bytes_per_param"]
            if row["name"] in EXPECTED_BYTES_PER_PARAM:
                expected = EXPECTED_BYTES_PER_PARAM[row["name"]]
                assert expected <= measured < expected + 0.1, (row["name"], measured)
        assert (tmp_path / f"train_llm_tiny_{regime}.png").stat().st_size > 0


def test_muon_rows_run_and_measure_their_bytes(tmp_path):
    """The Muon rows (asked for by name: slow on CPUs), 3 steps: finite losses, gaps taken
    to torch's Muon (row 9a), and fp8 momentum + 8-bit remainders at most 4.1 bytes/param
    of state + gradient on the Muon matrices' side (AdamW's fp8 m, v on the rest: the
    model's mean lies between)."""
    rows = "fp32,torch-muon,precis-muon,precis-muon-fp8-rem8"
    proc = subprocess.run([sys.executable, TRAIN_LLM, "--size", "tiny", "--threads", "1",
                           "--steps", "3", "--regimes", "pretrain", "--rows", rows,
                           "--out", str(tmp_path)], env=w.child_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = json.loads((tmp_path / "train_llm_tiny_pretrain.json").read_text())
    by_name = {row["name"]: row for row in result["rows"]}
    assert list(by_name) == rows.split(","), by_name
    for name, row in by_name.items():
        assert not row["skipped"], (name, row["skipped"])
        losses = row["runs"][0]["train_losses"] + row["runs"][0]["val_losses"]
        assert all(map(math.isfinite, losses)), (name, losses)
    table = (tmp_path / "train_llm_tiny_pretrain.md").read_text()
    assert table.count("(vs row 9a)") == 2, table
    measured = {n: by_name[n]["runs"][0]["state_and_grad_bytes_per_param"] for n in by_name}
    assert 4 + 4 <= measured["torch-muon"] < 12, measured  # fp32 momentum / AdamW's m, v
    assert measured["precis-muon-fp8-rem8"] < 5.1, measured  # AdamW rows are 5.06


def test_release_rows_count_the_gradients_alive_at_backwards_peak(tmp_path):
    """The gradient-release rows (issue #45, asked for by name), 3 steps: finite losses;
    their state + gradient bytes are the state's plus the gradients alive at the peak
    of backward, which a release keeps to one param's (the largest, the embedding's or
    the head's): fp8 m, v + 8-bit remainders 3.06 + that, under the ordinary row's 5.06.
    With a loss spike (--spike), written to the *_spike outputs. The capturable release
    (its step counts, verdicts and clipping on the device) trains to the same bits."""
    rows = "fp32,precis,precis-fp8-rem8,precis-release,precis-release-fp8-rem8," \
        "precis-release-fp8-rem8-capturable"
    proc = subprocess.run([sys.executable, TRAIN_LLM, "--size", "tiny", "--threads", "1",
                           "--steps", "3", "--regimes", "pretrain", "--rows", rows,
                           "--spike", "2:100", "--out", str(tmp_path)], env=w.child_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "a loss spike: step 2's loss x 100" in proc.stdout, proc.stdout[-4000:]
    result = json.loads((tmp_path / "train_llm_tiny_pretrain_spike.json").read_text())
    runs = {row["name"]: row["runs"][0] for row in result["rows"]}
    assert list(runs) == rows.split(","), runs
    for name, run in runs.items():
        assert all(map(math.isfinite, run["train_losses"] + run["val_losses"])), name
    llama = load_train_llm().llama
    model = llama.Llama(llama.LlamaConfig.named(result["run"]["model"]), seed=0)
    largest = max(p.numel() for p in model.parameters()) * 2 / llama.num_params(model)
    for name in ("precis", "precis-fp8-rem8"):  # every bf16 gradient alive at once
        assert runs[name]["peak_live_grad_bytes_per_param"] == pytest.approx(2.0), name
    for name, state in (("precis-release", 8.0), ("precis-release-fp8-rem8", 3.06)):
        run = runs[name]
        assert run["peak_live_grad_bytes_per_param"] == pytest.approx(largest), name
        assert state <= run["state_and_grad_bytes_per_param"] < state + 0.01 + largest, name
    assert runs["precis-release-fp8-rem8"]["state_and_grad_bytes_per_param"] < 3.2
    for key in ("train_losses", "val_losses"):
        assert runs["precis-release-fp8-rem8-capturable"][key] == \
            runs["precis-release-fp8-rem8"][key], key


def test_newton_schulz_in_fp32_is_torchs_iteration_and_is_put_back():
    """--newton-schulz fp32 (the Muon rows on CPUs without bf16 matmuls): torch's
    iteration with fp32 matmuls. Against a float64 run of the same iteration within 1e-5,
    and against torch's bf16 one within bf16's error (5e-2 of the largest entry), tall
    and wide; both Muons' function is swapped inside the context and put back after."""
    import torch
    import torch.optim._muon as torch_muon
    from precis import muon_step

    train_llm = load_train_llm()
    coefficients = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    gen = torch.Generator().manual_seed(3)
    for shape in ((127, 33), (33, 127), (1, 5)):
        g = torch.randn(shape, generator=gen)
        ours = train_llm.newton_schulz_fp32(g, coefficients, 5, 1e-7)
        assert ours.dtype == torch.float32 and ours.shape == g.shape
        exact = train_llm.newton_schulz_fp32(g.double(), coefficients, 5, 1e-7)
        assert torch.allclose(ours.double(), exact, atol=1e-5, rtol=0), shape
        theirs = torch_muon._zeropower_via_newtonschulz(g, coefficients, 5, 1e-7).float()
        assert (ours - theirs).abs().max() <= 5e-2 * theirs.abs().max(), shape
    before = torch_muon._zeropower_via_newtonschulz, muon_step._zeropower_via_newtonschulz
    with train_llm.newton_schulz_in("fp32"):
        assert torch_muon._zeropower_via_newtonschulz is train_llm.newton_schulz_fp32
        assert muon_step._zeropower_via_newtonschulz is train_llm.newton_schulz_fp32
    assert (torch_muon._zeropower_via_newtonschulz,
            muon_step._zeropower_via_newtonschulz) == before
