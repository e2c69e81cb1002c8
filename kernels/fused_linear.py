"""Fused linear + log-prob: log pi(a_t | s_t) straight from the last hidden state, never holding
the (rows, V) logits. Beyond the post.

The post runs the whole model, takes `out.logits[:, P - 1:-1]` and then log_softmax + gather
(`policy_forward`). The logits are one matmul away from the last hidden state h (the lm_head,
W of shape (V, H), tied to the embeddings in SmolLM2):

    z_t  = (h_t W^T) / temperature                                  (rows, V)
    logp = log softmax(z_t)[a_t]        the log pi_theta(a_t | s_t) of the ratio (8)
    H_t  = -sum_j p_j log p_j           optional, for the entropy bonus (12)

Here the rows are cut into chunks of about CHUNK_ELEMENTS logits. Forward: for each chunk, form
its logits, run the log-prob forward of kernels/logprob.py on it (Triton or PyTorch, whichever
backend is chosen), keep logp, lse and H, drop the logits. Backward: form each chunk's logits
again (one extra matmul in all: the price of never storing them), get dL/dlogits for the chunk
from the log-prob backward, then

    dL/dh_chunk  = dL/dlogits_chunk  W                              (c, H)
    dL/dW       += dL/dlogits_chunk^T h_chunk                       (V, H), only if W needs grad

In ppo.py the lm_head is frozen (the adapter lives in the attention layers), so the second
product, as large as the first, is skipped.

Memory: peak extra is about two chunks of logits (the chunk and its gradient) plus the fp32 grad
of W when it is needed, instead of the post's (rows, V) logits, log-probs and their gradients.
Traffic: W is read twice in forward+backward plus once more for the recompute.

The same chunked recomputation is in Liger-Kernel's fused linear cross-entropy (Hsu et al.,
arXiv:2410.10989, section 3.2), there for a scalar loss; here the loss is any function of the
per-token log-probs, which is what PPO needs.

Departures from the post: those of kernels/logprob.py (fp32 log-probs, a temperature divisor,
optional entropy). An lm_head bias is not supported (SmolLM2 and Qwen2 have none).

Test: python -m pytest -q tests/test_kernels.py -k hidden
"""
import torch

from . import logprob

# About 16M logits per chunk: 64 MB in fp32, so the chunk and its gradient are ~128 MB whatever
# the batch, while each matmul still has a few hundred rows (341 at V = 49,152, 110 at 151,936),
# enough to run near the matmul's full speed on a CPU or a GPU.
CHUNK_ELEMENTS = 2**24


def _chunks(n_rows, V):
    step = max(1, CHUNK_ELEMENTS // V)
    return [slice(r, r + step) for r in range(0, n_rows, step)]


class _LogProbsFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, W, a, temperature, with_entropy, backend):
        # h (N, H), W (V, H), a (N,) -> logp, H each (N,) fp32
        n_rows, V = h.shape[0], W.shape[0]
        logp, lse = (torch.empty(n_rows, dtype=torch.float32, device=h.device) for _ in range(2))
        entropy = torch.empty_like(logp) if with_entropy else None
        for rows in _chunks(n_rows, V):
            logits = (h[rows] @ W.T)[None]                   # (1, c, V) in h's dtype
            out = logprob.forward(logits, a[None, rows], temperature, with_entropy, backend)
            logp[rows], lse[rows] = out[0][0], out[1][0]
            if with_entropy:
                entropy[rows] = out[2][0]
        ctx.save_for_backward(h, W, a, lse, entropy)         # (N, H) and (N,): no (N, V)
        ctx.temperature, ctx.backend = temperature, backend
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        h, W, a, lse, entropy = ctx.saved_tensors
        need_h, need_W = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(h) if need_h else None
        grad_W = torch.zeros(W.shape, dtype=torch.float32, device=W.device) if need_W else None
        for rows in _chunks(h.shape[0], W.shape[0]):
            logits = (h[rows] @ W.T)[None]                   # (1, c, V), recomputed
            ent = None if entropy is None else entropy[None, rows]
            g_ent = None if grad_entropy is None else grad_entropy[None, rows]
            grad_logits = logprob.backward(logits, a[None, rows], ctx.temperature,
                                           lse[None, rows], ent, grad_logp[None, rows], g_ent,
                                           ctx.backend)[0]  # (c, V), dL/dlogits
            del logits
            if need_h:
                grad_h[rows] = grad_logits @ W               # dL/dh = dL/dlogits W
            if need_W:
                grad_W += (grad_logits.T @ h[rows]).float()  # dL/dW += dL/dlogits^T h
        grad_W = None if grad_W is None else grad_W.to(W.dtype)
        return grad_h, grad_W, None, None, None, None


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
    h = hidden.reshape(-1, hidden.shape[-1]).to(lm_head_weight.dtype)   # (N, H); small if copied
    out = _LogProbsFromHidden.apply(h, lm_head_weight, actions.reshape(-1), float(temperature),
                                    bool(return_entropy), backend)
    if return_entropy:
        return out[0].view(actions.shape), out[1].view(actions.shape)
    return out.view(actions.shape)
