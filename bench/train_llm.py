"""Train a Llama-style model (bench/llama.py) on byte-level text with precis and with
the optimizers users pick instead, side by side: loss, memory and speed.

Every row trains the same model from the same init (the seed), on the same batches
in the same order, with the same lr schedule (linear warmup over the first 10% of
the steps, then cosine down to 10% of the peak), AdamW betas (0.9, 0.95), weight
decay 0.1 on the matrices, and gradients clipped to norm 1.0:

    1  fp32 model, torch.optim.AdamW: the reference
    2  AMP: fp32 model, bf16 autocast, torch's fused AdamW
    3  bf16 model, torch.optim.AdamW (no master weights: the known failure mode)
    4  bf16 model, precis default policy (fp32 master, bf16 moments)
    5  bf16 model, precis + int16 remainders
    6  bf16 model, precis fp8 moments + int16 remainders
    6b bf16 model, precis fp8 moments + 8-bit remainders (a 24-bit master)
    9  Muon on the blocks' matrices, AdamW on the rest (one lr schedule: Muon's
       adjust_lr_fn="match_rms_adamw" takes AdamW's lr and weight decay):
       9a fp32 model, torch.optim.Muon + torch.optim.AdamW: the Muon reference
       9b bf16 model, precis Muon + AdamW, default policy
       9c bf16 model, precis Muon + AdamW, fp8 moments + 8-bit remainders
       9d bf16 model, precis Muon + AdamW, fp32 state (momentum, moments, master):
          separates the bf16 model's share of a gap to 9a from the stored state's
   11  NorMuon (precis.optim.NorMuon: Muon + dion's per-row second moment and rescale)
       on the blocks' matrices, AdamW on the rest, as 9:
       11a bf16 model, fp32 state: the NorMuon reference (torch has no NorMuon)
       11b default policy; 11c fp8 moments + 8-bit remainders
       (asked for by name, --rows fp32,torch-muon,precis-muon,precis-muon-fp8-rem8:
       Newton-Schulz's bf16 matmuls take seconds a step on a CPU without bf16
       instructions, 1.8-2.3 s on the tiny model on an AMD EPYC Zen 3; there
       --newton-schulz fp32 runs both Muons' Newton-Schulz in fp32, the same in every
       Muon row, so that the rows still differ only in the optimizers' state)
   10  gradient release (precis.optim.release_gradients: each param stepped inside
       backward and its gradient freed; max_norm=1.0 clips by an estimate of the
       global norm, this backward's so far over its average share of the total at
       that point, as the exact norm is known only once every param was stepped):
       10a bf16 model, precis default policy, released
       10b bf16 model, precis fp8 moments + 8-bit remainders, released
       10c, 10d the same, released in buckets of 25 MiB of gradients (torch DDP's
           default bucket): one step call per bucket, not per param
       10e, 10f as 10a, 10b with capturable=True: the step counts on the device, so
           no step call waits for the device (its verdict and clipping norm are read
           when backward ends)
       (asked for by name, --rows fp32,precis,precis-release,...); their "opt state +
       grad" column counts the gradients alive at the peak of backward (measured by a
       hook on every param, at step 1), the others' every gradient
    7  torchao AdamW8bit and AdamWFp8 (under AMP), _AdamW(bf16_stochastic_round=True)
       on a bf16 model: where torchao is installed (tools/setup.sh --bench)
    8  bitsandbytes AdamW8bit (AMP) and TransformerEngine FusedAdam (bf16 model,
       fp32 master, bf16 moments): on a GPU, where they are installed

--spike STEP:SCALE multiplies step STEP's loss (so its gradients) by SCALE before
backward: a loss spike, which the rows' clipping must absorb (outputs *_spike.*).

A row that cannot run says why in one line and in the table. Two regimes: a
pretraining-like lr (2e-3) and a fine-tuning-like one (1e-4), where a bf16 model
without master weights stalls as its updates fall below bf16's resolution. Both
start from the random init.

Per row, over the seeds (mean and spread = sample standard deviation): final train
loss (mean of the last 10% of the steps) and validation loss (fixed held-out
batches), their gap to row 1 taken seed by seed (the same seed is the same init and
data, so the gap's own spread is the noise of the optimizer's numerics; a gap within
its spread is called no difference), the first step whose validation loss reaches row 1's final
one, optimizer-state + gradient bytes per parameter measured from the tensors,
peak memory (GPU: torch.cuda.max_memory_allocated; CPU: the tracked tensors, see
tracked_peak_bytes), tokens/s and optimizer ms/step (both without the first 10% of
the steps). Writes, per regime, a markdown table, a PNG of the validation loss
against step and a JSON of the raw curves into --out.

    .venv/bin/python bench/train_llm.py --size tiny
    nice -n 10 .venv/bin/python bench/train_llm.py --size small \\
        --regimes finetune --threads 1
"""
import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# precis as installed (pip); from a clone without it, the checkout's package, whose
# loader finds the libraries in bazel-bin/.
if importlib.util.find_spec("precis") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ext"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama  # noqa: E402  (bench/llama.py)
from machine import cpu_model  # noqa: E402

BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
VAL_SEED = 1234  # the held-out batches, the same for every row and seed
REGIMES = {"pretrain": 2e-3, "finetune": 1e-4}  # peak lr


@dataclasses.dataclass(frozen=True)
class RunSize:
    model: str        # a key of llama.SIZES
    steps: int
    batch: int
    seq: int
    eval_every: int
    val_batches: int
    seeds: int
    spike_step: int = 0       # a loss spike: the loss of this step's batch (0: none) ...
    spike_scale: float = 1.0  # ... multiplied by this before backward


RUN_SIZES = {
    "tiny": RunSize("tiny", steps=24, batch=4, seq=32, eval_every=8, val_batches=2, seeds=1),
    "small": RunSize("small", steps=200, batch=4, seq=32, eval_every=20, val_batches=3, seeds=3),
    "125m": RunSize("125m", steps=2000, batch=16, seq=1024, eval_every=100, val_batches=8,
                    seeds=1),
    "350m": RunSize("350m", steps=2000, batch=8, seq=1024, eval_every=100, val_batches=8,
                    seeds=1),
}

# ---------------------------------------------------------------------------
# The rows
# ---------------------------------------------------------------------------


def groups_of(model):
    return llama.param_groups(model, WEIGHT_DECAY)


def torch_adamw(fused=False):
    return lambda model, lr: torch.optim.AdamW(groups_of(model), lr=lr, betas=BETAS, eps=EPS,
                                               fused=fused or None)


def precis_adamw(capturable=False, **policy):
    def make(model, lr):
        import precis
        return precis.optim.AdamW(groups_of(model), lr=lr, betas=BETAS, eps=EPS, policy=policy,
                                  capturable=capturable)
    return make


class MuonAndAdamW:
    """Muon for the blocks' matrices, AdamW for the rest, stepped as one optimizer (what
    train() calls: step, zero_grad, param_groups, state)."""

    def __init__(self, muon, adamw):
        self.parts = (muon, adamw)

    @property
    def param_groups(self):
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self):
        return {p: s for part in self.parts for p, s in part.state.items()}

    def step(self):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none=True):
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


def muon_and_adamw(library, muon="Muon", **policy):
    """Muon (or precis's NorMuon: muon="NorMuon") with adjust_lr_fn="match_rms_adamw"
    (AdamW's lr and weight decay fit it)."""
    def make(model, lr):
        import precis
        muon_cls, adamw_cls, kw = (torch.optim.Muon, torch.optim.AdamW, {}) \
            if library == "torch" else (getattr(precis.optim, muon), precis.optim.AdamW,
                                        {"policy": policy})
        hidden = llama.hidden_matrices(model)
        rest = [{**g, "params": [p for p in g["params"] if not any(p is h for h in hidden)]}
                for g in groups_of(model)]
        return MuonAndAdamW(
            muon_cls(hidden, lr=lr, weight_decay=WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw",
                     **kw),
            adamw_cls(rest, lr=lr, betas=BETAS, eps=EPS, **kw))
    return make


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim._muon._zeropower_via_newtonschulz with its matmuls in fp32 (torch's
    runs them in bf16, which CPUs without bf16 instructions emulate, many times slower
    than fp32's)."""
    a, b, c = ns_coefficients
    x = grad.to(torch.promote_types(grad.dtype, torch.float32))  # fp32, or float64 as given
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


@contextlib.contextmanager
def newton_schulz_in(dtype):
    """Both Muons (torch's and precis's) orthogonalize in dtype: "bf16" is torch's own
    function; "fp32" swaps newton_schulz_fp32 into the modules that call it."""
    if dtype == "bf16":
        yield
        return
    import torch.optim._muon as torch_muon
    from precis import muon_step
    name = "_zeropower_via_newtonschulz"
    saved = getattr(torch_muon, name), getattr(muon_step, name)
    setattr(torch_muon, name, newton_schulz_fp32)
    setattr(muon_step, name, newton_schulz_fp32)
    try:
        yield
    finally:
        setattr(torch_muon, name, saved[0])
        setattr(muon_step, name, saved[1])


def torchao_adamw(name, **kwargs):
    def make(model, lr):
        import torchao.optim
        return getattr(torchao.optim, name)(groups_of(model), lr=lr, betas=BETAS, eps=EPS,
                                            **kwargs)
    return make


def bitsandbytes_adamw8bit(model, lr):
    import bitsandbytes
    return bitsandbytes.optim.AdamW8bit(groups_of(model), lr=lr, betas=BETAS, eps=EPS)


def transformer_engine_fused_adam(model, lr):
    from transformer_engine.pytorch.optimizers import FusedAdam
    return FusedAdam(groups_of(model), lr=lr, betas=BETAS, eps=EPS, adam_w_mode=True,
                     master_weights=True, exp_avg_dtype=torch.bfloat16,
                     exp_avg_sq_dtype=torch.bfloat16)


def missing_module(module, hint=""):
    """A reason when `module` cannot be imported, else None."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed{hint}"
    return None


def precis_missing(device):
    try:
        import precis  # noqa: F401
    except Exception as err:  # the library not built, or built for another torch
        return f"precis does not load: {err}"
    return None


def torchao_missing(device):
    return missing_module("torchao", " (tools/setup.sh --bench installs the pinned version)")


def gpu_only(module, library):
    def missing(device):
        if device.type != "cuda":
            return f"needs a GPU ({library} runs on CUDA only)"
        return missing_module(module)
    return missing


def always_available(device):
    return None


@dataclasses.dataclass(frozen=True)
class Row:
    number: str
    name: str                 # short key: --rows, the JSON
    label: str
    model_dtype: torch.dtype
    autocast: bool            # bf16 autocast around the forward passes
    make_optimizer: object    # (model, lr) -> optimizer
    unavailable: object = always_available  # device -> a reason, or None
    reference: str = "fp32"   # the row its gaps are taken to (the Muon rows: torch's Muon)
    release: object = None    # gradient release: release_gradients' bucket_bytes (0: per param)


# torch DDP's default bucket (bucket_cap_mb=25): rows 10c, 10d
RELEASE_BUCKET = 25 * 2 ** 20

ROWS = [
    Row("1", "fp32", "fp32 model, torch AdamW (reference)", torch.float32, False,
        torch_adamw()),
    Row("2", "amp", "AMP: fp32 model, bf16 autocast, torch fused AdamW", torch.float32, True,
        torch_adamw(fused=True)),
    Row("3", "bf16", "bf16 model, torch AdamW (no master)", torch.bfloat16, False,
        torch_adamw()),
    Row("4", "precis", "bf16 model, precis default (fp32 master, bf16 m/v)", torch.bfloat16,
        False, precis_adamw(), precis_missing),
    Row("5", "precis-remainders", "bf16 model, precis + int16 remainders", torch.bfloat16,
        False, precis_adamw(store_param_remainders=True), precis_missing),
    Row("6", "precis-fp8", "bf16 model, precis fp8 m/v + remainders", torch.bfloat16, False,
        precis_adamw(store_param_remainders=True, exp_avg_dtype="fp8",
                     exp_avg_sq_dtype="fp8"), precis_missing),
    Row("6b", "precis-fp8-rem8", "bf16 model, precis fp8 m/v + 8-bit remainders",
        torch.bfloat16, False,
        precis_adamw(store_param_remainders=True, param_remainder_bits=8, exp_avg_dtype="fp8",
                     exp_avg_sq_dtype="fp8"), precis_missing),
    Row("9a", "torch-muon", "fp32 model, torch Muon + AdamW (the Muon reference)",
        torch.float32, False, muon_and_adamw("torch")),
    Row("9b", "precis-muon", "bf16 model, precis Muon + AdamW, default policy",
        torch.bfloat16, False, muon_and_adamw("precis"), precis_missing, "torch-muon"),
    Row("9c", "precis-muon-fp8-rem8", "bf16 model, precis Muon + AdamW, fp8 + 8-bit remainders",
        torch.bfloat16, False,
        muon_and_adamw("precis", store_param_remainders=True, param_remainder_bits=8,
                       exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8"), precis_missing,
        "torch-muon"),
    Row("9d", "precis-muon-fp32-state", "bf16 model, precis Muon + AdamW, fp32 state",
        torch.bfloat16, False,
        muon_and_adamw("precis", exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32",
                       momentum_dtype="fp32"), precis_missing, "torch-muon"),
    Row("11a", "precis-normuon-fp32-state",
        "bf16 model, precis NorMuon + AdamW, fp32 state (the NorMuon reference)",
        torch.bfloat16, False,
        muon_and_adamw("precis", "NorMuon", exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32",
                       momentum_dtype="fp32"), precis_missing),
    Row("11b", "precis-normuon", "bf16 model, precis NorMuon + AdamW, default policy",
        torch.bfloat16, False, muon_and_adamw("precis", "NorMuon"), precis_missing,
        "precis-normuon-fp32-state"),
    Row("11c", "precis-normuon-fp8-rem8",
        "bf16 model, precis NorMuon + AdamW, fp8 + 8-bit remainders", torch.bfloat16, False,
        muon_and_adamw("precis", "NorMuon", store_param_remainders=True,
                       param_remainder_bits=8, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8"),
        precis_missing, "precis-normuon-fp32-state"),
    Row("10a", "precis-release", "bf16 model, precis default, gradient release",
        torch.bfloat16, False, precis_adamw(), precis_missing, release=0),
    Row("10b", "precis-release-fp8-rem8",
        "bf16 model, precis fp8 m/v + 8-bit remainders, gradient release", torch.bfloat16,
        False, precis_adamw(store_param_remainders=True, param_remainder_bits=8,
                            exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8"), precis_missing,
        release=0),
    Row("10c", "precis-release-25mib", "bf16 model, precis default, released in 25 MiB buckets",
        torch.bfloat16, False, precis_adamw(), precis_missing, release=RELEASE_BUCKET),
    Row("10d", "precis-release-fp8-rem8-25mib",
        "bf16 model, precis fp8 m/v + 8-bit remainders, released in 25 MiB buckets",
        torch.bfloat16, False,
        precis_adamw(store_param_remainders=True, param_remainder_bits=8,
                     exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8"), precis_missing,
        release=RELEASE_BUCKET),
    Row("10e", "precis-release-capturable",
        "bf16 model, precis default, gradient release, capturable", torch.bfloat16, False,
        precis_adamw(capturable=True), precis_missing, release=0),
    Row("10f", "precis-release-fp8-rem8-capturable",
        "bf16 model, precis fp8 m/v + 8-bit remainders, gradient release, capturable",
        torch.bfloat16, False,
        precis_adamw(capturable=True, store_param_remainders=True, param_remainder_bits=8,
                     exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8"), precis_missing,
        release=0),
    Row("7a", "torchao-8bit", "AMP, torchao AdamW8bit", torch.float32, True,
        torchao_adamw("AdamW8bit"), torchao_missing),
    Row("7b", "torchao-fp8", "AMP, torchao AdamWFp8", torch.float32, True,
        torchao_adamw("AdamWFp8"), torchao_missing),
    Row("7c", "torchao-bf16-sr", "bf16 model, torchao _AdamW(bf16_stochastic_round)",
        torch.bfloat16, False, torchao_adamw("_AdamW", bf16_stochastic_round=True),
        torchao_missing),
    Row("8a", "bnb-8bit", "AMP, bitsandbytes AdamW8bit", torch.float32, True,
        bitsandbytes_adamw8bit, gpu_only("bitsandbytes", "bitsandbytes' 8-bit AdamW")),
    Row("8b", "te-fused", "bf16 model, TransformerEngine FusedAdam (fp32 master, bf16 m/v)",
        torch.bfloat16, False, transformer_engine_fused_adam,
        gpu_only("transformer_engine", "TransformerEngine")),
]
ROWS_BY_NAME = {row.name: row for row in ROWS}
MUON_ROWS = ("torch-muon", "precis-muon", "precis-muon-fp8-rem8",  # by name only (above)
             "precis-muon-fp32-state", "precis-normuon-fp32-state", "precis-normuon",
             "precis-normuon-fp8-rem8")
RELEASE_ROWS = ("precis-release", "precis-release-fp8-rem8", "precis-release-25mib",
                "precis-release-fp8-rem8-25mib", "precis-release-capturable",
                "precis-release-fp8-rem8-capturable")  # by name only
REFERENCE = ROWS[0]

# ---------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------


def storages(t):
    """The plain tensors holding t's bytes: t itself, or for a tensor subclass
    (torchao's quantized optimizer states) its inner tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in storages(getattr(t, name))]
    return [t]


def distinct_bytes(tensors):
    """Bytes of the tensors' storages, each storage counted once."""
    seen = {}
    for t in tensors:
        for plain in storages(t):
            storage = plain.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_and_grad_bytes(model, optimizer):
    """Bytes of the gradients and of every tensor in the optimizer's state."""
    tensors = [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if torch.is_tensor(value)]
    return distinct_bytes(tensors)


class LiveGrads:
    """The peak bytes of gradients alive during one backward: a hook on every param
    reads them as each gradient is accumulated (registered before a release's hooks,
    which step and free it after)."""

    def __init__(self, model):
        self.params = list(model.parameters())
        self.peak = 0
        self.handles = [p.register_post_accumulate_grad_hook(self.read) for p in self.params]

    def read(self, _):
        self.peak = max(self.peak, distinct_bytes([p.grad for p in self.params
                                                   if p.grad is not None]))

    def remove(self):
        for handle in self.handles:
            handle.remove()


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Inside it, counts the bytes autograd saves for the backward pass (each storage
    once; the parameters, counted elsewhere, left out)."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.saved = {}
        super().__init__(self.pack, lambda t: t)

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.saved[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def bytes(self):
        return sum(self.saved.values())


def tracked_peak_bytes(model, state_bytes, activation_bytes):
    """The CPU's peak estimate: parameters + gradients + optimizer state + the
    activations saved for backward, as if all were alive at once (an upper bound of
    what these tensors hold; temporaries are not counted)."""
    return distinct_bytes(model.parameters()) + state_bytes + activation_bytes


class Clock:
    """Seconds, waiting for the device's queued work first."""

    def __init__(self, device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self):
        self.sync()
        return time.perf_counter()


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def lr_at(step, steps, peak):
    """Linear warmup over the first 10% of the steps, cosine to 10% of the peak."""
    warmup = max(1, steps // 10)
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):  # torchao keeps lr as a tensor
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def autocast(row, device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=row.autocast)


@torch.no_grad()
def validation_loss(model, row, device, val_set):
    with autocast(row, device):
        losses = [model.loss(x.to(device), y.to(device)).float() for x, y in val_set]
    return float(torch.stack(losses).mean())


def train(row, run, lr, seed, device, val_set):
    """One row, one seed: its curves and measurements."""
    model = llama.Llama(llama.LlamaConfig.named(run.model), seed=seed)
    model = model.to(device=device, dtype=row.model_dtype)
    torch.manual_seed(seed)  # stochastic rounding that draws from torch's generator
    optimizer = row.make_optimizer(model, lr)
    live_grads = LiveGrads(model)  # step 1's backward, before the release's hooks
    if row.release is not None:
        import precis
        precis.optim.release_gradients(optimizer, max_norm=GRAD_CLIP,  # kept by the optimizer
                                       bucket_bytes=row.release)
    batches = llama.byte_batches("train", run.batch, run.seq, seed)
    timed_from = max(1, run.steps // 10) + 1  # leave out warm-up (and compilation)
    clock = Clock(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    train_losses, val_steps, val_losses = [], [], []
    step_seconds = optimizer_seconds = 0.0
    for step in range(1, run.steps + 1):
        set_lr(optimizer, lr_at(step, run.steps, lr))
        x, y = (t.to(device) for t in next(batches))
        saved = SavedActivations(model) if step == 1 else contextlib.nullcontext()
        start = clock()
        with autocast(row, device), saved:
            loss = model.loss(x, y)
        (loss * run.spike_scale if step == run.spike_step else loss).backward()
        if row.release is None:  # a release clipped inside backward (max_norm)
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer_start = clock()
        optimizer.step()
        end = clock()
        if step == 1:
            # a release freed every gradient: count those alive at backward's peak
            state_bytes = state_and_grad_bytes(model, optimizer) + \
                (live_grads.peak if row.release is not None else 0)
            activation_bytes = saved.bytes
            live_grad_bytes = live_grads.peak
            live_grads.remove()
        if step >= timed_from:
            step_seconds += end - start
            optimizer_seconds += end - optimizer_start
        optimizer.zero_grad(set_to_none=True)
        train_losses.append(loss.item())
        if step % run.eval_every == 0 or step == run.steps:
            val_steps.append(step)
            val_losses.append(validation_loss(model, row, device, val_set))
    timed_steps = run.steps - timed_from + 1
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else tracked_peak_bytes(model, state_bytes, activation_bytes))
    return {
        "seed": seed,
        "train_losses": train_losses,
        "val_steps": val_steps,
        "val_losses": val_losses,
        "state_and_grad_bytes_per_param": state_bytes / llama.num_params(model),
        "peak_live_grad_bytes_per_param": live_grad_bytes / llama.num_params(model),
        "peak_bytes": peak,
        "tokens_per_s": timed_steps * run.batch * run.seq / step_seconds,
        "optimizer_ms_per_step": 1e3 * optimizer_seconds / timed_steps,
    }


# ---------------------------------------------------------------------------
# Summary: the table, the plot, the JSON
# ---------------------------------------------------------------------------


def final_train_loss(result):
    tail = result["train_losses"][-max(1, len(result["train_losses"]) // 10):]
    return sum(tail) / len(tail)


def mean_and_spread(values):
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def first_step_reaching(result, target):
    return next((step for step, loss in zip(result["val_steps"], result["val_losses"])
                 if loss <= target), None)


def summarize(runs, reference_runs, reference_number="1"):
    """A row's figures over its seeds, gaps paired seed by seed with its reference's (row
    1, or the row it names)."""
    train = [final_train_loss(r) for r in runs]
    val = [r["val_losses"][-1] for r in runs]
    ref_train = [final_train_loss(r) for r in reference_runs]
    ref_val = [r["val_losses"][-1] for r in reference_runs]
    val_gap, val_gap_spread = mean_and_spread([v - ref for v, ref in zip(val, ref_val)])
    verdict = ("no spread: 1 seed" if len(runs) < 2
               else "no difference" if abs(val_gap) <= val_gap_spread
               else "worse" if val_gap > 0 else "better")
    if reference_number != "1":
        verdict += f" (vs row {reference_number})"
    return {
        "train_loss": mean_and_spread(train),
        "train_gap": statistics.fmean(t - ref for t, ref in zip(train, ref_train)),
        "val_loss": mean_and_spread(val),
        "val_gap": (val_gap, val_gap_spread),
        "verdict": verdict,
        "reaches_reference_at": [first_step_reaching(r, ref)
                                 for r, ref in zip(runs, ref_val)],
        "state_and_grad_bytes_per_param": runs[0]["state_and_grad_bytes_per_param"],
        "peak_mib": statistics.fmean(r["peak_bytes"] for r in runs) / 2**20,
        "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in runs),
        "optimizer_ms_per_step": statistics.fmean(r["optimizer_ms_per_step"] for r in runs),
    }


TABLE_HEADER = ("| row | train loss | Δ train | val loss | Δ val | vs row 1 (or the row named) "
                "| reaches its val at step | opt state + grad B/param | peak MiB | tokens/s | opt ms/step |")


def table_line(row, entry):
    cells = [f"{row.number} {row.label}"]
    if entry["skipped"]:
        return "| " + " | ".join(cells + [f"not run: {entry['skipped']}"] + [""] * 9) + " |"
    s = entry["summary"]
    reached = ", ".join("-" if step is None else str(step) for step in s["reaches_reference_at"])
    cells += [
        "%.4f ± %.4f" % s["train_loss"], f"{s['train_gap']:+.4f}",
        "%.4f ± %.4f" % s["val_loss"], "%+.4f ± %.4f" % s["val_gap"], s["verdict"], reached,
        f"{s['state_and_grad_bytes_per_param']:.2f}", f"{s['peak_mib']:.1f}",
        f"{s['tokens_per_s']:.0f}", f"{s['optimizer_ms_per_step']:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


def markdown_table(entries):
    lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    return "\n".join(lines + [table_line(ROWS_BY_NAME[e["name"]], e) for e in entries])


def plot(entries, title, path):
    """Validation loss against step (mean over seeds) for every row that ran, and its
    difference to row 1's at the same step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [e for e in entries if not e["skipped"]]
    reference = statistics_by_step(ran[0]["runs"])  # row 1 comes first (parse_args)
    fig, (curves, gaps) = plt.subplots(1, 2, figsize=(13, 5))
    for e in ran:
        row = ROWS_BY_NAME[e["name"]]
        steps = e["runs"][0]["val_steps"]
        mean = statistics_by_step(e["runs"])
        style = {"linestyle": "-" if row.name in ("fp32", "amp", "bf16")
                 else "--" if row.name.startswith("precis") else ":", "linewidth": 1.4}
        curves.plot(steps, mean, label=f"{row.number} {row.label}", **style)
        gaps.plot(steps, [m - r for m, r in zip(mean, reference)], **style)
    curves.set(xlabel="step", ylabel="validation loss (nats/byte)", title=title)
    gaps.set(xlabel="step", ylabel="validation loss − row 1's",
             title="difference to the fp32 reference (row 1)")
    gaps.axhline(0.0, color="black", linewidth=0.6)
    for ax in (curves, gaps):
        ax.grid(alpha=0.3)
    curves.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def statistics_by_step(runs):
    """The validation loss at each evaluated step, averaged over the seeds."""
    return [statistics.fmean(losses) for losses in zip(*(r["val_losses"] for r in runs))]


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def machine(device):
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = cpu_model()
    threads = torch.get_num_threads()
    return f"{cpu}, {threads} thread{'s' if threads > 1 else ''}, torch {torch.__version__}"


def run_regime(regime, run, rows, device, out_dir, args):
    """Trains every row over the seeds; rewrites the outputs after each row."""
    lr = REGIMES[regime]
    val_batches = llama.byte_batches("val", run.batch, run.seq, VAL_SEED)
    val_set = [next(val_batches) for _ in range(run.val_batches)]
    params = llama.num_params(llama.Llama(llama.LlamaConfig.named(run.model)))
    heading = (f"{args.size} ({params:,} params), {regime} regime (peak lr {lr:g}), "
               f"{run.steps} steps of {run.batch} x {run.seq} bytes, {run.seeds} seed(s); "
               f"{machine(device)}")
    stem = out_dir / f"train_llm_{args.size}_{regime}"
    if run.spike_step:
        heading += f"; a loss spike: step {run.spike_step}'s loss x {run.spike_scale:g}"
        stem = out_dir / f"train_llm_{args.size}_{regime}_spike"
    entries = []
    for row in rows:
        runs, reason = [], row.unavailable(device)
        try:
            for seed in range(run.seeds) if reason is None else ():
                runs.append(train(row, run, lr, seed, device, val_set))
                print(f"[{regime}] row {row.number} {row.label}, seed {seed}: val loss "
                      f"{runs[-1]['val_losses'][-1]:.4f}, {runs[-1]['tokens_per_s']:.0f} "
                      "tokens/s", flush=True)
        except Exception as err:  # an optional library failing on this machine
            if row is REFERENCE:
                raise
            reason = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        if reason:
            print(f"row {row.number} {row.label}: not run: {reason}", flush=True)
        entries.append({"name": row.name, "label": row.label, "skipped": reason,
                        "runs": [] if reason else runs})
        if not reason:
            ref = next((e for e in entries if e["name"] == row.reference and e["runs"]),
                       entries[0])
            entries[-1]["summary"] = summarize(runs, ref["runs"],
                                               ROWS_BY_NAME[ref["name"]].number)
        write_outputs(entries, heading, stem, {
            "size": args.size, "regime": regime, "peak_lr": lr, "run": dataclasses.asdict(run),
            "machine": machine(device), "text": llama.stdlib_source()})
    print(f"\n{heading}\n\n{markdown_table(entries)}\n\nwrote {stem}.md, .json, .png",
          flush=True)


def write_outputs(entries, heading, stem, about):
    stem.with_suffix(".md").write_text(f"{heading}\n\n{markdown_table(entries)}\n")
    stem.with_suffix(".json").write_text(json.dumps({**about, "rows": entries}, indent=1))
    plot(entries, f"{about['size']}, {about['regime']} (peak lr {about['peak_lr']:g})",
         stem.with_suffix(".png"))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=RUN_SIZES, default="tiny")
    ap.add_argument("--regimes", default=",".join(REGIMES),
                    help=f"comma-separated, from {', '.join(REGIMES)}")
    ap.add_argument("--rows", default=",".join(r.name for r in ROWS
                                               if r.name not in MUON_ROWS + RELEASE_ROWS),
                    help="comma-separated names; row 1 (fp32) gives the gaps")
    ap.add_argument("--steps", type=int, help="override the size's step count")
    ap.add_argument("--seeds", type=int, help="override the size's seed count")
    ap.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    ap.add_argument("--spike", metavar="STEP:SCALE",
                    help="inject a loss spike: step STEP's loss times SCALE before backward "
                         "(its gradients too; what clipping is for)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="bench/out", help="directory of the outputs")
    ap.add_argument("--newton-schulz", choices=("bf16", "fp32"), default="bf16",
                    help="the Muon rows' Newton-Schulz matmuls: bf16 (torch's) or fp32 "
                         "(CPUs without bf16 instructions), the same in every Muon row")
    args = ap.parse_args(argv)
    if REFERENCE.name not in args.rows.split(","):
        ap.error(f"--rows must include {REFERENCE.name}: row 1 gives the gaps")
    for flag, names, known in (("--regimes", args.regimes, REGIMES),
                               ("--rows", args.rows, ROWS_BY_NAME)):
        unknown = set(names.split(",")) - set(known)
        if unknown:
            ap.error(f"{flag}: unknown {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run = RUN_SIZES[args.size]
    run = dataclasses.replace(run, steps=args.steps or run.steps, seeds=args.seeds or run.seeds)
    if args.spike:
        step, scale = args.spike.split(":")
        run = dataclasses.replace(run, spike_step=int(step), spike_scale=float(scale))
    chosen = args.rows.split(",")
    rows = [row for row in ROWS if row.name in chosen]
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    print(f"text: {llama.stdlib_source()}")
    if any(row.name in MUON_ROWS for row in rows):
        print(f"Newton-Schulz: {args.newton_schulz}")
    with newton_schulz_in(args.newton_schulz):
        for regime in args.regimes.split(","):
            run_regime(regime, run, rows, device, out_dir, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
