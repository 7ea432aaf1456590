"""A param's whole, for an optimizer step that is not elementwise (Muon's Newton-Schulz
orthogonalizes a whole matrix) over the flat pieces a sharded wrapper hands out."""

import torch


class WholeParam:
    """What the step of a piece needs of its whole param: its shape, and apply(), which
    assembles the whole from every rank's piece and cuts fn's result back to this rank's.

    ranges: [start, stop) of the param's flat elements in each rank's shard (start ==
    stop where a rank holds none). They tile the param in rank order: one bucket holds
    the param, and the bucket's shards follow the ranks. comm: the wrapper's _Comm;
    group: its process group (None: the world), over which the ranks agree on skipping a
    step (dtensor.agreeing_groups): a rank that skipped would leave the others waiting
    in apply()."""

    def __init__(self, shape, ranges, comm):
        self.shape, self.ranges, self._comm = torch.Size(shape), ranges, comm

    @property
    def group(self):
        return self._comm.group

    def apply(self, local, fn, device):
        """fn of the whole tensor whose piece on this rank is `local` (fn runs on
        `device`), and this rank's elements of what fn returns, on local's device.
        Collective: every rank calls it for the param, in the same order, those holding
        no piece too (they pass an empty one, get it back, and skip fn). Each piece is
        broadcast from its rank, so every rank runs fn on the same bits: one process's
        result at every world size."""
        if self._comm.world == 1:  # the piece is the whole
            return fn(local.to(device).view(self.shape)).reshape(-1).to(local.device)
        whole = torch.empty(self.shape.numel(), dtype=local.dtype, device=device)
        start, stop = self.ranges[self._comm.rank]
        whole[start:stop].copy_(local)
        for rank, (lo, hi) in enumerate(self.ranges):
            if lo < hi:
                self._comm.broadcast(whole[lo:hi], src=rank)
        if start == stop:
            return local
        return fn(whole.view(self.shape)).reshape(-1)[start:stop].to(local.device)
