"""precis.ddp on 1, 2 and 3 CPU processes (gloo) against one process training on
the concatenated batch: the same params after 3 steps of 2 micro-batches, for
every sharding strategy and several precision policies.

Tolerances:
  fp32 buffers and fp32 on the wire: 1e-6 (only the summation order differs).
  fp32 model, bf16 on the wire: 3 steps * lr * 2^-6 = 4.7e-4 (each reduced gradient
    is rounded to bf16, relative error <= 2^-9; Adam's update moves by at most
    about that fraction of lr per step).
  bf16 models: 2 bf16 ulps of each param + the 4.7e-4 above (the gradients are
    rounded to bf16 at other points than in the single-process run: per
    micro-batch and after the reduction; that moves the fp32 master weights as bf16
    comm does, and the bf16 param may then round the other way).
World size 3 does not divide the model's 148 elements, nor its buckets: the
shards are uneven and padded.
"""
import warnings

import pytest
import torch

import ddp_worker as w
from state_snapshot import state_pieces

STEPS = 3
STRATEGIES = ("no_shard", "optim", "optim_grads")
POLICIES = {  # name -> (model dtype, policy overrides)
    "fp32": (torch.float32, None),
    "fp32_bf16comm": (torch.float32, {"grad_comm_dtype": "bf16"}),
    "bf16": (torch.bfloat16, None),
    "bf16_fp32grads": (torch.bfloat16, {"main_grads_dtype": "fp32"}),
    # bf16 on the wire, fp32 sums (precis.grad_sums)
    "fp32_bf16comm_fp32sums": (torch.float32, {"grad_comm_dtype": "bf16",
                                               "grad_sum_dtype": "fp32"}),
    "bf16_fp32sums": (torch.bfloat16, {"grad_sum_dtype": "fp32"}),
}
# Bucket layouts of the fp32 model: 2 buckets (the default of these tests), one per
# param, one for everything; and reductions only at the end of backward.
VARIANTS = {
    "buckets2": dict(bucket_size=50),
    "buckets_per_param": dict(bucket_size=1),
    "one_bucket": dict(bucket_size=None),
    "no_overlap": dict(bucket_size=50, overlap_grad_reduce=False),
}
SCENARIOS = [(s, p, "buckets2") for p in POLICIES for s in STRATEGIES] + \
    [(s, "fp32", v) for v in VARIANTS if v != "buckets2" for s in STRATEGIES]


def scenario_id(s):
    return "-".join(s)


def train_scenario(rank, world_size, strategy, policy_name, variant):
    """This rank's final params of one scenario."""
    import precis.optim
    dtype, policy = POLICIES[policy_name]
    with warnings.catch_warnings():
        # The optimizer must never think the DDP wrote its params behind its back.
        warnings.simplefilter("error", precis.optim.StaleMasterWarning)
        ddp, _ = w.train_ddp(rank, world_size, STEPS, dtype=dtype, policy=policy,
                             sharding=strategy, **VARIANTS[variant])
    return w.flat_params(ddp.module)


# Every rank handed the whole batch: the reduced gradient is each rank's own, exactly
# (bf16 on the wire, fp32 sums of equal copies, scaled by 1/W and rounded once), so a
# sharded optimizer steps pieces of the gradients one process steps whole (and a param
# of no wrapper after them, whole). Its
# stochastic rounding, keyed by the whole param (its stream) and each element's place
# in it, must then give one process's bits at every world size. Block-scaled fp16 /
# fp8 moments too: the wrapper, given their policy, cuts shards at their 128-element
# blocks (the model is wide enough for shards to cut its weights: 320 and 448
# elements).
SAME_GRADS = {"bf16 default": None, "remainders": {"store_param_remainders": True},
              "8-bit remainders": {"store_param_remainders": True, "param_remainder_bits": 8},
              "fp16 m, fp8 v": {"exp_avg_dtype": "fp16", "exp_avg_sq_dtype": "fp8"}}
SAME_GRADS_SCENARIOS = [(s, p) for p in SAME_GRADS for s in ("optim", "optim_grads")]
# SGD and Lion (issue #44): their one state, the momentum, under the key 'exp_avg';
# fp8 momentum is block-scaled and rounded stochastically (the keys of every piece),
# and the wrapper, given the policy, cuts shards at its blocks. "fp8 momentum_dtype":
# the same momentum asked for by momentum_dtype alone (exp_avg_dtype stays bf16).
ONE_STATE_POLICIES = {"bf16 default": None, "fp8 m + 8-bit remainders": w.FP8_MOMENTUM_REM8,
                      "fp8 momentum_dtype + 8-bit remainders": {
                          "momentum_dtype": "fp8", "store_param_remainders": True,
                          "param_remainder_bits": 8}}
SAME_GRADS_SCENARIOS += [(s, p, opt) for opt in w.ONE_STATE for p in ONE_STATE_POLICIES
                         for s in ("optim", "optim_grads")
                         if opt == "sgd" or "momentum_dtype" not in p]
SAME_GRADS_POLICIES = {**SAME_GRADS, **ONE_STATE_POLICIES}
WIDE = 64  # the same-gradients model's first hidden width


def extra_param():
    """A param of no wrapper, stepped by the same optimizer after the model's (its stream
    must not depend on how many pieces a rank holds before it)."""
    return torch.nn.Parameter(torch.linspace(-1, 1, 37).to(torch.bfloat16))


def extra_grad(step):
    return torch.cos(torch.arange(37.0) * (step + 1)).to(torch.bfloat16)


def train_same_grads(rank, world_size, strategy, policy_name, optimizer="adamw"):
    """(this rank's final params, the state of the tensors it steps); optimizer: a
    name of ddp_worker.OPTIMIZERS."""
    import precis.ddp
    policy = dict(SAME_GRADS_POLICIES[policy_name] or {}, grad_sum_dtype="fp32")
    ddp = precis.ddp.DistributedDataParallel(w.make_model(torch.bfloat16, hidden1=WIDE),
                                             policy=policy, sharding=strategy, bucket_size=50)
    extra = extra_param()
    opt = precis.ddp.attach_optimizer(w.make_optimizer(
        optimizer, list(ddp.parameters()) + [extra], policy=SAME_GRADS_POLICIES[policy_name]))
    for step, (x, y) in enumerate(w.make_batches(STEPS)):
        w.loss_fn(ddp, x, y, w.GLOBAL_BATCH).backward()
        extra.grad = extra_grad(step)
        opt.step()
        opt.zero_grad()
    params = torch.cat([w.flat_params(ddp.module), extra.detach().float()])
    return params, state_pieces(opt, precis.ddp.optimizer_pieces(opt))


def same_grads_reference(policy_name, optimizer="adamw"):
    """One process stepping whole params: (params, state of each whole param)."""
    model, extra = w.make_model(torch.bfloat16, hidden1=WIDE), extra_param()
    opt = w.make_optimizer(optimizer, list(model.parameters()) + [extra],
                           policy=SAME_GRADS_POLICIES[policy_name])
    for step, (x, y) in enumerate(w.make_batches(STEPS)):
        w.loss_fn(model, x, y, w.GLOBAL_BATCH).backward()
        extra.grad = extra_grad(step)
        opt.step()
        opt.zero_grad()
    pieces = [[name, 0, p.numel()] for name, p in model.named_parameters()] + [[None, 0, 37]]
    return torch.cat([w.flat_params(model), extra.detach().float()]), state_pieces(opt, pieces)


CASES = {s: (train_scenario, s) for s in SCENARIOS}  # all run in one world per size
CASES.update({("same grads",) + s: (train_same_grads, s) for s in SAME_GRADS_SCENARIOS})
_references = {}


def reference(policy_name):
    if policy_name not in _references:
        dtype, policy = POLICIES[policy_name]
        _references[policy_name] = w.train_reference(STEPS, dtype, policy)
    return _references[policy_name]


def bf16_ulp(x):
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    mag = x.abs().clamp(min=2.0 ** -126)
    return torch.pow(2.0, torch.floor(torch.log2(mag)) - 7)


def check_close(got, want, policy_name):
    diff = (got - want).abs()
    dtype, policy = POLICIES[policy_name]
    rounded = STEPS * w.OPTIM_KW["lr"] * 2.0 ** -6  # gradients rounded to bf16 somewhere
    if dtype == torch.bfloat16:
        bad = diff > 2 * bf16_ulp(want) + rounded
        assert not bad.any(), (f"{int(bad.sum())} params beyond tolerance; max diff "
                               f"{diff.max().item():.3g}")
    else:
        tol = rounded if policy else 1e-6
        assert diff.max().item() <= tol, f"max diff {diff.max().item():.3g} > {tol:.3g}"


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=scenario_id)
def test_matches_single_process(world_size, scenario):
    by_rank = w.case_result(CASES, world_size, scenario)
    for rank, got in enumerate(by_rank[1:], 1):  # every rank holds the same model
        assert torch.equal(got, by_rank[0]), f"rank {rank} differs from rank 0"
    assert not torch.equal(by_rank[0], w.flat_params(w.make_model(POLICIES[scenario[1]][0]))), \
        "the params did not move"
    check_close(by_rank[0], reference(scenario[1]), scenario[1])


def assert_piece_state(got, wholes, piece, who):
    """A piece's state (state_pieces) is its elements of the whole param's state."""
    name, start, stop = piece
    want = wholes[name]
    assert got.keys() == want.keys(), (name, got.keys(), want.keys())
    for key, value in got.items():
        whole = want[key]
        # a block scale per 128 elements: the piece's blocks (it starts on one)
        lo, hi = (start // 128, -(-stop // 128)) if key.endswith("_scale") else (start, stop)
        expected = whole[lo:hi] if torch.is_tensor(whole) else whole
        assert (torch.equal(value, expected) if torch.is_tensor(value)
                else value == expected), f"{who}: {name}[{start}:{stop}] {key} differs"


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("scenario", SAME_GRADS_SCENARIOS, ids=scenario_id)
def test_same_gradients_give_one_process_bits(world_size, scenario):
    want_params, want_state = same_grads_reference(*scenario[1:])
    wholes = {name: state for (name, _, _), state in want_state.items()}
    by_rank = w.case_result(CASES, world_size, ("same grads",) + scenario)
    for rank, (params, state) in enumerate(by_rank):
        assert torch.equal(params, want_params), f"rank {rank}: the params differ"
        assert state, f"rank {rank} stepped nothing"
        for piece, got in state.items():
            assert_piece_state(got, wholes, piece, f"rank {rank} of {world_size}")
    cut = [piece for _, state in by_rank for (name, start, stop) in state
           for piece in [(name, start, stop)]
           if start > 0 or stop < wholes[name]["exp_avg"].numel()]
    assert world_size == 1 or cut, "no piece cuts a param: no shard edge was tested"
    if len(scenario) == 3:  # SGD, Lion: the momentum alone, fp8 (m8 bytes) where asked
        momentum = {k: v for st in want_state.values() for k, v in st.items()}
        assert "exp_avg_sq" not in momentum and "exp_avg" in momentum, momentum.keys()
        fp8 = "fp8" in scenario[1]
        assert all((st["exp_avg"].dtype == torch.uint8) == fp8 for st in wholes.values())


# ---- Muon (issue #44) on precis.ddp --------------------------------------------------
# Muon orthogonalizes each weight matrix whole. `no_shard` keeps whole params in the
# optimizer: every rank steps them, with one process's bits. The ZeRO strategies
# (`optim`, `optim_grads`) hand the optimizer flat pieces of each matrix, and every rank
# a piece of each (empty where the matrix lies in other ranks' shards: at world 3 the
# last 7x3 matrix lies in rank 0's alone): Newton-Schulz runs on the whole matrix,
# assembled from the pieces, so the params and each piece's state are one process's
# bits at every world size. The ZeRO case also saves after step 2 and resumes a fresh
# optimizer from it (bit for bit), and skips a step with a NaN on the last rank only.
MUON_POLICIES = {"bf16 default": None, "fp8 m + 8-bit remainders": w.FP8_MOMENTUM_REM8}
MUON_KW = dict(lr=0.02, weight_decay=0.05)


def muon_model():
    """The same-gradients model without biases: Muon takes 2-D params only."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(w.IN, WIDE, bias=False), torch.nn.Tanh(),
        torch.nn.Linear(WIDE, w.HIDDEN2, bias=False), torch.nn.Tanh(),
        torch.nn.Linear(w.HIDDEN2, w.OUT, bias=False)).to(torch.bfloat16)


def muon_steps(model, opt, batches):
    for x, y in batches:
        w.loss_fn(model, x, y, w.GLOBAL_BATCH).backward()
        opt.step()
        opt.zero_grad()


def train_muon_ddp(rank, world_size, strategy, policy_name, offload_fraction=None):
    """Muon on a precis.ddp wrapper, every rank the whole batch: (params, the state of
    the tensors it steps, and for a ZeRO strategy the params resumed from a save after
    step 2, and whether a step with a NaN on the last rank left everything as it was).
    offload_fraction: Muon's state of that fraction of the matrices on the host (counted
    in whole matrices, so that every rank offloads the same ones)."""
    import io

    import precis.ddp
    import precis.optim
    policy = MUON_POLICIES[policy_name]

    def build():
        ddp = precis.ddp.DistributedDataParallel(
            muon_model(), sharding=strategy, bucket_size=50,
            policy=dict(policy or {}, grad_sum_dtype="fp32"))
        offload = {} if offload_fraction is None else dict(
            offload=True, offload_fraction=offload_fraction)
        return ddp, precis.ddp.attach_optimizer(
            precis.optim.Muon(ddp.parameters(), policy=policy, **MUON_KW, **offload))

    ddp, opt = build()
    batches = w.make_batches(STEPS)
    muon_steps(ddp, opt, batches[:2])
    saved = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "optim": opt.state_dict()}, saved)
    sent = ddp.comm_bytes["broadcast"]
    muon_steps(ddp, opt, batches[2:])
    out = {"params": w.flat_params(ddp.module),
           "state": state_pieces(opt, precis.ddp.optimizer_pieces(opt)),
           "broadcast": ddp.comm_bytes["broadcast"] - sent}  # by the last step
    if offload_fraction is not None:  # the names of the offloaded matrices
        out["offloaded"] = [name for (name, _, _), p in zip(
            precis.ddp.optimizer_pieces(opt), opt.param_groups[0]["params"])
            if opt._books.offload.selected(p)]
    if strategy == "no_shard":
        return out
    saved.seek(0)
    saved = torch.load(saved)
    ddp, opt = build()
    ddp.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    muon_steps(ddp, opt, batches[2:])
    out["resumed"] = w.flat_params(ddp.module)
    if rank == world_size - 1:  # a NaN in the last rank's gradient of the first matrix
        ddp.module[0].weight.register_hook(
            lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))
    before, state_before = w.flat_params(ddp.module), state_pieces(
        opt, precis.ddp.optimizer_pieces(opt))
    x, y = batches[0]
    w.loss_fn(ddp, x, y, w.GLOBAL_BATCH).backward()
    opt.step(grad_scale=1.0)
    out["nan_skipped"] = (opt.last_step_skipped, torch.equal(before, w.flat_params(ddp.module)),
                          _same_state(state_before, state_pieces(
                              opt, precis.ddp.optimizer_pieces(opt))))
    return out


def muon_nan_outside_wrapper(rank, world_size, strategy, groups):
    """Muon over a ZeRO wrapper's pieces and a matrix of no wrapper (its gradient each
    rank's own), with grad_scale, a NaN in that matrix's gradient on the last rank only:
    (whether the step was skipped, whether everything stayed) on this rank. Every rank
    must skip: one that stepped would wait for the others in each matrix's assembly."""
    import precis.ddp
    import precis.optim
    ddp = precis.ddp.DistributedDataParallel(muon_model(), sharding=strategy, bucket_size=50)
    extra = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    params = list(ddp.parameters())
    param_groups = [{"params": params + [extra]}] if groups == 1 else \
        [{"params": params[:1]}, {"params": params[1:] + [extra], "lr": 0.01}]
    opt = precis.ddp.attach_optimizer(precis.optim.Muon(param_groups, **MUON_KW))
    before = w.flat_params(ddp.module)
    x, y = w.make_batches(1)[0]
    w.loss_fn(ddp, x, y, w.GLOBAL_BATCH).backward()
    extra.grad = torch.ones(4, 4, dtype=torch.bfloat16)
    if rank == world_size - 1:
        extra.grad[0, 0] = float("nan")
    opt.step(grad_scale=1.0)
    return opt.last_step_skipped, torch.equal(before, w.flat_params(ddp.module)) and \
        torch.equal(extra.detach(), torch.ones(4, 4, dtype=torch.bfloat16))


def muon_and_adamw(model):
    """The README's pairing: Muon on the weight matrices (two groups, two lrs), AdamW on
    the biases."""
    import precis.optim
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    return [precis.optim.Muon([{"params": weights[:2]}, {"params": weights[2:], "lr": 0.01}],
                              **MUON_KW),
            precis.optim.AdamW(biases, **w.OPTIM_KW)]


def paired_steps(model, opts):
    for x, y in w.make_batches(STEPS):
        w.loss_fn(model, x, y, w.GLOBAL_BATCH).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


def muon_with_an_adamw_group(model):
    """muon_and_adamw's pairing as one optimizer: the biases in an "adamw" group."""
    import precis.optim
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    return [precis.optim.Muon([{"params": weights[:2]}, {"params": weights[2:], "lr": 0.01},
                               {"params": biases, "algorithm": "adamw", **w.OPTIM_KW}],
                              **MUON_KW)]


def train_muon_pairing(rank, world_size, strategy, one_optimizer):
    """Muon and AdamW attached to one wrapper, as two optimizers (muon_and_adamw) or as
    one (muon_with_an_adamw_group): this rank's final params."""
    import precis.ddp
    ddp = precis.ddp.DistributedDataParallel(w.make_model(torch.bfloat16, hidden1=WIDE),
                                             sharding=strategy, bucket_size=50,
                                             policy={"grad_sum_dtype": "fp32"})
    make = muon_with_an_adamw_group if one_optimizer else muon_and_adamw
    opts = [precis.ddp.attach_optimizer(opt) for opt in make(ddp.module)]
    paired_steps(ddp, opts)
    return w.flat_params(ddp.module)


def _same_state(a, b):
    return a.keys() == b.keys() and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k])
                                     else x[k] == y[k] for k in x)
        for x, y in zip(a.values(), b.values()))


def muon_reference(policy_name):
    """One process (one thread, as the ranks: the Newton-Schulz matmuls)."""
    import precis.optim
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = muon_model()
        opt = precis.optim.Muon(model.parameters(), policy=MUON_POLICIES[policy_name], **MUON_KW)
        muon_steps(model, opt, w.make_batches(STEPS))
    finally:
        torch.set_num_threads(threads)
    pieces = [[name, 0, p.numel()] for name, p in model.named_parameters()]
    return w.flat_params(model), state_pieces(opt, pieces)


CASES.update({("muon", s, p): (train_muon_ddp, (s, p))
              for p in MUON_POLICIES for s in STRATEGIES})
# Offloaded: half the elements, counted in whole matrices: the first matrix (320 of
# 789) and the last (21) on every rank. By the pieces' own sizes the ranks would pick
# differently, and with CUDA params (device calls first) gather in different orders.
CASES.update({("muon", s, p, 0.5): (train_muon_ddp, (s, p, 0.5))
              for p in MUON_POLICIES for s in ("optim", "optim_grads")})


CASES.update({("muon nan", s, n): (muon_nan_outside_wrapper, (s, n))
              for s in ("optim", "optim_grads") for n in (1, 2)})
CASES.update({("muon and adamw", s): (train_muon_pairing, (s, False)) for s in STRATEGIES})
CASES.update({("muon with an adamw group", s): (train_muon_pairing, (s, True))
              for s in ("optim", "optim_grads")})


def pairing_reference():
    """The params after train_muon_pairing's steps in one process, Muon and AdamW
    unwrapped (one thread, as the ranks: the Newton-Schulz matmuls)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = w.make_model(torch.bfloat16, hidden1=WIDE)
        paired_steps(model, muon_and_adamw(model))
    finally:
        torch.set_num_threads(threads)
    return w.flat_params(model)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_muon_and_adamw_on_one_wrapper_give_one_process_bits(strategy, world_size):
    """Muon on the matrices and AdamW on the biases, both attached to one wrapper (each
    steps its pieces; Muon's are assembled whole): one process's params, bit for bit."""
    want = pairing_reference()
    assert not torch.equal(want, w.flat_params(w.make_model(torch.bfloat16, hidden1=WIDE)))
    for rank, got in enumerate(w.case_result(CASES, world_size, ("muon and adamw", strategy))):
        assert torch.equal(got, want), f"rank {rank} of {world_size}: the params differ"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_one_optimizer_with_an_adamw_group_gives_the_pairings_bits(strategy, world_size):
    """Muon with an "adamw" group for the biases, attached to a ZeRO wrapper (every group
    gets pieces that can assemble their whole params; the AdamW group steps its own
    elementwise): one process's bits of the two-optimizer pairing."""
    want = pairing_reference()
    for rank, got in enumerate(w.case_result(CASES, world_size,
                                             ("muon with an adamw group", strategy))):
        assert torch.equal(got, want), f"rank {rank} of {world_size}: the params differ"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_muon_ranks_agree_to_skip_a_nan_outside_the_wrapper(strategy, groups, world_size):
    """The wrapper's agreed found_inf sees only its gradient shards; a NaN in a param of no
    wrapper is seen by one rank alone, and the step's own check must then be agreed on
    by all (it hung: the other ranks waited in the first matrix's assembly)."""
    for rank, r in enumerate(w.case_result(CASES, world_size, ("muon nan", strategy, groups))):
        assert r == (True, True), f"rank {rank} of {world_size}: (skipped, unchanged) {r}"


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("policy_name", MUON_POLICIES)
@pytest.mark.parametrize("strategy", STRATEGIES + ("optim offloaded", "optim_grads offloaded"))
def test_muon_gives_one_process_bits(strategy, world_size, policy_name):
    want_params, want_state = muon_reference(policy_name)
    wholes = {name: state for (name, _, _), state in want_state.items()}
    strategy, *offloaded = strategy.split()
    sizes = dict((name, p.numel()) for name, p in muon_model().named_parameters())
    key = ("muon", strategy, policy_name) + ((0.5,) if offloaded else ())
    by_rank = w.case_result(CASES, world_size, key)
    held = {name: 0 for name in wholes}  # elements of each matrix stepped, over the ranks
    for rank, r in enumerate(by_rank):
        assert torch.equal(r["params"], want_params), \
            f"rank {rank} of {world_size}: the params differ"
        assert len(r["state"]) == len(wholes), "a matrix is missing on this rank"
        for (name, start, stop), got in r["state"].items():
            held[name] += stop - start
            if start < stop:  # an empty piece keeps no state
                assert_piece_state(got, wholes, (name, start, stop), f"rank {rank} of {world_size}")
        if offloaded:
            assert r["offloaded"] == ["0.weight", "4.weight"], (rank, r["offloaded"])
        # The assembly's price: each matrix's bf16 direction, once per step (none at
        # world 1, nor with whole params)
        sharded = strategy != "no_shard" and world_size > 1
        assert r["broadcast"] == (2 * sum(sizes.values()) if sharded else 0), \
            (rank, r["broadcast"])
        if strategy != "no_shard":
            assert torch.equal(r["resumed"], want_params), f"rank {rank}: resumed differs"
            assert r["nan_skipped"] == (True, True, True), (rank, r["nan_skipped"])
    assert held == {name: sizes[name] * (world_size if strategy == "no_shard" else 1)
                    for name in sizes}, held
    if strategy != "no_shard" and world_size > 1:
        cut = [piece for r in by_rank for piece in r["state"]
               if 0 < piece[2] - piece[1] < sizes[piece[0]]]
        assert cut, "no piece cuts a matrix: no shard edge was tested"
    assert not torch.equal(want_params, w.flat_params(muon_model())), "nothing moved"
