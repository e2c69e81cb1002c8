"""Time of ppo.py's reference and human rows: sampled and scored, against read back.

The rows (SmolLM2's held-out samples and the judge's scores of them, of people's TL;DRs
and of OpenAI's summaries) are made once per judge and kept in its folder
(support/heldout.py); every later run with that judge reads them back. This times both
paths in one process on a copy of the judge's folder (so the real one is not touched),
and checks that what is read back is what was made.

Run:  python -m tools.bench_heldout --reward-model runs/reward_model    (about 4 minutes)
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import loaders
import ppo
import reward_model as rm
from support import heldout
from support.config import read_config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward-model", default="runs/reward_model")
    parser.add_argument("--preset", default="auto", help="ppo.py's preset (tiny: the tests')")
    args = parser.parse_args(argv)
    if not (Path(args.reward_model) / "config.json").is_file():
        parser.error(f"argument --reward-model: no reward model in {args.reward_model}")
    cfg, _ = read_config(ppo.Config, ppo.PRESETS, ppo.RANGES, ppo.CHOICES,
                         ["--beta", "0", "--reward-model", args.reward_model,
                          "--preset", args.preset])
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
        start = time.perf_counter()
        made = heldout.reference_and_human(cfg, models, held_out, Path(scratch), ppo.rollouts)
        sampled = time.perf_counter() - start           # and kept beside the judge
        start = time.perf_counter()
        read = heldout.reference_and_human(cfg, models, held_out, Path(scratch), ppo.rollouts)
        back = time.perf_counter() - start
    same = json.loads(json.dumps(made)) == read         # what a JSON file can hold
    print(f"preset {cfg.preset}, {cfg.eval_prompts} posts: sampled and scored {sampled:.1f} s, "
          f"read back {back:.2f} s; the same numbers: {same}")


if __name__ == "__main__":
    main()
