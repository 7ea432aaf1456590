"""examples/train_demo.py, the README's first command, at a toy size: it runs every
policy without a warning and draws its picture."""
import os
import subprocess
import sys

import pytest

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                    "train_demo.py")


def test_demo_runs_without_warnings_and_writes_its_picture(tmp_path):
    pytest.importorskip("matplotlib")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "picture.png"
    proc = subprocess.run(
        [sys.executable, "-W", "error", DEMO, "--steps", "6", "--batch", "2", "--context", "8",
         "--d-model", "16", "--layers", "1", "--heads", "2", "--warmup", "2", "--average", "2",
         "--text", str(text), "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    for label in ("fp32 model, torch.optim.AdamW", "bf16 model, precis fp8 moments + remainders"):
        assert label in proc.stdout, proc.stdout
