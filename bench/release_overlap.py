"""Can a released step overlap backward on the CPU? Gradient release
(precis.optim.release_gradients) steps each param in its gradient hook, on the thread
that runs backward, so on the CPU its steps add to backward's time. Backward leaves a
core idle part of the time (its many small ops), so this bench measures the one way a
host could fill it: the steps handed to a second thread.

Variants, each run in processes of its own (a thread that has done OpenMP work changes
how the whole process's OpenMP threads wait, so variants never share a process):
  hook:   the ordinary loop and precis's release (steps in the hooks);
  thread: the ordinary loop and a release whose steps run on one worker thread: a hook
          hands the param to it; the worker steps it with the functional core call the
          release makes (bench/release.py's step_released); the training step waits
          for the worker after backward and frees the gradients then (a worker that set
          p.grad = None while backward ran crashed the process: SIGSEGV in the main
          thread's hooks, 5 processes of 25), so this variant times the overlap, not the
          memory. The worker's OpenMP regions take torch's thread count (--threads:
          torch's per-thread init sets it), a team of their own when above 1;
  thread-1: the same, the worker's OpenMP at one thread (no team of its own);
  idle:   the ordinary loop and precis's release, after a second thread ran one torch op
          and stays parked (the cost of a worker's mere presence; at --threads 1 its op
          runs no OpenMP region).
In each process the rows take turns a training step at a time (bench/release.py's
Row without its gradient-bytes hook: bench/llama.py's model, batches and precis AdamW),
and at the end every row's
params must equal the ordinary row's (the same gradients give the same bits). The
driver runs the variants in turn, --processes times, and prints the medians per
process and each row's ratio to the ordinary row of its process (median of the paired
rounds; < 1: slower).

    PYTHONPATH=torch_ext .venv/bin/python bench/release_overlap.py [--size small]
        [--policy fp8-rem8] [--threads 2] [--repeat 15] [--processes 3]
"""
import argparse
import ctypes
import ctypes.util
import glob
import json
import os
import queue
import statistics
import subprocess
import sys
import threading

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "torch_ext"))

import machine  # noqa: E402
import precis  # noqa: E402
import release  # noqa: E402

VARIANTS = ("hook", "thread", "thread-1", "idle")


class WorkerRow(release.Row):
    """A release whose steps run on one worker thread (the bench's own hooks; the
    library's release steps in the hook)."""

    def __init__(self, config, batch, seq, policy, one_thread):
        super().__init__(config, batch, seq, policy, False, 0, count_bytes=False)
        self.one_thread = one_thread
        self.work = queue.Queue()
        self.failure = None
        self.changed = None  # what this backward's first step found written behind
        places = {id(p): (gi, i) for gi, group in enumerate(self.optimizer.param_groups)
                  for i, p in enumerate(group["params"])}
        for p in self.model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: self.work.put(places[id(p)]))
        ready = threading.Event()
        threading.Thread(target=self.serve, args=(ready,), daemon=True).start()
        ready.wait()

    def serve(self, ready):
        # torch's per-thread init, at this thread's first call, runs at::set_num_threads,
        # which is process-wide beyond OpenMP (it clears oneDNN's cache): done while the
        # main thread waits. thread-1 then sets OpenMP's own per-thread count (not
        # torch.set_num_threads, for the same reason).
        try:
            torch.get_num_threads()
            if self.one_thread:
                openmp().omp_set_num_threads(1)
                if torch.get_num_threads() != 1:
                    raise RuntimeError("the worker's OpenMP threads are not 1")
        except BaseException as error:  # noqa: BLE001 (re-raised by the training step)
            self.failure = error
        ready.set()
        while True:
            gi, i = self.work.get()
            try:
                if self.failure is None:
                    if self.changed is None:  # a backward's first step: one compare, as a release
                        self.changed = precis.release.written_behind_ids(self.optimizer)
                    release.step_released(self.optimizer, gi, i, self.changed)
            except BaseException as error:  # noqa: BLE001 (re-raised by the training step)
                self.failure = error
            finally:
                self.work.task_done()

    def backward(self, loss):
        self.changed = None
        loss.backward()
        self.work.join()  # the worker's steps of this backward
        if self.failure is not None:
            raise self.failure
        for p in self.model.parameters():  # here: the worker must not write .grad
            p.grad = None


def openmp():
    """The OpenMP runtime torch runs on (its bundled libgomp, else the system's)."""
    here = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))
    path = here[0] if here else ctypes.util.find_library("gomp")
    if path is None:
        raise RuntimeError("bench/release_overlap.py: no libgomp found (thread-1 sets the "
                           "worker's OpenMP threads through it)")
    return ctypes.CDLL(path)


def run_variant(args):
    """One process's rows: a dict of their step times and whether their bits agree."""
    torch.set_num_threads(args.threads)
    config, batch, seq = release.MODELS[args.size]
    policy = release.POLICIES[args.policy]
    if args.variant == "idle":
        done, parked = threading.Event(), threading.Event()

        def one_op_then_park():
            torch.ones(1 << 20).sum()  # its first torch call: torch's per-thread init too
            done.set()
            parked.wait()  # alive: an exiting thread would hand its OpenMP pool back
        threading.Thread(target=one_op_then_park, daemon=True).start()
        done.wait()  # before the rows: that init is process-wide (as in WorkerRow)
    rows = [release.Row(config, batch, seq, policy, False, 0, count_bytes=False)]
    if args.variant in ("thread", "thread-1"):
        rows.append(WorkerRow(config, batch, seq, policy, args.variant == "thread-1"))
    else:
        rows.append(release.Row(config, batch, seq, policy, True, 0, count_bytes=False))
    for turn in range(args.warmup + args.repeat):
        for k in range(len(rows)):
            rows[(turn + k) % len(rows)].step(timed=turn >= args.warmup)
    same = all(torch.equal(a, b) for row in rows[1:]
               for a, b in zip(rows[0].model.parameters(), row.model.parameters()))
    return {"times": [row.times for row in rows], "same_bits": same}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=release.MODELS, default="small")
    ap.add_argument("--policy", choices=release.POLICIES, default="fp8-rem8")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="torch's CPU threads (the main thread's)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--processes", type=int, default=3, help="processes per variant")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one process's
    args = ap.parse_args(argv)
    if args.variant is not None:
        print(json.dumps(run_variant(args)))
        return 0
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: a comma-separated subset of {', '.join(VARIANTS)}")
    print(f"machine: {machine.cpu_model()}, {os.cpu_count()} cores, torch's threads "
          f"{args.threads}, torch {torch.__version__}, precis.cpu_isa() {precis.cpu_isa()}")
    print(f"model: bench/llama.py {args.size}, bf16, precis AdamW policy {args.policy}, "
          f"{args.repeat} rounds after {args.warmup}, {args.processes} processes a variant\n")
    forwarded = [f"--{k}={getattr(args, k)}" for k in
                 ("size", "policy", "threads", "warmup", "repeat")]
    results = {v: [] for v in variants}
    for _ in range(args.processes):
        for v in variants:  # the variants in turn: the VM's drift reaches them alike
            # its stderr shows (a failure's reason); an hour is far past any variant's time
            out = subprocess.run([sys.executable, os.path.abspath(__file__), f"--variant={v}",
                                  *forwarded], check=True, stdout=subprocess.PIPE, text=True,
                                 timeout=3600)
            results[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| variant | process | ordinary ms/step, median | released ms/step, median "
          "| released vs ordinary | same bits |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        for k, r in enumerate(results[v]):
            ordinary, released = r["times"]
            ratio = statistics.median(o / t for o, t in zip(ordinary, released))
            print(f"| {v} | {k + 1} | {1e3 * statistics.median(ordinary):.1f} | "
                  f"{1e3 * statistics.median(released):.1f} | {ratio:.2f}x | "
                  f"{'yes' if r['same_bits'] else 'NO'} |")
    return 0 if all(r["same_bits"] for rs in results.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
