"""How well gradient release's clipping (precis.optim.release_gradients(max_norm=...))
estimates the global gradient norm it cannot know yet, and what the estimate costs in
validation loss, on bench/train_llm.py's pretraining loop (the small Llama, lr 2e-3 with
its warmup and cosine, clipping at norm 1.0, precis AdamW's default policy).

The release steps each param in backward and clips it by an estimate of the global
norm: the squared norm so far over the share of the total that the same step calls held
in past backwards, averaged with precis.release_clipping.SHARE_DECAY (0: the previous
backward's shares alone). Two measurements:

  * replay (default): one released run records, per backward, the squared norm so far
    after each step call; each decay is replayed on those records. Columns: the error
    of the norm a call was clipped by against the backward's true norm, |log(estimate /
    true)| weighted by each call's share of the squared norm, its mean over the steps and
    its worst step.
  * --train-seeds N: N seeds of the ordinary loop (exact clipping: clip_grad_norm_) and
    of a release per decay; the final validation loss, its mean and spread, and the
    paired difference (release minus ordinary, same seed).

    .venv/bin/python bench/release_clipping.py [--seed 0] [--decays 0,0.5,0.8]
        [--train-seeds 8] [--steps 200] [--threads 1]
"""
import argparse
import math
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "torch_ext"))

import llama  # noqa: E402
import machine  # noqa: E402
import precis  # noqa: E402
import precis.release_clipping  # noqa: E402
import train_llm  # noqa: E402

RUN = train_llm.RUN_SIZES["small"]
LR = train_llm.REGIMES["pretrain"]


def train(seed, steps, decay=None):
    """One run of train_llm's loop, released with SHARE_DECAY = decay (None: the
    ordinary loop, exact clipping). Returns (final validation loss, per backward of a
    release: the squared norm so far after each step call)."""
    model = llama.Llama(llama.LlamaConfig.named(RUN.model), seed=seed).to(torch.bfloat16)
    torch.manual_seed(seed)
    optimizer = train_llm.precis_adamw()(model, LR)
    release, profiles = None, []
    if decay is not None:
        # Before the release's hooks, on each param (one step call each): its squared
        # norm added to this backward's record, in the order the release steps them.
        def record(p):
            norm = float(torch.linalg.vector_norm(p.grad, dtype=torch.float64))
            squares = norm * norm  # as the release squares it
            profiles[-1].append(squares + (profiles[-1][-1] if profiles[-1] else 0.0))
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(record)
        precis.release_clipping.SHARE_DECAY = decay
        release = precis.optim.release_gradients(optimizer, max_norm=train_llm.GRAD_CLIP)
    batches = llama.byte_batches("train", RUN.batch, RUN.seq, seed)
    for step in range(1, steps + 1):
        train_llm.set_lr(optimizer, train_llm.lr_at(step, steps, LR))
        x, y = next(batches)
        profiles.append([])
        model.loss(x, y).backward()
        if release is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train_llm.GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    val = llama.byte_batches("val", RUN.batch, RUN.seq, train_llm.VAL_SEED)
    with torch.no_grad():
        loss = statistics.mean(float(model.loss(*next(val)).float())
                               for _ in range(RUN.val_batches))
    return loss, profiles


def replay(profiles, decay):
    """(mean, worst) over backwards 2.. of the weighted |log(estimate / true norm)|."""
    shares, errors, last_norm = [], [], None
    for squares in profiles:
        total = squares[-1]
        if shares:
            error, before = 0.0, 0.0
            for so_far, share in zip(squares, shares):
                estimate = precis.release_clipping.estimated_squares(so_far, share, last_norm)
                error += (so_far - before) / total * abs(0.5 * math.log(estimate / total))
                before = so_far
            errors.append(error)
        shares = precis.release_clipping.averaged_shares(shares, squares, total, decay)
        last_norm = math.sqrt(total)
    return statistics.mean(errors), max(errors)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="the replay's run")
    ap.add_argument("--decays", default="0,0.5,0.8", help="SHARE_DECAY values, comma-separated")
    ap.add_argument("--train-seeds", type=int, default=0,
                    help="train this many seeds per row instead of replaying")
    ap.add_argument("--steps", type=int, default=RUN.steps)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    decays = [float(d) for d in args.decays.split(",") if d]
    if not all(0.0 <= d < 1.0 for d in decays):
        ap.error("--decays: each in [0, 1)")
    print(f"machine: {machine.cpu_model()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, precis.cpu_isa() {precis.cpu_isa()}")
    print(f"bench/train_llm.py small, pretrain (lr {LR}), {args.steps} steps, clipping at "
          f"{train_llm.GRAD_CLIP}, precis AdamW default policy\n")
    if not args.train_seeds:
        _, profiles = train(args.seed, args.steps, decay=decays[0])
        print(f"seed {args.seed}, {len(profiles[0])} step calls a backward\n")
        print("| SHARE_DECAY | mean error | worst step's error |")
        print("|---|---|---|")
        for decay in decays:
            mean, worst = replay(profiles, decay)
            print(f"| {decay:g} | {mean:.4f} | {worst:.3f} |")
        return 0
    seeds = range(args.train_seeds)
    ordinary = [train(seed, args.steps)[0] for seed in seeds]
    print("| row | val loss, mean ± sd | paired difference, mean ± sd |")
    print("|---|---|---|")
    print(f"| ordinary (exact clipping) | {statistics.mean(ordinary):.4f} ± "
          f"{statistics.stdev(ordinary):.4f} | |")
    for decay in decays:
        released = [train(seed, args.steps, decay)[0] for seed in seeds]
        paired = [r - o for r, o in zip(released, ordinary)]
        print(f"| release, SHARE_DECAY {decay:g} | {statistics.mean(released):.4f} ± "
              f"{statistics.stdev(released):.4f} | {statistics.mean(paired):+.4f} ± "
              f"{statistics.stdev(paired):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
