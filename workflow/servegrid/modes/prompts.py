"""Prompts of exact token lengths, built with the server's own tokenizer.

Text comes from :mod:`servegrid.text`; it is tokenized once per cell by the
server itself (:meth:`Engine.tokenize <servegrid.engines.base.Engine.tokenize>`),
and prompts are sent as token-id lists, so the server receives exactly the
number of tokens asked for (and reports it back in ``usage.prompt_tokens``,
which the cell checks).

Every prompt that must be cold starts with a marker that contains a nonce
drawn for this cell run, so neither an earlier cell nor an earlier run can
have left a reusable prefix in the cache.
"""

from __future__ import annotations

import copy
import random
import secrets
from collections.abc import Callable, Sequence

from servegrid import text

Tokenize = Callable[[str], list[int]]


class PromptBuilder:
    """Cuts exact-length token sequences out of a seeded, tokenized corpus."""

    def __init__(self, tokenize: Tokenize, seed: int, corpus_tokens: int, nonce: str | None = None) -> None:
        self.tokenize = tokenize
        self.seed = seed
        self.nonce = nonce or secrets.token_hex(4)
        # ~1.3 tokens per word in the builtin text; ask for enough words once.
        ids = tokenize(text.paragraph(seed, max(256, int(corpus_tokens / 1.2))))
        if len(ids) < 64:
            raise ValueError(f"the corpus tokenized to only {len(ids)} tokens")
        self.corpus = ids

    def fresh(self) -> PromptBuilder:
        """The same corpus under a new nonce: prompts no earlier use of this builder can have cached."""
        clone = copy.copy(self)
        clone.nonce = secrets.token_hex(4)
        return clone

    def body(self, length: int, rng: random.Random) -> list[int]:
        """``length`` corpus tokens from a random offset, wrapping around."""
        if length <= 0:
            return []
        start = rng.randrange(len(self.corpus))
        out: list[int] = []
        while len(out) < length:
            out.extend(self.corpus[start : start + length - len(out)])
            start = 0
        return out

    def marker(self, label: str) -> list[int]:
        return self.tokenize(f"[{self.nonce} {label}] ")

    def unique(self, length: int, label: str) -> list[int]:
        """A prompt of exactly ``length`` tokens that no other prompt starts like."""
        head = self.marker(label)[:length]
        rng = random.Random(f"{self.seed}/{label}")
        return head + self.body(length - len(head), rng)

    def shared_prefix_prompts(
        self, prefix_len: int, suffix_len: int, labels: Sequence[str], prefix_label: str
    ) -> tuple[list[int], list[list[int]]]:
        """One prefix of ``prefix_len`` tokens and, per label, prefix + a unique suffix."""
        prefix = self.unique(prefix_len, prefix_label)
        return prefix, [prefix + self.unique(suffix_len, label) for label in labels]
