"""What seeing loads costs the CPU step, and what the step that sees them itself saves
(issue 82): the bf16 default AdamW (bf16 params, fp32 master, bf16 m and v) over
--sizes params in transformer-like tensors (bench/adam_cpu.py's), its steady op call
(one adam_step_flat_ over a Plan's Part) timed four ways, round-robin with
bench/adam_reference_loop.c's loops over the same bytes, at one and two threads:

  * "ref loop": the plain C loop, torch's AdamW arithmetic over the policy's bytes,
    no load detection: the limit ("vs ref" = ref ms / row ms);
  * "ref loop seeing loads": that loop also reading each param and taking it as the
    master where it is not the master's rounding (what the issue's target measures);
  * "op, no detection": the op call without record or compare (not a step precis
    takes: a write behind its back would be lost);
  * "op + compare + record (today)": the Plan's check of its params' fingerprints
    (Part.holds: one C pass over the params) and the op recording them as it writes;
  * "op seeing loads": the op with fingerprints [empty, kept] (precis_step_tensors_t.
    param_kept): each tile's params compared with its masters' rounding in the loop,
    no pass before, no record.

Before timing, a check: params written behind the op's back (every 97th element, and
one tensor whole) are taken by the op seeing loads, kept per tensor printed.

    PYTHONPATH=torch_ext .venv/bin/python bench/step_sees_loads.py [--sizes 5e7]
        [--repeat 5] [--min-time-ms 200] [--threads 1,2]
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
import precis  # noqa: E402
from precis import step_plan  # noqa: E402

BYTES = 20.0  # the bf16 default's bytes a param: grad 2, param 2, master 4+4, m 2+2, v 2+2


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
    args = ap.parse_args()
    print(f"CPU: {machine.cpu_model()}; torch {torch.__version__}")
    numel = int(float(args.sizes))
    sizes = adam_cpu.tensor_sizes(numel)
    values = adam_cpu.initial_values(sizes)
    with tempfile.TemporaryDirectory() as tmp:
        lib, compiler = adam_cpu.build_reference(tmp)
        print(f"reference loop: {compiler}")
        params = adam_cpu.make_params(values, torch.bfloat16)
        opt = precis.optim.AdamW(params, **adam_cpu.HPARAMS)
        opt.step()
        opt.step()  # the second makes the Plan
        call, part = steady_call(opt)
        op = call.op()
        kept = torch.empty(len(call.params), dtype=torch.int64)
        empty = torch.empty(0, dtype=torch.int64)
        base = dict(call.args)
        base.pop("fingerprints", None)

        def op_plain():
            op(**base, fingerprints=None)

        def op_today():
            # (the other rows write without a record: the compare finds them written,
            # at the same cost: one fingerprint pass and a list compare)
            part.holds()
            op(**base, fingerprints=part.out())
            part.restamp()

        def op_seeing():
            op(**base, fingerprints=empty, resync=(kept,))

        # the check: writes behind the op's back are taken, counted in kept
        op_seeing()
        if not bool((kept == torch.tensor([p.numel() for p in call.params])).all()):
            raise RuntimeError(f"a step with nothing written took elements: {kept.tolist()}")
        with torch.no_grad():
            flat0 = call.params[0].view(-1)
            flat0[::97] += 1.0
            call.params[-1].add_(1.0)
        op_seeing()
        numels = [p.numel() for p in call.params]
        if len(numels) < 2 or kept[0].item() != numels[0] - -(-numels[0] // 97) or \
                kept[-1].item() != 0:
            raise RuntimeError(f"the op seeing loads took {kept.tolist()} of {numels}")
        print(f"check: param 0 written every 97th element: kept {kept[0].item()} of "
              f"{numels[0]} (taken {numels[0] - kept[0].item()}, written "
              f"{-(-numels[0] // 97)}); last param written whole: kept {kept[-1].item()} of "
              f"{numels[-1]}")
        op(**base, fingerprints=part.out())  # the record after the writes, for holds()
        part.restamp()

        print(f"== {numel / 1e6:g}M params in {len(sizes)} tensors, bf16 default AdamW; "
              f"ms a step, best of >= {args.repeat} ==")
        print(f"{'row':34s} {'threads':>7s} {'ms':>9s} {'vs ref':>7s} {'GB/s':>7s}")
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            lib.ref_set_num_threads(threads)
            plain = adam_cpu.RefStep(lib, adam_cpu.KIND_BF16, values)
            seeing = adam_cpu.RefStep(lib, adam_cpu.KIND_BF16_CHECKED, values)
            rows = [("ref loop", plain.step), ("ref loop seeing loads", seeing.step),
                    ("op, no detection", op_plain),
                    ("op + compare + record (today)", op_today),
                    ("op seeing loads", op_seeing)]
            times = adam_cpu.time_round_robin([fn for _, fn in rows], args.repeat,
                                              args.min_time_ms / 1e3)
            ref_s = times[0]
            for (label, _), seconds in zip(rows, times):
                gbs = BYTES * numel / seconds / 1e9
                print(f"{label:34s} {threads:7d} {seconds * 1e3:9.3f} "
                      f"{ref_s / seconds:6.2f}x {gbs:7.1f}")
            del plain, seeing
            gc.collect()


if __name__ == "__main__":
    main()
