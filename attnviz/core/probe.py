"""Probe inputs that make a head type show itself without a hand-written sentence.

`induction`: spans of random common words, each followed by an exact copy (as TransformerLens
detects induction heads with repeated random tokens). In the copy, an induction head attends from
each word to the word that followed its first occurrence. Common English words keep every
tokenizer's pieces short; a word split into pieces repeats identically all the same.
"""

from __future__ import annotations

import random

from attnviz.core.choices import Probe

PROBES = Probe.values()
SPAN_LENGTHS = (4, 8, 16)  # one sentence per span length: span + copy
WORDS = tuple(dict.fromkeys((
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city name team minute idea kid body information "
    "back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education foot boy age "
    "policy music market sense nation plan college interest death experience effect class "
    "field development role effort rate heart drug show leader light voice wife police mind "
    "price report decision son view relationship town road arm difference value building "
    "action model season society tax director position player record paper space ground form "
    "event official matter center couple site project activity star table need court oil "
    "situation cost industry figure street image phone data picture practice piece land "
    "product doctor wall patient worker news test movie north love support technology step "
    "baby computer type attention film tree source organization hair window evidence "
    "population site river cat dog bird fish horse stone garden bridge island forest"
).split()))  # distinct: a span never repeats a word before its copy


def induction_probe(seed: int = 0, lengths: tuple[int, ...] = SPAN_LENGTHS) -> list[str]:
    """One sentence per span length: `length` random words, then the same words again."""
    rng = random.Random(seed)
    sentences = []
    for length in lengths:
        span = rng.sample(WORDS, length)
        sentences.append(" ".join(span + span))
    return sentences
