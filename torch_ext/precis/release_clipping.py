"""The global gradient norm a gradient release clips by (precis.release's max_norm):
known only once every param was stepped, so each step call is clipped by an estimate of
it, this backward's squared norm so far over the share of the total the same call held
in past backwards (averaged_shares), never below the norm so far (estimated_squares).
Norm holds the books the releases of one release_gradients call share (docs/design.md
section 11.1; bench/release_clipping.py measures the estimate's error)."""

import math
import threading

import torch

from . import device_reads

# The weight of the backwards before in each step call's average share of the squared
# norm (the rest is the last backward's): averaging cut the estimate's mean error by a
# quarter and its worst step's by 2.5x on bench/train_llm.py small
# (bench/release_clipping.py; docs/design.md section 11.1).
SHARE_DECAY = 0.5


def estimated_squares(so_far, share, last_norm):
    """The estimate of a backward's squared global norm after a step call: the squared
    norm so far over the share of the total its call held on average (`share`, None
    before the first backward ends), never below the norm so far; without a share, the
    larger of the norm so far and the previous backward's norm squared. so_far: a float,
    or a float64 tensor (the estimate then one too, made on its device). Divided as a
    multiply by the host's reciprocal, on both: a CUDA tensor divided by a number is
    such a multiply anyway, and a multiply is correctly rounded everywhere."""
    larger = torch.clamp_min if isinstance(so_far, torch.Tensor) else max
    if share is not None and share > 0.0:
        return larger(so_far, so_far * (1.0 / share))
    return larger(so_far, (last_norm or 0.0) ** 2)


def averaged_shares(shares, so_far_by_call, total, decay=None):
    """The average shares after a backward whose squared norm reached so_far_by_call[j]
    after its step call j, of `total` in all: decay (None: SHARE_DECAY as it is now) *
    the old average + (1 - decay) * this backward's; a backward of other calls (a param
    frozen, a bucket more) starts the average anew."""
    decay = SHARE_DECAY if decay is None else decay
    new = [so_far / total for so_far in so_far_by_call]
    if len(new) != len(shares):
        return new
    return [decay * old + (1.0 - decay) * share for old, share in zip(shares, new)]


def positive_or_none(what, value):
    """value, when it is None or a finite number > 0 (max_norm, grad_scale); else
    ValueError, before anything changes."""
    if value is not None and not (isinstance(value, (int, float)) and
                                  not isinstance(value, bool) and
                                  math.isfinite(value) and value > 0):
        raise ValueError(f"release_gradients: {what} must be a finite number > 0, "
                         f"got {value!r}")
    return value


def values(grad):
    """What a norm or a finiteness check reads of a gradient: a sparse one's values
    (coalesced: an index given twice summed, as the dense gradient holds it)."""
    return grad.coalesce().values() if grad.is_sparse else grad


def squared_norm(params, on_device=False):
    """The squared global norm of params' gradients, in float64 (a bf16 gradient's
    squares overflow float32 from 1.8e19 on; a DTensor's: all its shards'): a float,
    or with on_device a float64 tensor on their device (nothing read back). Each
    norm is squared by a multiply, the same on the host and on a device."""
    total = 0.0
    for p in params:
        grad = values(p.grad)
        norm = torch.linalg.vector_norm(  # (a complex one's: real float64 too)
            grad, dtype=torch.complex128 if grad.is_complex() else torch.float64)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if not on_device:
            norm = device_reads.number(norm, "norm")
        total = total + norm * norm
    return total


class Norm:
    """The clipping books the releases of one release_gradients call share (several
    optimizers: one global norm): max_norm, this backward's squared norm so far and its
    profile by step call, the average shares, the last norm; and the hooks' lock. Its
    divisor() is what a step call's gradients are clipped by."""

    max_norm = property(lambda self: self._max_norm,
                        lambda self, value: setattr(self, "_max_norm",
                                                    positive_or_none("max_norm", value)))

    def __init__(self, max_norm):
        self.max_norm = max_norm  # (checked by the property)
        self.lock = threading.RLock()
        self.releases = []  # weak references: the hooks must not keep an optimizer alive
        self.last_norm = None  # the global gradient norm of the last backward (max_norm)
        # per step call of a backward: the share of the backward's squared norm its
        # gradients so far held, averaged over backwards (done)
        self.shares = []
        self.task = None  # the backward the books below are of
        self.sum_squares = 0.0  # of this backward's gradients stepped so far
        self.profile_now = []  # sum_squares after each step call of this backward
        self.open = set()  # ids of the releases of that backward not done yet
        self.checked = None  # the backward whose param groups were checked

    def live(self):
        """The releases still stepping an optimizer (one dropped: its hooks do nothing)."""
        return [r for r in (ref() for ref in self.releases)
                if r is not None and r._optimizer is not None]

    def start(self, task, release):
        """release's first gradient of backward `task`: fresh books at the first
        release's."""
        if task != self.task:
            self.task, self.open, self.checked = task, set(), None
            self.sum_squares, self.profile_now = 0.0, []
        if task is not None:
            self.open.add(id(release))

    def add(self, squares):
        """squares (of gradients stepped) counted in this backward's sum (not in place:
        on a device, the sums so far are in profile_now too)."""
        self.sum_squares = self.sum_squares + squares

    def call_done(self):
        """One step call of this backward done: the sum so far, its point of the profile."""
        self.profile_now.append(self.sum_squares)

    def divisor(self, squares, each=False):
        """What clipping divides gradients whose squared norm is `squares` by: the
        estimated global norm over max_norm (at least 1). The estimate: the squared norm
        so far (the gradients stepped, and these; a non-finite one is skipped by the
        kernel, whatever the divisor) over the share of the total that the same step
        calls held in past backwards (SHARE_DECAY's average), never below the norm so
        far; without a share for this call (the first backward), the larger of the norm
        so far and the previous norm. squares: a float, or a float64 tensor on a GPU (the
        divisor then one too, made there with the host's operations: additions,
        multiplies by the host's reciprocals, an IEEE square root, maxima; each a kernel
        launch a param). each: squares is a list of floats, each param's of a flush (added
        one by one, as the flush adds those stepped)."""
        call = len(self.profile_now)
        share = self.shares[call] if call < len(self.shares) else None
        inv_max_norm = 1.0 / self.max_norm
        if isinstance(squares, torch.Tensor):  # (a non-finite norm counts 0)
            so_far = torch.nan_to_num(squares, nan=0.0, posinf=0.0, neginf=0.0) + \
                self.sum_squares
            bound = torch.sqrt(estimated_squares(so_far, share, self.last_norm))
            return torch.clamp_min(bound * inv_max_norm, 1.0)
        so_far = self.sum_squares
        for sq in (squares if each else [squares]):
            so_far = so_far + (sq if math.isfinite(sq) else 0.0)
        bound = math.sqrt(estimated_squares(so_far, share, self.last_norm))
        return max(bound * inv_max_norm, 1.0)

    def done(self, release):
        """release's backward ended: after the last release's, the norm is read back and
        folded into the average shares."""
        self.open.discard(id(release))
        if self.open:
            return
        if self.max_norm is not None:  # (read back now, where they were left on a device)
            *self.profile_now, self.sum_squares = device_reads.read_numbers(
                self.profile_now + [self.sum_squares], "release norm")
            self.last_norm = math.sqrt(self.sum_squares)
            if self.profile_now and self.sum_squares > 0.0:
                self.shares = averaged_shares(self.shares, self.profile_now, self.sum_squares)
        self.task = None
