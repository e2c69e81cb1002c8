"""ppo_kernels: fused ops for the PPO step, each a Triton kernel with a PyTorch fallback.

    gather_log_probs(logits, actions, temperature=1.0, return_entropy=False)
        log softmax(logits / temperature) at actions, fp32: the post's `token_log_probs` without
        the (rows, V) log-prob tensor. (ppo_kernels/logprob.py)
    gather_log_probs_from_hidden(hidden, lm_head_weight, actions, temperature=1.0,
                                 return_entropy=False)
        the same from the last hidden state, never holding the (rows, V) logits; what ppo.py's
        training forward uses on every backend. (ppo_kernels/fused_linear.py)
    masked_clipped_loss(logp, logp_old, adv, mask, clip=0.2) -> (loss, {"clipfrac", "approx_kl"})
        eq. (8)-(10) over real tokens, summed over tokens and averaged over sequences as the
        post's `ppo_losses` does; clip = inf: no clipping. (ppo_kernels/clipped_loss.py)
    masked_log_prob_loss(logp, logp_old, adv, mask, clip=0.2) -> the same, with no ratio:
        -(1/B) sum mask A log pi (vanilla policy gradient; RAFT's supervised loss)
    set_backend("auto" | "triton" | "torch") -> the previous backend name

The backend is chosen here and nowhere else. "auto" (the default) runs the Triton kernels on CUDA
tensors and the PyTorch fallback everywhere else (CPU, MPS); "triton" forces the kernels (on the
CPU they then need TRITON_INTERPRET=1 set before `import ppo_kernels`, which is how the tests run
them); "torch" forces the fallback. The environment variable RLHF_KERNELS_BACKEND sets the
starting value. Both paths compute the same quantities with fp32 accumulation and are tested
against one float64 oracle, so switching backend never changes what a function means.

Triton is optional: without it (macOS) everything runs on the fallback and
set_backend("triton") raises. A bad RLHF_KERNELS_BACKEND, or "triton" where Triton is not
installed, does not stop `import ppo_kernels`: the scripts raise it as one line before
anything loads (`check_environment`, from support/config.py), and so does any kernel call.
Where Triton is installed but cannot build a kernel (no C compiler, no CUDA driver library),
"auto" finds out once, on its first CUDA tensor, by building the log-prob kernel on a tiny
input: one line says so and the fallback runs; "triton" makes the same attempt on its first
tensor, wherever it is, and stops there with that line (`TritonCannotBuild`, a one-line error
of the scripts; RLHF_KERNELS_BACKEND=torch skips it).

Test:  python -m pytest -q tests/test_kernels.py
Bench: python -m tools.bench_kernels
"""
import functools
import os

import torch

from support import cli

from . import clipped_loss, fused_linear, logprob

BACKENDS = ("auto", "triton", "torch")
ENV = "RLHF_KERNELS_BACKEND"               # the starting backend
_backend = "auto"


class TritonCannotBuild(cli.UserError):
    """RLHF_KERNELS_BACKEND=triton where Triton cannot build: the scripts print one line."""


class BackendError(cli.UserError, ValueError):
    """A backend not in BACKENDS, or "triton" where Triton is not installed: one line."""


def set_backend(name):
    """Choose "auto", "triton" or "torch" for every function below; returns the previous one."""
    global _backend
    if name not in BACKENDS:
        raise BackendError(f"backend must be one of {BACKENDS}, got {name!r} (check {ENV})")
    if name == "triton" and logprob.triton is None:
        raise BackendError(f"the Triton backend ({ENV}=triton) needs Triton, which is not "
                           "installed here (it is for Linux with an NVIDIA GPU; none exists for "
                           f"macOS); unset {ENV}, or {ENV}=torch, to run the PyTorch path, which "
                           "computes the same")
    previous, _backend = _backend, name
    return previous


def check_environment():
    """Raise the one-line error of a bad RLHF_KERNELS_BACKEND, kept from import; else nothing."""
    if _environment_error is not None:
        raise _environment_error


def _resolve(tensor):
    """The one place a backend is picked: 'triton' or 'torch' for this input."""
    check_environment()
    if _backend == "auto":
        return ("triton" if tensor.is_cuda and logprob.triton is not None
                and triton_builds(tensor.device) else "torch")
    if _backend == "triton" and not triton_builds(tensor.device):
        raise TritonCannotBuild(triton_builds.why)
    return _backend


@functools.lru_cache(maxsize=None)
def triton_builds(device):
    """Whether Triton can build and run a kernel on `device` (once per device): the log-prob
    of a (1, 16) input. When it cannot, prints one line with the reason, kept as `.why`."""
    try:
        logits = torch.zeros(1, 16, device=device)
        logprob.gather_log_probs(logits, torch.zeros(1, dtype=torch.long, device=device),
                                 backend="triton")
        return True
    except Exception as error:              # a compiler, a driver library: whatever it lacks
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        triton_builds.why = (f"Triton cannot build its kernels on {device} ({reason}): "
                             "RLHF_KERNELS_BACKEND=torch runs the PyTorch path, which computes "
                             "the same")
        if _backend == "auto":
            print(f"note: {triton_builds.why}; taking it")
        return False


def gather_log_probs(logits, actions, temperature=1.0, return_entropy=False):
    """log softmax(logits / temperature) gathered at actions: (..., V), (...) -> (...) fp32.
    With return_entropy=True returns (logp, entropy), both differentiable in logits."""
    return logprob.gather_log_probs(logits, actions, temperature, return_entropy,
                                    backend=_resolve(logits))


def gather_log_probs_from_hidden(hidden, lm_head_weight, actions, temperature=1.0,
                                 return_entropy=False):
    """gather_log_probs(hidden @ lm_head_weight.T, actions, ...) without the (rows, V) logits:
    (..., H), (V, H), (...) -> (...) fp32, differentiable in hidden (and the weight if it needs
    grad)."""
    return fused_linear.gather_log_probs_from_hidden(hidden, lm_head_weight, actions, temperature,
                                                     return_entropy, backend=_resolve(hidden))


def masked_clipped_loss(logp, logp_old, adv, mask, clip=0.2):
    """(loss, {"clipfrac", "approx_kl"}) of eq. (8)-(10) over the tokens where mask is 1:
    loss = -(1/B) sum_{b,t} mask_bt min(r A, clip(r, 1-eps, 1+eps) A), differentiable in logp;
    the stats are detached 0-d fp32 tensors, means over real tokens (0 if there are none)."""
    return clipped_loss.masked_clipped_loss(logp, logp_old, adv, mask, clip,
                                            backend=_resolve(logp))


def masked_log_prob_loss(logp, logp_old, adv, mask, clip=0.2):
    """(loss, {"clipfrac", "approx_kl"}) with no ratio: -(1/B) sum_{b,t} mask A log pi_theta
    (vanilla policy gradient; RAFT's supervised loss with A its weights). PyTorch only: it is
    one multiply and a sum. (ppo_kernels/clipped_loss.py)"""
    return clipped_loss.masked_log_prob_loss(logp, logp_old, adv, mask, clip)


# The starting backend, from the environment. A bad value is kept, not raised: an import is
# outside the scripts' one-line errors (cli.run_script), so they raise it (check_environment).
try:
    set_backend(os.environ.get(ENV, "auto"))
    _environment_error = None
except BackendError as error:
    _environment_error = error

__all__ = ["gather_log_probs", "gather_log_probs_from_hidden", "masked_clipped_loss",
           "masked_log_prob_loss", "set_backend", "check_environment", "BackendError",
           "TritonCannotBuild"]
