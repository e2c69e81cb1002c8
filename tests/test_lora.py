"""The adapter invariants the post relies on (lora.py).

The PPO ratio can only start at exactly 1 if the wrapped policy *is* the
reference before the first step; these tests pin that down, then check that a
step moves the adapter and nothing else.
"""

import copy
import subprocess
import sys

import pytest
import torch

from lora import (LORA_ALPHA, LORA_R, LoRALinear, count_parameters, load_adapter,
                  save_adapter, with_lora)

PROMPT = "SUBREDDIT: r/test\n\nTITLE: A title\n\nPOST: Some words here.\n\nTL;DR:"


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_adapter_starts_as_an_exact_no_op(tiny, tokenizer):
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    policy = with_lora(copy.deepcopy(tiny))
    # identical, not merely close: the ratio check downstream uses exact equality
    assert torch.equal(logits(tiny, ids), logits(policy, ids))


def test_only_adapter_tensors_train(tiny):
    policy = with_lora(copy.deepcopy(tiny))
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    layers = len(policy.model.layers)
    assert len(trainable) == layers * 2 * 2                # (q, v) x (down, up) per layer
    assert all(n.endswith(("down.weight", "up.weight")) for n in trainable)
    wrapped = policy.model.layers[0].self_attn.q_proj
    assert isinstance(wrapped, LoRALinear) and wrapped.scale == LORA_ALPHA / LORA_R == 2.0
    n_trainable, _ = count_parameters(policy)
    d, q_out = tiny.config.hidden_size, tiny.model.layers[0].self_attn.q_proj.out_features
    v_out = tiny.model.layers[0].self_attn.v_proj.out_features
    assert n_trainable == layers * LORA_R * (2 * d + q_out + v_out)


def test_one_step_moves_the_adapter_and_nothing_else(tiny, tokenizer):
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    policy = with_lora(copy.deepcopy(tiny))
    frozen_before = {n: p.clone() for n, p in policy.named_parameters() if not p.requires_grad}
    before = logits(policy, ids)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    loss = policy(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    for name, parameter in policy.named_parameters():
        if not parameter.requires_grad:
            assert torch.equal(parameter, frozen_before[name]), name
    assert (logits(policy, ids) - before).abs().max() > 1e-4


def test_save_load_round_trip_is_exact(tiny, tokenizer, tmp_path):
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    trained = with_lora(copy.deepcopy(tiny))
    with torch.no_grad():                        # give the adapter non-trivial weights
        for p in trained.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    save_adapter(trained, tmp_path / "adapter.safetensors")
    restored = load_adapter(with_lora(copy.deepcopy(tiny)), tmp_path / "adapter.safetensors")
    expected = logits(trained, ids)
    assert not torch.equal(expected, logits(tiny, ids))     # the adapter does something
    assert torch.equal(expected, logits(restored, ids))
    with open(tmp_path / "adapter.safetensors", "rb") as handle:
        assert b"pickle" not in handle.read(64)             # safetensors header is JSON


def test_load_rejects_a_mismatched_adapter(tiny, tmp_path):
    small = with_lora(copy.deepcopy(tiny), rank=4)
    save_adapter(small, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="does not match"):
        load_adapter(with_lora(copy.deepcopy(tiny)), tmp_path / "a.safetensors")


@pytest.mark.slow
def test_lora_script_prints_the_posts_line():
    out = subprocess.run([sys.executable, "lora.py"], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert "921,600 trainable of 135,436,608 (0.68%)" in out
    assert "bit for bit: True" in out
