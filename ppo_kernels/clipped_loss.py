"""Masked clipped PPO loss, eq. (8)-(10) of the post, with its gradient from one elementwise pass.

For every token t of every sequence b (the post's symbols; epsilon is CLIP = 0.2):

    (8)   r_t = pi_theta(a_t | s_t) / pi_old(a_t | s_t) = exp(logp_t - logp_old_t)
    (9)   J_t = min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)
    (10)  L   = -J,  aggregated as the post's `ppo_losses` does: -clipped.sum(-1).mean(), i.e.

              L = -(1/B) sum_b sum_t mask_bt J_bt            (sum over tokens, mean over sequences)

    dL/dlogp_bt = -(1/B) mask_bt dJ_bt/dlogp_bt,  dJ/dlogp = r A where the unclipped term is the
    min, and 0 where the clipped term is (dr/dlogp = r; the clipped term is a constant there).

The worked example of the concept lesson: r = 1.5, eps = 0.2. With A = +2 the terms are 3.0 and
2.4, J = 2.4 and the gradient is 0: pushing this token further gains nothing. With A = -2 the
terms are -3.0 and -2.4, J = -3.0 and dJ/dlogp = r A = -3.0: the clip does not hold back a bad
action whose probability rose.

Departures from the post:
    1. `mask` (1 for real tokens, 0 for padding after EOS) zeroes padding out of the sum; the post
       sums every column. Masked tokens contribute exactly nothing, even if their log-probs are
       inf or nan (we select with where(), never multiply by the mask).
    2. Two diagnostics over the real tokens, returned as detached 0-d fp32 tensors (call .item()
       to log them; not calling it saves a device sync per step):
         clipfrac  = mean of 1[|r_t - 1| > eps]       (how often the ratio is outside the range;
                                                        cleanrl's definition)
         approx_kl = mean of (r_t - 1) - log r_t       (the k3 estimator of KL(pi_old || pi_theta),
                                                        J. Schulman, "Approximating KL
                                                        divergence", 2020; always >= 0)
       With no real token at all both are 0 and the loss is 0, not nan.

Memory traffic: four (B, T) inputs read once; per-token J, dJ/dlogp, the clip indicator and k3
written once (16 bytes per token), then summed. Tiny next to the log-prob kernel: this one is
about fusing nine small PyTorch launches into one, and about saving dJ/dlogp for backward.

PPO: Schulman et al., "Proximal Policy Optimization Algorithms", arXiv:1707.06347, section 3.

Test: python -m pytest -q tests/test_kernels.py -k clip
"""
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # macOS or a CPU-only install: the PyTorch path below still works
    triton = None

from .logprob import require_triton


# ---------------------------------------------------------------------------------------------
# PyTorch reference: the CPU/MPS fallback and the oracle for the Triton kernel.
# ---------------------------------------------------------------------------------------------
def loss_terms_torch(logp, logp_old, adv, keep, clip):
    """(N,) fp32 inputs, keep (N,) bool -> J, dJ/dlogp, clipped, k3, each (N,) fp32, 0 off-mask."""
    log_ratio = logp - logp_old
    # (8)  r = pi_theta / pi_old = exp(logp - logp_old)
    ratio = log_ratio.exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip, 1 + clip) * adv
    # (9)  J = min(r A, clip(r, 1 - eps, 1 + eps) A)
    objective = torch.minimum(unclipped, clipped)
    d_objective = torch.where(unclipped <= clipped, unclipped, 0.0)   # r A, or 0 where clipped
    is_clipped = ((ratio - 1).abs() > clip).float()
    k3 = (ratio - 1) - log_ratio
    return [torch.where(keep, v, 0.0) for v in (objective, d_objective, is_clipped, k3)]


# ---------------------------------------------------------------------------------------------
# Triton kernel: the same arithmetic, one token per lane.
# ---------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _clipped_loss_kernel(
        logp_ptr,         # (N,) fp32 log pi_theta(a_t | s_t), N = B * T tokens
        logp_old_ptr,     # (N,) fp32 log pi_old(a_t | s_t)
        adv_ptr,          # (N,) fp32 advantages A_t
        mask_ptr,         # (N,) fp32, nonzero for real tokens
        objective_ptr,    # (N,) fp32 out: J_t, 0 off-mask
        d_objective_ptr,  # (N,) fp32 out: dJ_t/dlogp_t, 0 off-mask
        clipped_ptr,      # (N,) fp32 out: 1[|r_t - 1| > eps], 0 off-mask
        k3_ptr,           # (N,) fp32 out: (r_t - 1) - log r_t, 0 off-mask
        N,                # number of tokens
        clip,             # eps
        BLOCK: tl.constexpr,  # tokens per program (see the launcher)
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < N                                    # the last block is ragged
        logp = tl.load(logp_ptr + offs, mask=inside, other=0.0)
        logp_old = tl.load(logp_old_ptr + offs, mask=inside, other=0.0)
        adv = tl.load(adv_ptr + offs, mask=inside, other=0.0)
        keep = tl.load(mask_ptr + offs, mask=inside, other=0.0) != 0
        log_ratio = logp - logp_old
        ratio = tl.exp(log_ratio)                            # (8)
        unclipped = ratio * adv
        clipped = tl.minimum(tl.maximum(ratio, 1 - clip), 1 + clip) * adv
        objective = tl.minimum(unclipped, clipped)           # (9)
        d_objective = tl.where(unclipped <= clipped, unclipped, 0.0)
        is_clipped = tl.where(tl.abs(ratio - 1) > clip, 1.0, 0.0)
        k3 = (ratio - 1) - log_ratio
        tl.store(objective_ptr + offs, tl.where(keep, objective, 0.0), mask=inside)
        tl.store(d_objective_ptr + offs, tl.where(keep, d_objective, 0.0), mask=inside)
        tl.store(clipped_ptr + offs, tl.where(keep, is_clipped, 0.0), mask=inside)
        tl.store(k3_ptr + offs, tl.where(keep, k3, 0.0), mask=inside)


def loss_terms_triton(logp, logp_old, adv, keep, clip):
    """Launcher: same contract as loss_terms_torch."""
    require_triton(logp)
    n = logp.numel()
    outs = [torch.empty(n, dtype=torch.float32, device=logp.device) for _ in range(4)]
    # 1024 tokens per program: 8 per thread at num_warps=4, so loads are 128-bit wide; a PPO
    # batch (16 x 48 to 16 x 304 tokens) is then a handful of programs.
    block = 1024
    _clipped_loss_kernel[(triton.cdiv(n, block),)](logp, logp_old, adv, keep.float(), *outs, n,
                                                    float(clip), BLOCK=block, num_warps=4)
    return outs


# ---------------------------------------------------------------------------------------------
# Autograd and the public function.
# ---------------------------------------------------------------------------------------------
class _MaskedClippedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, logp_old, adv, mask, clip, backend):
        n_seq = max(1, math.prod(logp.shape[:-1]))           # B: every leading index is a sequence
        flat = [t.detach().reshape(-1).float().contiguous() for t in (logp, logp_old, adv)]
        keep = mask.reshape(-1) != 0                         # (N,) real tokens
        terms = loss_terms_triton if backend == "triton" else loss_terms_torch
        objective, d_objective, is_clipped, k3 = terms(*flat, keep, clip)
        # (10) L = -J, summed over tokens and averaged over sequences: -clipped.sum(-1).mean()
        loss = -objective.sum() / n_seq
        n_tok = keep.sum().clamp(min=1)                      # no real token: stats are 0, not nan
        clipfrac, approx_kl = is_clipped.sum() / n_tok, k3.sum() / n_tok
        ctx.mark_non_differentiable(clipfrac, approx_kl)
        ctx.save_for_backward(d_objective)
        ctx.n_seq, ctx.shape, ctx.dtype = n_seq, logp.shape, logp.dtype
        return loss, clipfrac, approx_kl

    @staticmethod
    def backward(ctx, grad_loss, _grad_clipfrac, _grad_approx_kl):
        (d_objective,) = ctx.saved_tensors
        # dL/dlogp = -(1/B) mask dJ/dlogp  (the mask is already inside d_objective)
        grad_logp = d_objective.mul(-grad_loss / ctx.n_seq).view(ctx.shape).to(ctx.dtype)
        return grad_logp, None, None, None, None, None


def masked_clipped_loss(logp, logp_old, adv, mask, clip=0.2, backend="torch"):
    """The clipped surrogate loss (10) over real tokens, and {"clipfrac", "approx_kl"}.

    logp, logp_old, adv, mask: (B, T) (or (..., T): every leading index is a sequence); mask is 1
    (or True) for real tokens. Differentiable in logp only. Returns (loss, stats), loss a 0-d
    fp32 tensor = -(1/B) sum_{b,t} mask J, stats two detached 0-d fp32 tensors. `backend` is
    "torch" or "triton"; `ppo_kernels.masked_clipped_loss` picks it for you. clip = inf turns
    clipping off: J = r A (the note's "no clipping" ablation), and clipfrac is 0.
    """
    shapes = {tuple(t.shape) for t in (logp, logp_old, adv, mask)}
    if len(shapes) != 1 or logp.ndim == 0:
        raise ValueError(f"logp, logp_old, adv and mask must share one (B, T) shape, got "
                         f"{[tuple(t.shape) for t in (logp, logp_old, adv, mask)]}")
    if not (0 <= clip < 1 or clip == math.inf):
        raise ValueError(f"clip is epsilon in clip(r, 1 - eps, 1 + eps), in [0, 1) or inf (no "
                         f"clipping); got {clip}")
    loss, clipfrac, approx_kl = _MaskedClippedLoss.apply(logp, logp_old, adv, mask, float(clip),
                                                         backend)
    return loss, {"clipfrac": clipfrac, "approx_kl": approx_kl}


def masked_log_prob_loss(logp, logp_old, adv, mask, clip=0.2):
    """The loss with no ratio: L = -(1/B) sum_{b,t} mask_bt A_bt log pi_theta(a_bt|s_bt).

    Vanilla policy gradient when A is an advantage, and the supervised loss (13) on the
    rows whose A is a weight (RAFT: k on each prompt's best sample, 0 elsewhere). At the
    first inner step (r = 1) its gradient equals the clipped loss's; after a step it has
    no r_t: every step is a plain log-likelihood step. Same aggregation and the same
    detached stats as `masked_clipped_loss` (clipfrac: the share of tokens whose ratio is
    outside clip(r, 1 - eps, 1 + eps), although nothing is clipped). (B, T) inputs.
    """
    keep = mask.bool()
    n_seq = max(1, math.prod(logp.shape[:-1]))
    # L = -(1/B) sum_{b,t} mask A log pi_theta
    loss = -torch.where(keep, adv.float() * logp.float(), 0.0).sum() / n_seq
    with torch.no_grad():
        *_, is_clipped, k3 = loss_terms_torch(*(t.detach().reshape(-1).float() for t in (
            logp, logp_old, adv)), keep.reshape(-1), min(clip, 1e30))
        n_tok = keep.sum().clamp(min=1)
        return loss, {"clipfrac": is_clipped.sum() / n_tok, "approx_kl": k3.sum() / n_tok}
