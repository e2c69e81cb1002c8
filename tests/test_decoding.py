"""decoding.py against Hugging Face's `generate`, which it replaces on CUDA.

- The sampler: `filtered_probs` is transformers' temperature, top-k and top-p warpers to the
  bit, ties included; torch.multinomial(p, 1) is argmax(p / q), q ~ Exp(1), draw for draw.
- With a fixed seed the static loop draws `generate`'s ids (a tiny model with a trained-looking
  adapter; slow: the real SmolLM2, 48 tokens), leaves the random stream where `generate` does,
  and samples from logits within 1e-5 of Hugging Face's forward (fp32).
- EOS ends a row as in `generate`: EOS after it, T where the last row ends.
- Left padding changes no row's ids: a row padded in a batch draws what it draws unpadded
  when its noise is the same (same batch size, same place), and wider padding (the graph's
  --prompt-tokens columns) changes nothing.
- One PPO iteration sampled with --decoding static: the ratio is exactly 1 at the first step.
- Under bf16 autocast the loop runs, its logits stay fp32 and near the fp32 loop's.
- --decoding auto samples through `generate` off CUDA (the CPU's numbers do not move).
- CUDA only: the recorded graph replays the eager loop's ids, sees the adapter move between
  calls without re-recording, and is freed with the policy.

Test: pytest tests/test_decoding.py          (pytest -m slow tests/test_decoding.py: SmolLM2)
"""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

import decoding
import loaders
import ppo
import reward_model as rm
from lora import LoRALinear, with_lora
from test_ppo import tiny_pool

EOS = 2
PROMPTS = ["SUBREDDIT: r/a\n\nTITLE: b\n\nPOST: c d e\n\nTL;DR:",
           "SUBREDDIT: r/x\n\nTITLE: y\n\nPOST: a much longer post, with more words\n\nTL;DR:",
           "SUBREDDIT: r/q\n\nTITLE: w\n\nPOST: e\n\nTL;DR:"]


def config(*argv):
    return ppo.parse_args(["--preset", "tiny", "--max-new-tokens", "12", *argv])


def policy_of(model, seed=0):
    """`model` + the post's adapter with a non-zero B, so that LoRA takes part in every pass.
    The same adapter whatever the tests before drew (A comes from the global generator)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = with_lora(copy.deepcopy(model))
        with torch.no_grad():
            for module in policy.modules():
                if isinstance(module, LoRALinear):
                    module.up.weight.normal_(0, 0.1)
    return policy.eval()


def draw(model, prompts_or_ids, cfg, decoding_way, seed, tokenizer=None):
    """ppo.generate with --decoding `decoding_way` from `seed`: (sequences, actions, the
    random stream's next number)."""
    ids, mask = (loaders.encode(tokenizer, prompts_or_ids, "cpu") if tokenizer
                 else prompts_or_ids)
    cfg.decoding = decoding_way
    torch.manual_seed(seed)
    sequences, actions = ppo.generate(model, ids, mask, cfg, EOS)
    return sequences, actions, torch.rand(())


def recorded_logits(monkeypatch):
    """The logits `decoding.choose` samples from, step by step: a list it fills."""
    seen, real = [], decoding.filtered_probs

    def recording(logits, *args):
        seen.append(logits.clone())
        return real(logits, *args)
    monkeypatch.setattr(decoding, "filtered_probs", recording)
    return seen


# ------------------------------------------------------------------------ the sampler

@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 50, 0.95), (1.0, 0, 0.9),
                                                       (1.3, 20, 1.0), (1.0, 0, 1.0),
                                                       (1.0, 0, 1e-8)])
def test_filtered_probs_are_hf_warpers_to_the_bit(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g) * 3                # (B, V)
    logits[0, :60] = 20.0                                         # the k-th tied with 59 more
    logits[1, 100:900] = -float("inf")                            # filtered out before
    logits[2] = 0.0                                               # all tied
    logits[3, 7] = 40.0                                           # one token holds the mass
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    ours = decoding.filtered_probs(logits, temperature, top_k, top_p)
    assert torch.equal(ours, scores.softmax(-1))
    if top_k and top_p == 1:
        assert (ours[0] > 0).sum() == 60                          # ties with the k-th stay
    if top_p < 1:
        assert (ours[3] > 0).sum() == 1 and ours[3, 7] == 1       # the nucleus of one token
    if top_p == 1e-8:                   # 1 - p rounds to 1: every mass is <= it, yet
        assert ((ours > 0).sum(-1) == 1).all()                    # one token stays a row


def test_multinomial_is_argmax_of_probs_over_exponential_noise():
    """ATen's torch.multinomial(p, 1): q = empty_like(p).exponential_(1), argmax(p / q). The
    same ids, and the random stream left at the same place."""
    g = torch.Generator().manual_seed(1)
    probs = torch.rand(5, 3000, generator=g) ** 8                 # (B, V) peaked
    probs[:, 1000:] = 0                                           # filtered-out tokens
    probs = probs / probs.sum(-1, keepdim=True)
    for seed in range(10):
        torch.manual_seed(seed)
        drawn = torch.multinomial(probs, 1).squeeze(1)
        after = torch.rand(())
        torch.manual_seed(seed)
        ours = (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)
        assert torch.equal(ours, drawn) and torch.equal(torch.rand(()), after)
        assert (ours < 1000).all()


# ----------------------------------------------------------- the loop against generate

def test_the_static_loop_draws_generates_ids(tiny, tokenizer, monkeypatch):
    """Five seeds: the same sequences, log-probs and random stream as `generate`; every
    token drawn inside the top-k/top-p set; logits within 1e-5 of HF's forward."""
    model, cfg = policy_of(tiny), config()
    seen = recorded_logits(monkeypatch)
    for seed in range(5):
        seen.clear()
        static = draw(model, PROMPTS, cfg, "static", seed, tokenizer)
        hf = draw(model, PROMPTS, cfg, "hf", seed, tokenizer)
        for ours, theirs in zip(static, hf):                      # sequences, actions, stream
            assert torch.equal(ours, theirs)
        sequences, actions, _ = static
        ids, mask = loaders.encode(tokenizer, PROMPTS, "cpu")
        attention = ppo.full_mask(mask, actions)                  # (B, P+T)
        with torch.no_grad():
            logp = ppo.token_log_probs(model, sequences, attention, actions)     # (B, T)
            logits = model(sequences[:, :-1], attention_mask=attention[:, :-1],
                           position_ids=loaders.positions(attention[:, :-1])
                           ).logits[:, -actions.shape[1]:]        # (B, T, V) HF's forward
        assert torch.isfinite(logp).all()
        ours = torch.stack(seen, 1)                                # (B, T, V)
        assert torch.allclose(ours, logits, rtol=0, atol=1e-5)
        probs = decoding.filtered_probs(logits.flatten(0, 1), cfg.temperature, cfg.top_k,
                                        cfg.top_p)                 # (B*T, V)
        assert (probs.gather(1, actions.reshape(-1, 1)) > 0).all()


def eos_boosted(model, boost):
    """`model` with `boost` added to the EOS logit (a bias on the LM head): rows end early,
    each at its own step."""
    head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features)
    head.weight = model.lm_head.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[EOS] = boost
    model.lm_head = head
    return model


def test_eos_ends_a_row_and_the_loop_as_in_generate(tiny, tokenizer):
    model, cfg = eos_boosted(policy_of(tiny), 3.5), config("--max-new-tokens", "16")
    lengths = set()
    for seed in range(4):
        sequences, actions, after = draw(model, PROMPTS, cfg, "static", seed, tokenizer)
        hf = draw(model, PROMPTS, cfg, "hf", seed, tokenizer)
        assert torch.equal(sequences, hf[0]) and torch.equal(after, hf[2])
        ended = actions == EOS                                    # (B, T)
        first = ended.int().argmax(1)                             # (B,) the first EOS
        assert ended.any(1).all()
        assert actions.shape[1] == first.max() + 1 < cfg.max_new_tokens  # T: the last to end
        for row, t in enumerate(first.tolist()):
            assert ended[row, t:].all()                           # EOS after the first EOS
        lengths.update(first.tolist())
    assert len(lengths) > 2                                       # rows end at various steps


def test_left_padding_changes_no_rows_ids(tiny, tokenizer):
    """Row 0 is short: padded in [short, long], bare in [short, short]. Both batches draw
    (2, V) noise a step, so row 0 meets the same noise: it draws the same ids. Eight more
    padding columns (as the graph pads to --prompt-tokens) change no id at all."""
    model, cfg = policy_of(tiny), config()
    short, long = PROMPTS[0], PROMPTS[1]
    ids, mask = loaders.encode(tokenizer, [short, long], "cpu")
    assert (mask[0] == 0).sum() >= 5                               # row 0 is padded
    for seed in range(3):
        _, padded, _ = draw(model, (ids, mask), cfg, "static", seed)
        _, bare, _ = draw(model, [short, short], cfg, "static", seed, tokenizer)
        assert torch.equal(padded[0], bare[0])
        wider = (torch.cat([torch.full((2, 8), EOS), ids], 1),
                 torch.cat([torch.zeros(2, 8, dtype=mask.dtype), mask], 1))    # (B, P+8)
        _, widened, _ = draw(model, wider, cfg, "static", seed)
        assert torch.equal(widened, padded)


def test_the_ratio_is_one_after_sampling_with_static_decoding(tiny_judge, data_dir, tiny,
                                                              tokenizer, tmp_path,
                                                              monkeypatch):
    """One PPO iteration whose batch decoding.py sampled: exactly 1 at the first inner step."""
    calls, real = [], decoding.sample
    monkeypatch.setattr(decoding, "sample", lambda *a: calls.append(a[5:]) or real(*a))
    cfg = ppo.parse_args(["--preset", "tiny", "--iterations", "1", "--batch", "2",
                          "--decoding", "static", "--out", str(tmp_path)])
    models = (tiny, rm.load_reward_model(tiny_judge), tokenizer, torch.device("cpu"))
    _, _, results = ppo.train(cfg, 0.1, 0, models, tiny_pool(tokenizer), tmp_path,
                              progress=False)
    row = results["iterations"][0]
    assert calls == [(None,)]                  # no GraphCache: the eager loop
    assert row["ratio_min"] == row["ratio_max"] == 1.0


def test_bf16_autocast_runs_with_fp32_logits(tiny, tokenizer, monkeypatch):
    model, seen = policy_of(tiny), recorded_logits(monkeypatch)
    _, fp32_actions, _ = draw(model, PROMPTS, config(), "static", 0, tokenizer)
    fp32 = seen[:]
    cfg = config("--precision", "bf16")
    with loaders.precision(cfg, "cpu"):
        sequences, actions, _ = draw(model, PROMPTS, cfg, "static", 0, tokenizer)
    bf16 = seen[len(fp32):]
    assert all(x.dtype == torch.float32 and torch.isfinite(x).all() for x in bf16)
    assert not torch.equal(bf16[0], fp32[0])                      # bf16 did take effect
    assert torch.allclose(bf16[0], fp32[0], atol=0.02)
    assert actions.shape == fp32_actions.shape and (actions < len(tokenizer)).all()
    assert torch.equal(sequences[:, -actions.shape[1]:], actions)


def test_the_way_auto_picks_is_the_graph_on_cuda_and_generate_elsewhere():
    assert [decoding.way("auto", d) for d in ("cpu", "cuda", "cuda:1", "mps")] == \
        ["hf", "graph", "graph", "hf"]
    assert [decoding.way(d, "cuda") for d in ("hf", "static")] == ["hf", "static"]


def test_auto_decoding_is_generate_off_cuda(tiny, tokenizer, monkeypatch):
    """The CPU's numbers cannot move: `auto` never calls decoding.py there."""
    def refuse(*args, **kwargs):
        raise AssertionError("decoding.sample called with --decoding auto on the CPU")
    monkeypatch.setattr(decoding, "sample", refuse)
    cfg = config()
    auto = draw(tiny, PROMPTS, cfg, "auto", 0, tokenizer)
    hf = draw(tiny, PROMPTS, cfg, "hf", 0, tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(auto, hf))


@pytest.mark.slow
def test_the_static_loop_draws_generates_ids_on_real_smollm2(smollm2, tokenizer, tldr_posts):
    """Eight TL;DR prompts of up to 128 tokens, 48 new tokens, two seeds (768 draws): the
    same ids as `generate` (fp32 logits agree to about 8e-5 here, 2e-6 of their range)."""
    cfg = config("--max-new-tokens", "48")
    prompts = [loaders.fit_prompt(tokenizer, p, 128) for p in tldr_posts[:8]]
    for seed in range(2):
        static = draw(smollm2, prompts, cfg, "static", seed, tokenizer)
        hf = draw(smollm2, prompts, cfg, "hf", seed, tokenizer)
        assert all(torch.equal(a, b) for a, b in zip(static, hf))


class HostReads(TorchDispatchMode):
    """The aten ops a block runs that read a tensor's value on the host or give a shape that
    depends on it: what a CUDA graph cannot hold (the recording fails, or bakes in a value)."""
    SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim",
             "unique_consecutive", "item"}

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masked = name in ("index", "index_put", "index_put_") and any(
            i is not None and i.dtype == torch.bool for i in args[1])    # x[mask]: nonzero
        if name in self.SYNCS or masked:
            self.found.append(name)
        return func(*args, **(kwargs or {}))


def test_the_step_reads_nothing_on_the_host_and_writes_in_place(tiny, tokenizer):
    """On the CPU, what makes `step` recordable on CUDA: no op reads a value on the host, and
    every buffer it writes stays where it was (a graph replays into the same addresses)."""
    model, cfg = policy_of(tiny), config()
    ids, mask = loaders.encode(tokenizer, PROMPTS, "cpu")
    with torch.no_grad():
        decoder = decoding.decoder_for(model, ids, cfg, EOS)
        hidden = decoding.prefill(model, decoder, ids, mask)
        decoder.noise.exponential_(1)
        decoding.choose(model, decoder, hidden, cfg, EOS)
        buffers = [decoder.token, decoder.position, decoder.column, decoder.unfinished,
                   decoder.visible, *decoder.keys, *decoder.values]
        where = [b.data_ptr() for b in buffers]
        before = decoder.token.clone()
        with HostReads() as reads:
            decoding.step(model, decoder, cfg, EOS)
    assert reads.found == []
    assert [b.data_ptr() for b in buffers] == where
    assert decoder.column.item() == ids.shape[1] + 1 and not torch.equal(decoder.token, before)


def test_a_graph_that_cannot_be_recorded_is_one_line_and_the_loop_without_it(
        tiny, tokenizer, monkeypatch, capsys):
    """Where recording fails (an old driver, a torch that refuses an op in capture), the
    loop runs eagerly with the same draws, after one line, and recording is not retried."""
    def refuse(*args):
        refuse.calls = getattr(refuse, "calls", 0) + 1
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(decoding, "record", refuse)
    model, cfg = policy_of(tiny), config()
    ids, mask = loaders.encode(tokenizer, PROMPTS, "cpu")
    pad = cfg.prompt_tokens - ids.shape[1]              # the width a graph would have
    ids = torch.cat([torch.full((len(ids), pad), EOS), ids], 1)
    mask = torch.cat([torch.zeros(len(ids), pad, dtype=mask.dtype), mask], 1)
    graphs = decoding.GraphCache()
    for _ in range(2):
        torch.manual_seed(0)
        fallback = decoding.sample(model, ids, mask, cfg, EOS, graphs)
    torch.manual_seed(0)
    eager = decoding.sample(model, ids, mask, cfg, EOS)
    assert all(torch.equal(a, b) for a, b in zip(fallback, eager))
    assert refuse.calls == 1 and graphs.decoders[model].graph is None
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "could not be recorded as a CUDA graph" in out[0]


# ------------------------------------------------------------------------ CUDA only

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_graph_replays_the_loop_and_reads_the_live_adapter(tokenizer, precision):
    """At the graph's width (--prompt-tokens columns), the replayed step draws the eager
    loop's ids; after an in-place update of the adapter (as AdamW's) the same recorded graph
    draws the updated policy's ids; the graph goes with the policy."""
    device = torch.device("cuda")
    model = policy_of(loaders.tiny_model(tokenizer, device=device))
    cfg = config("--precision", precision)
    ids, mask = loaders.encode(tokenizer, PROMPTS, device)
    pad = cfg.prompt_tokens - ids.shape[1]                        # the graph's own width
    ids = torch.cat([torch.full((len(ids), pad), EOS, device=device), ids], 1)
    mask = torch.cat([torch.zeros(len(ids), pad, dtype=mask.dtype, device=device), mask], 1)

    graphs = decoding.GraphCache()

    def run(graph, seed=0):
        torch.manual_seed(seed)
        with loaders.precision(cfg, device):
            return decoding.sample(model, ids, mask, cfg, EOS, graphs if graph else None)

    eager, graphed = run(False), run(True)
    assert torch.equal(graphed[0], eager[0])
    recorded = graphs.decoders[model]
    with torch.no_grad():                                         # an optimizer step
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.5 * torch.randn_like(p))
    moved = run(True)
    assert graphs.decoders[model] is recorded                     # replayed, not recorded
    assert torch.equal(moved[0], run(False)[0])
    assert not torch.equal(moved[1], graphed[1])                  # the update moved the ids
    gone = weakref.ref(recorded)
    del model, recorded
    gc.collect()
    assert gone() is None                                         # freed with the policy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_decoding_on_cuda_samples_through_the_graph(tokenizer):
    device = torch.device("cuda")
    model, cfg = policy_of(loaders.tiny_model(tokenizer, device=device)), config()
    ids, mask = loaders.encode(tokenizer, PROMPTS, device)
    cfg.decoding = "auto"
    sequences, actions = ppo.generate(model, ids, mask, cfg, EOS)
    recorded = decoding.CUDA_GRAPHS.decoders[model]
    assert sequences.shape == (3, ids.shape[1] + actions.shape[1])
    assert torch.equal(sequences[:, :ids.shape[1]], ids)
    ppo.generate(model, ids[:, 2:], mask[:, 2:], cfg, EOS)        # a shorter P: same graph
    assert decoding.CUDA_GRAPHS.decoders[model] is recorded
    ppo.generate(model, ids[:2], mask[:2], cfg, EOS)              # another B: recorded again
    assert decoding.CUDA_GRAPHS.decoders[model] is not recorded
