"""Deterministic English-like text: the corpus for the tiny tokenizer and the
raw material for prompts.

Prompts are cut from this text at exact token counts (see ``prompts``); the
text itself only has to be reproducible from a seed and look enough like
language that a real model's speculative proposer behaves as on real prompts.
"""

from __future__ import annotations

import random

# Common English words: a real model sees plausible (if meaningless) text, and
# a byte-level BPE trained on it learns whole-word merges, as on real corpora.
_WORD_LIST = """
    the of and to in is was for on that with as by it from at be this are or
    an have not which has but were had their they been also its more one can
    other new all first two when there who after would into time only some
    these may such over most used than out about many between while during
    each both well where through system data model server request token
    cache prefix memory batch queue latency throughput decode prefill
    session context length concurrency engine worker kernel layer attention
    head block value key query compute device host network stream chunk
    reply question answer user assistant history turn message document
    report result table figure number measure test run grid cell
    configuration speculative draft accept reject sample greedy output input
    prompt suffix shared unique cold warm hit miss rate ratio median
    percentile interval bound limit capacity pool page fragment schedule
    preempt evict reuse hash store load read write fast slow small large
    long short early late high low open close start stop make take give find
    keep show tell ask work call move play change follow river mountain
    forest city village road bridge market garden window door table chair
    paper letter story book song music color light sound water fire stone
    wood glass metal bread apple winter summer morning evening
"""
WORDS: tuple[str, ...] = tuple(_WORD_LIST.split())


def sentences(seed: int, count: int) -> list[str]:
    """``count`` sentences of 6-18 words, fixed by ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        words = rng.choices(WORDS, k=rng.randint(6, 18))
        words[0] = words[0].capitalize()
        out.append(" ".join(words) + rng.choice(".?!"))
    return out


def paragraph(seed: int, approx_words: int) -> str:
    """Text of at least ``approx_words`` words, fixed by ``seed``."""
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < approx_words:
        sentence = sentences(rng.randrange(2**31), 1)[0]
        parts.append(sentence)
        total += sentence.count(" ") + 1
    return " ".join(parts)
