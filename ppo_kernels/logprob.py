"""Fused log-prob gather: log softmax(logits / temperature) at the sampled token, in one pass.

The post's `token_log_probs` and `policy_forward` compute, for every response position,

    log pi_theta(a_t | s_t) = log softmax(z_t)[a_t]
                            = z_t[a_t] - logsumexp_j z_t[j],          z_t = logits_t / temperature

which is the log pi inside the ratio (8). The post gets it with

    torch.log_softmax(logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)

which writes a full (rows, V) tensor of log-probs, keeps it for backward, and then reads one
number per row out of it. For SmolLM2 (V = 49,152) and 16 x 304 positions that tensor is 956 MB
in fp32. Here we keep three numbers per row instead: the log-prob, the logsumexp (lse) and the
entropy.

Math. With p = softmax(z), lse = logsumexp(z), g = dL/dlogp and h = dL/dH for one row:

    logp  = z[a] - lse
    H     = -sum_j p_j log p_j  =  lse - sum_j p_j z_j              (the entropy of eq. (12))
          =  log s - (1/s) sum_j e^(z_j - m) (z_j - m),   m = max z, s = sum_j e^(z_j - m)
             (the kernel's form: nothing of the size of z cancels when the logits are 1e4)
    dlogp/dz_j = 1[j = a] - p_j                                     (softmax Jacobian, one row)
    dH/dz_j    = -p_j (log p_j + H)
    dL/dlogits_j = (g (1[j = a] - p_j) - h p_j (log p_j + H)) / temperature

The backward recomputes p_j = exp(z_j - lse) from the saved lse, so nothing of size V is saved.

Memory traffic per row (s = bytes per logit: 4 for fp32, 2 for bf16/fp16):
    forward : read V s bytes once (an online logsumexp over vocabulary tiles), write 3 x 4 bytes
    backward: read V s bytes again, write V s bytes of grad_logits, read 5 numbers
    the post: log_softmax reads V s and writes V s, and that output is saved; its backward fills a
              zero tensor, scatters into it, and reads two V-sized tensors to write a third.
    fallback: the Triton traffic plus passes over a block of rows that stays in a reused buffer.

Departures from the post, stated once:
    1. The result is fp32 whatever the logits' dtype (the post's log_softmax on bf16 logits
       rounds log-probs to bf16, 8 bits of mantissa, before they enter exp(logp - logp_old)).
    2. A temperature divisor. The post samples at TEMPERATURE = 1.0, so the default changes nothing;
       sample at another temperature and score with the same one, or the ratio (8) is not 1 at
       the first step.
    3. Optionally the entropy H of every row from the same pass, for the bonus of eq. (12).

Layout of this file (the house layout for kernels): the PyTorch reference, which is also the
CPU/MPS fallback and what the tests check Triton against; the two @triton.jit kernels; the
launchers; the torch.autograd.Function; the one public function, `gather_log_probs`. Backend
choice is not made here but in `ppo_kernels/__init__.py`.

Background: the online softmax normaliser is from Milakov & Gimelshein, "Online normalizer
calculation for softmax" (arXiv:1805.02867, section 3); FlashAttention (arXiv:2205.14135,
section 3.1) uses the same recomputation of softmax from a saved logsumexp in backward.

Test:  python -m pytest -q tests/test_kernels.py
Bench: python -m tools.bench_kernels
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # macOS or a CPU-only install: the PyTorch path below still works
    triton = None


def _interpreting():
    """triton.jit reads TRITON_INTERPRET when a kernel is *defined*, i.e. when this module is
    imported. With it set, the kernels below run on CPU tensors in Triton's numpy interpreter."""
    if triton is None:
        return False
    if hasattr(triton, "knobs"):                             # Triton >= 3.4
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRET = _interpreting()

# The fallback works on blocks of about this many logits at a time (32M: 128 MB in fp32), reusing
# the same one or two block-sized buffers from block to block. Why this size: peak memory stays at
# a block or two however many rows there are (plus the gradient, which backward must return); and
# each PyTorch op gets enough work to dwarf the cost of waking its worker threads. That cost is
# small on an idle machine but not on a busy one, where a descheduled worker holds up every op:
# on our shared 2-core CI box, 4 MB blocks took 8x the time of the post's code, 128 MB blocks
# 0.75x (with one thread, where nothing waits, both took 0.6x). The loop is over blocks,
# never over single rows (unless V alone exceeds the budget: one row is the smallest block).
BLOCK_ELEMENTS = 2**25


def as_rows(logits, actions):
    """Check shapes and view logits (..., V) as (B, T, V) and actions (...) as (B, T), never copying
    a (B, T, V) tensor: the post's `out.logits[:, P - 1:-1]` slice is used in place."""
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if actions.dtype.is_floating_point or actions.dtype == torch.bool:
        raise TypeError(f"actions must be integer token ids, got {actions.dtype}")
    if logits.ndim == 0 or actions.shape != logits.shape[:-1]:
        raise ValueError(f"logits (..., V) and actions (...) disagree: {tuple(logits.shape)} "
                         f"and {tuple(actions.shape)}")
    if logits.ndim == 1:
        return logits.view(1, 1, -1), actions.view(1, 1)
    if logits.ndim == 2:
        return logits.unsqueeze(0), actions.unsqueeze(0)                 # (1, N, V), (1, N)
    return logits.flatten(0, -3), actions.flatten(0, -2)                 # (B, T, V), (B, T)


def _blocks(B, T, V):
    """Yield (batch slice, position slice) pairs covering a (B, T, V) tensor in blocks of about
    BLOCK_ELEMENTS logits. Every block is a view, so a strided input is never copied. The first
    block is the largest."""
    t_step = min(T, max(1, BLOCK_ELEMENTS // V))
    b_step = max(1, BLOCK_ELEMENTS // (t_step * V))
    for b0 in range(0, B, b_step):
        for t0 in range(0, T, t_step):
            yield slice(b0, b0 + b_step), slice(t0, t0 + t_step)


class _Workspace:
    """Block-sized fp32 buffers, allocated at the first block and reused for the rest: a fresh
    128 MB tensor per block would cost a page fault per 4 kB, every block."""

    def __init__(self):
        self.buffers = {}

    def get(self, name, like):
        """A (b, t, V) fp32 view the shape of `like`, from buffer `name`."""
        if name not in self.buffers:
            self.buffers[name] = torch.empty(like.shape, dtype=torch.float32, device=like.device)
        b, t, _ = like.shape
        return self.buffers[name][:b, :t]


def _scaled(x_blk, temperature, work):
    """z = logits / temperature in fp32: a view of x when there is nothing to do."""
    if x_blk.dtype == torch.float32 and temperature == 1.0:
        return x_blk
    z = work.get("z", x_blk).copy_(x_blk)                    # exact upcast of bf16/fp16
    return z.div_(temperature) if temperature != 1.0 else z  # departure 2: z = logits / T


# ---------------------------------------------------------------------------------------------
# PyTorch reference: the CPU/MPS fallback and the oracle the Triton kernels are tested against.
# Vectorised within a block, fp32 throughout, one block of the logits alive at a time.
# ---------------------------------------------------------------------------------------------
def forward_torch(x, a, temperature, with_entropy):
    """x (B, T, V) logits, a (B, T) int64 -> logp, lse, entropy-or-None, each (B, T) fp32."""
    B, T, V = x.shape
    logp = torch.empty((B, T), dtype=torch.float32, device=x.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    work = _Workspace()
    for bs, ts in _blocks(B, T, V):
        z = _scaled(x[bs, ts], temperature, work)            # (b, t, V) fp32
        # log_softmax is one fused pass in PyTorch (logsumexp is several on the CPU)
        log_p = torch.log_softmax(z, -1, out=work.get("log_p", z))
        # logp = z[a] - lse
        logp[bs, ts] = log_p.gather(-1, a[bs, ts, None]).squeeze(-1)
        # lse = z_j - log p_j for any j; at the largest z_j both are exact (log p_j there is
        # -log sum exp(z - max)), so lse = max z - max log p, as logsumexp would have it
        lse[bs, ts] = z.amax(-1) - log_p.amax(-1)
        if with_entropy:
            # H = -sum_j p_j log p_j. Entries of -inf would make 0 * -inf = nan: clamp them to the
            # most negative float first, so that p log p = 0 * (-3.4e38) = 0 there.
            log_p.clamp_(min=torch.finfo(torch.float32).min)
            p = torch.exp(log_p, out=work.get("p", z))
            entropy[bs, ts] = -p.mul_(log_p).sum(-1)
    return logp, lse, entropy


def backward_torch(x, a, temperature, lse, entropy, grad_logp, grad_entropy, out=None):
    """dL/dx (B, T, V) in x's dtype, from the saved lse (and entropy when it was returned);
    written into `out` if given (fused_linear.py reuses one buffer across its chunks)."""
    B, T, V = x.shape
    grad_x = torch.empty((B, T, V), dtype=x.dtype, device=x.device) if out is None else out
    work = _Workspace()
    for bs, ts in _blocks(B, T, V):
        z = _scaled(x[bs, ts], temperature, work)            # (b, t, V) fp32
        g = grad_logp[bs, ts, None]                          # (b, t, 1)
        # Work in the gradient's own memory when it is fp32: no temporary, no copy.
        dz = grad_x[bs, ts] if x.dtype == torch.float32 else work.get("dz", z)
        if grad_entropy is None:
            p = torch.sub(z, lse[bs, ts, None], out=dz).exp_()   # recomputed softmax, in place
            p.mul_(-g)                                       # -g p_j
        else:
            log_p = torch.sub(z, lse[bs, ts, None], out=work.get("log_p", z))
            log_p.clamp_(min=torch.finfo(torch.float32).min)     # as in forward: no 0 * -inf
            p = torch.exp(log_p, out=dz)
            # dH/dz_j = -p_j (log p_j + H): + h dH/dz_j, with h = dL/dH
            d_entropy = log_p.add_(entropy[bs, ts, None]).mul_(p)
            p.mul_(-g).addcmul_(d_entropy, grad_entropy[bs, ts, None], value=-1)
        dz.scatter_add_(-1, a[bs, ts, None], g)              # + g 1[j = a]
        if temperature != 1.0:
            dz.div_(temperature)                             # dz/dlogits = 1 / T
        if x.dtype != torch.float32:
            grad_x[bs, ts] = dz                              # rounded to bf16/fp16
    return grad_x


# ---------------------------------------------------------------------------------------------
# Triton kernels. One program per row (grid axis 0, which allows 2**31 - 1 programs, unlike axes
# 1 and 2 with their 65,535 limit); each program walks the vocabulary in tiles of BLOCK_V.
# ---------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _logprob_fwd_kernel(
        logits_ptr,       # (B, T, V) logits, fp32/bf16/fp16, unit stride along V
        actions_ptr,      # (B*T,) int64 sampled token ids, contiguous
        logp_ptr,         # (B*T,) fp32 out: log softmax(z)[a]
        lse_ptr,          # (B*T,) fp32 out: logsumexp(z), saved for backward
        entropy_ptr,      # (B*T,) fp32 out: H = -sum_j p_j log p_j
        T,                # positions per sequence: row r is (b, t) = (r // T, r % T)
        stride_b,         # elements between consecutive sequences of logits
        stride_t,         # elements between consecutive positions of logits
        V,                # vocabulary size (any value; the last tile is masked)
        inv_temperature,  # 1 / temperature, so z = logits * inv_temperature
        BLOCK_V: tl.constexpr,  # vocabulary tile width, a power of two (see the launcher)
    ):
        row = tl.program_id(0).to(tl.int64)                  # int64: B*T*V can pass 2**31
        row_ptr = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
        # Online logsumexp with fp32 accumulators: m = max so far, s = sum exp(z - m), and for
        # the entropy u = sum exp(z - m) (z - m). Both are measured from m, so H = log s - u / s
        # at the end; lse - sum p z would cancel two numbers of 1e4 when the logits are 1e4.
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        u = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            z = z * inv_temperature                          # the ragged tail reads as -inf
            m_new = tl.maximum(m, tl.max(z, axis=0))
            # While every entry so far is -inf, shift by 0 so exp() gives 0, not exp(nan).
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            e = tl.exp(z - shift)                            # 0 for the -inf entries
            alpha = tl.exp(m - shift)                        # rescales the old sums to m_new
            # old terms: exp(z-m')(z-m') = alpha exp(z-m) ((z-m) + (m-m')); no 0 * -inf = nan
            u = alpha * (u + s * tl.where(s > 0, m - shift, 0.0))
            u += tl.sum(e * tl.where(e > 0, z - shift, 0.0), axis=0)
            s = s * alpha + tl.sum(e, axis=0)
            m = m_new
        lse = m + tl.log(s)
        a = tl.load(actions_ptr + row)
        z_a = tl.load(row_ptr + a).to(tl.float32) * inv_temperature  # one gathered logit
        tl.store(logp_ptr + row, z_a - lse)                  # logp = z[a] - lse
        tl.store(lse_ptr + row, lse)
        tl.store(entropy_ptr + row, tl.log(s) - u / s)       # H = log s - u / s

    @triton.jit
    def _logprob_bwd_kernel(
        logits_ptr,       # (B, T, V) logits, as in the forward
        actions_ptr,      # (B*T,) int64 sampled token ids
        grad_logp_ptr,    # (B*T,) fp32 upstream gradient dL/dlogp
        grad_entropy_ptr, # (B*T,) fp32 upstream gradient dL/dH (zeros when H was not returned)
        lse_ptr,          # (B*T,) fp32 logsumexp saved by the forward
        entropy_ptr,      # (B*T,) fp32 entropy saved by the forward
        grad_logits_ptr,  # (B*T, V) out, contiguous, in the logits' dtype
        T,                # positions per sequence
        stride_b,         # elements between sequences of logits
        stride_t,         # elements between positions of logits
        V,                # vocabulary size
        inv_temperature,  # 1 / temperature
        BLOCK_V: tl.constexpr,  # vocabulary tile width, as in the forward
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
        out_ptr = grad_logits_ptr + row * V
        a = tl.load(actions_ptr + row)
        g = tl.load(grad_logp_ptr + row)
        h = tl.load(grad_entropy_ptr + row)
        lse = tl.load(lse_ptr + row)
        H = tl.load(entropy_ptr + row)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            log_p = z * inv_temperature - lse                # log softmax, recomputed
            p = tl.exp(log_p)
            # g (1[j = a] - p_j) - h p_j (log p_j + H), with p_j = 0 giving 0, not 0 * -inf
            dz = tl.where(cols == a, g, 0.0) - g * p
            dz -= h * p * tl.where(p > 0, log_p + H, 0.0)
            dx = dz * inv_temperature
            tl.store(out_ptr + cols, dx.to(grad_logits_ptr.dtype.element_ty), mask=cols < V)


# ---------------------------------------------------------------------------------------------
# Launchers: check, allocate, grid, launch.
# ---------------------------------------------------------------------------------------------
def require_triton(x):
    """Raise a clear error unless the Triton kernels can run on tensor x (here and in
    clipped_loss.py)."""
    if triton is None:
        raise RuntimeError("the Triton backend needs `pip install triton`; or set_backend('torch')")
    if not x.is_cuda and not INTERPRET:
        raise RuntimeError("Triton kernels need CUDA tensors; to run them on the CPU (slowly, for "
                           "tests) set TRITON_INTERPRET=1 before `import ppo_kernels`")


def _launch_setup(x, a):
    require_triton(x)
    B, T, V = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()                                   # the kernels assume unit V stride
    # An id outside [0, V) would read past the row; say so instead (costs one device sync).
    if a.numel() and (int(a.min()) < 0 or int(a.max()) >= V):
        raise IndexError(f"actions must lie in [0, {V}), got [{int(a.min())}, {int(a.max())}]")
    # 4096 logits per tile: 16 per thread at num_warps=8, enough loads in flight to keep HBM busy
    # without spilling registers; under the interpreter, fewer and larger numpy steps. Small
    # vocabularies get one tile rounded up to a power of two (tl.arange needs one), at least 16.
    block_v = min(4096, max(16, triton.next_power_of_2(V)))
    return x, a.reshape(-1).contiguous(), block_v


def forward_triton(x, a, temperature):
    """Same contract as forward_torch, always computing the entropy (it costs no extra reads)."""
    x, a_flat, block_v = _launch_setup(x, a)
    B, T, V = x.shape
    logp, lse, entropy = (torch.empty((B, T), dtype=torch.float32, device=x.device)
                          for _ in range(3))
    _logprob_fwd_kernel[(B * T,)](x, a_flat, logp, lse, entropy, T, x.stride(0), x.stride(1), V,
                                  1.0 / temperature, BLOCK_V=block_v, num_warps=8)
    return logp, lse, entropy


def backward_triton(x, a, temperature, lse, entropy, grad_logp, grad_entropy, out=None):
    x, a_flat, block_v = _launch_setup(x, a)
    B, T, V = x.shape
    if grad_entropy is None:                                 # H was not returned: h = 0
        grad_entropy = torch.zeros_like(lse)
        entropy = torch.zeros_like(lse) if entropy is None else entropy
    grad_x = torch.empty((B, T, V), dtype=x.dtype, device=x.device) if out is None else out
    _logprob_bwd_kernel[(B * T,)](x, a_flat, grad_logp.float().contiguous(),
                                  grad_entropy.float().contiguous(), lse.contiguous(),
                                  entropy.contiguous(), grad_x,
                                  T, x.stride(0), x.stride(1), V, 1.0 / temperature,
                                  BLOCK_V=block_v, num_warps=8)
    return grad_x


def forward(x, a, temperature, with_entropy, backend):
    """(B, T, V), (B, T) -> logp, lse, entropy (None unless with_entropy), each (B, T) fp32."""
    if backend == "triton":
        logp, lse, entropy = forward_triton(x, a, temperature)
        return logp, lse, (entropy if with_entropy else None)
    return forward_torch(x, a.long(), temperature, with_entropy)


def backward(x, a, temperature, lse, entropy, grad_logp, grad_entropy, backend, out=None):
    """dL/dx for forward(); grad_entropy is None when the entropy was not returned; `out`, if
    given, is a contiguous (B, T, V) tensor of x's dtype to write it into."""
    if backend == "triton":
        return backward_triton(x, a, temperature, lse, entropy, grad_logp, grad_entropy, out)
    return backward_torch(x, a.long(), temperature, lse, entropy, grad_logp.float(),
                          None if grad_entropy is None else grad_entropy.float(), out)


# ---------------------------------------------------------------------------------------------
# Autograd and the public function.
# ---------------------------------------------------------------------------------------------
class _GatherLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, temperature, with_entropy, backend):
        logp, lse, entropy = forward(x, a, temperature, with_entropy, backend)
        ctx.save_for_backward(x, a, lse, entropy)            # no (rows, V) tensor is saved
        ctx.temperature, ctx.backend = temperature, backend
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        x, a, lse, entropy = ctx.saved_tensors
        grad_x = backward(x, a, ctx.temperature, lse, entropy, grad_logp, grad_entropy,
                          ctx.backend)
        return grad_x, None, None, None, None


def gather_log_probs(logits, actions, temperature=1.0, return_entropy=False, backend="torch"):
    """log softmax(logits / temperature) at `actions`, fp32, shape (...); with return_entropy,
    also the entropy of each row's distribution, (...). Differentiable in logits through both.

    logits (..., V) fp32/bf16/fp16, actions (...) integer ids in [0, V). `backend` is "torch" or
    "triton"; `ppo_kernels.gather_log_probs` picks it for you (see ppo_kernels/__init__.py).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    x, a = as_rows(logits, actions)
    out = _GatherLogProbs.apply(x, a, float(temperature), bool(return_entropy), backend)
    if return_entropy:
        return out[0].view(actions.shape), out[1].view(actions.shape)
    return out.view(actions.shape)
