"""tools/sass_budget.py: every policy that the README, the demo and the benches name
steps with a specialized CUDA update kernel, predicted from its SASS to reach at least
90% of a device-to-device copy on an H100 and to keep enough reads in flight for the
H200's memory latency (Little's law) (docs/design.md section 7, "The SASS budget"). No
GPU needed.

test_named_policies_are_advertised resolves the policies of those files with
precis.resolve_policy into the kernels they step with and checks that the tool's
ADVERTISED list holds exactly them. test_kernel_reaches_a_copy and
test_loads_in_flight_cover_the_latency run the tool once (one case per advertised
policy) on the kernels of libprecis_cuda12.so (NVRTC 12.9, the toolchain they are tuned
on): under Bazel the //:libprecis_cuda12 the other tests load, from a shell cuda/step.cu
compiled now (about a minute; or $PRECIS_CUDA_LIBRARY, a path to either library). It
needs the pinned pip packages (NVRTC 12.9 at .venv/cuda12, nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm) that tools/setup.sh installs: without them it fails, saying so,
and never skips. test_kernel_variants_dry_run lists what bench/kernel_variants.py would
time on a GPU.
"""
import importlib.util
import json
import os
import re
import sys

import pytest
import torch

import precis

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def _tool():
    spec = importlib.util.spec_from_file_location(
        "sass_budget", os.path.join(ROOT, "tools", "sass_budget.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sass_budget = _tool()
NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
         torch.uint8: "fp8", torch.int16: "int16"}


def kernels_of(model_dtype, overrides):
    """The update kernels (grad, param, master mode, master, m, v) a policy steps with:
    one per gradient dtype it may hand the step (the param's, and the main grads' of
    precis.ddp / precis.fsdp)."""
    p = precis.resolve_policy(model_dtype, overrides or {})
    param = NAMES[p.param_dtype]
    if p.store_param_remainders:
        mode, master = ("remainder", "int16") if p.param_remainder_bits == 16 else \
            ("remainder8", "fp8")
    elif p.main_params_dtype == p.param_dtype:
        mode, master = "own", param
    else:
        mode, master = "master", NAMES[p.main_params_dtype]
    m, v = NAMES[p.exp_avg_dtype], NAMES[p.exp_avg_sq_dtype]
    return {(g, param, mode, master, m, v) for g in {param, NAMES[p.main_grads_dtype]}}


def named_policies():
    """(where, model dtype, overrides) of every precis policy the README, the demo and
    the benches name."""
    out = [(f"README policy table ({NAMES[d]} model)", d, {})
           for d in (torch.float32, torch.float16, torch.bfloat16)]
    out.append(("README grad_reduce_in_fp32", torch.bfloat16, {"grad_reduce_in_fp32": True}))
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_demo  # the README's demo
    out += [(f"examples/train_demo.py {k}", d, o) for k, (d, o) in train_demo.POLICIES.items()
            if o is not None]
    import policies
    out += [(f"bench/policies.py {k}", d, o) for k, (d, o) in policies.POLICIES.items()]
    import adam_cuda
    out += [(f"bench/adam_cuda.py {k}", adam_cuda.CONFIGS[k][0], o)
            for k, o in adam_cuda.POLICIES.items()]
    import moment_fidelity  # fp32 params, each moment dtype
    out += [(f"bench/moment_fidelity.py {d}", torch.float32,
             {"exp_avg_dtype": d, "exp_avg_sq_dtype": d}) for d in moment_fidelity.DTYPES]
    import train_llm  # precis rows: closures over their policy (a dict of overrides)
    out += [(f"bench/train_llm.py {r.name}", r.model_dtype,
             next(c.cell_contents for c in r.make_optimizer.__closure__
                  if isinstance(c.cell_contents, dict)))
            for r in train_llm.ROWS if r.unavailable is train_llm.precis_missing]
    import fsdp_bytes  # the FSDP2 table, bf16 models
    out += [(f"bench/fsdp_bytes.py {k}", torch.bfloat16, o)
            for k, (kind, o) in fsdp_bytes.ROWS.items() if kind != "torch"]
    return out


def test_named_policies_are_advertised():
    """Each named policy's kernels are in ADVERTISED (so the budget checks them), and
    ADVERTISED lists nothing that no file names."""
    named = {}
    for where, dtype, overrides in named_policies():
        for kernel in kernels_of(dtype, overrides):
            named.setdefault(kernel, []).append(where)
    missing = {k: w for k, w in named.items() if k not in sass_budget.ADVERTISED}
    assert not missing, f"named policies without an ADVERTISED kernel: {missing}"
    stale = set(sass_budget.ADVERTISED) - set(named)
    assert not stale, f"ADVERTISED kernels that no README, demo or bench policy names: {stale}"
    assert len(named_policies()) > 20  # the sources were read


@pytest.fixture(scope="module")
def rows():
    """tools/sass_budget.py's rows of the kernels of libprecis_cuda12.so."""
    library = os.environ.get("PRECIS_CUDA_LIBRARY", "")
    library = library if "/" in library else None  # (a bare name is the glue's)
    if library is None and os.environ.get("TEST_SRCDIR"):
        from precis import _lib  # Bazel: the genrule's library in the runfiles
        library = next((p for _, p in _lib.candidate_paths("libprecis_cuda12.so",
                                                              "PRECIS_SASS_LIBRARY")
                        if os.path.isfile(p)), None)
        assert library, "libprecis_cuda12.so is not in the runfiles"
    rows = sass_budget.run(library)  # raises when NVRTC, cuobjdump or nvdisasm is missing
    print(sass_budget.table(rows, markdown=False))
    return rows


@pytest.fixture(scope="module")
def results(rows):
    """tools/sass_budget.py's check of the kernels: {policy: failure or None}."""
    # (the loads in flight: the staged candidate's, below; the shipped loop waits on its
    # loads, which the H200 measured at 44-93% of a copy)
    return sass_budget.check(rows, sass_budget.THRESHOLD, in_flight=False)


@pytest.mark.parametrize("policy", list(sass_budget.ADVERTISED.values()))
def test_kernel_reaches_a_copy(results, policy):
    assert results[policy] is None, results[policy]


# The fp8 m, v + 8-bit remainders kernel's hot loop, SASS instructions an element on sm_90
# (NVRTC 12.9), that CI holds: 118.5 before the word-at-a-time codes, the guarded square
# roots and divisions and the shared block-scale division (bench/RESULTS.md, "Fewer
# instructions an element in the fp8 Adam kernels"), 94.8 after, 93.9 with the moments'
# stochastic-rounding keys made by the host (bench/RESULTS.md, 2026-11-29). Issue #79's
# target is 80.
FP8_REMAINDER8_CEILING = 94.1


def test_fp8_remainder8_instructions_under_the_ceiling(rows):
    name = "fp8 m, v + 8-bit remainders"
    row, = [r for r in rows if r["policy"] == name and r["arch"] == "sm_90"]
    per_element = sum(row["per"].values())
    assert per_element <= FP8_REMAINDER8_CEILING, (name, per_element)


def test_calibrated_model_predicts_the_measured_h200_within_10_points():
    """tools/sass_calibration.json holds the update kernels an H200 measured at 1B params
    (two runs, six kernels) with their SASS counts: the calibrated model, sass_budget's
    predict (arith/mem from the counts, as for today's kernels) then calibrated(),
    predicts each within 10 points of its measured fraction of a copy (the fit's largest
    error is 4.2), where the model's two ends miss by up to 45 (perfect overlap) and 20
    (serial). The SASS is nvcc 13.0's (the measured builds); the model is applied to
    NVRTC 12.9's, the shipped kernels' (of today's source the two read within half an
    instruction an element, the fits within 0.2 points)."""
    with open(sass_budget.CALIBRATION) as f:
        data = json.load(f)
    kernels = data["kernels"]
    assert {tuple(k["dtypes"]) for k in kernels} == {
        dt for dt, policy in sass_budget.ADVERTISED.items()
        if policy in ("fp32", "bf16 default", "bf16 int16 remainders", "bf16 fp8 moments",
                      "fp8 m, v + int16 remainders", "fp8 m, v + 8-bit remainders")}
    assert {k["commit"] for k in kernels} == set(data["sources"])
    errors, ends = [], []
    for k in kernels:
        fraction, _, t = sass_budget.predict(k["per"], k["bytes"], "H200")
        a = max(v for key, v in t.items() if key != "memory") / t["memory"]
        errors.append(sass_budget.calibrated(a) - k["measured"])
        ends.append((fraction - k["measured"], 1.0 / (1.0 + a) - k["measured"]))
    worst = max(map(abs, errors))
    assert worst <= 0.10, [(k["kernel"], k["commit"], round(e, 3))
                           for k, e in zip(kernels, errors)]
    assert worst == pytest.approx(0.042, abs=0.005)  # (the fit's, as the tool's comment says)
    assert max(o for o, _ in ends) == pytest.approx(0.447, abs=0.005)
    assert min(s for _, s in ends) == pytest.approx(-0.200, abs=0.005)
    assert all(k["kernel"] == sass_budget.ADVERTISED[tuple(k["dtypes"])] for k in kernels)


# The calibrated model's H200 fraction of a copy at 1B params (sass_budget.calibrated) of
# each advertised kernel, that CI holds (bench/RESULTS.md, "The SASS model calibrated on
# the H200", 2026-11-30; the L2 term's select, csrc/rules.h precis_l2, 2026-12-02: -0.5 to
# +1.2 points): a change that the model predicts slower by more than half a
# point fails here (nvcc 13.0's code, read where $PRECIS_CUDA_LIBRARY names
# libprecis_cuda.so, is within 0.2 of NVRTC 12.9's); one it predicts faster raises the
# figure.
H200_FIT = {
    "fp32": 0.946, "bf16 default": 0.832, "bf16 default, fp32 grads": 0.859,
    "bf16 int16 remainders": 0.785, "bf16 fp8 moments": 0.662,
    "fp8 m, v + int16 remainders": 0.585, "fp8 m, v + 8-bit remainders": 0.526,
    "bf16 fp16 moments": 0.558, "bf16 fp32 moments": 0.933, "fp16 default, fp32 grads": 0.924,
    "fp16 default": 0.887, "fp32 bf16 moments": 0.856, "fp32 fp16 moments": 0.607,
    "fp32 fp8 moments": 0.694,
}


@pytest.mark.parametrize("policy", list(sass_budget.ADVERTISED.values()))
def test_calibrated_h200_prediction_held(rows, policy):
    dt, = [k for k, v in sass_budget.ADVERTISED.items() if v == policy]
    row, = [r for r in rows if r["dtypes"] == dt and r["arch"] == "sm_90"]
    fit = sass_budget.calibrated(row["predictions"]["H200"][2])
    assert fit >= H200_FIT[policy] - 0.005, (policy, round(fit, 4), H200_FIT[policy])


@pytest.fixture(scope="module")
def staged_rows():
    """The rows of the staged hot loop (PR_ADAM_STAGED=1), the candidate that keeps the
    next group's loads in flight: not the shipped default until a GPU has timed it
    (bench/kernel_variants.py), so compiled here for the check."""
    return sass_budget.run(None, ["PR_ADAM_STAGED=1"])


@pytest.mark.parametrize("policy", list(sass_budget.ADVERTISED.values()))
def test_loads_in_flight_cover_the_latency(staged_rows, policy):
    """Little's law on the H200 (sm_90 code) for the staged loop: the reads an SM has in
    flight, resident warps x a warp's mean bytes loaded and not yet used over its hot
    loop, cover the bandwidth x the latency."""
    dt, = [k for k, v in sass_budget.ADVERTISED.items() if v == policy]
    row, = [r for r in staged_rows if r["dtypes"] == dt and r["arch"] == "sm_90"]
    f = sass_budget.little(row, "H200", sass_budget.kernel_constants()["threads"])
    assert f["have"] >= f["need"], (policy, f, row["warp_in_flight"], row["registers"])


def test_in_flight_and_occupancy_on_made_up_loops():
    """A loop that loads and at once uses what it loaded has almost nothing in flight
    over its instructions; one that copies the next group (LDGSTS) and waits (DEPBAR)
    at its top has the copies in flight all through its arithmetic. Registers to warps:
    128 a thread, 2 blocks of 256 an SM (16 warps); 80, 3 (24); 255, 1 (8)."""
    body = [("FFMA", "R0, R0, R0, R0", "")] * 98
    wait_and_use = [("LDG.E.128", "R4, desc[UR4][R2.64]", ""),
                    ("FADD", "R0, R4, R5", "")] + body
    peak, mean, distance = sass_budget.in_flight(wait_and_use)
    assert (peak, distance) == (512, 1) and mean == pytest.approx(512 / 100)
    ahead = [("DEPBAR.LE", "SB0, 0x0", ""), ("LDS.128", "R4, [R1]", ""),
             ("LDGSTS.E.BYPASS.128", "[R1], desc[UR4][R2.64]", "")] + body[:-1]
    peak, mean, distance = sass_budget.in_flight(ahead)
    assert (peak, distance) == (512, 98) and mean == pytest.approx(512 * 98 / 100)
    assert [sass_budget.occupancy(r, 256) for r in (128, 80, 255)] == [16, 24, 8]
    row = {"registers": 128, "warp_in_flight": 512 * 98 / 100, "read_share": 0.5}
    f = sass_budget.little(row, "H200", 256)
    assert f["need"] == pytest.approx(4.8e12 * 0.5 * 1e-6 / 132)
    assert f["have"] == pytest.approx(16 * 512 * 98 / 100) and f["have"] < f["need"]


def test_kernel_variants_dry_run():
    """bench/kernel_variants.py --dry-run lists every variant (its -D knobs, which
    cuda/step.cu reads, the default variant's being step.cu's defaults), every advertised
    policy and both sizes, without a GPU."""
    import subprocess
    script = os.path.join(ROOT, "bench", "kernel_variants.py")
    out = subprocess.run([sys.executable, script, "--dry-run"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    variants = [line for line in out.splitlines() if line.startswith("variant ")]
    assert len(variants) == 6, out
    src = open(os.path.join(ROOT, "cuda", "step.cu")).read()
    default, = [v for v in variants if "(default)" in v]
    for knob, value in re.findall(r"-D(PR_ADAM_\w+)=(\d+)", default):
        assert f"#define {knob} {value}\n" in src, (knob, value)
    for name in sass_budget.ADVERTISED.values():
        assert f"policy {name}: adam_kernel<" in out
    assert "sizes 100M" in out and "1B" in out
    assert f"{6 * len(sass_budget.ADVERTISED) * 2} timings" in out


def test_kernel_variants_set_the_model_beside_each_measurement(rows):
    """bench/kernel_variants.py reads each variant's predictions at --build
    (predictions: the calibrated H200 fit of every advertised kernel, its SASS counts);
    on the GPU its table puts the fit beside each 1B measurement, and --json's points
    carry the counts, in tools/sass_calibration.json's form, to recalibrate the model."""
    import kernel_variants
    predicted = kernel_variants.predictions(rows)
    assert set(predicted) == set(sass_budget.ADVERTISED.values())
    default = predicted["bf16 default"]
    fraction, _, t = sass_budget.predict(default["per"], default["bytes"], "H200")
    assert default["fit"] == pytest.approx(sass_budget.calibrated(
        max(v for k, v in t.items() if k != "memory") / t["memory"]))
    built = {"commit": "abc1234", "variants": {"plain-b2": predicted}}
    results = {"plain-b2": [{"policy": "bf16 default", "size": "1B", "ms": 5.5,
                             "copy_ms": 4.6, "pct": 83.6},
                            {"policy": "bf16 default", "size": "100M", "ms": 0.6,
                             "copy_ms": 0.5, "pct": 80.0}]}
    text = kernel_variants.table(results, ["100M", "1B"], ["bf16 default"], built)
    assert f"| bf16 default | 1B | 84%* ({100 * default['fit']:.0f}) |" in text, text
    assert "| bf16 default | 100M | 80%* |" in text, text  # (the fit is for 1B only)
    point, = kernel_variants.calibration_points(results, built, {"1B": 183, "100M": 75})
    with open(sass_budget.CALIBRATION) as f:
        keys = set(json.load(f)["kernels"][0])
    assert keys <= set(point) and point["measured"] == pytest.approx(0.836)
    assert (point["variant"], point["commit"], point["tensors"]) == ("plain-b2", "abc1234", 183)
    assert point["per"] == default["per"] and point["dtypes"] == list(default["dtypes"])


def test_model_numbers():
    """The model's arithmetic on made-up counts: memory-bound under the budget, bound by
    the busiest limit over it; the H100 figures give 132 SMs x 1.98 GHz."""
    h100 = sass_budget.GPUS["H100"]
    assert h100["tflops"] * 1e12 / 2 / h100["fp32_lanes"] == pytest.approx(132 * 1.98e9,
                                                                            rel=1e-3)
    per = {p: 0.0 for p in sass_budget.PIPES}
    per["fma"] = 100.0
    fraction, bound, t = sass_budget.predict(per, 16.0, "H100")
    assert bound == "memory" and fraction == 1.0  # 100 FMAs in 16 bytes' 1.25 clocks
    per["alu"] = 160.0  # 2.5 clocks at 64 per clock, about twice the memory's time
    fraction, bound, t = sass_budget.predict(per, 16.0, "H100")
    assert bound == "alu" and fraction == pytest.approx(t["memory"] / 2.5)
    assert t["memory"] == pytest.approx(16 / (3.35e12 / (132 * 1.98e9)), rel=1e-3)
    assert sass_budget.bytes_per_element(("bf16", "bf16", "master", "fp32", "bf16", "bf16")) == 20
    assert sass_budget.bytes_per_element(
        ("bf16", "bf16", "remainder8", "fp8", "fp8", "fp8")) == pytest.approx(12 + 16 / 128)


@pytest.mark.parametrize("config", ["fp32", "bf16", "remainders", "fp8", "fp8-rem", "fp8-rem8"])
def test_bench_moves_the_models_bytes(config):
    """bench/adam_cuda.py's bytes a step moves, read from the tensors it steps (CPU
    ones here, sizes whole scale blocks), are the model's bytes_per_element for the
    kernel of that config's policy: the measured % of copy and the predicted one count
    the same bytes."""
    import adam_cuda
    cfg = adam_cuda.CONFIGS[config]
    sizes = [128 * 33, 256, 128]
    state = adam_cuda.make_state(cfg, sizes, torch.device("cpu"))
    kernel, = [k for k in kernels_of(cfg[0], adam_cuda.POLICIES[config])
               if k[0] == NAMES[cfg[1]]]
    assert adam_cuda.moved_bytes(state) / sum(sizes) == \
        pytest.approx(sass_budget.bytes_per_element(kernel), rel=1e-12)

