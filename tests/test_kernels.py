"""Tests for ppo_kernels/: every path (the Triton kernels, the PyTorch fallback, the fused linear +
log-prob) against a float64 oracle written plainly below, forward and backward with a random
upstream gradient, on every device this machine has: the CPU always (Triton under its
interpreter, TRITON_INTERPRET=1), and CUDA when there is one (Triton compiled, as in training;
the interpreted CPU cases then run in a fresh process). tests/conftest.py sets the variable.

    python -m pytest -q tests/test_kernels.py        (about 20 s on two CPU cores)

Tolerances, per input dtype (the outputs are always fp32):
    fp32 logits: log-probs and entropies to 2e-5 absolute (they are O(10); fp32 carries ~7
                 digits), gradients to 1e-5 absolute (they are O(1)).
    bf16 logits: the oracle reads the same bf16 values, so log-probs still agree to 2e-5; the
                 gradient is returned in bf16, 8 bits of mantissa: relative 2**-7.
"""
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy
import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ppo_kernels  # noqa: E402
from ppo_kernels import fused_linear, logprob  # noqa: E402

# Triton on CPU tensors needs the interpreter; compiled Triton (CUDA) needs it off. When this
# process has it off, test_triton_cases_in_a_fresh_process below runs the CPU cases with it on.
TRITON_HERE = logprob.INTERPRET
TRITON_ELSEWHERE = logprob.triton is not None and not logprob.INTERPRET
CUDA = torch.cuda.is_available()


def numpy_outside_the_range():
    """Why Triton's interpreter is not tested here, or None: numpy above requirements.txt's
    range (Triton 3.6's interpreter stopped with "only 0-dimensional arrays can be converted
    to Python scalars" under numpy 2.5.2; the range's numpy runs it)."""
    line = next(line for line in (ROOT / "requirements.txt").read_text().splitlines()
                if line.startswith("numpy"))
    allowed = Requirement(line.split("#")[0].strip()).specifier
    if numpy.__version__ in allowed:
        return None
    return (f"numpy {numpy.__version__} is outside requirements.txt's range {allowed}, where "
            "Triton's interpreter is tested; the compiled kernels are tested on CUDA")


INTERPRETER_SKIP = numpy_outside_the_range()


def case(device, backend):
    """One (device, backend) parameter, skipped where this machine cannot run it."""
    skip = {("cpu", "triton"): not TRITON_HERE or INTERPRETER_SKIP, ("cuda", "torch"): not CUDA,
            ("cuda", "triton"): not CUDA or logprob.triton is None or logprob.INTERPRET}
    reason = (INTERPRETER_SKIP if (device, backend) == ("cpu", "triton") and INTERPRETER_SKIP
              else f"{backend} on {device}: no CUDA, no triton, or the interpreter's turn is "
                   "elsewhere")
    marks = pytest.mark.skipif(bool(skip.get((device, backend), False)), reason=reason)
    return pytest.param((device, backend), marks=marks, id=f"{device}-{backend}")


@pytest.fixture(params=[case(d, b) for d in ("cpu", "cuda") for b in ("torch", "triton")])
def backend(request):
    """The backend's name; every tensor a test makes lands on the case's device."""
    device, name = request.param
    previous = ppo_kernels.set_backend(name)
    torch.set_default_device(device)
    yield name
    torch.set_default_device("cpu")
    ppo_kernels.set_backend(previous)


# ---------------------------------------------------------------------------------------------
# The float64 oracles, written the plain way.
# ---------------------------------------------------------------------------------------------
def oracle_log_probs(logits, actions, temperature=1.0):
    """The post's log_softmax + gather, in float64, plus the entropy."""
    logp_all = torch.log_softmax(logits.double() / temperature, -1)
    p = logp_all.exp()
    entropy = -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)   # 0 log 0 = 0
    return logp_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1), entropy


def oracle_clipped_loss(logp, logp_old, adv, mask, clip):
    """The post's ppo_losses policy term, float64, with padding dropped from the token sum."""
    ratio = (logp.double() - logp_old.double()).exp()
    clipped = torch.min(ratio * adv.double(), ratio.clamp(1 - clip, 1 + clip) * adv.double())
    keep = mask.bool()
    clipped = torch.where(keep, clipped, 0.0)
    n = keep.sum().clamp(min=1)
    clipfrac = torch.where(keep, ((ratio - 1).abs() > clip).double(), 0.0).sum() / n
    k3 = torch.where(keep, (ratio - 1) - ratio.log(), 0.0).sum() / n
    return -clipped.sum(-1).mean(), clipfrac, k3


def check_log_probs(fn, logits, actions, temperature=1.0, value_tol=2e-5, grad_rtol=0.0,
                    grad_atol=1e-5, grad_scaled=None):
    """fn(logits, actions, temperature) -> (logp, entropy); compare values and gradients through
    both outputs (random upstream gradients) with the oracle. grad_scaled: instead of
    grad_atol, every gradient to that fraction of the largest one."""
    x = logits.detach().clone().requires_grad_()
    logp, entropy = fn(x, actions, temperature)
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == actions.shape
    g_logp, g_ent = torch.randn_like(logp), torch.randn_like(entropy)
    (grad,) = torch.autograd.grad((logp * g_logp).sum() + (entropy * g_ent).sum(), x)

    x64 = logits.detach().double().requires_grad_()
    logp64, entropy64 = oracle_log_probs(x64, actions, temperature)
    (grad64,) = torch.autograd.grad((logp64 * g_logp.double()).sum()
                                    + (entropy64 * g_ent.double()).sum(), x64)
    torch.testing.assert_close(logp.double(), logp64, rtol=1e-6, atol=value_tol)
    torch.testing.assert_close(entropy.double(), entropy64, rtol=1e-6, atol=value_tol)
    assert grad.dtype == logits.dtype
    if grad_scaled is not None:
        grad_atol = grad_scaled * grad64.abs().max().item()
    torch.testing.assert_close(grad.double(), grad64, rtol=grad_rtol, atol=grad_atol)


def via_logits(x, a, t):
    return ppo_kernels.gather_log_probs(x, a, t, return_entropy=True)


# ---------------------------------------------------------------------------------------------
# gather_log_probs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("V", [1, 7, 4097])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_float64(backend, V, temperature):
    torch.manual_seed(V)
    logits = 3 * torch.randn(3, 5, V)                        # 15 rows, V not a block multiple
    actions = torch.randint(0, V, (3, 5))
    check_log_probs(via_logits, logits, actions, temperature)


@pytest.mark.parametrize("rows,V", [(2, 49152), (1, 151936)])  # SmolLM2's and Qwen's vocabularies
def test_log_probs_long_vocabularies(backend, rows, V):
    torch.manual_seed(0)
    logits = 3 * torch.randn(rows, V)
    actions = torch.randint(0, V, (rows,))
    # fp32 sums over 150k terms: the values to 1e-4; the gradients to 5e-5 (2.1e-5 seen on a
    # CPU without AVX-512, where the reduction order differs; 1e-5 held on one with it)
    check_log_probs(via_logits, logits, actions, value_tol=1e-4, grad_atol=5e-5)


def test_one_row_and_the_post_slice(backend):
    """A single (V,) row, and the post's logits[:, P - 1:-1] slice, which is not contiguous and
    must be read in place."""
    torch.manual_seed(1)
    check_log_probs(via_logits, torch.randn(300), torch.tensor(17))
    full = torch.randn(2, 9, 301)
    logits, actions = full[:, 3:-1], torch.randint(0, 301, (2, 5))
    assert not logits.is_contiguous()
    check_log_probs(via_logits, logits, actions, temperature=0.7)


def test_huge_logits(backend):
    """Logits of +-1e4: nothing overflows, and log-probs near -3e4 keep fp32's relative precision.
    In fp32, z = 1e4 / 0.7 is only known to a few ulps, eps |z| ~ 1.7e-3, so p = exp(z - lse)
    near the top is good to that relative, and so is each gradient, a sum of p-weighted terms:
    the tolerance is 4 eps max|z| of the largest gradient. The same numbers on every device
    (drawn on the CPU). Seen: the post's expression in fp32, 1.3e-4 off float64 on the CPU;
    ours 2.4e-4 (CPU), 2.8e-3 and 1.5e-3 absolute on an H200 (torch, Triton) before the
    draws moved to the CPU."""
    g = torch.Generator().manual_seed(2)
    z = 1e4 / 0.7                                            # the largest |logit / T|
    logits = (1e4 * (2 * torch.rand(4, 4097, generator=g) - 1)).to(torch.get_default_device())
    actions = torch.randint(0, 4097, (4,), generator=g).to(torch.get_default_device())
    check_log_probs(via_logits, logits, actions, temperature=0.7, value_tol=1e-2,
                    grad_scaled=4 * torch.finfo(torch.float32).eps * z)


def test_minus_inf_except_target(backend):
    """-inf everywhere but the target: logp = 0, H = 0, and every gradient 0 (not nan)."""
    V = 4097
    actions = torch.tensor([0, 4096, 2000])
    logits = torch.full((3, V), float("-inf"))
    logits[torch.arange(3), actions] = torch.tensor([5.0, -3.0, 1e4])
    logits.requires_grad_()
    logp, entropy = ppo_kernels.gather_log_probs(logits, actions, return_entropy=True)
    assert logp.tolist() == [0.0, 0.0, 0.0] and entropy.tolist() == [0.0, 0.0, 0.0]
    (logp.sum() + entropy.sum()).backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_bf16_logits(backend):
    torch.manual_seed(3)
    logits = (3 * torch.randn(6, 4097)).bfloat16()
    actions = torch.randint(0, 4097, (6,))
    # bf16 gradient: relative 2**-7 (8 mantissa bits, with a rounding on each side)
    check_log_probs(via_logits, logits, actions, grad_rtol=2**-7, grad_atol=1e-6)


def test_logp_alone_and_temperature_semantics(backend):
    """Without return_entropy: one tensor, equal to the post's expression on logits / T."""
    torch.manual_seed(4)
    logits, actions = torch.randn(2, 3, 50), torch.randint(0, 50, (2, 3))
    logp = ppo_kernels.gather_log_probs(logits, actions, temperature=0.7)
    post = torch.log_softmax(logits / 0.7, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp, post, rtol=0, atol=1e-6)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="disagree"):
        ppo_kernels.gather_log_probs(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        ppo_kernels.gather_log_probs(torch.randn(2, 5), torch.zeros(2))
    with pytest.raises(TypeError, match="float32"):
        ppo_kernels.gather_log_probs(torch.randn(2, 5).double(), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("shape", [(3, 5), (7, 1)])
@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.bfloat16, 0.7)])
def test_fallback_blocks(monkeypatch, shape, dtype, temperature):
    """The fallback's blocks, shrunk to 3 rows: ragged along positions (3 + 2 of 5) and along
    sequences (3 + 3 + 1 of 7); fp32 at T = 1 reads the logits in place, bf16 at T = 0.7 goes
    through the reused fp32 buffers."""
    V = 301
    monkeypatch.setattr(logprob, "BLOCK_ELEMENTS", 3 * V)
    previous = ppo_kernels.set_backend("torch")
    try:
        torch.manual_seed(9)
        logits = (3 * torch.randn(*shape, V)).to(dtype)
        actions = torch.randint(0, V, shape)
        rtol = 0.0 if dtype == torch.float32 else 2**-7
        check_log_probs(via_logits, logits, actions, temperature, grad_rtol=rtol, grad_atol=1e-6)
    finally:
        ppo_kernels.set_backend(previous)


@pytest.mark.skipif(not TRITON_HERE, reason="needs triton under TRITON_INTERPRET=1")
def test_triton_matches_the_fallback():
    """The PyTorch path is the Triton kernels' reference: same inputs, same numbers, forward and
    backward, with -inf entries, a ragged vocabulary and a temperature."""
    torch.manual_seed(8)
    logits = 3 * torch.randn(2, 3, 5000)
    logits[0, 1, :4000] = float("-inf")
    actions = torch.randint(4000, 5000, (2, 3))
    g_logp, g_ent = torch.randn(2, 3), torch.randn(2, 3)
    results = []
    for name in ("torch", "triton"):
        previous = ppo_kernels.set_backend(name)
        x = logits.clone().requires_grad_()
        logp, entropy = ppo_kernels.gather_log_probs(x, actions, 0.7, return_entropy=True)
        ((logp * g_logp).sum() + (entropy * g_ent).sum()).backward()
        results.append((logp, entropy, x.grad))
        ppo_kernels.set_backend(previous)
    for ours, reference in zip(*results):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# gather_log_probs_from_hidden
# ---------------------------------------------------------------------------------------------
def via_hidden(weight):
    def fn(hidden, actions, temperature):
        return ppo_kernels.gather_log_probs_from_hidden(hidden, weight, actions, temperature,
                                                    return_entropy=True)
    return fn


# SmolLM2's vocabulary takes seconds a case under the interpreter: `pytest -m slow` runs it
@pytest.mark.parametrize("V", [7, 4097, pytest.param(49152, marks=pytest.mark.slow)])
@pytest.mark.parametrize("train_head", [False, True], ids=["frozen_head", "trained_head"])
def test_hidden_matches_float64(backend, monkeypatch, V, train_head):
    """Fused linear + log-prob against the float64 oracle, over several row chunks
    (CHUNK_ELEMENTS shrunk so 10 rows make 3 or more). A frozen lm_head takes the per-row
    Jacobian path, a trained one the recompute-in-backward path that also returns dL/dW."""
    monkeypatch.setattr(fused_linear, "CHUNK_ELEMENTS", 4 * V)
    torch.manual_seed(V)
    H = 16
    hidden = torch.randn(2, 5, H)
    weight = (torch.randn(V, H) / math.sqrt(H) * 3).requires_grad_(train_head)
    actions = torch.randint(0, V, (2, 5))
    h = hidden.clone().requires_grad_()
    logp, entropy = via_hidden(weight)(h, actions, 0.7)
    g_logp, g_ent = torch.randn_like(logp), torch.randn_like(entropy)
    leaves = (h, weight) if train_head else (h,)
    grads = torch.autograd.grad((logp * g_logp).sum() + (entropy * g_ent).sum(), leaves)

    h64, w64 = hidden.double().requires_grad_(), weight.detach().double().requires_grad_()
    logp64, entropy64 = oracle_log_probs(h64 @ w64.T, actions, 0.7)
    grads64 = torch.autograd.grad((logp64 * g_logp.double()).sum()
                                  + (entropy64 * g_ent.double()).sum(), (h64, w64))
    # fp32 matmuls over H = 16 and sums over V: a few 1e-6 relative
    torch.testing.assert_close(logp.double(), logp64, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(entropy.double(), entropy64, rtol=1e-5, atol=1e-4)
    # Gradients sum over V in fp32: 1e-5 up to a few thousand terms; over 49k, 4.9e-5 was seen
    # on a CPU without AVX-512 (another reduction order), so 1e-4 there.
    for grad, grad64 in zip(grads, grads64):
        torch.testing.assert_close(grad.double(), grad64, rtol=1e-4,
                                   atol=1e-5 if V < 10_000 else 1e-4)


def test_hidden_frozen_head_and_bf16(backend):
    """ppo.py's case: a frozen lm_head (no grad computed for it) in bf16."""
    torch.manual_seed(5)
    H, V = 32, 1000
    weight = (torch.randn(V, H) / math.sqrt(H)).bfloat16()
    hidden = torch.randn(3, 4, H).bfloat16().requires_grad_()
    actions = torch.randint(0, V, (3, 4))
    logp = ppo_kernels.gather_log_probs_from_hidden(hidden, weight, actions)
    g = torch.randn_like(logp)
    (logp * g).sum().backward()
    h64 = hidden.detach().double().requires_grad_()
    logp64, _ = oracle_log_probs((h64.bfloat16() @ weight.T).double(), actions)  # bf16 logits
    (logp64 * g.double()).sum().backward()
    torch.testing.assert_close(logp.double(), logp64, rtol=0, atol=1e-4)
    # the chain goes through bf16 logits and a bf16 matmul: relative 2**-6
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=2**-6, atol=2e-3)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("V", [49152, 151936])             # SmolLM2's and Qwen's vocabularies
def test_fused_linear_equals_the_naive_path_on_cuda(V):
    """SmolLM2's width (576), 64 rows, fp32 on the GPU: the fused path (Triton under "auto")
    against the post's logits = hidden @ W^T, log_softmax, gather; values and dL/dhidden."""
    torch.manual_seed(V)
    hidden = torch.randn(64, 576, device="cuda")
    weight = torch.randn(V, 576, device="cuda") / math.sqrt(576) * 3
    actions = torch.randint(0, V, (64,), device="cuda")
    g = torch.randn(64, device="cuda")
    h = hidden.clone().requires_grad_()
    logp = ppo_kernels.gather_log_probs_from_hidden(h, weight, actions)
    (grad,) = torch.autograd.grad((logp * g).sum(), h)
    h_naive = hidden.clone().requires_grad_()
    naive = torch.log_softmax(h_naive @ weight.T, -1).gather(-1, actions[:, None]).squeeze(-1)
    (grad_naive,) = torch.autograd.grad((naive * g).sum(), h_naive)
    # TF32 may be on for the naive matmul: both sides to 1e-3
    torch.testing.assert_close(logp, naive, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(grad, grad_naive, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not CUDA or logprob.triton is None or logprob.INTERPRET,
                    reason="needs CUDA and compiled triton")
def test_many_rows_do_not_overflow_the_grid():
    """A grid axis other than the first stops at 65,535 blocks (Liger hit this, its PR #1294):
    70,000 rows through every op on the Triton backend equal the fallback's numbers."""
    torch.manual_seed(10)
    rows, V, H = 70_000, 64, 16
    logits = torch.randn(rows, V, device="cuda")
    hidden, weight = torch.randn(rows, H, device="cuda"), torch.randn(V, H, device="cuda")
    actions = torch.randint(0, V, (rows,), device="cuda")
    logp_old = -torch.rand(rows, 1, device="cuda")
    logp = logp_old + 0.1 * torch.randn(rows, 1, device="cuda")
    adv, mask = torch.randn(rows, 1, device="cuda"), torch.ones(rows, 1, device="cuda")
    out = {}
    for name in ("torch", "triton"):
        previous = ppo_kernels.set_backend(name)
        try:
            out[name] = (*ppo_kernels.gather_log_probs(logits, actions, return_entropy=True),
                         ppo_kernels.gather_log_probs_from_hidden(hidden, weight, actions),
                         ppo_kernels.masked_clipped_loss(logp, logp_old, adv, mask)[0])
        finally:
            ppo_kernels.set_backend(previous)
    for ours, reference in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# masked_clipped_loss
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("advantage,objective,grad", [(2.0, 2.4, 0.0), (-2.0, -3.0, -3.0)])
def test_clip_worked_example(backend, advantage, objective, grad):
    """rho = 1.5, eps = 0.2. A = +2: min(3.0, 2.4) = 2.4 and no gradient, the incentive is gone.
    A = -2: min(-3.0, -2.4) = -3.0 and dJ/dlogp = rho A = -3.0, the clip does not hold back."""
    logp = torch.tensor([[math.log(0.30)]], requires_grad=True)   # pi_theta = 0.30
    logp_old = torch.tensor([[math.log(0.20)]])                   # pi_old = 0.20
    loss, stats = ppo_kernels.masked_clipped_loss(logp, logp_old, torch.tensor([[advantage]]),
                                              torch.ones(1, 1), clip=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-objective, abs=1e-6)     # (10) L = -J
    assert logp.grad.item() == pytest.approx(-grad, abs=1e-6)     # dL/dlogp = -dJ/dlogp
    assert stats["clipfrac"].item() == 1.0                        # |1.5 - 1| > 0.2
    assert stats["approx_kl"].item() == pytest.approx(0.5 - math.log(1.5), abs=1e-6)


def test_clipped_loss_matches_float64(backend):
    torch.manual_seed(6)
    B, T = 4, 37
    logp_old = -3 * torch.rand(B, T)
    logp = (logp_old + 0.3 * torch.randn(B, T)).requires_grad_()   # ratios spread across the clip
    adv = torch.randn(B, T)
    lengths = torch.tensor([37, 20, 1, 9])                          # ragged responses
    mask = (torch.arange(T) < lengths[:, None]).float()
    loss, stats = ppo_kernels.masked_clipped_loss(logp, logp_old, adv, mask, clip=0.2)
    upstream = torch.randn(())
    (grad,) = torch.autograd.grad(loss * upstream, logp)

    logp64 = logp.detach().double().requires_grad_()
    loss64, clipfrac64, k3_64 = oracle_clipped_loss(logp64, logp_old, adv, mask, 0.2)
    (grad64,) = torch.autograd.grad(loss64 * upstream.double(), logp64)
    assert 0.1 < clipfrac64 < 0.9                                   # both branches exercised
    torch.testing.assert_close(loss.double(), loss64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), grad64, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stats["clipfrac"].double(), clipfrac64, rtol=0, atol=1e-6)
    torch.testing.assert_close(stats["approx_kl"].double(), k3_64, rtol=1e-5, atol=1e-7)
    assert not stats["approx_kl"].requires_grad


def test_masked_tokens_contribute_nothing(backend):
    """Whatever sits under mask = 0 (here inf and nan) changes neither the loss, nor the stats,
    nor any gradient; an all-padding batch gives 0, not nan."""
    torch.manual_seed(7)
    logp_old, adv = -torch.rand(2, 6), torch.randn(2, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    clean = (logp_old + 0.1 * torch.randn(2, 6))
    dirty = clean.masked_fill(mask == 0, float("nan")).requires_grad_()
    bad_adv = adv.masked_fill(mask == 0, float("inf"))
    clean = clean.masked_fill(mask == 0, 0.0).requires_grad_()
    loss_a, stats_a = ppo_kernels.masked_clipped_loss(clean, logp_old, adv, mask)
    loss_b, stats_b = ppo_kernels.masked_clipped_loss(dirty, logp_old, bad_adv, mask.bool())
    loss_a.backward()
    loss_b.backward()
    assert loss_a.item() == loss_b.item() and torch.isfinite(loss_a)
    assert torch.equal(clean.grad, dirty.grad)
    assert (clean.grad[mask == 0] == 0).all()
    assert stats_a["approx_kl"].item() == stats_b["approx_kl"].item()

    nothing = clean.detach().clone().requires_grad_()
    loss, stats = ppo_kernels.masked_clipped_loss(nothing, logp_old, adv, torch.zeros(2, 6))
    loss.backward()
    assert loss.item() == 0.0 and stats["clipfrac"].item() == 0.0
    assert stats["approx_kl"].item() == 0.0 and (nothing.grad == 0).all()


# ---------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------
def test_set_backend():
    previous = ppo_kernels.set_backend("auto")
    try:
        assert ppo_kernels._resolve(torch.zeros(1)) == "torch"        # CPU tensors: the fallback
        with pytest.raises(ValueError, match="one of"):
            ppo_kernels.set_backend("cuda")
        assert ppo_kernels.set_backend("torch") == "auto"
    finally:
        ppo_kernels.set_backend(previous)


def test_where_triton_cannot_build_auto_takes_the_torch_path_in_one_line(monkeypatch, capsys):
    """A CUDA tensor (a stand-in: only is_cuda and device are read; the probe's input goes to
    the meta device) where the kernel's build fails, as without a C compiler: auto prints one
    line and takes the fallback, once per device; a forced "triton" stops with that line,
    which names the switch."""
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC")
    monkeypatch.setattr(ppo_kernels.logprob, "gather_log_probs", no_compiler)
    ppo_kernels.triton_builds.cache_clear()
    gpu = types.SimpleNamespace(is_cuda=True, device=torch.device("meta"))
    previous = ppo_kernels.set_backend("auto")
    try:
        if ppo_kernels.logprob.triton is None:
            pytest.skip("Triton is not installed: auto never tries it")
        assert ppo_kernels._resolve(gpu) == ppo_kernels._resolve(gpu) == "torch"
        out = capsys.readouterr().out.splitlines()
        assert len(out) == 1 and "cannot build" in out[0] and "C compiler" in out[0]
        ppo_kernels.set_backend("triton")
        with pytest.raises(ppo_kernels.TritonCannotBuild, match="RLHF_KERNELS_BACKEND=torch"):
            ppo_kernels._resolve(gpu)
    finally:
        ppo_kernels.set_backend(previous)
        ppo_kernels.triton_builds.cache_clear()


@pytest.mark.slow
@pytest.mark.skipif(ppo_kernels.logprob.triton is None, reason="Triton is not installed")
def test_forced_triton_that_cannot_build_is_one_line_and_exit_1():
    """RLHF_KERNELS_BACKEND=triton on the CPU with Triton's interpreter off: Triton cannot
    build there, and a script stops with one line naming the switch, no traceback."""
    code = ("import torch, ppo_kernels; from support import cli; cli.run_script(lambda argv: "
            "ppo_kernels.gather_log_probs(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long)))")
    env = dict(os.environ, RLHF_KERNELS_BACKEND="triton", TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", code, "script.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("<string>: error: Triton cannot build its kernels on cpu (")
    assert lines[0].endswith("RLHF_KERNELS_BACKEND=torch runs the PyTorch path, which "
                             "computes the same")


@pytest.mark.slow
def test_backend_environment_variable():
    """RLHF_KERNELS_BACKEND sets the starting backend; a bad one is one line from a script."""
    code = ("import ppo_kernels; from support import cli; print(ppo_kernels._backend); "
            "cli.run_script(lambda argv: ppo_kernels.check_environment())")
    env = dict(os.environ, RLHF_KERNELS_BACKEND="torch")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "torch", out.stderr
    env["RLHF_KERNELS_BACKEND"] = "cuda"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "RLHF_KERNELS_BACKEND" in lines[0]


@pytest.mark.slow
def test_forced_triton_where_triton_is_not_installed_is_one_line_in_every_script(tmp_path):
    """RLHF_KERNELS_BACKEND=triton with no Triton (every Mac; here an importable `triton`
    that raises ImportError stands in): each of the four scripts stops with one line naming
    the switch and the fix, exit 1, before anything loads, and writes nothing."""
    (tmp_path / "stub" / "triton").mkdir(parents=True)
    (tmp_path / "stub" / "triton" / "__init__.py").write_text(
        "raise ImportError('no Triton here')\n")
    env = dict(os.environ, RLHF_KERNELS_BACKEND="triton",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "stub"), str(ROOT)]))
    for script in ("sft.py", "reward_model.py", "ppo.py", "dpo.py"):
        out = subprocess.run([sys.executable, script, "--preset", "tiny", "--out",
                              str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1, (script, out.stderr[-2000:])
        assert lines[0].startswith(f"{script}: error: the Triton backend "
                                   "(RLHF_KERNELS_BACKEND=triton) needs Triton"), lines
        assert "RLHF_KERNELS_BACKEND=torch" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stub"]


@pytest.mark.skipif(not TRITON_ELSEWHERE, reason="the Triton cases ran in this process")
@pytest.mark.skipif(bool(INTERPRETER_SKIP), reason=str(INTERPRETER_SKIP))
def test_triton_cases_in_a_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "triton"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-4000:]
