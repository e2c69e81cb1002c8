"""What tests/test_parallel.py runs in other processes, under torchrun or plain python.

    parallel_worker.py gradients OUT          one update on a fixed batch; rank 0 saves the
                                              summed gradients and the log to OUT
    parallel_worker.py killed-ppo ARGS...     ppo.py's main, with rank 1 killed (SIGKILL) as it
                                              scores its 4th batch
"""
import copy
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from support import parallel  # noqa: E402
import torch  # noqa: E402

import loaders  # noqa: E402
import ppo  # noqa: E402
from gae import response_mask, whiten  # noqa: E402
from lora import with_lora  # noqa: E402

PROMPTS = ["SUBREDDIT: r/a\n\nTITLE: b\n\nPOST: c d e\n\nTL;DR:",
           "SUBREDDIT: r/x\n\nTITLE: y\n\nPOST: a much longer post, with more words\n\nTL;DR:",
           "SUBREDDIT: r/q\n\nTITLE: w\n\nPOST: e\n\nTL;DR:",
           "SUBREDDIT: r/z\n\nTITLE: a title\n\nPOST: some words here and there\n\nTL;DR:"]


def fixed_batch(tokenizer, policy, value_head, cfg):
    """A batch of 2 x 4 rows with no sampling in it: responses, advantages, returns and old
    values drawn from a fixed seed, old log-probs from the policy itself."""
    g = torch.Generator().manual_seed(0)
    posts = [{"prompt": p, "summary": "a summary"} for p in PROMPTS * 2]
    prompt_ids, prompt_mask = loaders.encode(tokenizer, [p["prompt"] for p in posts], "cpu")
    actions = torch.randint(100, 5000, (len(posts), 7), generator=g)        # (B, T)
    actions[0, 3:] = tokenizer.eos_token_id                                 # ends early
    actions[4:, 4:] = tokenizer.eos_token_id                                # rank 1's rows
    actions[5, 1:] = tokenizer.eos_token_id
    mask = response_mask(actions, tokenizer.eos_token_id)
    sequences = torch.cat([prompt_ids, actions], 1)
    attention = ppo.full_mask(prompt_mask, actions)
    with torch.no_grad():
        logp_old, values, _ = ppo.policy_forward(policy, value_head, sequences, attention,
                                                 actions)
    adv = torch.where(mask.bool(), torch.randn(actions.shape, generator=g), 0.0)
    ret = torch.where(mask.bool(), torch.randn(actions.shape, generator=g), 0.0)
    rows = parallel.mine(torch.arange(len(posts)))      # this rank's rows; all in one process
    return ppo.Rollout(0, sequences[rows], attention[rows], actions[rows], mask[rows],
                       logp_old[rows], values[rows], adv[rows], ret[rows],
                       loaders.micro_batches(prompt_mask[rows], cfg.micro_batch),
                       [posts[r] for r in rows.tolist()])


def gradients(out):
    parallel.setup()
    torch.manual_seed(0)
    tokenizer = loaders.load_tokenizer()
    tiny = loaders.tiny_model(tokenizer, seed=0)
    policy = with_lora(copy.deepcopy(tiny))
    with torch.no_grad():                               # a non-zero adapter: both halves learn
        for name, p in policy.named_parameters():
            if p.requires_grad:
                p.copy_(0.05 * torch.randn(p.shape))
    value_head = ppo.ValueHead(tiny.config.hidden_size)
    cfg = ppo.Config(**{**ppo.PRESETS["tiny"], "ent_coef": 0.01, "value_clip": 0.2,
                        "ptx_coef": 0.1})
    batch = fixed_batch(tokenizer, policy, value_head, cfg)
    log, ratios = ppo.accumulate_gradients(policy, value_head, batch, cfg, tokenizer)
    named = [(n, p) for n, p in policy.named_parameters() if p.requires_grad] + [
        ("value." + n, p) for n, p in value_head.named_parameters()]
    trainable = [p for _, p in named]
    parallel.sum_gradients(trainable)
    # Whitening over every rank's rows, each rank's responses cut to their own longest (rank
    # 1's are shorter: gather pads them back).
    width = int(batch.mask.sum(1).max())
    whitened = parallel.gather(parallel.across(whiten, batch.adv[:, :width],
                                               batch.mask[:, :width]))
    if parallel.is_main():
        torch.save({"grads": {n: p.grad for n, p in named}, "log": log,
                    "ratios": parallel.gather(ratios), "size": parallel.size(),
                    "whitened": whitened}, out)
    else:
        parallel.gather(ratios)


def killed_ppo(argv):
    calls = []
    score = ppo.score

    def score_then_die(*args, **kwargs):
        calls.append(1)
        if parallel.rank() == 1 and len(calls) == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        return score(*args, **kwargs)

    ppo.score = score_then_die
    ppo.main(argv)


if __name__ == "__main__":
    {"gradients": lambda: gradients(sys.argv[2]),
     "killed-ppo": lambda: killed_ppo(sys.argv[2:])}[sys.argv[1]]()
