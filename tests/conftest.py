"""Shared fixtures: the real tokenizer, a tiny random model, and (for slow tests) SmolLM2."""
import os
os.environ.setdefault("TRITON_INTERPRET", "1")   # Triton reads it at import: set before any test imports it


import pytest
import torch

import loaders


@pytest.fixture(scope="session")
def tokenizer():
    return loaders.load_tokenizer()


@pytest.fixture()
def tiny(tokenizer):
    """A fresh 2-layer Llama with the real vocabulary, frozen, in eval mode."""
    return loaders.tiny_model(tokenizer, seed=0)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (the embedded copy offline); frozen, eval mode."""
    torch.manual_seed(0)
    return loaders.load_model()
