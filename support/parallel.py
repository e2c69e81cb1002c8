"""More than one process: `torchrun` runs ppo.py and reward_model.py data-parallel.

    python ppo.py [flags]                                             one process, as the post
    torchrun --standalone --nproc_per_node N ppo.py [flags]           N processes, one machine
    torchrun --nnodes M --nproc_per_node N --node_rank I \\
             --rdzv_backend c10d --rdzv_endpoint HOST:29500 --rdzv_id RUN ppo.py [flags]
                                                                      M machines (docs/torchrun.md)

Every process (a rank) holds the whole model and takes an equal share of each batch. Its
gradients are summed with the others' by one all-reduce (torch.distributed: NCCL on CUDA, gloo
on the CPU). No DDP wrapper: the policy is also sampled from and read in micro-batches, and an
explicit all-reduce after the backward passes reads closer to the post than hooks would.
    split    ppo.py: each iteration's prompts (rank r takes the r-th share of the seeded draw),
             the sampling (each rank its own RNG stream), scoring, the old and reference passes
             and the backward passes. reward_model.py: the pairs of each optimizer step, and
             the held-out scoring.
    global   the gradients: every rank's loss is its share of the whole batch's loss, so their
             sum is the whole batch's gradient. Advantage whitening, the sequence-level
             baselines, results.json's metrics, the KL fed to the adaptive beta, and the ratio
             and NaN checks, on every rank's rows: each rank takes the same decision, and a
             failed check stops every rank with the same message.
    rank 0   writes every file (`report.write_json` and `report.save_checkpoint` return at once
             on the others, whose RNG states rank 0's checkpoint holds), and runs ppo.py's
             held-out evaluation. The other ranks print nothing and show no progress bars.
In one process every function here is the identity or does nothing, so the single-device path
has no distributed code in its way.

Used by: ppo.py, reward_model.py, report.py. Tests: tests/test_parallel.py.
"""

import atexit
import os
import signal
import sys
from datetime import timedelta

# The scripts import this module before torch, for what tqdm reads as it loads: a rank
# other than 0 shows no progress bars (tqdm reads TQDM_DISABLE when torch imports it).
if int(os.environ.get("RANK", "0")) > 0:
    os.environ["TQDM_DISABLE"] = "1"
# OpenMP's threads keep their default: after a parallel op they spin a moment for the next
# one, then sleep. Made to sleep at once (OMP_WAIT_POLICY=PASSIVE), a PPO iteration's median
# took 1.7x as long and the reward model's step up to 2.2x on an idle 2-core Intel VM, the
# same numbers (docs/speed.md). Where other busy processes share the cores, spinning costs
# instead: set OMP_WAIT_POLICY=PASSIVE there (the tests do). torchrun: one thread a rank.

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import loaders  # noqa: E402
from support import cli  # noqa: E402

# Rank 0 alone runs ppo.py's held-out evaluation while the others wait at their next
# collective: more than the default 10 minutes (NCCL) on a slow machine.
TIMEOUT = timedelta(hours=2)
FINISH = timedelta(seconds=10)    # the most a finished rank waits for the others at exit


def setup():
    """Join torchrun's process group, when torchrun started this process; otherwise nothing.

    NCCL and one GPU per process (LOCAL_RANK) on CUDA; gloo on the CPU, also where CUDA is
    visible but $RLHF_DEVICE=cpu (loaders.pick_device). A rank other than 0 prints nothing.
    torchrun stops the other ranks with SIGTERM when one fails: it becomes SystemExit here,
    so that the cleanups run (no half-made run folder is left behind).
    """
    if "RANK" not in os.environ or dist.is_initialized():
        return
    device = loaders.pick_device()
    if device.type == "cuda":
        ranks, gpus = int(os.environ["LOCAL_WORLD_SIZE"]), torch.cuda.device_count()
        if ranks > gpus:
            raise cli.UserError(f"torchrun: {ranks} processes on this machine and {gpus} "
                                f"GPU{'s' * (gpus > 1)}: NCCL needs one GPU per process "
                                f"(--nproc_per_node {gpus}), or {loaders.DEVICE_ENV}=cpu "
                                "for gloo on the CPU")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "nccl"
    elif device.type == "mps":
        raise cli.UserError("torchrun: Apple's MPS has no collective backend in PyTorch; run "
                            "`python` instead (one process)")
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=TIMEOUT)
    atexit.register(finish)
    if rank() > 0:
        sys.stdout = open(os.devnull, "w")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def finish():
    """The group's end, on every exit of a torchrun process (atexit): with gloo, wait for the
    other ranks (at most FINISH: a rank that failed, or was killed, is not waited for longer),
    then destroy the group while the interpreter is whole. Left to the interpreter's teardown,
    or torn down while another rank still used it, gloo has aborted a rank whose work was
    done ("terminate called without an active exception", twice in CI)."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=FINISH)
        except Exception:       # a rank gone or late: whatever the barrier says, destroy
            pass
    dist.destroy_process_group()


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def size():
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main():
    return rank() == 0


def _device():
    """Where collectives run: the current GPU with NCCL, the CPU with gloo."""
    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")


def mine(items, like=None):
    """This rank's contiguous share of `items` (a list, a range or a tensor's rows): equal
    shares when the length divides by the number of ranks. `like`: also cut the columns to
    like's width, undoing `gather`'s padding."""
    if size() == 1:
        return items
    n = len(items)
    part = items[n * rank() // size():n * (rank() + 1) // size()]
    return part if like is None else part[:, :like.shape[1]]


def gather(x):
    """Every rank's rows of x, in rank order: (b, ...) on each -> (sum of the b's, ...).

    Responses differ in length between ranks, so columns are padded with zeros (False) to the
    widest; masks padded so count nothing. None stays None.
    """
    if size() == 1 or x is None:
        return x
    y = x.to(_device(), torch.uint8 if x.dtype == torch.bool else x.dtype)
    shapes = [torch.zeros(y.ndim, dtype=torch.long, device=_device()) for _ in range(size())]
    dist.all_gather(shapes, torch.tensor(y.shape, device=_device()))
    widest = torch.stack(shapes).amax(0).tolist()                       # (ndim,)
    pad = [p for d in reversed(range(y.ndim)) for p in (0, widest[d] - y.shape[d])]
    parts = [torch.empty(widest, dtype=y.dtype, device=_device()) for _ in range(size())]
    dist.all_gather(parts, F.pad(y, pad))
    out = torch.cat([part[:int(shape[0])] for part, shape in zip(parts, shapes)])
    return out.to(x.device, x.dtype)


def across(fn, *tensors, **kwargs):
    """fn over the whole batch (every rank's rows of each tensor), and this rank's rows of the
    result, cut to the first tensor's width. In one process: fn(*tensors)."""
    if size() == 1:
        return fn(*tensors, **kwargs)
    return mine(fn(*map(gather, tensors), **kwargs), like=tensors[0])


def total(x, op="sum"):
    """x summed (op "sum"), or its "min" or "max", over the ranks: a number, a tensor (the
    result is a new tensor), or a dict of numbers. In one process: x itself."""
    if size() == 1:
        return x
    if isinstance(x, dict):
        return dict(zip(x, total(torch.tensor(list(x.values()), dtype=torch.float64),
                                 op).tolist()))
    y = torch.as_tensor(x, dtype=torch.float64 if isinstance(x, float) else None)
    y = y.to(_device(), copy=True)
    dist.all_reduce(y, {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                        "max": dist.ReduceOp.MAX}[op])
    return y.item() if not torch.is_tensor(x) else y.to(x.device)


def sum_gradients(parameters):
    """Each gradient summed over the ranks, in place, in one all-reduce. Every rank's loss is
    its share of the whole batch's loss, so the sum is the whole batch's gradient. A rank that
    had no rows this step (a reward-model step of fewer pairs than ranks) adds zeros."""
    if size() == 1:
        return
    parameters = [p for p in parameters if p.requires_grad]
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.flatten() for p in parameters])
    dist.all_reduce(flat)
    for p, g in zip(parameters, flat.split([p.numel() for p in parameters])):
        p.grad.copy_(g.view_as(p))


def seed_sampling(seed):
    """Rank r > 0 samples from its own stream, derived from the seed and r. Rank 0 keeps the
    seed's own stream, so one process under torchrun is `python`."""
    if rank() > 0:
        torch.manual_seed(seed * 1_000_003 + rank())


def rng_states(device):
    """Every rank's RNG states, in rank order: [{"torch": the CPU generator's, and "cuda" (the
    current GPU's: cuda:N's, which loaders.pick_device made current) or "mps" (Apple's) when
    `device` is one}] (a collective: every rank calls it). Sampling on a GPU draws from its
    own generator, so a checkpoint without it does not resume exactly."""
    states = {"torch": torch.get_rng_state()}
    if device.type in ("cuda", "mps"):
        states[device.type] = torch.get_device_module(device.type).get_rng_state()
    if size() == 1:
        return [states]
    gathered = {kind: gather(state[None]) for kind, state in states.items()}   # (ranks, n)
    return [{kind: gathered[kind][r] for kind in states} for r in range(size())]


def set_rng_states(states, device):
    """This rank's RNG states, as `rng_states` returned them: the CPU's, and `device`'s where
    the states hold it."""
    torch.set_rng_state(states["torch"])
    if device.type in ("cuda", "mps") and device.type in states:
        torch.get_device_module(device.type).set_rng_state(states[device.type])
