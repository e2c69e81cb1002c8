"""LoRA: a frozen Linear with a trainable low-rank update beside it.

Mirrors the post's `LoRALinear` and `with_lora` (section "The four models"):
the policy is the reference model with this adapter on the query and value
projections of every attention layer, and the adapter is the only tensor in the
policy that receives a gradient.

    h = W x + (alpha / r) * B A x        W frozen, A = `down` (r x d_in), B = `up` (d_out x r)

`up` starts at zero, so the wrapped model is the reference bit for bit until the
first optimizer step; that is half of why the PPO ratio starts at exactly 1.

Paper: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685, section 4.1 (the update BA, B = 0 at init, scaling alpha/r).

Departures from the post:
    1. `down` is initialised N(0, 0.01) as in the post (the paper uses a random
       Gaussian too; peft uses Kaiming-uniform). No dropout on the adapter input.
    2. Adapter weights are saved and loaded as safetensors, never pickled.

Run:  python lora.py      (prints the post's parameter count, then checks the no-op)
Test: pytest tests/test_lora.py
"""

import argparse
import copy

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import loaders

LORA_R, LORA_ALPHA = 16, 32                 # the post's rank and alpha
TARGETS = ("q_proj", "v_proj")              # the post wraps these two in every layer


class LoRALinear(nn.Module):
    """A frozen Linear with a trainable low-rank update beside it."""

    def __init__(self, base, rank=LORA_R, alpha=LORA_ALPHA):
        super().__init__()
        self.base = base
        for parameter in self.base.parameters():
            parameter.requires_grad = False
        device, dtype = base.weight.device, base.weight.dtype
        self.down = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=dtype)
        nn.init.normal_(self.down.weight, std=0.01)          # A ~ N(0, 0.01), the post's init
        nn.init.zeros_(self.up.weight)                       # B = 0: the adapter starts as a no-op
        self.scale = alpha / rank

    def forward(self, x):
        # h = W x + (alpha / r) B A x       x: (..., d_in) -> (..., d_out)
        return self.base(x) + self.up(self.down(x)) * self.scale


def with_lora(model, rank=LORA_R, alpha=LORA_ALPHA, top_layers=None):
    """Wrap q_proj and v_proj of every attention layer, in place; leave the rest alone.

    `top_layers=k` wraps only the top k layers (reward_model.py's cpu preset); None or 0
    wraps them all, as the post does.
    """
    layers = model.model.layers
    for layer in layers[len(layers) - (top_layers or len(layers)):]:
        attention = layer.self_attn
        for name in TARGETS:
            setattr(attention, name, LoRALinear(getattr(attention, name), rank, alpha))
    return model


def merge_lora(model):
    """Fold every adapter into its frozen Linear, in place, and unwrap it: the model that
    `with_lora` wrapped, with the trained update inside its weights (sft.py saves this).

        W' = W + (alpha / r) B A        so that  W' x = W x + (alpha / r) B A x
    """
    for layer in model.model.layers:
        attention = layer.self_attn
        for name in TARGETS:
            wrapped = getattr(attention, name)
            if not isinstance(wrapped, LoRALinear):
                continue
            with torch.no_grad():
                # W' = W + (alpha / r) B A:  (d_out, d_in) + (d_out, r) @ (r, d_in)
                wrapped.base.weight += wrapped.scale * (wrapped.up.weight @ wrapped.down.weight)
            setattr(attention, name, wrapped.base)
    return model


def adapter_numel(model, rank=LORA_R, top_layers=None):
    """How many parameters `with_lora(model, rank, top_layers=...)` adds: r (d_in + d_out) for
    each wrapped projection. Read from the unwrapped model, before any copy is made."""
    layers = model.model.layers
    wrapped = layers[len(layers) - (top_layers or len(layers)):]
    return sum(rank * (p.in_features + p.out_features)
               for layer in wrapped for p in (getattr(layer.self_attn, n) for n in TARGETS))


def adapter_state(model):
    """Only the adapter's tensors ({name: tensor}), the part worth saving."""
    return {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()
            if name.endswith(("down.weight", "up.weight"))}


def save_adapter(model, path, metadata=None):
    """Adapter weights as safetensors (no pickle, so loading runs no code)."""
    save_file(adapter_state(model), str(path), metadata=metadata)


class AdapterMismatch(ValueError):
    """A saved adapter whose names or shapes are not the model's."""


def load_adapter(model, path):
    """Load adapter weights saved by `save_adapter` into a model already wrapped by `with_lora`."""
    state = load_file(str(path), device=str(next(model.parameters()).device))
    expected = set(adapter_state(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise AdapterMismatch(f"{path}: adapter does not match the model "
                              f"(missing {missing[:3]}..., unexpected {extra[:3]}...)")
    own = adapter_state(model)
    wrong = [n for n in state if state[n].shape != own[n].shape]
    if wrong:
        raise AdapterMismatch(f"{path}: adapter does not match the model ({wrong[0]} has "
                              f"shape {tuple(state[wrong[0]].shape)}, the model "
                              f"{tuple(own[wrong[0]].shape)})")
    model.load_state_dict(state, strict=False)
    return model


def count_parameters(model):
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


def main():
    parser = loaders.add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--preset", choices=["blog", "tiny"], default="blog",
                        help="blog: the post's SmolLM2-135M-Instruct; tiny: a toy model for tests")
    args = parser.parse_args()

    reference, tokenizer = loaders.load_policy_and_tokenizer(args.model, preset=args.preset)
    policy = with_lora(copy.deepcopy(reference))          # the post's copy of the reference
    trainable, total = count_parameters(policy)
    print(f"{trainable:,} trainable of {total:,} ({trainable / total:.2%})")

    # The adapter starts as a no-op: up = 0, so up(down(x)) * scale is exactly +0.0
    # and the wrapped model's logits are the base model's, bit for bit.
    prompt = "SUBREDDIT: r/test\n\nTITLE: A short post\n\nPOST: Hello there.\n\nTL;DR:"
    ids = tokenizer(prompt, return_tensors="pt").input_ids            # (1, L)
    with torch.no_grad():
        base_logits = reference(ids).logits                           # (1, L, V)
        lora_logits = policy(ids).logits                              # (1, L, V)
    same = torch.equal(base_logits, lora_logits)
    print(f"wrapped logits equal the base model's bit for bit: {same} "
          f"(max |difference| {(base_logits - lora_logits).abs().max().item():.1e} "
          f"over {base_logits.numel():,} logits)")
    if not same:
        raise SystemExit("the adapter is not a no-op at initialisation")


if __name__ == "__main__":
    main()
