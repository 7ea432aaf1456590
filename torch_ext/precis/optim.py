"""precis.optim: precision-aware fused Adam and AdamW, SGD, Lion, Muon and NorMuon.

    opt = precis.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    opt = precis.optim.AdamW(model.parameters(), policy={"exp_avg_dtype": "fp8",  # bf16
                                                         "store_param_remainders": True})
    opt = precis.optim.Muon(hidden_matrices, lr=0.02, policy={"momentum_dtype": "fp8"})

SGD, Lion, Muon and NorMuon (their modules: sgd.py, lion.py, muon.py, normuon.py) share
everything below with Adam / AdamW (adamw.py) through one optimizer class and one update
engine (precis.rule: each optimizer's file holds its class and its rule); their one
state, the momentum, is 'exp_avg' in the policy's momentum_dtype (no exp_avg_sq;
NorMuon adds a row state). What follows describes AdamW; it holds for them unless their
class says otherwise.

The optimizer state of each param lives in the dtypes its precision policy
chooses (docs/design.md section 3): `policy` is None (the defaults for each param's
dtype), a precis.Policy (for params of its param_dtype), or a mapping of
overrides applied per param dtype with precis.resolve_policy. The Adam math is
C's (precis_step, through torch.ops.precis.adam_step_): one call per param
group and step (one per dtype combination in the group). Python only keeps the
books.

Params: float32, float16, bfloat16 or complex64, in any strides. A dense param
(contiguous, channels_last, transposed, any permutation) is stepped as its elements
in memory order, and its state has its strides (fp16/fp8 blocks of 128 follow
memory order); a view with gaps is stepped through a contiguous copy written back;
a param whose elements share memory (expanded) is refused. A complex64 param is
stepped as torch does, as view_as_real pairs of fp32, with complex64 moments and
the fp32 policy (other moment dtypes or masters are refused for it). float64 and
complex128 params, and every param of a differentiable=True group (fp32 params with the
fp32 policy only), are stepped by torch.optim.Adam's own code (precis.torch_math):
torch's values and state, and a step autograd can differentiate through. So are fp32
params with fp32 state whose gradient is sparse (torch's SGD takes them; torch's Adam,
AdamW and Muon refuse them, and so does precis with their errors; precis.optim.SGD).

torch.compile(opt.step): the step counts reach the kernel as tensors in a traced step,
so a compiled step is one graph from its second step on (the first, which makes the
state, is another), with no graph break from precis, as torch's compiled AdamW.

State of a param (allocated at its first step, laid out like the param, on its device):

  step              torch's: a float32 0-dim tensor on the CPU (on the param's device
                    when capturable), counting as torch's does (exact up to 2^24).
                    With fused=True too, where torch's fused step keeps it on the
                    device: an eager precis step counts on the host, and never
                    waits on the device for a count
  exp_avg           first moment in exp_avg_dtype (fp8 as uint8 bytes of precis's m8 code)
  exp_avg_sq        second moment in exp_avg_sq_dtype
  exp_avg_scale     fp32 block scales, only for fp16 / fp8 moments
  exp_avg_sq_scale  same for exp_avg_sq
  max_exp_avg_sq    amsgrad only: the running max of exp_avg_sq, in its dtype (+
                    max_exp_avg_sq_scale for fp16 / fp8), as torch's
  master            fp32 / fp16 master weights, when the policy keeps a separate
                    copy (none when the param is its own master: fp32 models, or a
                    bf16 master = stochastic rounding of bf16 params)
  remainder         int16 low halves of the fp32 master (store_param_remainders):
                    master = param:remainder exactly; uint8 with
                    param_remainder_bits 8: one more byte of mantissa, a 24-bit
                    master rounded to nearest each step

Checkpoints (precis.checkpoint, plain functions): state_dict() holds every buffer
in its stored dtype, and a run resumed with load_state_dict() follows the same
trajectory bit for bit. A state torch.optim would misread (scaled moments, masters,
remainders) has a 'step' torch's loader refuses with a message naming
precis.checkpoint.to_torch_state_dict, the converter to torch's layout.
load_state_dict() also takes a torch.optim.Adam / AdamW state dict (plain
moments, no master) and converts it to the policy's dtypes; anything malformed
raises ValueError and leaves the optimizer unchanged.

Model weights loaded after the optimizer was built make master weights, remainders
and host copies (offload) stale. Call reload_model_params() after loading; the
optimizer also notices by itself, by any path the weights came (model.load_state_dict,
torch.distributed.checkpoint, set_model_state_dict, FSDP2's shards, writes through
`param.data`): it keeps a 64-bit fingerprint of what its last step left in each param
that has such a copy, compares it before the next step (precis.fingerprints; the
cost is one read of those params before and one after each step), resyncs a changed
param's copies from the param (a master's elements that still round to it are kept, so
a mask or a clamp rewrites only the masters it wrote; remainders are zeroed only in the
blocks of precis.fingerprints.BLOCK elements it wrote, and a remainder loaded for its
very bits is kept) and warns (StaleMasterWarning: once, but each time a write into
remainders is found; on a GPU's path a planned step's findings are read back every 16
steps, or at once by state_dict()). A step compiled by
torch.compile or captured in a CUDA graph compares nothing: call reload_model_params()
after a load there (an eager capturable step compares, reading the fingerprints back).

Sharded params (torch's fully_shard / precis.fsdp: DTensor params): each rank steps
its local shard, the state is kept as DTensors placed like the param (state_dict()
and torch.distributed.checkpoint see DTensors), a NaN/Inf found with grad_scale
skips the step on every rank holding a shard; fp16/fp8 moments' scale blocks lie
along each param's rows, which Shard(0) never cuts (a param whose rows are not whole
blocks, a norm or bias, keeps bf16 moments; a placement that cuts rows is refused).

Loss scaling: the optimizer leaves `_step_supports_amp_scaling` False, so a
GradScaler unscales the gradients and skips step() on Inf/NaN as it does for any
torch optimizer. To fuse the unscaling into the kernel instead, call
step(grad_scale=scale, found_inf=flag) (or set the optimizer's `grad_scale` /
`found_inf` attributes, as torch's fused Adam reads them): a truthy found_inf
skips the step; with grad_scale, gradients are multiplied by 1/grad_scale in the
kernel (they are not written back) and any Inf/NaN gradient skips the whole step,
every param group, without modifying params or state (a found_inf tensor is then
set to 1). `last_step_skipped` tells whether the last step() was skipped (None after
a step compiled by torch.compile, which dynamo traces as a capturable one).

Gradient release (release_gradients(opt), precis.release): each param stepped inside
backward as its gradient is final, and the gradient freed; the ordinary step's bits.

CPU offload (offload="cpu" or True, offload_fraction): the state of the
offloaded params lives on the CPU and the CPU kernel steps host copies of them in
a few pieces, each written back to its params as soon as it is stepped
(precis.offload, docs/design.md section 10); the state dict has the same format
either way. An offload_fraction given with offload off is warned of (nothing moves).

Capturable (capturable=True, as torch's): a step reads nothing back from the
device (but the load check's fingerprints, outside a capture), so a whole optimizer
step can be captured in a CUDA graph and replayed.
Each param's 'step' is then torch's float32 tensor on its device (the kernel gets
int64 copies of the counts), the
learning rate goes to the kernel through a float64 device tensor (give the
group a tensor lr, e.g. torch.tensor(1e-3, dtype=torch.float64, device="cuda"),
and change it in place to change the lr of a replayed graph; a float lr is
copied in at capture time), grad_scale and found_inf may be device tensors
(found_inf=GradScaler's flag: a step with found_inf set changes nothing, steps
counts included), and last_step_skipped is None: read `last_found_inf` (the
device flag of the last step, or None) instead. As with any CUDA graph, take a
few eager steps on a side stream first, so that the state exists before capture.
capturable=True also works on CPU params (same results, no graphs there).
All param groups must agree on capturable; all params of a capturable optimizer
must be on one device.
"""


# The stored forms are precis.optim's public names too (they were defined here first).
from .stored_forms import decode_moment, encode_moment, remainder_join, remainder_split  # noqa
from .adamw import Adam, AdamW
from .lion import Lion
from .muon import Muon
from .normuon import NorMuon
from .master_state import DroppedStateWarning
from .optim_state import StaleMasterWarning
from .optimizer import PrecisOptimizer
from .release import GradientRelease, GradientReleases, release_gradients
from .release_verdicts import NonFiniteGradientWarning
from .sgd import SGD


__all__ = ["Adam", "AdamW", "SGD", "Lion", "Muon", "NorMuon", "PrecisOptimizer", "StaleMasterWarning",
           "DroppedStateWarning",
           "release_gradients", "GradientRelease", "GradientReleases", "NonFiniteGradientWarning",
           "encode_moment", "decode_moment", "remainder_split", "remainder_join"]
