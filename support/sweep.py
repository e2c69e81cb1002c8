"""The runs of one `ppo.py` command, in turn: a single run, or the post's sweep of betas x seeds.

Kept apart from ppo.py, whose `run_plan` loads the four models and hands this module two
functions: one that trains a run (`ppo.train`) and one that evaluates it on the held-out
posts. Nothing here is RL:
    runs, run_dir_for, out_folder   every (beta, seed) pair and the folder each writes
    run_config            one run's settings, as its results.json keeps them
    check_room            the disk can hold the runs still to do, checked before the long part
    run_all               each run trained and evaluated: a finished one skipped by --resume,
                          a killed one continued from its checkpoint, one whose numbers turn
                          non-finite a failed row of the sweep (the end of a single run), the
                          reference's rows written once, the time left, then the sweep's table

Used by: ppo.py (tests: tests/test_ppo.py, resume and sweep end to end).
"""

import contextlib
import dataclasses
import time
from pathlib import Path

from support import cli, disk, parallel
from support.heldout import keep_for_judge
from support.report import (NonFiniteError, checkpoint_iteration, finished_row,
                            has_checkpoint, record_failure, report_sweep, resume_hint,
                            run_bytes, write_json)


def runs(cfg):
    """Every (beta, seed) pair: one run each; more than one is a sweep."""
    return [(beta, seed) for beta in cfg.beta for seed in cfg.seeds]


def run_config(cfg, beta, seed):
    """One run's settings, as results.json keeps them: the config with its beta and seed, and
    the number of processes (torchrun's ranks; each samples its own stream)."""
    return {**dataclasses.asdict(cfg), "beta": beta, "seed": seed,
            "processes": parallel.size()}


def run_dir_for(cfg, beta, seed):
    sweep = len(runs(cfg)) > 1
    base = Path(cfg.out or ("runs/ppo_sweep" if sweep else f"runs/ppo_beta{beta:g}_seed{seed}"))
    return base / f"beta{beta:g}_seed{seed}" if sweep else base


def out_folder(cfg, plan):
    """The folder the whole command writes: the sweep's, or the one run's."""
    return Path(cfg.out or "runs/ppo_sweep") if len(plan) > 1 else plan[0][2]


def check_room(cfg, plan, folder, adapter_numel, hidden):
    """Refuse in one line, before the long part, when the disk cannot hold what the runs
    still to do will write (report.run_bytes each; a sweep's table and baseline once)."""
    one = run_bytes(adapter_numel, hidden, cfg)
    left = [d for _, _, d in plan if not (cfg.resume and finished_row(d, cfg.iterations))]
    need = len(left) * one + (one // 2 if len(plan) > 1 else 0)
    disk.check_room(folder, need, f"{len(left)} run{'s' * (len(left) > 1)} in {folder}")


def run_all(cfg, plan, folder, base, train_run, evaluate_run):
    """Every run of `plan` ([(beta, seed, run_dir)]): `train_run(beta, seed, run_dir)` gives
    (policy, value head, results), then `evaluate_run(beta, seed, policy, results, run_dir)`
    on rank 0. `base` is the reference's and people's rows (None on the other ranks)."""
    started, trained, base_saved = time.time(), 0, False
    for k, (beta, seed, run_dir) in enumerate(plan):
        if cfg.resume and finished_row(run_dir, cfg.iterations):
            print(f"{run_dir}: finished before, skipped")
            continue
        start = checkpoint_iteration(run_dir) if cfg.resume else 0
        # A run that fails before its first checkpoint leaves no folder behind; one that
        # cannot write says where its last checkpoint is.
        with (cli.new_folders(run_dir, keep=has_checkpoint) if parallel.is_main()
              else contextlib.nullcontext()), resume_hint(run_dir):
            try:
                policy, _, results = train_run(beta, seed, run_dir)
            except NonFiniteError as error:
                if len(plan) == 1:
                    raise
                print(f"beta={beta:g} seed={seed} failed: {error}")    # a row, not a gap
                record_failure(run_dir, run_config(cfg, beta, seed), error)
                continue
            if not base_saved:      # once, for a resumed sweep and later runs to read back
                write_json(folder / "baseline.json", base)
                keep_for_judge(cfg, base)
                base_saved = True
            if parallel.is_main():
                evaluate_run(beta, seed, policy, results, run_dir)
        trained += cfg.iterations - start
        left = sum(not finished_row(d, cfg.iterations) for _, _, d in plan[k + 1:])
        if left and trained:    # at this process's pace so far, evaluation included
            eta = (time.time() - started) / trained * cfg.iterations * left
            print(f"sweep: {len(plan) - left} of {len(plan)} runs over, about "
                  + (f"{eta / 60:.0f} min" if eta > 90 else f"{eta:.0f} s") + " to go")
    if len(plan) > 1 and parallel.is_main():    # the table, from every run's results.json
        report_sweep([finished_row(d, cfg.iterations) for _, _, d in plan], base, folder)
