"""Shared fixtures: the real tokenizer, a tiny random model, and (for slow tests) SmolLM2."""
import csv
import functools
import os
import subprocess
import sys
from pathlib import Path

# The tests start scripts as processes beside this one: OpenMP threads that spin while
# they wait would take the 2 cores from them (the scripts alone keep OpenMP's spinning
# default: support/parallel.py). Read before torch loads OpenMP, and inherited by the scripts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every script a test starts, and every device this process picks, is on the CPU unless the
# run says otherwise (`RLHF_DEVICE=cuda pytest`): a test of equal numbers compares one device
# with itself. The tests meant for a GPU name it themselves (tests/test_devices.py).
os.environ.setdefault("RLHF_DEVICE", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when a kernel is defined (at `import ppo_kernels`), so it is set
# here, before any test module imports them. Without CUDA the kernels run under Triton's
# interpreter on CPU tensors; with CUDA they are compiled and run on the GPU, as in training
# (tests/test_kernels.py then runs the interpreted CPU cases in a fresh process).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import loaders  # noqa: E402
import reward_model as rm  # noqa: E402
from support import rm_data  # noqa: E402
from test_reward_model import tiny_model  # noqa: E402


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


@functools.cache
def missing_data():
    """Why the tests that read TL;DR data cannot run here (no data folder, no hub), or None."""
    try:
        if loaders.resolve_data_dir() is not None or loaders.hub_reachable():
            return None
    except loaders.DataError as error:              # $RLHF_DATA_DIR names no folder
        return str(error)
    return loaders.no_data("data for these tests")


@pytest.fixture(scope="session")
def data_dir():
    """The data folder the scripts find by default (None: the hub). Tests that read data ask
    for this fixture, so that with no data anywhere they skip, saying where data is looked
    for, rather than each error after the hub's retries."""
    reason = missing_data()
    if reason:
        pytest.skip(reason)
    return loaders.resolve_data_dir()


@pytest.fixture(scope="session")
def tldr_posts(data_dir):
    return loaders.load_tldr(data_dir)


def data_folder(folder, posts):
    """A data folder holding `posts` as the TL;DR file, and nothing else."""
    (folder / "tldr_validation_samples").mkdir()
    with open(folder / "tldr_validation_samples" / "oai1b.csv", "w", newline="") as sink:
        writer = csv.DictWriter(sink, fieldnames=["", "query", "reference_responses"])
        writer.writeheader()
        writer.writerows({"": i, "query": post["prompt"], "reference_responses": post["summary"]}
                         for i, post in enumerate(posts))
    return folder


@pytest.fixture(scope="session")
def small_data(tmp_path_factory, tldr_posts):
    """A data folder with the first 40 TL;DR posts: enough for the tiny preset (4 held-out
    and 4 training prompts), and fitted to a prompt budget in a fraction of a second."""
    return data_folder(tmp_path_factory.mktemp("small_data"), tldr_posts[:40])


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory, tldr_posts):
    """A data folder with the first 320 TL;DR posts and no comparisons: sft.py's tiny preset
    keeps out the 256 of ppo.py's evaluation reserve and trains on the rest, fitted to
    its prompt budget in a second rather than the whole file's ten."""
    return data_folder(tmp_path_factory.mktemp("sft_data"), tldr_posts[:320])


@pytest.fixture(scope="session")
def judge_data(tmp_path_factory, tldr_posts, data_dir):
    """sft_data's 320 posts and the first 96 comparisons of the first batch: enough for
    reward_model.py's tiny preset, read and fitted in a second or two."""
    folder = data_folder(tmp_path_factory.mktemp("judge_data"), tldr_posts[:320])
    first = sorted((data_dir / "summarize_from_feedback_comparisons").glob("batch*.json"))[0]
    (folder / "summarize_from_feedback_comparisons").mkdir()
    lines = first.read_text().splitlines(keepends=True)[:96]
    (folder / "summarize_from_feedback_comparisons" / first.name).write_text("".join(lines))
    return folder


def save_tiny_judge(folder, data_dir):
    """An untrained tiny reward model saved in `folder`: a non-zero adapter, and a length
    weight and bias, so that every term of its score takes part and `content` differs from
    `full`. Its config.json says how the tiny preset splits the comparisons of `data_dir`
    (None: the default), as reward_model.py's would, so dpo.py accepts it there."""
    model, _ = tiny_model()
    with torch.no_grad():
        model.length_weight.fill_(0.5)
        model.bias.fill_(-0.25)
    config = rm.Config(**{**rm.PRESETS["tiny"], "data_dir": str(data_dir or "")})
    model.settings["split"] = rm_data.split_settings(config, rm_data.load_and_split(config))
    folder.mkdir()
    rm.save_reward_model(model, folder)
    return folder


@pytest.fixture(scope="session")
def tiny_judge(tmp_path_factory, data_dir):
    """An untrained tiny judge's folder (`save_tiny_judge`), in a second, for the tests that
    only load and call one; its split is of the default data folder."""
    return save_tiny_judge(tmp_path_factory.mktemp("judge") / "reward_model", data_dir)


@pytest.fixture(scope="session")
def tiny_judge_small(tmp_path_factory, judge_data):
    """The same untrained tiny judge, its split of `judge_data`'s 96 comparisons."""
    return save_tiny_judge(tmp_path_factory.mktemp("judge_small") / "reward_model", judge_data)


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory, data_dir):
    """`reward_model.py --preset tiny`'s folder (seconds), for the tests that run ppo.py."""
    out = tmp_path_factory.mktemp("rm") / "reward_model"
    subprocess.run([sys.executable, "reward_model.py", "--preset", "tiny", "--out", str(out)],
                   cwd=Path(__file__).resolve().parent.parent, capture_output=True, check=True,
                   timeout=300)
    return out
