"""Bitwise snapshots of an optimizer's params and state, for tests that a step
changed nothing, or the same as another optimizer's."""
import torch


def bits(t):
    return t.detach().view(torch.int16 if t.element_size() == 2 else
                           torch.uint8 if t.element_size() == 1 else torch.int32).clone() \
        if t.is_floating_point() else t.detach().clone()


def state_pieces(opt, pieces):
    """{(param name, start, stop): its state, each tensor flat as raw bits} (the pieces
    of precis.ddp.optimizer_pieces, one a param)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {tuple(piece): {k: bits(v).reshape(-1) if torch.is_tensor(v) and v.dim() else v
                           for k, v in opt.state[p].items() if k != "step"}
            for p, piece in zip(params, pieces)}


def snapshot(opt):
    ps = [p for g in opt.param_groups for p in g["params"]]
    state = {i: {k: bits(v) if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for i, p in enumerate(ps) if p in opt.state}
    return [bits(p) for p in ps], state


def assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb)), "a param changed"
    assert sa.keys() == sb.keys(), "state was made or dropped"
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            assert (torch.equal(x, y) if torch.is_tensor(x) else x == y), f"state {i} {k} changed"
