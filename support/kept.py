"""The small summary a run leaves beside its results.json, which the repository keeps.

A run folder holds weights, checkpoints and every sample; none of that survives the machine.
What a page needs does: the run's settings, its per-iteration rows, and its held-out
evaluation with every post's numbers (reward, the reference's reward on that post, length,
KL, ROUGE-L, retrieval rank, ...), texts only for the first few posts. `summary.json` is
that, written by every run (`support/heldout.evaluate_run`) and copied into `docs/runs/` by
`python -m tools.keep_runs`; every table and plot of a page is remade from those copies
(`python -m tools.analysis.claims_page`, and the other pages' commands).

    summarize_run(results)   results.json's dict -> the summary (same keys, no texts
                             beyond TEXTS posts but each summary's words, no ids, no
                             code commits)
    machine()                the CPU that ran it, as a page names it: model and the
                             instruction sets that change the numbers' last bits and time
    read_run(path)           a run's summary from a run folder, a summary.json or a
                             results.json
Test: pytest tests/test_claims.py -k kept
"""
import json
import platform
from pathlib import Path

import torch

from support import cli
from support.quality import words

TEXTS = 3          # posts whose summaries keep their text: the samples a page quotes
DROPPED = ("ids", "commits")


def machine():
    """'AMD EPYC (AVX2, no AVX-512)', 'Intel Xeon (AVX-512, AMX)', ... from /proc/cpuinfo;
    the platform's processor name elsewhere."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    name = fields.get("model name", platform.machine())
    flags = set(fields.get("flags", "").split())
    sets = ["AVX-512" if "avx512f" in flags else ("AVX2, no AVX-512" if "avx2" in flags
                                                  else "no AVX2")]
    sets += ["AVX512-BF16"] * ("avx512_bf16" in flags) + ["AMX"] * ("amx_tile" in flags)
    return f"{name} ({', '.join(sets)}{_kernels_held_back(flags)})"


def _kernels_held_back(flags):
    """'; kernels as AVX2' when PyTorch was told to use fewer instructions than the CPU has
    (ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU: the numbers are then an AVX2 machine's,
    to the last bit, and the time is not this CPU's); '' otherwise."""
    have = "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "DEFAULT"
    used = torch.backends.cpu.get_cpu_capability()
    order = ["DEFAULT", "AVX2", "AVX512"]
    if used in order and order.index(used) < order.index(have):
        return f"; kernels as {used if used != 'DEFAULT' else 'no AVX2'}"
    return ""


def _strip(value, keep_text):
    """A copy of a results.json value without ids and commits, and without texts unless
    `keep_text`; per-post lists keep their texts for the first TEXTS posts."""
    if isinstance(value, dict):
        if isinstance(value.get("text"), str):              # a summary: its words stay
            value = {**value, "words": len(words(value["text"]))}
        return {k: _strip(v, keep_text) for k, v in value.items()
                if k not in DROPPED and (k != "text" or keep_text)}
    if isinstance(value, list):
        return [_strip(v, keep_text and (not isinstance(v, dict) or i < TEXTS))
                for i, v in enumerate(value)]
    return value


def summarize_run(results, where=None):
    """The summary of a run's results.json dict (`where`: the CPU, default this one)."""
    out = _strip(results, keep_text=True)
    out["machine"] = results.get("machine") or where or machine()
    return out


def read_run(path):
    """A run's summary: `path` a run folder (its summary.json, else its results.json), or
    either file itself."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json" if (path / "summary.json").exists() else path / "results.json"
    with cli.reading(path, "a run's summary.json or results.json"):
        data = json.loads(path.read_text())
    return data if path.name == "summary.json" else summarize_run(data)
