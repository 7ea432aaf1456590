"""precis.optim's state dicts: its own written in the stored forms of precis.checkpoint,
and a loaded one (precis's or torch.optim.Adam / AdamW's) checked and converted to the
optimizer's policy before anything is applied."""

from collections.abc import Mapping

from . import checkpoint as ckpt
from . import master_state, optim_state, torch_math
from .checkpoint import local_state
from .dtensor import is_dtensor, whole_shape
from .group_checks import STEPPED_DTYPES
from .optim_state import plain_policy
from .state_layout import rounds_stochastically

# Group options that are the optimizer's own, whatever a loaded state dict says.
OWN_GROUP_KEYS = ("policy", "capturable")


def export(opt, sd):
    """torch's state dict of opt (sd, from Optimizer.state_dict) made precis's, in place:
    the policy option as plain data, every state in its stored form
    (checkpoint.export_state), and the param's 'stream' (an int, from the books) unless
    it is its place in the optimizer (optim_state.stream_index): a load gives that
    back (the stream a new state would get), and the state dict keeps the keys it had
    before streams were saved (a checkpoint's template, e.g.
    torch.distributed.checkpoint's, matches older checkpoints)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    indices = [i for group in sd["param_groups"] for i in group["params"]]
    by_index = dict(zip(indices, params))
    rule_of = {i: optim_state.rule_of(opt._books, group)  # each param's group's rule
               for group in opt.param_groups for i in group["params"]}
    place = {index: k for k, index in enumerate(indices)}
    for group in sd["param_groups"]:
        group["policy"] = plain_policy(group.get("policy"))
    # torch reads the dict exactly only if it reads every state in it exactly and steps
    # every group as precis does (not a Muon group with dion's options: it would step
    # it with its own, misreading a summed momentum as its average)
    steps_as_torch = not any(torch_math.muon_options_torch_lacks(group)
                             for group in opt.param_groups if "ns_steps" in group)
    whole_dict_exact = steps_as_torch and all(
        ckpt.torch_reads_exactly(state, by_index[index].dtype)
        for index, state in sd["state"].items()
        if isinstance(state, Mapping) and state and index in by_index)
    for index, state in list(sd["state"].items()):
        p = by_index.get(index)
        if not isinstance(state, Mapping):  # what a state_dict pre-hook put there, as it is
            continue
        if p is None or not state:  # a plain dict: weights_only torch.load refuses ParamState
            sd["state"][index] = dict(state)
            continue
        # A shard's fingerprint would not survive resharding: a DTensor's remainder is
        # kept on load only when the params were loaded first (set_state_dict's order).
        sd["state"][index] = out = ckpt.export_state(
            state, p, remainder_fingerprint=not is_dtensor(p),
            torch_names=rule_of[p].torch_names, whole_dict_exact=whole_dict_exact)
        # A loaded remainder no step has used yet belongs to the bits it was saved with,
        # which its param does not hold (else joins_arrived joined it): saved as loaded,
        # with their fingerprint, not made over the param's bits now (a checkpoint
        # converted on a model whose weights come later keeps them exact).
        join = opt._books.joins.get(p)
        if join is not None:
            out.pop("master", None)
            out["remainder"], out["param_fingerprint"] = join[0], join[1]
        elif "param_fingerprint" in out and p in opt._books.fingerprints:
            out["param_fingerprint"] = opt._books.fingerprints[p]
        stream = opt._books.streams.get(p)
        if stream is not None and stream != optim_state.stream_index(opt._books, p,
                                                                      place[index]):
            sd["state"][index]["stream"] = stream


def convert(opt, state_dict):
    """A state dict of precis's or torch.optim.Adam / AdamW's, checked and converted for
    opt: (param groups, state by param, remainder fingerprints by param, streams by
    param, remainders to join anew by param: master_state.pending). Nothing of opt is
    modified; anything malformed raises ValueError naming it."""
    name = type(opt).__name__
    # Other top-level keys are ignored, as torch ignores them.
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        keys = sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else None
        raise ValueError(f"{name}.load_state_dict: expected a mapping with keys 'state' and "
                         f"'param_groups', got "
                         f"{keys if keys is not None else type(state_dict).__name__}")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, (list, tuple)) or not isinstance(saved_state, Mapping):
        raise ValueError(f"{name}.load_state_dict: 'param_groups' must be a list and "
                         f"'state' a mapping")
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"{name}.load_state_dict: the state dict has {len(saved_groups)} "
                         f"param groups, the optimizer {len(opt.param_groups)}")

    new_groups, id_to_param, where_of, place, rule_of = [], {}, {}, {}, {}
    for gi, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        where = f"{name}.load_state_dict: param group {gi}"
        rule = optim_state.rule_of(opt._books, group)  # the optimizer's group decides it
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), (list, tuple)):
            raise ValueError(f"{where}: expected a mapping with a 'params' list")
        ids = saved["params"]
        if len(ids) != len(group["params"]):
            raise ValueError(f"{where} has {len(ids)} params in the state dict, "
                             f"{len(group['params'])} in the optimizer")
        for i, (pid, p) in enumerate(zip(ids, group["params"])):
            if pid in id_to_param:
                raise ValueError(f"{where}: param id {pid!r} appears twice")
            place[pid] = len(id_to_param)
            id_to_param[pid] = p
            rule_of[pid] = rule
            where_of[pid] = f"{name}.load_state_dict: state of param {i} of group {gi} " \
                            f"(id {pid!r}, shape {tuple(p.shape)}, {p.dtype})"
        missing = [k for k in rule.group_keys if k not in saved]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}")
        new = {k: v for k, v in saved.items() if k not in OWN_GROUP_KEYS + ("params",)}
        new = {**rule.saved_defaults, **new}  # (a group saved before the rule had them)
        if isinstance(new.get("betas"), list):
            new["betas"] = tuple(new["betas"])
        for key in OWN_GROUP_KEYS:
            new[key] = group[key]
        if rule.name == "adam":
            # torch's rule: AdamW always decouples; Adam keeps what was saved (False if
            # absent); so does a Muon optimizer's "adamw" group (muon.ADAMW_GROUP).
            new["decoupled_weight_decay"] = opt._always_decoupled or \
                group.get("algorithm") == "adamw" or new.get("decoupled_weight_decay", False)
        # The optimizer's params, and its options a saved group lacks (torch's state
        # dicts lack precis's seed, older ones a flag; param_names where none was saved).
        for key, value in group.items():
            new.setdefault(key, value)
        if optim_state.rule_of(opt._books, new) is not rule:  # (a group's "algorithm")
            raise ValueError(f"{where} was saved for algorithm {saved.get('algorithm')!r}; "
                             f"this optimizer steps the group by {rule.name!r}")
        rule.check(new, where)
        new_groups.append(new)

    new_state, fingerprints, streams, owners, joins = {}, {}, {}, {}, {}
    layouts = {id(p): optim_state.layout_for(opt._books, ng, p)  # (bad policies fail now)
               for ng in new_groups for p in ng["params"] if p.dtype in STEPPED_DTYPES}
    saved_state = ckpt.dcp_merged(saved_state, id_to_param, f"{name}.load_state_dict")
    dropped = {}  # what the policy keeps nowhere (master_state.dropped) -> params
    for pid, saved in saved_state.items():
        if pid not in id_to_param:
            raise ValueError(f"{name}.load_state_dict: 'state' has an entry for param id "
                             f"{pid!r}, which no param group lists")
        p, rule = id_to_param[pid], rule_of[pid]
        if id(p) not in layouts:  # (a frozen int8 weight, say: never stepped)
            raise ValueError(f"{where_of[pid]}: {name} never steps a param of this dtype, "
                             f"so it keeps no state for it")
        home = optim_state.local_home(opt._books, p)
        saved = ckpt.precis_keys(local_state(p, saved, where_of[pid]), rule.torch_names,
                                 where_of[pid])
        row = rule.row_state and (rule.row_state, whole_shape(p)[0])
        state, fp = ckpt.convert_state(home, saved, layouts[id(p)], where_of[pid],
                                       rule.required(), rule.all_moments, row)
        kind = master_state.dropped(saved, state)
        if kind is not None:
            dropped[kind] = dropped.get(kind, 0) + 1
        # (a shard's remainder has no fingerprint of its own: export saves none)
        join = None if not state or is_dtensor(p) else \
            master_state.pending(home, saved, layouts[id(p)], state)
        if join is not None:
            joins[p] = join
        stream = state.pop("stream", None)
        if state and stream is None and rounds_stochastically(layouts[id(p)], p.dtype):
            stream = optim_state.stream_index(opt._books, p, place[pid])  # as export left it out
        if stream is not None:  # two params drawing one stream would round alike
            other = owners.setdefault(stream, pid)
            if other != pid:
                raise ValueError(f"{where_of[pid]}: 'stream' {stream} is also the "
                                 f"stream of param id {other!r}; each param needs its own")
            streams[p] = stream
        if state:
            new_state[p] = {k: ckpt.placed_state(p, k, v) for k, v in state.items()}
        if fp is not None:
            fingerprints[p] = fp
    # (everything checked: a load that is refused warns of nothing)
    master_state.warn_dropped(f"{name}.load_state_dict", dropped)
    return new_groups, new_state, fingerprints, streams, joins
