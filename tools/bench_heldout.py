"""Time of ppo.py's reference and human rows: sampled and scored, scored from sft.py's
draws, and read back.

The rows (the reference's held-out samples, those of the model sft.py started from, and the
judge's scores of them, of people's TL;DRs and of OpenAI's summaries) are made once per
judge and kept in its folder (support/heldout.py); every later run with that judge reads
them back. The first run after a new judge makes them; where the reference is sft.py's
model, it scores the ids sft.py drew for both models instead of drawing them again
(`heldout.sft_draws`). This times the three paths in one process on a copy of the judge's
folder (so the real one is not touched): the draws are the ones the first path made, handed
to the second as sft.py's would be; and it checks that each path gives the first's numbers.

Run:  python -m tools.bench_heldout --reward-model runs/reward_model    (about 6 minutes)
      python -m tools.bench_heldout --model runs/sft_60 --reward-model runs/rm_sft60
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

import loaders
import ppo
import reward_model as rm
from support import heldout
from support.config import read_config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward-model", default="runs/reward_model")
    parser.add_argument("--model", default=loaders.SFT_MODEL, help="ppo.py's --model")
    parser.add_argument("--preset", default="auto", help="ppo.py's preset (tiny: the tests')")
    args = parser.parse_args(argv)
    if not (Path(args.reward_model) / "config.json").is_file():
        parser.error(f"argument --reward-model: no reward model in {args.reward_model}")
    cfg, _ = read_config(ppo.Config, ppo.PRESETS, ppo.RANGES, ppo.CHOICES,
                         ["--beta", "0", "--reward-model", args.reward_model,
                          "--preset", args.preset, "--model", args.model])
    with tempfile.TemporaryDirectory() as scratch:
        judge = Path(scratch) / "judge"
        shutil.copytree(args.reward_model, judge, ignore=shutil.ignore_patterns("baselines"))
        cfg.reward_model = str(judge)
        device = loaders.pick_device()
        reference, tokenizer = loaders.load_policy_and_tokenizer(cfg.model, preset=cfg.preset,
                                                                 device=device)
        reward = rm.load_reward_model(judge, device=device)
        _, held_out = loaders.load_prompts(cfg, tokenizer)
        models = (reference, reward, tokenizer, device)
        drawn = []                                      # the ids of each rollouts call

        def recording(*args, **kwargs):
            samples = ppo.rollouts(*args, **kwargs)
            drawn.append([s["ids"] for s in samples])
            return samples
        heldout.sft_draws = lambda *args: None          # 1. sampled, as with no sft.py draws
        start = time.perf_counter()
        made = heldout.reference_and_human(cfg, models, held_out, Path(scratch), recording)
        sampled = time.perf_counter() - start
        # 2. sft.py's draws (here: the ones just made) scored again: reference, then start
        heldout.sft_draws = lambda *args: dict(zip(("sft", "start"), drawn))
        start = time.perf_counter()
        scored = heldout.reference_and_human(cfg, models, held_out, Path(scratch), ppo.rollouts)
        from_draws = time.perf_counter() - start
        heldout.keep_for_judge(cfg, scored)             # as ppo.py does once a run trained
        start = time.perf_counter()                     # 3. read back from the judge's folder
        read = heldout.reference_and_human(cfg, models, held_out, Path(scratch), ppo.rollouts)
        back = time.perf_counter() - start
    same = json.loads(json.dumps(made)) == json.loads(json.dumps(scored)) == read
    print(f"preset {cfg.preset}, {cfg.eval_prompts} posts, {len(drawn)} model{'s' * (len(drawn) > 1)} sampled, "
          f"{torch.get_num_threads()} threads: sampled and scored {sampled:.1f} s, scored from the "
          f"draws {from_draws:.1f} s ({from_draws / sampled:.2f}x), read back {back:.2f} s; "
          f"the same numbers: {same}")


if __name__ == "__main__":
    main()
