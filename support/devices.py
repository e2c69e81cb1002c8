"""The device a run uses, and what depends on it: the post's `DEVICE`, bf16, the RNG.

    pick_device         $RLHF_DEVICE (cpu, cuda, cuda:N, mps), else CUDA, then Apple's MPS,
                        then the CPU; where an NVIDIA GPU is here and torch cannot use it (a
                        CPU build, or a CUDA build whose CUDA the driver is too old for), one
                        line says why and how to fix it, and the run goes on on the CPU
    native_bf16, resolve_precision, precision, at_precision, heads_in_fp32
                        bf16 where its matmuls are native, and the autocast contexts
    fork_rng            the CPU's generator and the current GPU's (or MPS's) forked together
    default_preset      `blog` with CUDA or MPS, else `cpu`
loaders.py imports every name here, so the scripts read them as `loaders.pick_device` and so
on (the README's map). Like support/cli.py, this module imports no module of this project
but cli (tests/test_layout.py), so loaders.py, below support/, can use it without a cycle.

Test: pytest tests/test_devices.py
"""
import contextlib
import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from support import cli

DEVICE_ENV = "RLHF_DEVICE"          # cpu, cuda or mps: the device every script uses
# The oldest Linux driver each CUDA major version runs on (NVIDIA's CUDA compatibility
# table, minor-version compatibility included): PyPI's torch 2.13.0 is built for CUDA 13.0.
MIN_DRIVER = {11: 450, 12: 525, 13: 580}


def pick_device():
    """$RLHF_DEVICE when set (cpu, cuda, cuda:N or mps: the tests name the device they mean
    with it), else CUDA, then Apple's MPS, then the CPU. cuda:N is made the current GPU here,
    before anything is allocated: kernel launches, CUDA graphs, side streams, the RNG state
    and the peak memory that ask for "the current GPU" then get GPU N."""
    if chosen := os.environ.get(DEVICE_ENV):
        try:
            device = torch.device(chosen)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda", "mps"):
            raise cli.UserError(f"${DEVICE_ENV}={chosen}: not a device (cpu, cuda, cuda:N "
                                "or mps)")
        available = {"cpu": True, "cuda": torch.cuda.is_available(),
                     "mps": torch.backends.mps.is_available()}[device.type]
        if not available:
            why = f" ({note})" if device.type == "cuda" and (note := unused_gpu_note()) else ""
            raise cli.UserError(f"${DEVICE_ENV}={chosen}: no {device.type} device here{why}")
        if device.type == "cuda" and device.index is not None:
            count = torch.cuda.device_count()       # torchrun: each process its GPU already
            if not device.index < count or "LOCAL_RANK" in os.environ:
                raise cli.UserError(f"${DEVICE_ENV}={chosen}: " + (
                    f"torchrun gives each process its GPU; set ${DEVICE_ENV}=cuda"
                    if "LOCAL_RANK" in os.environ else f"cuda:0 to cuda:{count - 1} are here"))
            torch.cuda.set_device(device.index)
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    if note := unused_gpu_note():
        say_once(f"note: {note}; running on the CPU")
    return torch.device("cpu")


def nvidia_gpu_present():
    """Whether this machine has an NVIDIA GPU, whatever torch was built for: its driver's
    files (Linux) or its nvidia-smi command."""
    return (Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidia0").exists()
            or shutil.which("nvidia-smi") is not None)


@functools.cache
def nvidia_driver():
    """The NVIDIA driver's version ("580.65.06"), from its kernel module or nvidia-smi; None
    where neither says. Read once a process."""
    try:
        found = re.search(r"\s(\d{3,}\.\d+(?:\.\d+)?)\s",
                          Path("/proc/driver/nvidia/version").read_text())
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def unused_gpu_note():
    """Why torch cannot use the NVIDIA GPU here, and the fix; None where it can, or there is
    none. A CPU build (the lock's +cpu); or a CUDA build that cannot start CUDA, mostly a
    driver older than its CUDA needs (PyPI's 2.13.0 is CUDA 13.0's: a driver from 580)."""
    if torch.cuda.is_available() or not nvidia_gpu_present():
        return None
    version = torch.__version__.split("+")[0]
    if torch.version.cuda is None:
        return (f"an NVIDIA GPU is here but torch {torch.__version__} is a CPU build; `pip "
                f"uninstall -y torch && pip install torch=={version}` installs PyPI's CUDA build "
                "(docs/dependencies.md#which-torch)")
    major, driver = int(torch.version.cuda.split(".")[0]), nvidia_driver() or ""
    needs = MIN_DRIVER.get(major)
    if not driver.split(".")[0].isdigit() or needs is None or int(driver.split(".")[0]) < needs:
        said = f"driver {driver}" if driver else "a driver whose version nvidia-smi does not give"
        older = (f"`pip install torch=={version} --index-url "
                 "https://download.pytorch.org/whl/cu128`: " if major > 12 else "")
        return (f"an NVIDIA GPU is here but torch {torch.__version__}, built for CUDA "
                f"{torch.version.cuda}, cannot start it: {said}"
                + (f", and CUDA {major} needs {needs} or newer" if needs else "")
                + "; update the NVIDIA driver, or install a torch built for an older CUDA "
                f"({older}docs/dependencies.md#which-torch)")
    return (f"an NVIDIA GPU is here, and driver {driver} is new enough for torch "
            f"{torch.__version__} (CUDA {torch.version.cuda}), but torch cannot start it; "
            "`nvidia-smi` and $CUDA_VISIBLE_DEVICES say why")


@functools.lru_cache(maxsize=None)
def say_once(line):
    print(line)                                     # once a process, however often called


def fork_rng():
    """torch.random.fork_rng over the CPU's generator and the GPU's: the current CUDA device's,
    or Apple's MPS generator (torch before 2.8 forks CUDA's only, and every GPU's by default)."""
    if torch.backends.mps.is_available():
        return torch.random.fork_rng([0], device_type="mps")
    gpus = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    return torch.random.fork_rng(gpus, device_type="cuda")


def native_bf16(device):
    """Whether bf16 matmuls are native on `device`: a CUDA GPU of compute capability 8.0 or
    newer (Ampere on; torch's `is_bf16_supported` also counts the emulated bf16 of a T4 or a
    V100), or a CPU with AVX512-BF16 or AMX (from Linux's /proc/cpuinfo). Elsewhere they are
    emulated, and slower."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type != "cpu":
        return False
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve_precision(choice, device):
    """--precision's value for a run on `device`: `auto` is bf16 where bf16 matmuls are
    native (`native_bf16`) and fp32 elsewhere. ValueError for bf16 on Apple MPS, where
    bf16 autocast is untested here."""
    if choice == "auto":
        choice = "bf16" if native_bf16(device) else "fp32"
    if choice == "bf16" and torch.device(device).type == "mps":
        raise ValueError("argument --precision: bf16 runs on CUDA and on CPUs here; on Apple "
                         "MPS use fp32 (bf16 autocast there is untested)")
    return choice


def precision(cfg, device):
    """The context for every transformer-body pass: bf16 autocast with --precision bf16,
    else nothing at all (fp32, as the post; and no autocast object on Apple MPS, which
    torch 2.4 does not know). The log-prob gather and the value head opt out of it
    (`heads_in_fp32`), so log-probs, values and losses are fp32 either way."""
    if cfg.precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def at_precision(name, device):
    """A model's passes at the precision it was trained in, `name` ("fp32" or "bf16"),
    whatever autocast the caller set: the judge, trained in fp32, scores in fp32 inside PPO's
    bf16 bodies (and one trained with --precision bf16 in bf16 everywhere)."""
    kind = torch.device(device).type
    if name == "bf16":
        return torch.autocast(kind, dtype=torch.bfloat16)
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


def heads_in_fp32(hidden):
    """Autocast off, for the LM and value heads that read `hidden`, where the bodies ran under
    it (bf16 on CUDA or the CPU); nothing otherwise."""
    kind = hidden.device.type
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


def default_preset():
    """The preset a script picks when given none: `blog` with CUDA or MPS, else `cpu`."""
    return "cpu" if pick_device().type == "cpu" else "blog"
