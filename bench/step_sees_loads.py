"""What seeing loads costs the CPU step, and what the step that sees them itself saves
(issue 82): the bf16 default policy (bf16 params, fp32 master, bf16 moments) of AdamW
over --sizes params in transformer-like tensors (bench/adam_cpu.py's), and of SGD
(momentum 0.9) and Lion over as many in 60 equal matrices (bench/rules_cpu.py's), its
steady op call (one adam_step_flat_ over a Plan's Part) timed four ways, round-robin
with bench/adam_reference_loop.c's loops over the same bytes (AdamW 20 bytes a param,
SGD and Lion 16), at one and two threads:

  * "ref loop": the plain C loop, torch's AdamW arithmetic over the policy's bytes,
    no load detection: the limit ("vs ref" = ref ms / row ms);
  * "ref loop seeing loads": that loop also reading each param and taking it as the
    master where it is not the master's rounding (what the issue's target measures);
  * "op, no detection": the op call without record or compare (not a step precis
    takes: a write behind its back would be lost);
  * "op + compare + record (before)": the step before issue 82: a check of the params'
    fingerprints (one C pass over them, as Part.holds made it) and the op recording
    them as it writes;
  * "op seeing loads": the op with fingerprints [empty, kept] (precis_step_tensors_t.
    param_kept): each tile's params compared with its masters' rounding in the loop,
    no pass before, no record;
  * "full path + compare + record (before)": the full path's call (adam_step_ over the
    params' state as lists, step_calls.make_call: first steps, no Plan, a release's
    steps) as it was before: optim_state.written_behind's fingerprint pass, the op
    recording the params as it writes;
  * "full path seeing loads": that call with fingerprints [empty, kept], as the full
    path now makes it for params compared by rounding (Records.by_rule).

Before timing, a check: params written behind the op's back (every 97th element of the
first, the last whole) are taken by the op seeing loads, exactly (else it exits non-zero).

    PYTHONPATH=torch_ext .venv/bin/python bench/step_sees_loads.py [--sizes 5e7]
        [--repeat 5] [--min-time-ms 200] [--threads 1,2] [--rules adam,sgd,lion]
"""
import argparse
import gc
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "torch_ext"))

import adam_cpu  # noqa: E402
import machine  # noqa: E402
import rules_cpu  # noqa: E402
import precis  # noqa: E402
from precis import ops, step_calls, step_plan  # noqa: E402

# the bf16 default's bytes a param: AdamW grad 2, param 2, master 4+4, m 2+2, v 2+2; SGD
# and Lion grad 2, param 2, master 4+4, m 2+2
BYTES = {"adam": 20.0, "sgd": 16.0, "lion": 16.0}


def rule_case(rule, numel, lib):
    """(precis optimizer of bf16 params, its plain and seeing reference loops' steps, the
    scenario's words) for rule."""
    if rule == "adam":
        sizes = adam_cpu.tensor_sizes(numel)
        values = adam_cpu.initial_values(sizes)
        params = adam_cpu.make_params(values, torch.bfloat16)
        opt = precis.optim.AdamW(params, **adam_cpu.HPARAMS)
        plain = adam_cpu.RefStep(lib, adam_cpu.KIND_BF16, values)
        seeing = adam_cpu.RefStep(lib, adam_cpu.KIND_BF16_CHECKED, values)
        return opt, plain.step, seeing.step, f"{len(sizes)} tensors, AdamW"
    shape = rules_cpu.matrix_shape(numel // 60)
    values = rules_cpu.initial_values([shape] * 60, seed=1)
    params = adam_cpu.make_params(values, torch.bfloat16)
    ref_rule, hp = (rules_cpu.REF_SGD, dict(rules_cpu.SGD_HP, weight_decay=0.0)) \
        if rule == "sgd" else (rules_cpu.REF_LION, rules_cpu.LION_HP)
    opt = (precis.optim.SGD if rule == "sgd" else precis.optim.Lion)(params, **hp)
    rules_cpu.load_rules(lib)
    plain, seeing = (rules_cpu.RuleRef(lib, ref_rule, kind, rules_cpu.ref_buffers(kind, values), hp)
                     for kind in (rules_cpu.KIND_BF16, rules_cpu.KIND_BF16_CHECKED))
    return opt, plain.step, seeing.step, \
        f"60 tensors {shape[0]}x{shape[1]}, {'SGD (momentum 0.9)' if rule == 'sgd' else 'Lion'}"


def steady_call(opt):
    """The Plan's one op call of opt (after two steps), its Part, and a runner."""
    books = opt._books
    calls = step_plan.planned_calls(books, opt.state, opt.param_groups, 0)
    if not calls or len(calls) != 1:
        raise RuntimeError(f"expected one planned call, got {calls!r}")
    call = calls[0]
    return call, call.part


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="5e7", help="total params (default 5e7)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--min-time-ms", type=float, default=200.0)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rules", default="adam,sgd,lion")
    args = ap.parse_args()
    print(f"CPU: {machine.cpu_model()}; torch {torch.__version__}")
    numel = int(float(args.sizes))
    with tempfile.TemporaryDirectory() as tmp:
        lib, compiler = adam_cpu.build_reference(tmp)
        print(f"reference loop: {compiler}")
        for rule in args.rules.split(","):
            run_rule(args, rule, numel, lib)
            gc.collect()


def run_rule(args, rule, numel, lib):
    """The check, then the table of one rule."""
    opt, plain_step, seeing_step, words = rule_case(rule, numel, lib)
    params = [p for group in opt.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.randn(p.shape).mul_(1e-2).to(p.dtype)
    opt.step()
    opt.step()  # the second makes the Plan
    call, part = steady_call(opt)
    if not part.sees:
        raise RuntimeError("the Plan's Part does not see writes itself (Part.sees)")
    op = call.op()
    kept = torch.empty(len(call.params), dtype=torch.int64)
    empty = torch.empty(0, dtype=torch.int64)
    record = torch.zeros(len(call.params), dtype=torch.int64)
    base = dict(call.args)
    base.pop("fingerprints", None)
    base.pop("resync", None)
    ranges = precis.fingerprints.Ranges([p.data_ptr() for p in call.params],
                                        [p.numel() * p.element_size() for p in call.params])
    # the full path's call over the same params and state (the Part's views, as lists)
    full = dict(step_calls.make_call(opt._books, 0, opt.param_groups[0], torch.device("cpu"),
                                     False, [(p, p, p.grad, opt.state[p])
                                             for p in params]).args)
    full.pop("fingerprints", None)
    full_kept = torch.empty(len(params), dtype=torch.int64)

    def op_plain():
        op(**base, fingerprints=None)

    def op_today():
        # what the step before issue 82 made: a fingerprint pass over the params and a
        # list compare (Part.holds), the op recording them as it writes
        list(ranges.fingerprints_now())
        op(**base, fingerprints=record)

    def op_seeing():
        op(**base, fingerprints=empty, resync=(kept,))

    def full_today():  # (fingerprints.of: written_behind's compare, its ranges made anew)
        precis.fingerprints.of(params)
        ops.adam_step_(**full, fingerprints=record)

    def full_seeing():
        ops.adam_step_(**full, fingerprints=[empty, full_kept])

    # the check: writes behind the op's back are taken, counted in kept
    op_seeing()
    numels = [p.numel() for p in call.params]
    if kept.tolist() != numels:
        raise RuntimeError(f"a step with nothing written took elements: {kept.tolist()}")
    with torch.no_grad():
        call.params[0].view(-1)[::97] += 1.0
        call.params[-1].add_(1.0)
    op_seeing()
    if len(numels) < 2 or kept[0].item() != numels[0] - -(-numels[0] // 97) or \
            kept[-1].item() != 0:
        raise RuntimeError(f"the op seeing loads took {kept.tolist()} of {numels}")
    print(f"check ({rule}): param 0 written every 97th element: kept {kept[0].item()} of "
          f"{numels[0]} (taken {numels[0] - kept[0].item()}, written "
          f"{-(-numels[0] // 97)}); last param written whole: kept {kept[-1].item()} of "
          f"{numels[-1]}")
    print(f"== {numel / 1e6:g}M params in {words}, bf16 default; ms a step, best of "
          f">= {args.repeat} ==")
    print(f"{'row':38s} {'threads':>7s} {'ms':>9s} {'vs ref':>7s} {'GB/s':>7s}")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        lib.ref_set_num_threads(threads)
        rows = [("ref loop", plain_step), ("ref loop seeing loads", seeing_step),
                ("op, no detection", op_plain),
                ("op + compare + record (before)", op_today),
                ("op seeing loads", op_seeing),
                ("full path + compare + record (before)", full_today),
                ("full path seeing loads", full_seeing)]
        times = adam_cpu.time_round_robin([fn for _, fn in rows], args.repeat,
                                          args.min_time_ms / 1e3)
        for (label, _), seconds in zip(rows, times):
            gbs = BYTES[rule] * numel / seconds / 1e9
            print(f"{label:38s} {threads:7d} {seconds * 1e3:9.3f} "
                  f"{times[0] / seconds:6.2f}x {gbs:7.1f}")


if __name__ == "__main__":
    main()
