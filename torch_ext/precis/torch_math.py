"""The params precis steps with torch's own optimizer code: its counterpart's
`_init_group` makes the state and its functional step (torch.optim.adam.adam, sgd.sgd,
_muon.muon) does the update, with the group's foreach / fused / capturable /
differentiable flags, so these params get torch's values, torch's state (under
torch's keys, in the param's dtype) and, with differentiable=True, a step autograd can
differentiate through.

precis's kernels are fp32 arithmetic over fp32/fp16/bf16 params (complex64 as pairs of
fp32), and autograd cannot see into them. So torch's math steps:

* every rule: float64 and complex128 params, every param of a differentiable=True group;
* Adam / AdamW: fp32 params with fp32 state in a group whose betas are tensors (torch
  then computes with tensor betas, which rounds differently), complex64 params under
  Adam's L2 weight decay (torch adds it in complex arithmetic);
* SGD: complex64 params (torch's SGD works in complex arithmetic throughout: a complex
  times a real scalar, then an add, two roundings where the kernel's fp32 pairs fuse);
* Muon: complex params, which torch.optim.Muon refuses (its error, at the step).

Lion has no torch counterpart: its params of these kinds are refused by the caller
(adam_step.gather). A rule is named by its precis.rules name ("adam", "sgd", ...)."""

import torch
from torch.optim._muon import Muon, muon
from torch.optim.adam import Adam, adam
from torch.optim.sgd import SGD, sgd

# Params torch's math steps whatever the rule (precis's kernels have no fp64 path).
DTYPES = (torch.float64, torch.complex128)


class AdamMath:
    """torch.optim.Adam's step of one group's params."""

    keeps_state = staticmethod(lambda group: True)

    @staticmethod
    def takes(group, p, fp32_state):
        # torch adds Adam's L2 decay to a complex grad in complex arithmetic, which
        # rounds otherwise than the kernel's fp32 pairs now and then (1 ulp)
        if p.is_complex() and group["weight_decay"] != 0 and \
                not group.get("decoupled_weight_decay", True):
            return True
        tensor_betas = any(isinstance(b, torch.Tensor) for b in group.get("betas", ()))
        return tensor_betas and fp32_state and p.dtype == torch.float32

    def __init__(self, state, group, params):
        self.group, self.state = group, state  # (what torch's _init_group reads of its optimizer)
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs = [], [], [], []
        self.max_exp_avg_sqs, self.steps = [], []
        self.has_complex = Adam._init_group(
            self, dict(group, params=params), self.params, self.grads, self.exp_avgs,
            self.exp_avg_sqs, self.max_exp_avg_sqs, self.steps)

    def step(self):
        group = self.group
        beta1, beta2 = group["betas"]
        with torch.set_grad_enabled(group["differentiable"]):
            adam(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs,
                 self.max_exp_avg_sqs, self.steps, foreach=group["foreach"],
                 capturable=group["capturable"], differentiable=group["differentiable"],
                 fused=group["fused"], has_complex=self.has_complex,
                 decoupled_weight_decay=group["decoupled_weight_decay"],
                 amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"])


def _torch_named(state, params):
    """A loaded state of a one-state rule (precis.checkpoint names its momentum 'exp_avg'
    and adds a 'step') back in torch's form: 'momentum_buffer', no step."""
    for p in params:
        st = state.get(p)
        if st and "exp_avg" in st and "momentum_buffer" not in st:
            st["momentum_buffer"] = st.pop("exp_avg")
            st.pop("step", None)


class SGDMath:
    """torch.optim.SGD's step of one group's params (its state: 'momentum_buffer', made
    at the first step with momentum; none without)."""

    keeps_state = staticmethod(lambda group: group["momentum"] != 0)
    takes = staticmethod(lambda group, p, fp32_state: p.is_complex())

    def __init__(self, state, group, params):
        self.group, self.state = group, state
        _torch_named(state, params)
        self.params, self.grads, self.bufs = [], [], []
        self.has_sparse_grad = SGD._init_group(self, dict(group, params=params), self.params,
                                               self.grads, self.bufs)

    def step(self):
        group = self.group
        with torch.set_grad_enabled(group["differentiable"]):
            sgd(self.params, self.grads, self.bufs, has_sparse_grad=self.has_sparse_grad,
                foreach=group["foreach"], fused=group["fused"],
                weight_decay=group["weight_decay"], momentum=group["momentum"],
                lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
                maximize=group["maximize"])
        if group["momentum"] != 0:  # (torch's SGD.step keeps the buffers sgd() made)
            for p, buf in zip(self.params, self.bufs):
                self.state[p]["momentum_buffer"] = buf


class MuonMath:
    """torch.optim.Muon's step of one group's params (its state: 'momentum_buffer')."""

    keeps_state = staticmethod(lambda group: True)
    takes = staticmethod(lambda group, p, fp32_state: p.is_complex())  # torch refuses them

    def __init__(self, state, group, params):
        self.group, self.state = group, state
        _torch_named(state, params)
        self.params, self.grads, self.bufs = [], [], []
        self.has_complex = Muon._init_group(self, dict(group, params=params), self.params,
                                            self.grads, self.bufs)

    def step(self):
        group = self.group
        muon(self.params, self.grads, self.bufs, lr=group["lr"],
             weight_decay=group["weight_decay"], momentum=group["momentum"],
             nesterov=group["nesterov"], ns_coefficients=group["ns_coefficients"],
             eps=group["eps"], ns_steps=group["ns_steps"], adjust_lr_fn=group["adjust_lr_fn"],
             has_complex=self.has_complex)


# precis.rules name -> the step of its torch counterpart (Lion has none).
COUNTERPARTS = {"adam": AdamMath, "sgd": SGDMath, "muon": MuonMath}


def uses_torch_math(rule, group, p, fp32_state):
    """Whether torch's math steps p (for a rule without a counterpart: whether it would
    need to, which the caller refuses). fp32_state: p is kept with fp32 moments and no
    master (the fp32 policy)."""
    if group["differentiable"] or p.dtype in DTYPES:
        return True
    counterpart = COUNTERPARTS.get(rule)
    return counterpart is not None and counterpart.takes(group, p, fp32_state)


def keeps_state(rule, group):
    """Whether the counterpart's step keeps a state for the group's params (torch's SGD
    without momentum keeps none, and its state dict then lists none)."""
    return COUNTERPARTS[rule].keeps_state(group)


def prepared(rule, state, group, params):
    """One group's params, their state made, ready for step(). state: param -> its state
    (what the counterpart's _init_group reads as its optimizer's self.state)."""
    return COUNTERPARTS[rule](state, group, params)
