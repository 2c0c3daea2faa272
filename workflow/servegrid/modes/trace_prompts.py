"""A replayed trace's prompts, token-exact and prefix-exact (servegrid.modes.trace).

Each block id of the trace (``hash_ids``) becomes one block of exactly ``block_tokens`` tokens, the same wherever it
appears in one cell run (:class:`BlockPrompts`), so requests that share ids in the trace share exactly those tokens
on the wire and the server's prefix cache sees the trace's own reuse. Prompts are built per arrival, when it is sent
(:class:`ArrivalPrompts`): a day-long trace's prompts all built first would fill the memory.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import overload

from servegrid.modes.prompts import PromptBuilder
from servegrid.modes.trace_file import Trace, TraceRequest

# A block's id as tokens: one token per decimal digit, so that every block starts unlike any other while the
# tokenizer is asked only a dozen times per cell, not once per block.
DIGITS = "0123456789"


class BlockPrompts:
    """Token-exact prompts from block ids: block ``h`` is the same ``block_tokens`` tokens wherever it appears in
    this cell run (``h``'s digits, a marker with the run's nonce, then corpus text seeded by ``h``), and a prompt
    is its blocks, the last one cut to the prompt's length."""

    def __init__(self, builder: PromptBuilder, block_tokens: int) -> None:
        self.builder = builder
        self.block_tokens = block_tokens
        self.opening = builder.marker("trace block")
        self.digits = [builder.tokenize(d)[-1] for d in DIGITS]
        self.closing = builder.tokenize("] ")

    def block(self, hash_id: int) -> list[int]:
        """Block ``hash_id``'s tokens, made afresh each time (microseconds, deterministic): a day-long trace's
        blocks kept in memory would hold gigabytes."""
        # The id first: two blocks part at their first tokens, so no cache block of any size matches across them.
        head = ([self.digits[int(c)] for c in str(abs(hash_id))] + self.opening + self.closing)[: self.block_tokens]
        rng = random.Random(f"{self.builder.seed}/{self.builder.nonce}/block {hash_id}")
        return head + self.builder.body(self.block_tokens - len(head), rng)

    def prompt(self, request: TraceRequest) -> list[int]:
        out: list[int] = []
        for hash_id in request.hash_ids:
            out.extend(self.block(hash_id))
        return out[: request.input_tokens]


class ArrivalPrompts(Sequence[list[list[int]]]):
    """Each arrival's prompts (one per turn), built when the arrival is sent: the tokenizer was asked once, in
    BlockPrompts, and a long trace's prompts all built before the first send would fill the memory."""

    def __init__(self, trace: Trace, prompts: BlockPrompts, indices: list[int]) -> None:
        self.trace, self.prompts, self.indices = trace, prompts, indices

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, position: int) -> list[list[int]]: ...

    @overload
    def __getitem__(self, position: slice) -> list[list[list[int]]]: ...

    def __getitem__(self, position: int | slice) -> list[list[int]] | list[list[list[int]]]:
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        return [self.prompts.prompt(turn) for turn in self.trace.conversations[self.indices[position]].turns]
