"""Fused linear + log-prob: log pi(a_t | s_t) straight from the last hidden state, never holding
the (rows, V) logits. Beyond the post.

The post runs the whole model, takes `out.logits[:, P - 1:-1]` and then log_softmax + gather
(`policy_forward`). The logits are one matmul away from the last hidden state h (the lm_head,
W of shape (V, H), tied to the embeddings in SmolLM2):

    z_t  = (h_t W^T) / temperature                                  (rows, V)
    logp = log softmax(z_t)[a_t]        the log pi_theta(a_t | s_t) of the ratio (8)
    H_t  = -sum_j p_j log p_j           optional, for the entropy bonus (12)

Here the rows are cut into chunks of about CHUNK_ELEMENTS logits, and each chunk's logits live
only while that chunk is processed: form them, run the log-prob forward of ppo_kernels/logprob.py on
them (Triton or PyTorch, whichever backend is chosen), keep logp, lse and H. The gradient takes
one of two routes, depending on whether the lm_head is trained:

  1. Frozen lm_head (ppo.py: the adapter lives in the attention layers). Row i of the output
     depends on row i of h only, so dL/dh_i = g_i dlogp_i/dh_i with g_i = dL/dlogp_i, and the
     per-row Jacobian is one H-vector we can form in forward, while the chunk's logits are at
     hand:
         dlogp_i/dh_i = (dlogp_i/dlogits_i) W = (1[j = a_i] - p_ij)_j W / temperature   (1, H)
     (the log-prob backward with an upstream gradient of 1, times W; the same for H_i).
     Backward is then g_i times a saved (N, H) tensor: two matmuls in all, as the post's path
     (logits = h W^T; dL/dh = dL/dlogits W), and no recomputation.
  2. Trained lm_head. dL/dW = sum_i g_i (dlogp_i/dlogits_i)^T h_i mixes rows through g, which is
     only known in backward. So backward forms each chunk's logits again (one extra matmul: the
     price of never storing them), gets dL/dlogits from the log-prob backward, and accumulates

         dL/dh_chunk  = dL/dlogits_chunk  W                           (c, H)
         dL/dW       += dL/dlogits_chunk^T h_chunk                    (V, H), in fp32

Under torch.no_grad() (the old and reference log-probs) neither is built.

Memory: peak extra is about three chunks of logits (the chunk, its log-probs, its gradient),
plus (N, H) Jacobians on route 1 and the fp32 grad of W on route 2, instead of the post's
(rows, V) logits, log-probs and their gradients.

The same chunked recomputation is in Liger-Kernel's fused linear cross-entropy (Hsu et al.,
arXiv:2410.10989, section 3.2), there for a scalar loss; here the loss is any function of the
per-token log-probs, which is what PPO needs.

Departures from the post: those of ppo_kernels/logprob.py (fp32 log-probs, a temperature divisor,
optional entropy). An lm_head bias is not supported (SmolLM2 and Qwen2 have none).

Test: python -m pytest -q tests/test_kernels.py -k hidden
"""
import torch

from . import logprob

# About 16M logits per chunk, 64 MB in fp32: a few chunks in memory are ~200 MB whatever the batch,
# while each matmul still has a hundred rows or more (341 at V = 49,152, 110 at 151,936), enough
# to run near full speed on a CPU or a GPU. The chunk is one block of logprob.py's fallback.
CHUNK_ELEMENTS = 2**24


def _chunks(n_rows, V):
    step = max(1, CHUNK_ELEMENTS // V)
    return [slice(r, r + step) for r in range(0, n_rows, step)]


def _chunk_buffer(h, V):
    """One (rows per chunk, V) tensor in h's dtype, reused by every chunk: a fresh 64 MB tensor
    per chunk would be page-faulted in, 4 kB at a time, every chunk."""
    return torch.empty((min(h.shape[0], max(1, CHUNK_ELEMENTS // V)), V), dtype=h.dtype,
                       device=h.device)


def forward_chunks(h, W, a, temperature, with_entropy, backend, jacobian):
    """h (N, H), W (V, H), a (N,) -> logp, lse, entropy (None unless asked), each (N,) fp32, and
    with `jacobian` the per-row Jacobians dlogp_i/dh_i and dH_i/dh_i, (N, H) each (else None)."""
    n_rows, V = h.shape[0], W.shape[0]
    logp, lse = (torch.empty(n_rows, dtype=torch.float32, device=h.device) for _ in range(2))
    entropy = torch.empty_like(logp) if with_entropy else None
    jac_logp = torch.empty_like(h) if jacobian else None
    jac_entropy = torch.empty_like(h) if jacobian and with_entropy else None
    logits_buf = _chunk_buffer(h, V)
    d_logits_buf = _chunk_buffer(h, V) if jacobian else None
    for rows in _chunks(n_rows, V):
        c = h[rows].shape[0]
        logits = torch.matmul(h[rows], W.T, out=logits_buf[:c])[None]   # (1, c, V), h's dtype
        a_c = a[None, rows]                                  # (1, c)
        logp_c, lse_c, entropy_c = logprob.forward(logits, a_c, temperature, with_entropy,
                                                   backend)
        logp[rows], lse[rows] = logp_c[0], lse_c[0]
        if with_entropy:
            entropy[rows] = entropy_c[0]
        if not jacobian:
            continue
        # dlogp_i/dh_i = (dlogp_i/dlogits_i) W: the log-prob backward with upstream gradient 1
        ones, zeros = torch.ones_like(logp_c), torch.zeros_like(logp_c)
        d_logits = logprob.backward(logits, a_c, temperature, lse_c, entropy_c, ones,
                                    zeros if with_entropy else None, backend,
                                    out=d_logits_buf[None, :c])[0]      # (c, V)
        jac_logp[rows] = d_logits @ W                        # (c, H)
        if with_entropy:                                     # dH_i/dh_i, the same way
            d_logits = logprob.backward(logits, a_c, temperature, lse_c, entropy_c, zeros, ones,
                                        backend, out=d_logits_buf[None, :c])[0]
            jac_entropy[rows] = d_logits @ W
    return logp, lse, entropy, jac_logp, jac_entropy


class _LogProbsFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, W, a, temperature, with_entropy, backend):
        # Route 1 (per-row Jacobians now) for a frozen lm_head, route 2 (recompute in backward)
        # for a trained one; see the docstring at the top.
        ctx.jacobian = ctx.needs_input_grad[0] and not ctx.needs_input_grad[1]
        logp, lse, entropy, jac_logp, jac_entropy = forward_chunks(
            h, W, a, temperature, with_entropy, backend, ctx.jacobian)
        if ctx.jacobian:
            ctx.save_for_backward(jac_logp, jac_entropy)     # (N, H) each: no (N, V)
        else:
            ctx.save_for_backward(h, W, a, lse, entropy)     # (N, H) and (N,): no (N, V)
        ctx.temperature, ctx.backend = temperature, backend
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        if ctx.jacobian:
            jac_logp, jac_entropy = ctx.saved_tensors
            # dL/dh_i = dL/dlogp_i dlogp_i/dh_i (+ dL/dH_i dH_i/dh_i)
            grad_h = grad_logp[:, None] * jac_logp
            if grad_entropy is not None:
                grad_h += grad_entropy[:, None] * jac_entropy
            return grad_h.to(jac_logp.dtype), None, None, None, None, None
        return (*recompute_backward(ctx, grad_logp, grad_entropy), None, None, None, None)


def recompute_backward(ctx, grad_logp, grad_entropy):
    """dL/dh and dL/dW, recomputing each chunk's logits (the lm_head trains)."""
    h, W, a, lse, entropy = ctx.saved_tensors
    need_h, need_W = ctx.needs_input_grad[:2]
    grad_h = torch.empty_like(h) if need_h else None
    grad_W = torch.zeros(W.shape, dtype=torch.float32, device=W.device) if need_W else None
    logits_buf, grad_logits_buf = _chunk_buffer(h, W.shape[0]), _chunk_buffer(h, W.shape[0])
    for rows in _chunks(h.shape[0], W.shape[0]):
        c = h[rows].shape[0]
        logits = torch.matmul(h[rows], W.T, out=logits_buf[:c])[None]   # (1, c, V), recomputed
        ent = None if entropy is None else entropy[None, rows]
        g_ent = None if grad_entropy is None else grad_entropy[None, rows]
        grad_logits = logprob.backward(logits, a[None, rows], ctx.temperature, lse[None, rows],
                                       ent, grad_logp[None, rows], g_ent, ctx.backend,
                                       out=grad_logits_buf[None, :c])[0]   # (c, V) dL/dlogits
        if need_h:
            grad_h[rows] = grad_logits @ W                   # dL/dh = dL/dlogits W
        if need_W:
            # dL/dW += dL/dlogits^T h, accumulated in fp32
            grad_W.addmm_(grad_logits.T.to(grad_W.dtype), h[rows].to(grad_W.dtype))
    return grad_h, None if grad_W is None else grad_W.to(W.dtype)


def gather_log_probs_from_hidden(hidden, lm_head_weight, actions, temperature=1.0,
                                 return_entropy=False, backend="torch"):
    """log softmax((hidden @ lm_head_weight.T) / temperature) at `actions`, fp32, shape (...),
    without materialising the (rows, V) logits; with return_entropy, also each row's entropy.

    hidden (..., H) and lm_head_weight (V, H) in one float dtype, actions (...) integer ids in
    [0, V). Differentiable in hidden and in the weight (its gradient is only computed when the
    weight requires grad). Same meaning as gather_log_probs(hidden @ W.T, actions, temperature).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if lm_head_weight.ndim != 2 or hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(f"hidden (..., H) and lm_head_weight (V, H) disagree: "
                         f"{tuple(hidden.shape)} and {tuple(lm_head_weight.shape)}")
    if hidden.shape[:-1] != actions.shape:
        raise ValueError(f"hidden (..., H) and actions (...) disagree: {tuple(hidden.shape)} "
                         f"and {tuple(actions.shape)}")
    if actions.dtype.is_floating_point or actions.dtype == torch.bool:
        raise TypeError(f"actions must be integer token ids, got {actions.dtype}")
    if lm_head_weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"lm_head_weight must be float32, bfloat16 or float16, got "
                        f"{lm_head_weight.dtype}")
    h = hidden.reshape(-1, hidden.shape[-1]).to(lm_head_weight.dtype)   # (N, H); small if copied
    a = actions.reshape(-1)
    if torch.is_grad_enabled() and (h.requires_grad or lm_head_weight.requires_grad):
        out = _LogProbsFromHidden.apply(h, lm_head_weight, a, float(temperature),
                                        bool(return_entropy), backend)
    else:                                                    # old and reference log-probs
        logp, _, entropy, _, _ = forward_chunks(h, lm_head_weight, a, float(temperature),
                                                bool(return_entropy), backend, jacobian=False)
        out = (logp, entropy) if return_entropy else logp
    if return_entropy:
        return out[0].view(actions.shape), out[1].view(actions.shape)
    return out.view(actions.shape)
