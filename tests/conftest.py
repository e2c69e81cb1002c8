"""Shared fixtures: the real tokenizer, a tiny random model, and (for slow tests) SmolLM2."""
import csv
import os
import subprocess
import sys
from pathlib import Path

# Threads that spin while waiting lose ~10x when another process shares the 2 cores (the
# scripts set this too, but here torch is imported before them). Before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when a kernel is defined (at `import kernels`), so it is set
# here, before any test module imports them. Without CUDA the kernels run under Triton's
# interpreter on CPU tensors; with CUDA they are compiled and run on the GPU, as in training
# (tests/test_kernels.py then runs the interpreted CPU cases in a fresh process).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import loaders  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return loaders.load_tokenizer()


@pytest.fixture()
def tiny(tokenizer):
    """A fresh 2-layer Llama with the real vocabulary, frozen, in eval mode."""
    return loaders.tiny_model(tokenizer, seed=0)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (the embedded copy offline); frozen, eval mode."""
    torch.manual_seed(0)
    return loaders.load_model()


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """A data folder with the first 40 TL;DR posts: enough for the tiny preset (4 held-out
    and 4 training prompts), and fitted to a prompt budget in a fraction of a second."""
    folder = tmp_path_factory.mktemp("small_data")
    (folder / "tldr_validation_samples").mkdir()
    with open(loaders.resolve_data_dir() / "tldr_validation_samples" / "oai1b.csv",
              newline="") as source:
        rows = list(csv.DictReader(source))[:40]
    with open(folder / "tldr_validation_samples" / "oai1b.csv", "w", newline="") as sink:
        writer = csv.DictWriter(sink, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return folder


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory):
    """`reward_model.py --preset tiny`'s folder (seconds), for the tests that run ppo.py."""
    out = tmp_path_factory.mktemp("rm") / "reward_model"
    subprocess.run([sys.executable, "reward_model.py", "--preset", "tiny", "--out", str(out)],
                   cwd=Path(__file__).resolve().parent.parent, capture_output=True, check=True,
                   timeout=300)
    return out
