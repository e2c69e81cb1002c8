"""The post's machines: which device a script uses, bf16 where it is native, the RNG a
checkpoint keeps, no float64 on a device (Apple's MPS has none), and left padding.

- $RLHF_DEVICE names the device every script uses (the tests set it to the CPU in conftest.py,
  so that a test of equal numbers compares one device with itself); a bad or absent device is
  one line.
- bf16 is native on CUDA from compute capability 8.0 (a T4 or a V100 only emulates it).
- A checkpoint restores the CPU generator, and the GPU's where there is one: `generate` on
  CUDA draws from the GPU's, so without it `--resume` would not repeat the run. On CUDA, a
  resumed tiny run equals an uninterrupted one.
- tests/device_rules.py's mode raises at a float64 tensor off the CPU; on CUDA the tiny
  pipeline (sft.py, reward_model.py, ppo.py) runs to the end under it.
- Left-padded prompts of real lengths give finite log-probs, equal to each row run alone, in
  fp32 and bf16, on the CPU and on CUDA.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import loaders
import ppo
import reward_model as rm
import sft
from device_rules import Float64OnDevice, NoFloat64OnDevice
from lora import with_lora
from support import cli, devices, parallel, report

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def test_rlhf_device_names_the_device_and_a_bad_one_is_one_line(monkeypatch):
    monkeypatch.setenv("RLHF_DEVICE", "cpu")
    assert loaders.pick_device() == torch.device("cpu")
    assert loaders.default_preset() == "cpu"
    monkeypatch.setenv("RLHF_DEVICE", "gpu0")
    with pytest.raises(cli.UserError, match=r"\$RLHF_DEVICE=gpu0: not a device"):
        loaders.pick_device()
    if not CUDA:
        monkeypatch.setenv("RLHF_DEVICE", "cuda")
        with pytest.raises(cli.UserError, match=r"\$RLHF_DEVICE=cuda: no cuda device here"):
            loaders.pick_device()


def test_a_cpu_torch_beside_an_nvidia_gpu_says_so_once_with_the_fix(monkeypatch, capsys):
    """The lock's torch is 2.13.0+cpu: on a machine with a GPU (faked here), one line says so
    and names the command; the run goes on on the CPU. $RLHF_DEVICE=cuda names it too."""
    monkeypatch.delenv("RLHF_DEVICE")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(devices, "nvidia_gpu_present", lambda: False)
    devices.say_once.cache_clear()
    assert loaders.pick_device() == torch.device("cpu")
    assert capsys.readouterr().out == ""                    # no GPU: nothing to say
    monkeypatch.setattr(devices, "nvidia_gpu_present", lambda: True)
    assert loaders.pick_device() == loaders.pick_device() == torch.device("cpu")
    fix = "`pip uninstall -y torch && pip install torch==2.13.0`"
    assert capsys.readouterr().out.splitlines() == [
        f"note: an NVIDIA GPU is here but torch 2.13.0+cpu is a CPU build; {fix} installs "
        "PyPI's CUDA build (docs/dependencies.md#which-torch); running on the CPU"]
    monkeypatch.setenv("RLHF_DEVICE", "cuda")
    with pytest.raises(cli.UserError, match=r"no cuda device here \(an NVIDIA GPU is here.*"
                                            r"pip install torch==2\.13\.0"):
        loaders.pick_device()


def test_a_cuda_torch_whose_driver_is_too_old_says_so_once_and_runs_on_the_cpu(monkeypatch,
                                                                              capsys):
    """PyPI's torch 2.13.0 is CUDA 13.0's build: beside a GPU whose driver is older than CUDA
    13 needs (faked here: 535), torch.cuda.is_available() is False. One line names the driver,
    what it needs and the fix, and the run goes on on the CPU; $RLHF_DEVICE=cuda says so."""
    monkeypatch.delenv("RLHF_DEVICE")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(devices, "nvidia_gpu_present", lambda: True)
    monkeypatch.setattr(devices, "nvidia_driver", lambda: "535.104.05")
    devices.say_once.cache_clear()
    assert loaders.pick_device() == loaders.pick_device() == torch.device("cpu")
    assert capsys.readouterr().out.splitlines() == [
        "note: an NVIDIA GPU is here but torch 2.13.0+cu130, built for CUDA 13.0, cannot start "
        "it: driver 535.104.05, and CUDA 13 needs 580 or newer; update the NVIDIA driver, or "
        "install a torch built for an older CUDA (`pip install torch==2.13.0 --index-url "
        "https://download.pytorch.org/whl/cu128`: docs/dependencies.md#which-torch); running "
        "on the CPU"]
    monkeypatch.setenv("RLHF_DEVICE", "cuda")
    with pytest.raises(cli.UserError, match=r"no cuda device here \(.*driver 535\.104\.05, "
                                            r"and CUDA 13 needs 580 or newer"):
        loaders.pick_device()
    # A driver new enough, and still no CUDA: the line says where to look instead
    monkeypatch.setattr(devices, "nvidia_driver", lambda: "580.65.06")
    assert "driver 580.65.06 is new enough" in devices.unused_gpu_note()


def test_the_driver_version_is_read_from_the_kernel_modules_line(monkeypatch, tmp_path):
    line = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build "
            " (dvs-builder@U16-I3-B03-4-3)  Tue Jul 15 21:59:22 UTC 2025\n")
    real_path = devices.Path
    monkeypatch.setattr(devices, "Path", lambda name: real_path(tmp_path / "version")
                        if name == "/proc/driver/nvidia/version" else real_path(name))
    (tmp_path / "version").write_text(line)
    devices.nvidia_driver.cache_clear()
    assert devices.nvidia_driver() == "580.65.06"
    devices.nvidia_driver.cache_clear()


def test_cuda_n_is_checked_against_the_gpus_and_made_current(monkeypatch):
    """Two GPUs (faked): cuda:1 becomes current, so the RNG state saved is GPU 1's; cuda:2 is
    one line; plain cuda leaves the current GPU alone (torchrun's LOCAL_RANK sets it)."""
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: current.append(index))
    monkeypatch.setattr(torch.cuda, "get_rng_state",       # each GPU's state: its index
                        lambda device="cuda": torch.tensor([current[-1]], dtype=torch.uint8))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("RLHF_DEVICE", "cuda:1")
    assert loaders.pick_device() == torch.device("cuda:1") and current == [0, 1]
    assert parallel.rng_states(torch.device("cuda:1"))[0]["cuda"].tolist() == [1]
    monkeypatch.setenv("RLHF_DEVICE", "cuda")
    assert loaders.pick_device() == torch.device("cuda") and current == [0, 1]
    monkeypatch.setenv("RLHF_DEVICE", "cuda:2")
    with pytest.raises(cli.UserError, match=r"^\$RLHF_DEVICE=cuda:2: cuda:0 to cuda:1 are here$"):
        loaders.pick_device()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RLHF_DEVICE", "cuda:1")
    with pytest.raises(cli.UserError, match="torchrun gives each process its GPU"):
        loaders.pick_device()
    assert current == [0, 1]


@pytest.fixture()
def fake_mps(monkeypatch):
    """Apple's MPS generator, faked on any machine: its state is mps["state"]."""
    mps = {"state": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda device="mps": mps["state"].clone())
    monkeypatch.setattr(torch.mps, "set_rng_state",
                        lambda state, device="mps": mps.update(state=state.clone()))
    return mps


def test_on_mps_a_checkpoint_keeps_its_generator_and_one_without_it_says_so(
        tokenizer, tmp_path, monkeypatch, capsys, fake_mps):
    policy, value_head, optimizer = tiny_state(tokenizer, "cpu")
    monkeypatch.setattr(report, "model_device", lambda model: torch.device("mps"))
    report.save_checkpoint(tmp_path / "mps", 0, policy, value_head, optimizer, 0.1)
    fake_mps["state"] = torch.tensor([9, 9, 9], dtype=torch.uint8)     # sampling moved it on
    report.load_checkpoint(tmp_path / "mps", policy, value_head, optimizer)
    assert fake_mps["state"].tolist() == [1, 2, 3] and capsys.readouterr().out == ""
    monkeypatch.setattr(report, "model_device", lambda model: torch.device("cpu"))
    report.save_checkpoint(tmp_path / "cpu", 0, policy, value_head, optimizer, 0.1)
    monkeypatch.setattr(report, "model_device", lambda model: torch.device("mps"))
    report.load_checkpoint(tmp_path / "cpu", policy, value_head, optimizer)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "has no MPS RNG state" in out[0]


def test_fork_rng_gives_back_the_mps_generator_and_the_cpus(fake_mps):
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with loaders.fork_rng():
        torch.rand(100)
        fake_mps["state"] = torch.tensor([7, 7, 7], dtype=torch.uint8)  # a draw on the GPU
    assert fake_mps["state"].tolist() == [1, 2, 3] and torch.rand(4).equal(expected)


@pytest.mark.slow
def test_a_script_started_with_a_bad_device_stops_in_one_line(tmp_path):
    env = dict(os.environ, RLHF_DEVICE="tpu")
    done = subprocess.run([sys.executable, "ppo.py", "--preset", "tiny", "--out",
                           str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "ppo.py: error: $RLHF_DEVICE=tpu: not a device (cpu, cuda, cuda:N or mps)"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("capability,native", [((7, 0), False), ((7, 5), False),
                                               ((8, 0), True), ((9, 0), True)])
def test_bf16_is_native_on_cuda_from_compute_capability_8(monkeypatch, capability, native):
    """V100 (7.0) and T4 (7.5) emulate bf16, which torch.cuda.is_bf16_supported counts."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert loaders.native_bf16("cuda") is native
    assert loaders.resolve_precision("auto", "cuda") == ("bf16" if native else "fp32")


def tiny_state(tokenizer, device):
    """A policy with the adapter, a value head and an optimizer with moments, on `device`."""
    policy = with_lora(loaders.tiny_model(tokenizer, device=device))
    value_head = ppo.ValueHead(policy.config.hidden_size).to(device)
    optimizer, trainable = ppo.make_optimizer(policy, value_head, ppo.Config(lr=1e-3))
    sum(p.sum() for p in trainable).backward()
    optimizer.step()
    return policy, value_head, optimizer


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_a_checkpoint_restores_every_generator_sampling_draws_from(tokenizer, tmp_path, device):
    """After a checkpoint, the draws that follow it; after loading it, the same draws again,
    on the CPU's generator and, on CUDA, on the GPU's (where `generate` draws there)."""
    policy, value_head, optimizer = tiny_state(tokenizer, device)
    torch.manual_seed(5)
    torch.rand(7, device=device)                        # move the generators on a little
    report.save_checkpoint(tmp_path, 0, policy, value_head, optimizer, controller_beta=0.1)

    def draws():
        return [torch.rand(5).tolist()] + ([torch.rand(5, device="cuda").tolist()]
                                           if device == "cuda" else [])
    after_saving = draws()
    assert report.load_checkpoint(tmp_path, policy, value_head, optimizer)[:2] == (1, 0.1)
    assert draws() == after_saving
    states = parallel.rng_states(torch.device(device))
    assert len(states) == 1 and set(states[0]) == ({"torch"} if device == "cpu"
                                                   else {"torch", "cuda"})


@pytest.mark.slow
@needs_cuda
def test_a_resumed_run_on_cuda_repeats_the_uninterrupted_one(tiny_reward_model, tmp_path):
    """ppo.py's tiny preset on the GPU: 4 iterations straight, and 2 then --resume to 4."""
    env = dict(os.environ, RLHF_DEVICE="cuda")
    common = ["ppo.py", "--preset", "tiny", "--reward-model", str(tiny_reward_model),
              "--beta", "0.1", "--checkpoint-every", "2"]

    def run(*args):
        done = subprocess.run([sys.executable, *common, *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout
    assert "on cuda" in run("--iterations", "4", "--out", str(tmp_path / "straight"))
    run("--iterations", "2", "--out", str(tmp_path / "resumed"))
    run("--iterations", "4", "--out", str(tmp_path / "resumed"), "--resume")
    straight, resumed = (json.loads((tmp_path / name / "results.json").read_text())
                         for name in ("straight", "resumed"))
    assert report.differences(resumed, straight) == []


def test_the_float64_rule_raises_off_the_cpu_and_allows_the_cpu():
    """On the meta device (no memory, no GPU needed) as it would on CUDA or MPS."""
    with NoFloat64OnDevice():
        torch.zeros(3, dtype=torch.float64).sum()           # the CPU: allowed
        x = torch.zeros(3, device="meta")
        x.float() + 1                                       # float32 off the CPU: allowed
        for make in (lambda: x.double(), lambda: x.to(torch.float64),
                     lambda: torch.zeros(2, dtype=torch.float64, device="meta"),
                     lambda: x + torch.zeros(3, dtype=torch.float64, device="meta")):
            with pytest.raises(Float64OnDevice, match="float64 tensor on meta"):
                make()


@pytest.mark.slow
@needs_cuda
def test_the_tiny_pipeline_on_cuda_makes_no_float64_on_the_device(tmp_path, monkeypatch,
                                                                    data_dir):
    """sft.py, reward_model.py and ppo.py at the tiny preset, in this process, on the GPU,
    under Apple's rule: none of them makes a float64 tensor on the device."""
    monkeypatch.setenv("RLHF_DEVICE", "cuda")
    out = {name: str(tmp_path / name) for name in ("sft", "judge", "ppo")}
    with NoFloat64OnDevice():
        sft.main(["--preset", "tiny", "--out", out["sft"], "--reward-model", out["judge"]])
        rm.main(["--preset", "tiny", "--out", out["judge"]])
        ppo.main(["--preset", "tiny", "--model", out["sft"], "--reward-model", out["judge"],
                  "--beta", "0.1", "--out", out["ppo"]])
    results = json.loads((tmp_path / "ppo" / "results.json").read_text())
    assert results["iterations"][0]["ratio_min"] == results["iterations"][0]["ratio_max"] == 1.0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_left_padded_prompts_of_real_lengths_give_the_rows_own_log_probs(
        tokenizer, tldr_posts, device, precision):
    """Six posts cut to 40-160 tokens, left-padded into one batch: every log-prob is finite
    and equals the row run alone (fp32 to 1e-4; bf16, whose rounding depends on the shapes,
    to 0.1 nats), under the same path PPO uses (`ppo.token_log_probs`)."""
    model = loaders.tiny_model(tokenizer, device=device)
    cfg = ppo.Config(precision=precision)
    posts = [{**p, "prompt": loaders.fit_prompt(tokenizer, p, budget)}
             for p, budget in zip(tldr_posts[:6], (40, 160, 64, 128, 90, 50))]
    prompt_ids, prompt_mask = loaders.encode(tokenizer, [p["prompt"] for p in posts], device)
    assert len(set(prompt_mask.sum(1).tolist())) == 6               # six real lengths
    g = torch.Generator().manual_seed(0)
    actions = torch.randint(100, 5000, (6, 12), generator=g).to(device)     # (B, T)
    with torch.no_grad(), loaders.precision(cfg, device):
        batch = ppo.token_log_probs(model, torch.cat([prompt_ids, actions], 1),
                                    ppo.full_mask(prompt_mask, actions), actions)    # (B, T)
        alone = torch.cat([ppo.token_log_probs(model, torch.cat([ids[m.bool()][None], a[None]], 1),
                                               torch.ones(1, int(m.sum()) + len(a),
                                                          dtype=m.dtype, device=device),
                                               a[None])
                           for ids, m, a in zip(prompt_ids, prompt_mask, actions)])  # (B, T)
    assert torch.isfinite(batch).all()
    tolerance = 1e-4 if precision == "fp32" else 0.1
    assert (batch - alone).abs().max().item() < tolerance
