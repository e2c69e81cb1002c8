"""The runs of one `ppo.py` command, in turn: a single run, or the post's sweep of betas x seeds.

Kept apart from ppo.py, whose `run_plan` loads the four models and loops over the betas
and seeds as the post does; what surrounds each run is here. Nothing here is RL:
    runs, run_dir_for, out_folder   every (beta, seed) pair and the folder each writes
    run_config            one run's settings, as its results.json keeps them
    check_settings        the flags that only make sense together (after their ranges)
    announce, reward_folder, judge_sd   the start line, the judge's folder, noise's unit
    check_room            the disk can hold the runs still to do, checked before the long part
    Book                  around each run: a finished one skipped by --resume, a killed one
                          continued from its checkpoint, one whose numbers turn non-finite a
                          failed row of the sweep (the end of a single run), the reference's
                          rows written once, the time left, then the sweep's table

Used by: ppo.py (tests: tests/test_ppo.py, resume and sweep end to end).
"""

import contextlib
import dataclasses
import math
import time
from pathlib import Path

import torch

import loaders
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


# What --resume may change; any other setting that differs from the checkpoint's is an error
# (unless --force): a run continued with another beta or seed is no run at all.
RESUME_MAY_CHANGE = ("iterations", "checkpoint_every", "eval_prompts", "micro_batch", "out",
                     "resume", "force", "seeds")
# The settings printed when a run starts
SHOWN = ("estimator", "iterations", "batch", "samples_per_prompt", "prompt_tokens",
         "max_new_tokens", "inner_steps", "lr", "value_lr", "clip", "gamma", "lam", "micro_batch",
         "precision", "decoding", "eval_prompts", "kl_estimator", "target_kl", "reward")
ESTIMATOR_NOTE = {"rloo": "the other samples of the same prompt",
                  "reinforce": "a moving average of the rewards",
                  "grpo": "the mean of the prompt's samples",
                  "raft": "none: the supervised loss (13) on the best of each prompt's samples"}
GAE_ONLY = ("value_clip", "value_init", "whiten_rewards")       # there is no value head else


def check_settings(cfg, parser):
    """ppo.py's checks of flags that only make sense together, after the ranges: --out of
    every run, the precision on this device, the estimators' sample counts and the value
    head's flags. A bad one exits with status 2 and one line; returns `cfg`, its micro-batch
    made to divide the batch."""
    for beta, seed in runs(cfg):
        if problem := cli.out_problem(run_dir_for(cfg, beta, seed)):
            parser.error(problem)
    try:
        cfg.precision = loaders.resolve_precision(cfg.precision, loaders.pick_device())
    except ValueError as error:
        parser.error(str(error))
    if cfg.estimator in ("rloo", "grpo", "raft") and cfg.samples_per_prompt < 2:
        parser.error(f"argument --samples-per-prompt: --estimator {cfg.estimator} needs at "
                     f"least 2 samples per prompt, got {cfg.samples_per_prompt}")
    defaults = {"value_clip": None, "value_init": "post", "whiten_rewards": False}
    given = [cli.flag(name) for name in GAE_ONLY if getattr(cfg, name) != defaults[name]]
    if cfg.estimator != "gae" and given:
        parser.error(f"argument {given[0]}: applies to --estimator gae only (there is no "
                     f"value head with --estimator {cfg.estimator})")
    if cfg.clip == math.inf and cfg.value_clip is not None:
        parser.error("argument --value-clip: --clip off turns clipping off for the value "
                     "loss too; leave out --value-clip")
    if cfg.batch % parallel.size():
        raise cli.UserError(f"--batch {cfg.batch} does not split evenly over "
                            f"{parallel.size()} processes; pass a multiple of {parallel.size()}")
    responses = cfg.batch * cfg.samples_per_prompt
    if responses % cfg.micro_batch:
        cfg.micro_batch = math.gcd(responses, cfg.micro_batch)
    return cfg


def announce(cfg, device):
    """The line a run starts with: the preset, the device and the settings that matter."""
    processes = f", {parallel.size()} processes" if parallel.size() > 1 else ""
    print(f"preset {cfg.preset} on {device}{processes}: "
          + ", ".join(f"{k}={getattr(cfg, k)}" for k in SHOWN))
    if cfg.estimator != "gae":
        print(f"--estimator {cfg.estimator}: no value head, no value loss; the baseline is "
              + ESTIMATOR_NOTE[cfg.estimator])


def reward_folder(cfg):
    """--reward-model's folder, or one line saying how to make it."""
    path = Path(cfg.reward_model)
    if not (path / "config.json").exists():
        raise cli.UserError(f"no reward model in {path}: run `python reward_model.py"
                            + (" --preset tiny --out " + str(path) if cfg.preset == "tiny"
                               else "") + "` first, or pass --reward-model DIR")
    return path


def judge_sd(base):
    """The unit of --reward-noise: the SD of the judge's score over the reference's (SFT's)
    held-out summaries (rank 0 has them; every rank gets the number)."""
    sd = 0.0
    if base is not None:
        scores = torch.tensor([s["reward"] for s in base["ref_samples"]], dtype=torch.float64)
        sd = scores.std().item() if len(scores) > 1 else 0.0
    return parallel.total(sd)


class Book:
    """The bookkeeping around each run of a sweep, so that ppo.run_plan's loop reads as the
    post's: a run finished before is skipped by --resume, a killed one continues from its
    checkpoint, a run that fails before its first checkpoint leaves no folder, one whose
    numbers turn non-finite is a failed row of the sweep (the end of a single run), the
    reference's rows are kept once, the time left is printed, then the sweep's table."""

    def __init__(self, cfg, plan, folder, base):
        self.cfg, self.plan, self.folder, self.base = cfg, plan, folder, base
        self.started, self.trained, self.base_saved = time.time(), 0, False

    def finished(self, run_dir):
        """Whether --resume finds this run finished (it is then skipped)."""
        if self.cfg.resume and finished_row(run_dir, self.cfg.iterations):
            print(f"{run_dir}: finished before, skipped")
            return True
        return False

    @contextlib.contextmanager
    def run(self, beta, seed, run_dir):
        """Around one run's training and evaluation."""
        cfg, plan = self.cfg, self.plan
        start = checkpoint_iteration(run_dir) if cfg.resume else 0
        with (cli.new_folders(run_dir, keep=has_checkpoint) if parallel.is_main()
              else contextlib.nullcontext()), resume_hint(run_dir):
            try:
                yield
            except NonFiniteError as error:
                if len(plan) == 1:
                    raise
                print(f"beta={beta:g} seed={seed} failed: {error}")    # a row, not a gap
                record_failure(run_dir, run_config(cfg, beta, seed), error)
                return
            if not self.base_saved:  # once, for a resumed sweep and later runs to read back
                write_json(self.folder / "baseline.json", self.base)
                keep_for_judge(cfg, self.base)
                self.base_saved = True
        self.trained += cfg.iterations - start
        k = [d for _, _, d in plan].index(run_dir)
        left = sum(not finished_row(d, cfg.iterations) for _, _, d in plan[k + 1:])
        if left and self.trained:   # at this process's pace so far, evaluation included
            eta = (time.time() - self.started) / self.trained * cfg.iterations * left
            print(f"sweep: {len(plan) - left} of {len(plan)} runs over, about "
                  + (f"{eta / 60:.0f} min" if eta > 90 else f"{eta:.0f} s") + " to go")

    def table(self):
        """A sweep's table, from every run's results.json (rank 0)."""
        if len(self.plan) > 1 and parallel.is_main():
            report_sweep([finished_row(d, self.cfg.iterations) for _, _, d in self.plan],
                         self.base, self.folder)
