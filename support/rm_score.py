"""Scoring many summaries with a trained reward model: grouped by prompt, or from text.

reward_model.py defines the judge and PPO's entry point (`score_ids`, sampled ids in, no
decode); the held-out evaluation (support/heldout.py), the judge's own metrics and the
tools score lists of id lists or written summaries with the two functions here, so no
support module needs to import the stage script:
    score_grouped   scores of summaries[i] after prompts[i]: each distinct prompt is read
                    once for all the summaries that follow it (its keys and values cached
                    and copied: `RewardModel.forward_shared`), exact because attention is
                    causal (tested against one full pass per summary)
    score_texts     scores of written summaries (people's TL;DRs), tokenized as in training
The equation numbers are reward_model.py's: (R5) content f_hat, or full f_hat + w g(y).
Test: pytest tests/test_reward_model.py -k "score"
"""
import torch
from tqdm import tqdm

from support import parallel, rm_data
from support.rm_data import encode


@torch.no_grad()
def score_grouped(model, prompts, summaries, batch_rows=32, progress="", split=False):
    """Scores (N,) of summaries[i] after prompts[i] (id lists), on the CPU.

    Each distinct prompt is read once and each distinct (prompt, summary) scored once;
    prompts of similar length share a batch of about `batch_rows` summaries; `progress`
    labels a progress bar (none if ""). `split`: under torchrun each rank scores its share
    of the rows and every rank gets all N scores (a collective); nothing changes in one process.
    """
    if split:
        mine = parallel.mine(range(len(prompts)))        # every row in one process
        prompts, summaries = [prompts[i] for i in mine], [summaries[i] for i in mine]
    groups = {}                                  # prompt -> its distinct summaries, in order
    for p, s in zip(prompts, summaries):
        groups.setdefault(tuple(p), {})[tuple(s)] = None
    batches, batch, rows = [], [], 0
    for p in sorted(groups, key=len):
        batch, rows = batch + [p], rows + len(groups[p])
        if rows >= batch_rows:
            batches, batch, rows = batches + [batch], [], 0
    batches += [batch] if batch else []
    scores = {}
    for batch in tqdm(batches, desc=progress, unit="batch", disable=not progress, leave=False):
        rows = [(i, s) for i, p in enumerate(batch) for s in groups[p]]
        got = model.forward_shared(batch, [s for _, s in rows],
                                   torch.tensor([i for i, _ in rows]))      # (rows,)
        scores.update(zip([(batch[i], s) for i, s in rows], got.cpu().tolist()))
    out = torch.tensor([scores[tuple(p), tuple(s)] for p, s in zip(prompts, summaries)])
    return parallel.gather(out) if split else out


@torch.no_grad()
def score_texts(model, tokenizer, prompts, summaries, max_prompt_tokens=None, batch_rows=32,
                part="content"):
    """Scores (B,) of written summaries (human TL;DRs), tokenized as in training.

    `part` as in `RewardModel.score_part`: "content" (reward_model.DEFAULT_PART) or "full".
    """
    budget = max_prompt_tokens or model.settings["max_prompt_tokens"]
    encoded = [encode(tokenizer, rm_data.fit_prompt_text(tokenizer, p, budget), s,
                      model.settings["max_summary_tokens"]) for p, s in zip(prompts, summaries)]
    content = score_grouped(model, [p for p, _ in encoded], [s for _, s in encoded], batch_rows)
    # (R5) on the summary's tokens, the EOS not counted
    return model.score_part(content, [len(s) - 1 for _, s in encoded], part)   # (B,)
