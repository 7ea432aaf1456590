"""A small Llama-style language model and the byte-level text it trains on, for the
benchmarks (bench/moment_fidelity.py, bench/train_llm.py).

Model: a decoder-only transformer as Llama builds it: token embedding, n_layers
blocks of (RMSNorm -> causal self-attention with rotary positions -> residual,
RMSNorm -> SwiGLU MLP -> residual), a final RMSNorm and an untied output head. No
biases, no dropout. Random init (normal, std 0.02; the projections back into the
residual stream scaled by 1/sqrt(2 n_layers)) from a seeded generator: nothing is
downloaded.

bf16 and fp16 models on the CPU: every linear layer multiplies its bf16 operands in
fp32 and rounds the product once (Linear below), which is what a GPU's bf16 GEMM does
(fp32 accumulation) and runs at fp32's speed; torch's own bf16 matmul on a CPU without
bf16 instructions (AVX2) is about 7x slower than fp32. Under CPU autocast the operands
are cast to the autocast dtype first, as autocast would. fp32 models and every GPU run
use F.linear unchanged.

    cfg = LlamaConfig.named("tiny")          # ~1M params, 256 byte tokens
    model = Llama(cfg, seed=0)
    for x, y in byte_batches("train", batch=16, seq=cfg.max_seq, seed=0):
        loss = model.loss(x, y)

Data: byte-level tokens (vocabulary 256) of text every machine with Python has
offline: the *.py sources of Python's standard library
(sysconfig.get_paths()["stdlib"], site-/dist-packages left out), sorted by path and
concatenated. The first 95% of the bytes are the "train" split, the rest "val" (a
fixed held-out split). The text differs between Python versions, so compare runs
made with the same Python (stdlib_source() names the directory and size).
"""
import dataclasses
import functools
import math
import pathlib
import sysconfig

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    dim: int = 128          # width of the residual stream
    n_layers: int = 5
    n_heads: int = 4        # dim // n_heads is the head size (even: rotary pairs)
    hidden: int = 352       # SwiGLU inner width (~8/3 dim, a multiple of 32)
    vocab: int = 256        # byte tokens
    max_seq: int = 128      # longest sequence (rotary table size)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @staticmethod
    def named(size):
        """The config of a named size: one of SIZES."""
        if size not in SIZES:
            raise ValueError(f"unknown model size {size!r}; known: {', '.join(SIZES)}")
        return SIZES[size]


SIZES = {
    "micro": LlamaConfig(dim=64, n_layers=2, n_heads=2, hidden=176, max_seq=64),  # ~0.13M: tests
    "tiny": LlamaConfig(dim=128, n_layers=5, n_heads=4, hidden=352),      # ~1.0M params
    "small": LlamaConfig(dim=256, n_layers=8, n_heads=8, hidden=688),     # ~6.5M
    "medium": LlamaConfig(dim=512, n_layers=8, n_heads=8, hidden=1376,
                          max_seq=256),                                   # ~25M
    # GPU sizes of bench/train_llm.py: GPT-2 small's and medium's widths and
    # depths (their token embeddings, 38M and 51M params, are absent with bytes).
    "125m": LlamaConfig(dim=768, n_layers=18, n_heads=12, hidden=2048, max_seq=1024),  # ~128M
    "350m": LlamaConfig(dim=1024, n_layers=24, n_heads=16, hidden=3072, max_seq=1024),  # ~327M
}

# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LowPrecisionMatmulOnCpu(torch.autograd.Function):
    """x @ weight.T for bf16/fp16 x and weight on the CPU: the operands are widened to
    fp32 (exactly), multiplied with fp32 accumulation and the result rounded once to
    their dtype; the backward's two products likewise. Saves the low-precision
    operands, as the GPU's GEMM would."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad32 = grad.float()
        grad_x = (grad32 @ weight.float()).to(x.dtype)
        grad_weight = grad32.flatten(0, -2).T @ x.float().flatten(0, -2)
        return grad_x, grad_weight.to(weight.dtype)


class Linear(nn.Linear):
    """nn.Linear without bias whose bf16/fp16 products on the CPU go through
    LowPrecisionMatmulOnCpu (see the module's docstring)."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        if x.device.type != "cpu":
            return F.linear(x, self.weight)
        weight = self.weight
        if torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            x, weight = x.to(dtype), weight.to(dtype)
        if x.dtype not in (torch.bfloat16, torch.float16):
            return F.linear(x, weight)
        with torch.autocast("cpu", enabled=False):
            return LowPrecisionMatmulOnCpu.apply(x, weight)


def rotary_table(head_dim, max_seq, theta):
    """cos and sin of the rotary angles, each (max_seq, head_dim // 2)."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x, cos, sin):
    """Rotate the (even, odd) pairs of x's last dimension; x is (batch, heads, seq,
    head_dim), cos and sin (seq, head_dim // 2)."""
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = Linear(cfg.dim, 3 * cfg.dim)
        self.out = Linear(cfg.dim, cfg.dim)

    def forward(self, x, cos, sin):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, dim // self.n_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = Linear(cfg.dim, cfg.hidden)
        self.up = Linear(cfg.dim, cfg.hidden)
        self.out = Linear(cfg.hidden, cfg.dim)

    def forward(self, x):
        return self.out(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg, seed=0):
        super().__init__()
        if cfg.dim % cfg.n_heads or (cfg.dim // cfg.n_heads) % 2:
            raise ValueError(f"dim {cfg.dim} must split into {cfg.n_heads} heads of even size")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = Linear(cfg.dim, cfg.vocab)
        cos, sin = rotary_table(cfg.dim // cfg.n_heads, cfg.max_seq, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def init_weights(self, gen):
        """Normal(0, 0.02) weights, the residual outputs scaled by 1/sqrt(2 n_layers),
        norm gains 1; drawn on the CPU, so every device starts from the same values."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = residual_std if name.endswith("out.weight") else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, tokens):
        """Logits (batch, seq, vocab) for int64 tokens (batch, seq)."""
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq:
            raise ValueError(f"sequence of {seq} tokens > max_seq {self.cfg.max_seq}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def loss(self, tokens, targets):
        """Mean next-token cross entropy (nats per byte), taken in fp32."""
        logits = self(tokens).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def hidden_matrices(model):
    """The blocks' 2-D weights: what Muon steps (the embedding, the head and the gains go
    to AdamW, the usual pairing)."""
    return [p for p in model.blocks.parameters() if p.dim() == 2]


def param_groups(model, weight_decay):
    """AdamW groups: weight decay on the matrices (linear and embedding weights),
    none on the RMSNorm gains."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices, "weight_decay": weight_decay},
            {"params": vectors, "weight_decay": 0.0}]


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------

TRAIN_FRACTION = 0.95


def stdlib_files():
    """The standard library's *.py files, sorted by path (no site-/dist-packages)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_source():
    """A line naming the text: the directory, its file count and bytes."""
    root, files = stdlib_files()
    return f"{root}: {len(files)} *.py files, {sum(p.stat().st_size for p in files):,} bytes"


@functools.lru_cache(maxsize=None)
def stdlib_bytes(split):
    """The bytes of one split ("train" or "val") as a uint8 tensor (read once; do not
    write to it)."""
    if split not in ("train", "val"):
        raise ValueError(f"unknown split {split!r}: 'train' or 'val'")
    _, files = stdlib_files()
    data = b"".join(p.read_bytes() for p in files)
    cut = int(len(data) * TRAIN_FRACTION)
    part = data[:cut] if split == "train" else data[cut:]
    return torch.frombuffer(bytearray(part), dtype=torch.uint8)


def byte_batches(split, batch, seq, seed):
    """Endless (inputs, targets) pairs of int64 tensors (batch, seq), targets shifted
    by one byte: windows at offsets drawn uniformly from a torch.Generator seeded with
    `seed`, so the same arguments give the same batches on every run (on the CPU;
    move them to a device yourself)."""
    data = stdlib_bytes(split)
    if data.numel() <= seq + 1:
        raise ValueError(f"the {split} split has {data.numel()} bytes, too few for seq {seq}")
    gen = torch.Generator().manual_seed(seed)
    window = torch.arange(seq + 1)
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch, 1), generator=gen)
        rows = data[starts + window].long()
        yield rows[:, :-1], rows[:, 1:]
