"""What a released backward's step calls found (precis.release): the params an Inf/NaN
gradient left as they were, named in `skipped` with a NonFiniteGradientWarning; whether
the step took anything (the optimizer's last_step_skipped); and the compares the kept
calls made, queued for the StaleMasterWarning. On a GPU a call of one param leaves its
verdict on the device (a flag); the flags are copied back when the backward ends,
without a wait, and read when asked for (Verdicts.publish), a skipped param's step
count, counted by the host at its call, taken back then."""

import functools

import torch

from . import device_reads, fingerprints, optim_state, user_warnings
from .kept_calls import compared_resynced


class NonFiniteGradientWarning(UserWarning):
    """Params whose gradient had an Inf/NaN were not stepped in a released backward."""


def warn_skipped(names, where):
    """A NonFiniteGradientWarning naming the params (names) an Inf/NaN gradient left as
    they were, if any; where: which step calls they were left by."""
    if names:
        user_warnings.warn(f"release_gradients: {len(names)} params {where} had an Inf/NaN "
                           f"gradient and were not stepped ({', '.join(names[:5])}"
                           f"{', ...' if len(names) > 5 else ''})", NonFiniteGradientWarning)


class Verdicts:
    """The verdicts of one release's step calls (a GradientRelease's `verdicts`), for the
    optimizer's books; name_of(p) names a param in a warning."""

    def __init__(self, books, name_of):
        self._books = books
        self._name_of = name_of
        # the params not stepped in the last backward (non-finite), by name, or None while
        # its verdicts are on their way back (publish reads them)
        self.skipped = []
        # this backward's: the params skipped, by name, or (param, found_inf flag, the
        # step count the host added to or None) where the verdict is still on a device
        self.now = []
        # (the ended backward's `now`, their flags' copy back: device_reads.Later), or None;
        # and, once the step they belong to ended before they were read (end_step),
        # whether its verdict waits for them (the optimizer's last_step_skipped), else
        # None (the step open: they count for it)
        self._unread, self._unread_step = None, None
        self.taken = False  # whether a step call since the last opt.step() stepped anything
        # ([(group index, param index, param, whether it keeps remainders)], their op's
        # kept) of the params whose kept calls compared them, a call each, for the
        # StaleMasterWarning (queue_compares)
        self.compares = []

    @property
    def unread(self):
        """Whether the ended backward's flags are on their way back (copy), not read."""
        return self._unread is not None

    def queue_compares(self):
        """The kept of the compares the kept calls made since (compares) queued for the
        StaleMasterWarning, copied back without waiting (functional.settle_stale)."""
        if self.compares and fingerprints.readable():
            compared, self.compares = self.compares, []
            self._books.last.setdefault("stale_later", []).append((
                functools.partial(compared_resynced, [e for entries, _ in compared
                                                      for e in entries]),
                device_reads.Later(torch.cat([kept for _, kept in compared]))))

    def copy(self):
        """At a backward's end: the flags its calls left on a device (now) copied back
        without waiting for them (device_reads.Later), read when asked for (publish).
        Where they are on several devices, or a capture runs, publish reads them with a
        wait instead (device_reads.read_numbers)."""
        self.queue_compares()
        flags = [e[1] for e in self.now if not isinstance(e, str)]
        self.skipped = None
        if flags and len({f.device for f in flags}) == 1 and fingerprints.readable():
            self._unread = (self.now, device_reads.Later(torch.cat(flags)))

    def publish(self, where="of the last backward"):
        """The verdicts the ended backward's calls left read (read), and the params they
        skipped named (skipped, a NonFiniteGradientWarning), once; the verdicts of a
        backward that raised read too. where: which backward the warning names."""
        self.read()
        if self.skipped is None:
            self.skipped = self.now
            warn_skipped(self.skipped, where)

    def read(self):
        """Read the verdicts left on a device, in `now`: a param whose gradient had an
        Inf/NaN was not stepped and keeps its place there, named, the step the host
        counted taken back (from that count: a state loaded since is not touched); the
        others leave it. The flags come from their copy back where the backward's end
        started one, else from the device (device_reads.read_numbers: a wait). The step
        they belong to, ended before (end_step), is skipped where none was taken (the
        optimizer's last_step_skipped). A flag read is not handed out after (the
        optimizer's last_found_inf None, as after opt.step()): a kept call's is its own,
        zeroed at the next backward."""
        self.queue_compares()
        entries = self.now
        if self._unread is not None and self._unread[0] is entries:
            values = iter(self._unread[1].values("release verdicts"))
            flags = [e if isinstance(e, str) else next(values) for e in entries]
        else:
            flags = device_reads.read_numbers(
                [e if isinstance(e, str) else e[1] for e in entries], "release verdicts")
        self._unread = None
        books = self._books
        if any(not isinstance(e, str) for e in entries):  # (a flag read: none handed
            books.last["found_inf"] = None                # out after, as after opt.step())
        named, stepped = [], []
        for entry, flag in zip(entries, flags):
            if isinstance(entry, str):
                named.append(entry)
            elif flag != 0.0:
                p, _, counted = entry
                named.append(self._name_of(p))
                if counted is not None:
                    counted.sub_(1.0)
            else:
                stepped.append(entry[0])
        self.now = named
        if self._unread_step is None:  # (the step they count for still open)
            self.taken = self.taken or bool(stepped)
        elif self._unread_step:  # (end_step left the step's verdict to these)
            books.last["step_skipped"] = not stepped
        self._unread_step = None
        if stepped and (books.fingerprints or books.joins):  # (as step_groups' of a step
            optim_state.forget_loaded(books, stepped)        # taken: the verdict known now)

    def end_step(self, ended, stepped):
        """opt.step() or zero_grad(): the step's verdict in the optimizer's
        last_step_skipped where it ended a step (ended: a param was stepped since the last
        one; stepped: opt.step() stepped params the hooks left), whether nothing of it
        was taken, or optim_state.VERDICT_UNREAD while the backward's flags, none known
        taken, are on their way back (read when asked for, or at the next backward)."""
        if self._unread is None:
            self.read()  # (a backward that raised left them)
        later = self._unread is not None and not (self.taken or stepped)
        if ended:
            self._books.last["step_skipped"] = optim_state.VERDICT_UNREAD if later else \
                not (self.taken or stepped)
            self._books.last["found_inf"] = None  # (a call's flag: the step's is above)
            self._unread_step = None if self._unread is None else later
        self.taken = False
