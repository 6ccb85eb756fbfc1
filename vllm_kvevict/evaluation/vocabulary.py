"""Word lists and a seeded pseudo-word maker: the raw material of every generated task (no downloads)."""

from __future__ import annotations

import random

NOUNS: tuple[str, ...] = tuple(
    """
    river garden window mountain teacher letter market village bridge engine forest island harbor kitchen
    library painter farmer doctor student signal pocket ladder basket candle mirror pillow camera wallet
    blanket bottle button carpet castle cellar chapter circle cloud coast collar cottage county crowd desert
    factory feather fence field finger flower fountain friend galaxy gate hammer helmet highway hill horizon
    hotel journey jungle kettle lantern lawyer meadow merchant message meteor minute monster morning needle
    notebook ocean office orchard palace parcel pencil picture pilot planet poet pond prison puzzle quarry
    rabbit railway record ribbon rocket saddle sailor scholar season shadow shelter shore singer sister
    soldier spirit stable station statue stone storm stranger street summer sunset table temple theater
    ticket tower traveler tunnel valley vessel victory voyage wagon wave weaver whisper winter wizard worker
    author banker battle blossom border bucket cabin canyon captain carriage cathedral ceiling champion
    chimney citizen clock comet compass council courtyard cousin cradle crystal custom dancer daughter
    diamond dragon drawer emperor estate falcon festival fisher fortress garage glacier governor guardian
    guitar habit hunter inventor jacket jewel knight lagoon leader legend lemon lizard machine magnet
    mansion marble meadowlark melody miller monk museum neighbor novel orbit organ oyster parrot pasture
    pebble pepper pioneer pirate plumber porch prophet pyramid quilt rainbow ranger reader reef rider ritual
    saint satellite sculptor senator servant settler shepherd sheriff shrine skipper sparrow spider spring
    squirrel stadium steward surgeon swallow tailor tavern thunder tiger tractor trumpet tutor umbrella
    uncle veteran violin volcano walrus warden warrior weasel whale widow willow wolf writer
    """.split()
)

ADJECTIVES: tuple[str, ...] = tuple(
    """
    ancient bright careful quiet hidden golden silver gentle narrow restless hollow patient distant humble
    curious brave clever crooked dusty eager faint fierce fragile frozen generous graceful grumpy handsome
    heavy honest icy jolly keen lively lonely lucky massive mellow mighty modest muddy nimble noisy obscure
    odd plain polite proud rapid rare rough royal rusty sacred scarlet secret shallow sharp shiny silent
    simple sleepy slender smooth sober solemn sour spare stern sticky stormy strange sturdy subtle sudden
    sunny swift tame tender tidy tiny tired tough tranquil vast velvet vivid wandering warm weary wicked
    wild wise witty wooden young zealous amber bitter bold calm cheerful cosmic crimson dense drowsy
    elegant emerald fancy fearless feeble fluffy foggy fuzzy gloomy hasty hearty hungry jagged loyal
    """.split()
)

VERBS_PAST: tuple[str, ...] = tuple(
    """
    carried painted watched followed opened crossed visited remembered described measured collected
    repaired borrowed guarded planted studied cleaned built found lost sold bought noticed admired
    ignored questioned explored traded shared praised doubted recorded imagined welcomed abandoned
    discovered polished mended counted gathered sketched weighed examined inherited
    """.split()
)

ADVERBS: tuple[str, ...] = tuple(
    """
    quietly slowly eagerly rarely often suddenly carefully gently boldly calmly warmly barely nearly
    loudly proudly briskly softly plainly seldom usually
    """.split()
)

PREPOSITIONS: tuple[str, ...] = ("near", "behind", "beside", "above", "below", "beyond", "inside", "across")

FIRST_NAMES: tuple[str, ...] = tuple(
    """
    Alice Bruno Clara Dmitri Elena Farid Greta Hiro Irene Jonas Kamala Lucas Mirela Nadia Oscar Priya
    Quentin Rosa Samuel Tamsin Ulrich Valeria Wendell Ximena Yusuf Zelda Anton Beatrix Cyrus Delia
    """.split()
)

CITIES: tuple[str, ...] = tuple(
    """
    Lisbon Oslo Nairobi Lima Hanoi Dublin Quito Tbilisi Seoul Reykjavik Marrakesh Bergen Valletta
    Cusco Kyoto Tallinn Zagreb Tunis Accra Perth Montreal Porto Krakow Bilbao Riga Antwerp Havana Manila
    """.split()
)

CATEGORIES: dict[str, tuple[str, ...]] = {
    "animal": tuple("tiger horse rabbit wolf eagle otter camel zebra moose badger lion goat".split()),
    "fruit": tuple("apple banana cherry mango peach plum grape lemon melon pear apricot fig".split()),
    "color": tuple("red blue green yellow purple orange brown violet indigo crimson teal beige".split()),
    "tool": tuple("hammer wrench shovel chisel drill saw pliers rake axe trowel spanner file".split()),
    "vehicle": tuple("car truck bicycle tram ferry canoe scooter wagon bus yacht glider sled".split()),
    "instrument": tuple("violin flute drum cello harp trumpet piano banjo oboe tuba lute organ".split()),
}

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr", "pl", "gr")
_VOWELS = ("a", "e", "i", "o", "u")


def pseudo_words(rng: random.Random, count: int, syllables: tuple[int, int] = (2, 3)) -> list[str]:
    """``count`` distinct pronounceable made-up words (e.g. ``"bravoli"``), drawn from ``rng``."""
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < count:
        n = rng.randint(*syllables)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def magic_number(rng: random.Random) -> str:
    """A 7-digit number without a leading zero, as RULER's needle values."""
    return str(rng.randint(1_000_000, 9_999_999))


def magic_key(rng: random.Random) -> str:
    """A hyphenated ``adjective-noun`` needle key such as ``"quiet-harbor"``."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
