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
* Muon: complex params, which torch.optim.Muon refuses (its error, at the step);
* every rule with a counterpart: a param whose gradient is sparse (nn.Embedding(
  sparse=True)), and one whose state its counterpart made ('momentum_buffer': it goes on
  stepping it, dense gradients too). torch's SGD steps it; torch's Adam and Muon refuse
  it with their own errors. Only fp32 params with fp32 state (the fp32 policy) are
  taken: torch's math would step a bf16 / fp16 param in its own dtype, past its master
  and the policy's momentum dtype (refusal() names this, before anything is written).

Lion has no torch counterpart: its params of these kinds are refused by the caller
(functional.gather). A rule is named by its Rule.name ("adam", "sgd", ...)."""

import torch
from torch.optim._muon import Muon, muon
from torch.optim.adam import Adam, adam
from torch.optim.sgd import SGD, sgd

# Params torch's math steps whatever the rule (precis's kernels have no fp64 path).
DTYPES = (torch.float64, torch.complex128)


class AdamMath:
    """torch.optim.Adam's step of one group's params."""

    keeps_state = staticmethod(lambda group: True)
    takes_sparse = False  # its _init_group raises torch's error (SparseAdam's to take them)
    sparse_error = "Adam does not support sparse gradients, please consider SparseAdam instead"

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
        with torch.set_grad_enabled(self.grad_enabled):
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
    at the first step with momentum; none without; sparse, as torch makes it, from a
    sparse gradient). precis's decoupled_weight_decay=True (SGDW, which torch lacks)
    decays the param as the kernel does, p *= 1 - lr * weight_decay, before torch's
    step without weight decay."""

    keeps_state = staticmethod(lambda group: group["momentum"] != 0)
    takes = staticmethod(lambda group, p, fp32_state: p.is_complex())
    takes_sparse = True

    def __init__(self, state, group, params):
        self.group, self.state = group, state
        self.decoupled = group.get("decoupled_weight_decay", False) and \
            group["weight_decay"] != 0
        self._check_sparse(group, params)
        _torch_named(state, params)
        self.params, self.grads, self.bufs = [], [], []
        self.has_sparse_grad = SGD._init_group(self, dict(group, params=params), self.params,
                                               self.grads, self.bufs)

    def _check_sparse(self, group, params):
        """torch's errors at its step (after it wrote the params before), raised here
        before anything is written or renamed."""
        if group["fused"] and any(map(sparse_grad, params)):
            raise RuntimeError("`_fused_sgd` does not support sparse gradients")
        add_error = "add(sparse, dense) is not supported. Use add(dense, sparse) instead."
        for p in params:  # (in torch's order: the first param it fails on)
            if p.grad is None:
                continue
            st = self.state.get(p) or {}
            buf = st.get("momentum_buffer", st.get("exp_avg"))
            if p.grad.is_sparse and group["weight_decay"] != 0 and not self.decoupled:
                raise RuntimeError(f"{add_error} (torch.optim.SGD's weight_decay adds the "
                                   f"param to its gradient, sparse here: use weight_decay=0, "
                                   f"or precis's decoupled_weight_decay=True)")
            if not p.grad.is_sparse and group["momentum"] != 0 and \
                    isinstance(buf, torch.Tensor) and buf.is_sparse:
                raise RuntimeError(f"{add_error} (torch.optim.SGD's momentum buffer, made "
                                   f"sparse by sparse gradients, takes no dense one)")

    def step(self):
        group = self.group
        with torch.set_grad_enabled(self.grad_enabled):
            if self.decoupled:
                for p in self.params:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
            sgd(self.params, self.grads, self.bufs, has_sparse_grad=self.has_sparse_grad,
                foreach=group["foreach"], fused=group["fused"],
                weight_decay=0 if self.decoupled else group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
                maximize=group["maximize"])
        if group["momentum"] != 0:  # (torch's SGD.step keeps the buffers sgd() made)
            for p, buf in zip(self.params, self.bufs):
                self.state[p]["momentum_buffer"] = buf


class MuonMath:
    """torch.optim.Muon's step of one group's params (its state: 'momentum_buffer')."""

    keeps_state = staticmethod(lambda group: True)
    takes = staticmethod(lambda group, p, fp32_state: p.is_complex())  # torch refuses them
    takes_sparse = False  # (nor sparse gradients: its _init_group raises torch's error)
    sparse_error = "Muon does not support sparse gradients"

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


# Rule.name -> the step of its torch counterpart (Lion has none).
COUNTERPARTS = {"adam": AdamMath, "sgd": SGDMath, "muon": MuonMath}


def muon_options_torch_lacks(group):
    """The options of a Muon group that torch.optim.Muon would step otherwise, or
    not at all (dion's: precis.optim.Muon's momentum_form, adjust_lr_fn and
    ns_coefficients), as "name=value" strings; [] where torch steps it as precis does."""
    coefficients = group.get("ns_coefficients")
    return [f"{key}={group[key]!r}" for key, torchs in (
        ("momentum_form", group.get("momentum_form", "ema") == "ema"),
        ("adjust_lr_fn", group.get("adjust_lr_fn") in (None, "original", "match_rms_adamw")),
        ("ns_coefficients", isinstance(coefficients, (tuple, list)) and len(coefficients) == 3
         and not any(isinstance(c, (tuple, list)) for c in coefficients)))
        if key in group and not torchs]


def sparse_grad(p):
    """Whether p's gradient is sparse (torch's math reads p.grad)."""
    return p.grad is not None and p.grad.is_sparse


def torch_momentum(state):
    """Whether a param's state holds a momentum torch's math made: 'momentum_buffer',
    or one loaded from it (precis.checkpoint names it 'exp_avg') that is sparse."""
    if not state or isinstance(state.get("step"), bytes):  # (a saved state's entry: its
        return False                                          # step refuses it by name)
    buf = state.get("exp_avg")
    return "momentum_buffer" in state or (isinstance(buf, torch.Tensor) and buf.is_sparse)


def uses_torch_math(rule, group, p, fp32_state, state=None):
    """Whether torch's math steps p (for a rule without a counterpart: whether it would
    need to, which the caller refuses; its sparse gradients are the caller's to refuse).
    fp32_state: p is kept with fp32 moments and no master (the fp32 policy); state: p's
    state, if any."""
    if group["differentiable"] or p.dtype in DTYPES:
        return True
    counterpart = COUNTERPARTS.get(rule)
    if counterpart is None:
        return False
    # once torch's math made p's momentum, it goes on stepping it (the kernel would
    # start a new one)
    return sparse_grad(p) or torch_momentum(state) or counterpart.takes(group, p, fp32_state)


def routing_key(group):
    """What uses_torch_math reads of a group for a real param with a dense gradient: a
    step_plan.Plan, which steps no param torch's math does, holds while it stands."""
    return group["differentiable"], any(isinstance(b, torch.Tensor)
                                        for b in group.get("betas", ()))


def refusal(name, rule, p, fp32_state, group=None):
    """Why p, which uses_torch_math() gives to torch's math, cannot be stepped so (a
    message for the caller's ValueError), or None. name: the optimizer's class name;
    group: p's param group (a Muon group with options torch's Muon lacks is refused)."""
    counterpart = COUNTERPARTS.get(rule)
    lacks = muon_options_torch_lacks(group) if rule == "muon" and group is not None else []
    if lacks:
        return (f"{p.dtype} params, differentiable=True and sparse gradients are stepped by "
                f"torch.optim.Muon's own math, which has no {', '.join(lacks)}: give them a "
                f"group of torch's options")
    if counterpart is None:
        return (f"{p.dtype} params and differentiable=True are stepped by the torch.optim "
                f"counterpart's own math, and torch has no {name}; its kernels step "
                f"float32, float16 and bfloat16 params (and complex64 ones, elementwise "
                f"rules only)")
    if counterpart.takes_sparse and sparse_grad(p) and p.dtype not in DTYPES and \
            not (p.dtype == torch.float32 and fp32_state) and not p.is_complex():
        # torch's step would write the param in its own dtype, past the master, and keep
        # its momentum in that dtype, not in the policy's
        return (f"its gradient is sparse, which torch.optim.{name}'s own math steps (the "
                f"kernels take dense gradients) with torch's state: momentum in the "
                f"param's dtype, no master. This {p.dtype} param's policy keeps a master "
                f"or its momentum in another dtype, which that step would bypass: keep it "
                f"a float32 param with fp32 state (the default policy for float32 params; "
                f"a param group of its own), or "
                f"give it dense gradients (e.g. nn.Embedding(sparse=False))")
    return None


def check_grad(rule, p, where):
    """p's gradient as torch's math reads it (p.grad): refused before any state is made
    or renamed (torch's _init_group, which raises for sparse ones, runs after the state
    of earlier params, and torch's step after earlier groups, changed). torch's error
    first, for a sparse gradient its counterpart refuses; then p's dtype, shape and
    device, which torch's math needs."""
    grad = p.grad
    if grad is None:
        return
    if grad.is_sparse and not COUNTERPARTS[rule].takes_sparse:
        raise RuntimeError(f"{COUNTERPARTS[rule].sparse_error} ({where})")
    if grad.dtype != p.dtype or grad.shape != p.shape or grad.device != p.device:
        raise ValueError(f"{where}: its gradient is {grad.dtype} of shape {tuple(grad.shape)} "
                         f"on {grad.device}; torch's own math, which steps this param, needs "
                         f"the param's: {p.dtype} of shape {tuple(p.shape)} on {p.device}")


# Rule.name -> the momentum keys torch's math reads of a state it made (precis's name,
# 'exp_avg', for a loaded one-state rule's), and whether it reads a 'step' tensor.
STATE_KEYS = {"adam": (("exp_avg", "exp_avg_sq"), True),
              "sgd": (("momentum_buffer", "exp_avg"), False),
              "muon": (("momentum_buffer", "exp_avg"), False)}


def check_state(rule, group, p, state, where):
    """p's state as torch's math reads it (found made: not empty), refused before
    anything is written, naming p (torch's math raises at the first param it fails
    on, after the kernels and earlier groups stepped, and names none): each buffer it
    reads a tensor of p's shape on p's device (Adam's in p's dtype, as torch's lerp
    needs), Adam's step a one-element tensor, AMSGrad's max there (torch keeps none for
    a state made with amsgrad off: its step raises KeyError)."""
    if not state:
        return
    keys, counted = STATE_KEYS[rule]
    if rule == "adam":
        if group["amsgrad"]:
            keys += ("max_exp_avg_sq",)
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"{where}: its state has no {', '.join(missing)}, which torch's "
                             f"own math, stepping this {p.dtype} param, reads (amsgrad turned "
                             f"on after its state was made? torch.optim.Adam keeps no max "
                             f"for it either)")
    elif rule == "sgd" and group["momentum"] == 0:
        keys = ()  # (torch's SGD reads no momentum then)
    else:
        keys = keys[:1] if keys[0] in state else keys[1:]
    for key in keys:
        t = state.get(key)
        if t is None and rule != "adam":
            continue  # (torch's SGD starts a momentum None holds)
        same_dtype = rule != "adam" or (isinstance(t, torch.Tensor) and t.dtype == p.dtype)
        if not (isinstance(t, torch.Tensor) and t.shape == p.shape and
                t.device == p.device and same_dtype):
            got = f"{t.dtype} of shape {tuple(t.shape)} on {t.device}" \
                if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}: its {key} is {got}; torch's own math, which steps "
                             f"this param, needs a tensor of its shape {tuple(p.shape)} on "
                             f"{p.device}{f' in {p.dtype}' if rule == 'adam' else ''}")
    step = state.get("step")
    if counted and not (isinstance(step, torch.Tensor) and step.numel() == 1):
        raise ValueError(f"{where}: its step is {type(step).__name__} "
                         f"{step if not isinstance(step, torch.Tensor) else tuple(step.shape)}; "
                         f"torch's own math, which steps this param, needs a one-element "
                         f"tensor")


def keeps_state(rule, group):
    """Whether the counterpart's step keeps a state for the group's params (torch's SGD
    without momentum keeps none, and its state dict then lists none)."""
    return COUNTERPARTS[rule].keeps_state(group)


def prepared(rule, state, group, params, grad_enabled=False):
    """One group's params, their state made, ready for step(). state: param -> its state
    (what the counterpart's _init_group reads as its optimizer's self.state).
    grad_enabled: the grad mode of its step, the optimizer's defaults["differentiable"]
    (torch's step sets it from the defaults, not from the group: a group added with
    differentiable=True to an optimizer made without steps under no_grad)."""
    math = COUNTERPARTS[rule](state, group, params)
    math.grad_enabled = grad_enabled
    return math
