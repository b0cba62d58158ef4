"""A synthetic world of invented countries, and the sentences that describe it.

Invented names keep the demo honest: nothing the model knows can come from anywhere but
this corpus, so a fact it recalls is a fact it learned here, and the patching sweep shows
where *this* model keeps it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
          "br", "dr", "kr", "st", "tr", "sh"]
VOWELS = ["a", "e", "i", "o", "u"]
CODAS = ["", "", "", "n", "r", "l", "s"]
COUNTRY_ENDINGS = ["ia", "land", "ova", "esh", "ar"]

# The template whose recall the demo measures and dissects; the others teach the same facts
# in other words so that the model stores them with the country, not with one sentence.
PROMPT = "the capital of {country} is"
TEMPLATES = [
    "the capital of {country} is {capital} .",
    "{capital} is the capital of {country} .",
    "the currency of {country} is the {currency} .",
    "in {country} people pay with the {currency} .",
]


@dataclass(frozen=True)
class Fact:
    country: str
    capital: str
    currency: str

    @property
    def prompt(self) -> str:
        return PROMPT.format(country=self.country)


def _syllable(rng: random.Random) -> str:
    return rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)


def invent_names(rng: random.Random, count: int, syllables: tuple[int, int], endings=("",),
                 taken: set[str] | None = None) -> list[str]:
    """`count` distinct pronounceable names, none of them in `taken` (which is updated)."""
    taken = set() if taken is None else taken
    names = []
    while len(names) < count:
        n = rng.randint(*syllables)
        name = ("".join(_syllable(rng) for _ in range(n)) + rng.choice(endings)).capitalize()
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def make_facts(n_countries: int, seed: int) -> list[Fact]:
    """One capital and one currency per invented country, all names distinct."""
    rng = random.Random(seed)
    taken: set[str] = set()
    countries = invent_names(rng, n_countries, (1, 2), COUNTRY_ENDINGS, taken)
    capitals = invent_names(rng, n_countries, (2, 2), ("",), taken)
    currencies = invent_names(rng, n_countries, (1, 2), ("o", "ix", "um"), taken)
    return [Fact(*names) for names in zip(countries, capitals, currencies)]


def sentences(facts: list[Fact]) -> list[str]:
    """Every template filled with every fact, in a fixed order."""
    return [t.format(country=f.country, capital=f.capital, currency=f.currency)
            for f in facts for t in TEMPLATES]
