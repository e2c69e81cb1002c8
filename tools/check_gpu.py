"""One command that checks a GPU: `python -m tools.bench_ppo --check-gpu [--dry-run] [--out FILE]`.

On a CUDA machine it runs three steps, prints one table and writes it as JSON to --out
(default runs/gpu_check.json), within five minutes in all (BUDGET), counted from the start of
the command: `import torch` and the preparation (the model folders, pip) included. Each
command's limit is its share (SHARES) of the time left, so the limits sum within the budget
and time a step leaves unused goes to the ones after it; a command past its limit is stopped
with every process under it (torchrun's workers too, which run in sessions of their own) and
becomes a row "over N s, skipped". Only `import torch`, in this process, cannot be stopped:
it is counted, not limited.
    1. tests     the kernel suite with the Triton kernels compiled on CUDA tensors
                 (tests/test_kernels.py; its interpreter cases are the CPU's, run by CI)
    2. kernels   tools/bench_kernels.py on CUDA at 16 x 304 rows x 49,152: time, peak extra
                 memory and bandwidth (as a fraction of a device-to-device copy) of every
                 path, against the post's and torch.compile of it; a path past PATH_SECONDS
                 (torch.compile can take minutes at this size) is a row that says so
    3. ppo       4 iterations of the blog preset with random weights of SmolLM2-135M's
                 architecture, per phase, the median after the first: bf16 and fp32 with
                 decoding.py's CUDA graph (--decoding auto), bf16 with Hugging Face's
                 `generate` (--decoding hf, side by side), bf16 under `torchrun
                 --nproc_per_node 1` (parallel.py's path on one GPU); ms a new token, against
                 issue 52's targets
--dry-run runs the same steps on the CPU at toy sizes (a few kernel tests under the
interpreter, 64 x 4097, 2 iterations of the tiny preset), so a machine without CUDA, and CI,
can check the command itself. Without CUDA and without --dry-run it stops with one line.

Weights do not matter for timing, so none travel. A model folder with a config and a
tokenizer but no weights (3.4 MB, `loaders.save_architecture`) loads as random weights of
that architecture (`loaders.load_model`); the reward model is built on it the same way, and
the prompts are the post's template around filler text. `--prepare` writes the two folders
and the wheels of pytest and Liger-Kernel (installed there only where missing) into
runs/gpu_check/ on a machine that has SmolLM2: carry that folder to the GPU machine. The
check needs neither `gguf` nor `datasets` nor the hub there.

Run:  python -m tools.bench_ppo --check-gpu --prepare       (here, once: the model folders)
      python -m tools.bench_ppo --check-gpu                 (on the GPU machine, <= 5 min)
      python -m tools.bench_ppo --check-gpu --steps tests kernels     (some steps; the JSON is
                                                      written after each, so a timeout keeps
                                                      what finished)
Test: pytest tests/test_check_gpu.py      (pytest -m slow tests/test_check_gpu.py: the --dry-run)
"""

import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import loaders
from support.disk import write_json
from support.report import peak_memory_gb

ROOT = Path(__file__).resolve().parent.parent        # the repository root
MODELS = {"smollm2": None}        # folder name: vocabulary override (None: the model's own)
PHASES = ("generate", "score", "forward", "update")
# Pure-Python wheels that travel with the model folders, and the module each provides.
WHEELS = {"pytest": "pytest", "pluggy": "pluggy", "iniconfig": "iniconfig",
          "packaging": "packaging", "liger-kernel": "liger_kernel"}


def prepare(folder, deadline):
    """The model folders (config and tokenizer, no weights) that the check loads, and wheels
    of pytest (pure Python) for a GPU machine that lacks it and cannot download: two commands
    within the check's budget (reading SmolLM2's config and tokenizer can take a while)."""
    _, output = deadline.run(["python", "-m", "tools.check_gpu", "--save-architecture",
                              str(folder)], SHARES["models"])
    print(output, end="")
    deadline.run(["python", "-m", "pip", "download", "--quiet", "--no-deps", "-d",
                  str(Path(folder) / "wheels"), *WHEELS], SHARES["pip"])


def save_architectures(folder):
    """What `prepare`'s first command runs: each model folder of MODELS in `folder`."""
    for name, vocab in MODELS.items():
        loaders.save_architecture(Path(folder) / name, vocab)
        print(f"wrote {Path(folder) / name}")


def missing_packages(folder):
    """The carried wheels of pytest and Liger-Kernel (to time against) this Python lacks."""
    if not (Path(folder) / "wheels").is_dir():
        return []
    return [wheel for wheel, module in WHEELS.items() if importlib.util.find_spec(module) is None]


def ensure_packages(folder, missing, deadline):
    """Install `missing` from the carried wheels, within the check's budget."""
    if missing:
        deadline.run(["python", "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                      "--find-links", str(Path(folder) / "wheels"), *missing], SHARES["pip"])


def filler_pool(tokenizer, n, prompt_tokens):
    """n posts in the post's template, each filling `prompt_tokens`: made-up text, for timing."""
    body = " ".join(f"sentence {i} of a post written only to fill the prompt." for i in range(200))
    post = {"subreddit": "test", "title": "a post for timing", "post": body,
            "summary": "a summary for timing"}
    prompt = loaders.fit_prompt(tokenizer, post, prompt_tokens)
    return [{**post, "prompt": prompt} for _ in range(n)]


def ppo_worker(model, preset, precision, decoding, iterations):
    """`iterations` of ppo.train with random weights; prints one RESULT line of JSON."""
    import lora
    from support import parallel
    import ppo
    import reward_model as rm
    parallel.setup()                            # under torchrun only
    with tempfile.TemporaryDirectory() as out:
        argv = ["--preset", preset, "--iterations", str(iterations), "--precision", precision,
                "--decoding", decoding, "--checkpoint-every", "1000", "--out", out]
        cfg = ppo.parse_args(argv + (["--model", model] if model else []))
        device = loaders.pick_device()
        reference, tokenizer = loaders.load_policy_and_tokenizer(cfg.model, preset=cfg.preset,
                                                                 device=device)
        settings = {"base_model": cfg.model, "tiny": preset == "tiny", "seed": 0,
                    "lora_r": lora.LORA_R, "lora_alpha": lora.LORA_ALPHA, "lora_layers": 0,
                    "resolved_from": "random weights, for timing"}
        reward, _ = rm.build_reward_model(settings, device)
        reward.settings.update(pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
        pool = filler_pool(tokenizer, cfg.batch, cfg.prompt_tokens)
        _, _, results = ppo.train(cfg, 0.1, 0, (reference, loaders.freeze(reward), tokenizer,
                                                device), pool, out, progress=False)
    print("RESULT " + json.dumps({"rows": results["iterations"],
                                  "peak_gb": peak_memory_gb(device)}))


class Deadline:
    """The check's whole time budget, shared out as it goes: a command's limit is its share of
    the time left, share / (the shares of it and every command still to run), so the limits
    sum to the budget at most, and what one command leaves unused goes to those after it. A
    command past its limit is stopped with every process it started and becomes a row that
    says so ("over N s, skipped"), and the check goes on to the next."""

    def __init__(self, seconds, planned, clock=time.monotonic, start=None):
        self.clock = clock
        self.end = (clock() if start is None else start) + seconds    # start: on `clock`
        self.planned = planned              # the shares of the commands still to run

    def limit(self, share):
        """This command's seconds: its share of the time left (counted as run from now)."""
        left = self.end - self.clock()
        seconds = left * share / max(share, self.planned)
        self.planned -= share
        return seconds

    def run(self, command, share):
        """(return code, output) of a command in the repository root ("python" is this
        interpreter); code None when it ran past its limit (the output then ends saying so).
        At the limit the command and every process under it are killed (`stop_tree`), then
        its output read; after it, its process group: nothing it started outlives it."""
        limit = self.limit(share)
        if limit < 0.5:
            return None, "no time left in the budget, skipped"
        command = [sys.executable, *command[1:]] if command[0] == "python" else command
        print("$ " + " ".join(command[1:]), flush=True)
        child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output = child.communicate(timeout=limit)[0]
        except subprocess.TimeoutExpired:
            stop_tree(child.pid)            # torchrun's workers hold the output pipe open too
            partial = child.communicate()[0]
            return None, partial + "\n" * (partial[-1:] not in ("", "\n")) + \
                f"over {limit:.0f} s, skipped"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)        # what it left running
        return child.returncode, output


def stop_tree(pid):
    """SIGKILL `pid`, its process group and every process under it, however it was started:
    torchrun starts its workers with start_new_session, outside the group. They are found by
    their parent links in /proc (Linux), each stopped (SIGSTOP) as found, so that none starts
    another or reacts while the rest are found; then every one and its group is killed.
    Without /proc, the process group alone."""
    found, seen = [pid], set()
    while len(seen) < len(found):
        for each in found:
            if each not in seen:
                seen.add(each)
                with contextlib.suppress(OSError):
                    os.kill(each, signal.SIGSTOP)
        parents = parent_links()
        found += [child for child, parent in parents.items()
                  if parent in seen and child not in found]
    for each in found:
        with contextlib.suppress(OSError):
            os.killpg(each, signal.SIGKILL)     # a group it leads (the command's, a worker's)
        with contextlib.suppress(OSError):
            os.kill(each, signal.SIGKILL)


def parent_links():
    """{pid: parent pid} of every process /proc lists; {} without /proc."""
    links = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (command) state ppid ...": the command may hold spaces and parentheses
            links[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    return links


def step_tests(dry_run, deadline):
    """The kernel tests on CUDA tensors (their interpreter cases are the CPU's: CI runs them)."""
    command = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py",
               "-k", "worked_example" if dry_run else "not fresh_process"]
    code, output = deadline.run(command, SHARES["tests"])
    summary = [line for line in output.splitlines() if " passed" in line or " failed" in line]
    return {"ok": code == 0, "summary": summary[-1].strip("= ") if summary else output[-500:]}


def step_kernels(dry_run, deadline):
    """bench_kernels at the post's size; a path past PATH_SECONDS (torch.compile) is a row."""
    sizes = ["64x4097"] if dry_run else ["4864x49152"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernels.json"
        command = ["python", "-m", "tools.bench_kernels", "--sizes", *sizes, "--rounds", "1",
                   "--path-timeout", str(PATH_SECONDS), "--json", str(path)] + (
                       ["--device", "cpu"] if dry_run else [])
        code, output = deadline.run(command, SHARES["kernels"])
        return ({"ok": True, "sizes": json.loads(path.read_text())} if code == 0
                else {"ok": False, "error": output[-2000:]})


def ppo_variants(dry_run, models_dir):
    """label: (model folder, preset, precision, --decoding, launcher) of each PPO variant."""
    python = ["python"]
    torchrun = ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    model = str(Path(models_dir) / "smollm2")
    variants = ({"tiny fp32": (None, "tiny", "fp32", "auto", python),
                 "tiny fp32 torchrun": (None, "tiny", "fp32", "auto", torchrun)} if dry_run else
                {"bf16": (model, "blog", "bf16", "auto", python),
                 "fp32": (model, "blog", "fp32", "auto", python),
                 "bf16 generate": (model, "blog", "bf16", "hf", python),
                 "bf16 torchrun": (model, "blog", "bf16", "auto", torchrun)})
    return variants


def step_ppo(dry_run, models_dir, deadline):
    """PPO iterations of each variant: bf16 and fp32 with decoding.py's graph (--decoding
    auto), bf16 with Hugging Face's generate (the old way, side by side), bf16 under torchrun;
    the median of the iterations after the first (the warm-up: compiles, the graph's
    recording). ms a new token: the generate phase over its T."""
    variants = ppo_variants(dry_run, models_dir)
    iterations = 2 if dry_run else 4
    out = {}
    for label, (model, preset, precision, decoding, launcher) in variants.items():
        command = launcher + ["-m", "tools.check_gpu", "--ppo-worker", model or "", preset,
                              precision, decoding, str(iterations)]
        code, output = deadline.run(command, SHARES["ppo variant"])
        line = [x for x in output.splitlines() if x.startswith("RESULT ")]
        if code or not line:
            out[label] = {"ok": False, "error": output[-2000:]}
            continue
        result = json.loads(line[0][len("RESULT "):])
        rows = result["rows"][1:] or result["rows"]          # the first is the warm-up
        out[label] = {"ok": True, "peak_gb": result["peak_gb"],
                      "ratio": [min(r["ratio_min"] for r in result["rows"]),
                                max(r["ratio_max"] for r in result["rows"])],
                      "ms_per_token": statistics.median(1e3 * r["seconds_generate"]
                                                        / r["new_tokens"] for r in rows),
                      **{key: statistics.median(r[key] for r in rows)
                         for key in [f"seconds_{p}" for p in PHASES] + ["seconds"]}}
    return out


def print_table(report):
    print(f"\nGPU check on {report['device']} (torch {report['torch']}, triton "
          f"{report['triton']}){' -- DRY RUN on the CPU' if report['dry_run'] else ''}")
    print(f"1. kernel tests: {'ok' if report['tests']['ok'] else 'FAILED'}: "
          f"{report['tests']['summary']}")
    kernels = report["kernels"]
    print(f"2. tools/bench_kernels.py: {'ok' if kernels['ok'] else 'FAILED'}")
    for size, paths in kernels.get("sizes", {}).items():
        for path, r in paths.items():
            if "skipped" in r:
                print(f"   {size:>12} {path:<16} {r['skipped']}")
                continue
            bandwidth = (f", {r['bytes_per_s'] / r['copy_bytes_per_s']:.0%} of copy bandwidth"
                         if "bytes_per_s" in r else "")
            print(f"   {size:>12} {path:<16} {r['seconds'] * 1e3:9.2f} ms  "
                  f"{r['extra_bytes'] / 2**20:9.0f} MB extra{bandwidth}")
    print("3. PPO iterations (median s after the first; ratio at the first inner step):")
    print(f"   {'variant':<22}" + "".join(f"{p:>10}" for p in PHASES)
          + f"{'total':>10}{'ms/token':>9}{'peak GB':>9}  ratio")
    for label, r in report["ppo"].items():
        if not r["ok"]:
            print(f"   {label:<22} FAILED: {r['error'].splitlines()[-1] if r['error'] else ''}")
            continue
        print(f"   {label:<22}" + "".join(f"{r[f'seconds_{p}']:>10.2f}" for p in PHASES)
              + f"{r['seconds']:>10.2f}{r['ms_per_token']:>9.2f}{r['peak_gb']:>9.2f}  "
              f"{r['ratio'][0]:.4f} to {r['ratio'][1]:.4f}")
    print(f"   targets (issue 52, blog preset, one H200): decoding <= {TARGETS['ms_per_token']} "
          f"ms a new token, an iteration <= {TARGETS['seconds']} s, bf16 faster than fp32")
    bf16, fp32 = report["ppo"].get("bf16", {}), report["ppo"].get("fp32", {})
    if bf16.get("ok") and not report["dry_run"]:
        print(f"   bf16: {bf16['ms_per_token']:.2f} ms a token, {bf16['seconds']:.2f} s an "
              f"iteration: {'met' if bf16['ms_per_token'] <= TARGETS['ms_per_token'] else 'missed'}"
              f", {'met' if bf16['seconds'] <= TARGETS['seconds'] else 'missed'}"
              + (f"; fp32 {fp32['seconds']:.2f} s: bf16 "
                 f"{'faster' if bf16['seconds'] < fp32['seconds'] else 'not faster'}"
                 if fp32.get("ok") else ""))


STEPS = ("tests", "kernels", "ppo")
BUDGET = 300                    # seconds for the whole check (issue 51: five minutes on an H200)
# Each command's share of BUDGET, in seconds if every one takes its whole share (4 PPO
# variants, and pip where wheels are missing): 10 + 60 + 70 + 4 x 40 = 300. Where the model
# folders are made here too (models, then pip), the shares sum to 320, and each limit is
# that much smaller.
SHARES = {"models": 10, "pip": 10, "tests": 60, "kernels": 70, "ppo variant": 40}
PATH_SECONDS = 25               # one kernel path at one size, compile included
TARGETS = {"ms_per_token": 2.0, "seconds": 0.5}


def main(dry_run=False, out="runs/gpu_check.json", models_dir="runs/gpu_check",
         prepare_only=False, steps=STEPS, started=None):
    """The check; `started`: when the command started, on time.monotonic's clock (before it
    imported torch), from which the budget counts (default: now)."""
    started = time.monotonic() if started is None else started
    if prepare_only:
        return prepare(models_dir, Deadline(BUDGET, SHARES["models"] + SHARES["pip"],
                                            start=started))
    if not torch.cuda.is_available() and not dry_run:
        sys.exit("tools.bench_ppo: error: no GPU found (torch.cuda.is_available() is False); "
                 "--dry-run checks the command on the CPU")
    unprepared = not dry_run and not all((Path(models_dir) / name / "config.json").is_file()
                                         for name in MODELS)
    missing = missing_packages(models_dir) if not dry_run else []
    variants = len(ppo_variants(dry_run, models_dir)) if "ppo" in steps else 0
    planned = (SHARES["models"] * unprepared + SHARES["pip"] * (unprepared + bool(missing))
               + SHARES["ppo variant"] * variants
               + sum(SHARES[step] for step in steps if step != "ppo"))
    start = time.time() - (time.monotonic() - started)    # the command's start, import included
    deadline = Deadline(BUDGET if not dry_run else 3 * BUDGET, planned,     # dry run: 2 slow
                        start=started)                                      # cores
    if unprepared:
        prepare(models_dir, deadline)           # where SmolLM2 is at hand; else carry them
    ensure_packages(models_dir, missing, deadline)      # a GPU machine may lack them
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    report = {"device": torch.cuda.get_device_name() if not dry_run else "cpu",
              "torch": torch.__version__, "triton": triton_version, "dry_run": dry_run,
              "tests": {"ok": True, "summary": "not run"}, "kernels": {"ok": True},
              "ppo": {}}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    run_step = {"tests": lambda: step_tests(dry_run, deadline),
                "kernels": lambda: step_kernels(dry_run, deadline),
                "ppo": lambda: step_ppo(dry_run, models_dir, deadline)}
    for step in steps:                      # the JSON after each: a timeout keeps the rest
        report[step] = run_step[step]()
        report["seconds"] = time.time() - start
        write_json(out, report)
    print_table(report)
    print(f"\n{report['seconds']:.0f} s in all; the table as JSON in {out}")
    ok = report["tests"]["ok"] and report["kernels"]["ok"] and all(
        r["ok"] for r in report["ppo"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ppo-worker"]:
        model, preset, precision, decoding, iterations = sys.argv[2:7]
        ppo_worker(model or None, preset, precision, decoding, int(iterations))
    elif sys.argv[1:2] == ["--save-architecture"]:
        save_architectures(sys.argv[2])
