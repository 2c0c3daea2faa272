"""Exact-length prompts and cache-safe uniqueness."""

from __future__ import annotations

import pytest

from servegrid.modes.prompts import PromptBuilder
from servegrid.testing.calibration import Vocabulary

VOCAB = Vocabulary()


def builder(nonce: str = "n0nce", seed: int = 1) -> PromptBuilder:
    return PromptBuilder(VOCAB.encode, seed=seed, corpus_tokens=2000, nonce=nonce)


@pytest.mark.parametrize("length", [1, 5, 16, 100, 1024, 5000])
def test_unique_prompts_have_exactly_the_requested_length(length):
    assert len(builder().unique(length, "s0 r0")) == length


def test_unique_prompts_differ_in_their_first_cache_block():
    b = builder()
    prompts = [b.unique(256, f"s{s} r{r}") for s in range(4) for r in range(4)]
    first_blocks = {tuple(p[:16]) for p in prompts}
    assert len(first_blocks) == len(prompts)


def test_a_new_nonce_makes_the_same_label_cold_again():
    assert builder("aaaa").unique(64, "s0 r0")[:16] != builder("bbbb").unique(64, "s0 r0")[:16]


def test_same_seed_and_nonce_reproduce_the_same_prompt():
    assert builder().unique(300, "x") == builder().unique(300, "x")
    assert builder(seed=1).body(50, __import__("random").Random(0)) != builder(seed=2).body(
        50, __import__("random").Random(0)
    )


def test_shared_prefix_prompts_share_exactly_the_prefix():
    prefix, prompts = builder().shared_prefix_prompts(512, 64, ["a", "b", "c"], "shared")
    assert len(prefix) == 512
    for prompt in prompts:
        assert len(prompt) == 576
        assert prompt[:512] == prefix
    suffixes = {tuple(p[512:528]) for p in prompts}
    assert len(suffixes) == 3


def test_tiny_corpus_is_refused():
    with pytest.raises(ValueError, match="tokenized to only"):
        PromptBuilder(lambda text: [1, 2, 3], seed=1, corpus_tokens=10)
