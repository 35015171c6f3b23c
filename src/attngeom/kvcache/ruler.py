"""Long-context tasks made offline: RULER's synthetic task families, sized in a model's own tokens.

RULER is Hsieh et al., *RULER: What's the Real Context Size of Your Long-Context Language
Models?*, COLM 2024 (arXiv 2404.06654, https://github.com/NVIDIA/RULER). Its synthetic tasks hide
what the question needs in a long distracting text, so a KV-cache policy that drops the wrong
entries loses the answer. This module reproduces the task templates, answer prefixes, answer-length
limits (``tokens_to_generate``) and scoring rule of RULER's ``scripts/data/synthetic`` and
``scripts/eval/synthetic``, in its own code, with no download: the word lists are built in, and
each task's haystack is the one RULER's ``scripts/synthetic.yaml`` gives it (:attr:`TaskSpec.haystack`):
RULER's noise, other needles, or for RULER's essay tasks the prose shipped with the package
(``attngeom/kvcache/data/prose.txt``, from *The Debian Administrator's Handbook*, CC BY-SA 3.0:
:func:`essay_words`; RULER's are Paul Graham's essays, which may not be shipped), unless the
caller passes a haystack of its own.

Every prompt is split as RULER's template puts it: ``context`` (the instruction preamble, then the
haystack with the needles: the part a cache policy compresses), then ``question`` (after the
context; it always begins with ``"\\n"``), then ``answer_prefix`` (the start of the answer, which
the model continues). Sizes are tokens of ``context + question + answer_prefix`` as plain text,
encoded by the model's tokenizer with its special tokens (BOS) but without a chat template, found by
binary search over the haystack size as RULER does; RULER counts the answer's
``tokens_to_generate`` in its ``max_seq_length`` too, so RULER's 4096 setting of a task is
``length=4096 - TASKS[task].max_new_tokens`` here.

Deterministic: example ``index`` of ``seed`` draws everything from its own
``random.Random(f"ruler:{task}:{seed}:{index}")`` (a string seed, hashed by SHA-512, so seeds 0
and 1 share no example), never from global state.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import random
import re
import string
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""RULER's noise haystack: this line repeated (one line per five sentences here; see :func:`haystack_text`)."""

NOISE_SENTENCES = tuple(s + "." for s in NOISE.rstrip(".").split(". "))

RULER_HAYSTACK = "ruler"
"""The ``haystack`` argument that gives each task RULER's own (:attr:`TaskSpec.haystack`): the
shipped essays (:func:`essay_words`) for the essay tasks, the noise for the others."""

ESSAY_FILE = Path(__file__).with_name("data") / "prose.txt"
"""The essay haystack shipped with the package: 300 kB of *The Debian Administrator's Handbook*
(Raphaël Hertzog and Roland Mas; CC BY-SA 3.0, see ``data/LICENSE`` beside it), about 64,000
SmolLM2 tokens (a longer haystack repeats it, as RULER repeats its essays)."""

DEPTHS = tuple(round(100 * i / 39) for i in range(40))
"""RULER's needle depths in a prose haystack: 40 evenly spaced percentages, 0 to 100."""

NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
"""RULER's needle sentence (``type_v`` is plural: ``numbers``, ``words`` or ``uuids``)."""

_ADJECTIVES = """
able acid active agile alert amber ancient angry anxious arctic ashen awful bald barren basic
bitter blank bleak blind bold brave brief bright brisk broad broken bronze calm candid careful
casual cheap cheerful chilly civil clean clever cloudy clumsy coarse cold cosmic crisp cruel curly
damp dark dear deep dense dizzy dry dull dusty eager early earthy easy elder empty endless equal
exact faint fair false famous fancy fast fierce filthy firm flat fluffy fond foolish fragile frank
free fresh friendly frosty frozen fuzzy gentle giant glad glossy golden grand grateful greasy great
green grim gritty gusty handy happy hardy harsh hasty hazy heavy hidden hollow honest huge humble
hungry icy idle jolly juicy keen kind lame large lazy lean level light little lively lonely loose
loud lousy loyal lucky lumpy mad mellow merry messy mild misty modern moist murky narrow nasty
neat nervous new nimble noble noisy odd oily old orange pale patient plain plump polite poor proud
pure quick quiet rapid rare raw ready regular rich rigid ripe rough round royal rude rusty sad
salty scarce secret shallow sharp shiny short shy silent silky silly simple sleepy slim slow smart
smooth snowy soft solid sour spicy stale steady steep sticky stiff stormy strange strict strong
sturdy subtle sunny super sweet swift tall tame tender thick thin thirsty tidy tiny tough tricky
ugly upset urban vague valid vast violet vivid warm wary weak weary wet wicked wide wild windy wise
witty wooden young zealous
""".split()

_NOUNS = """
acorn actor airport album anchor angle ankle apple apron arch arena armor arrow artist ash attic
author avenue badge bakery balcony ball bamboo banana band banner barn barrel basket bath beach
beacon bean bear beard bed bee bell belt bench berry bicycle bird biscuit blanket blossom boat bone
book boot bottle boulder bowl box bracelet branch bread brick bridge broom brush bubble bucket
bulb bundle butter button cabin cable cactus cake camel camera candle canoe canyon captain card
carpet carrot castle cat cattle cave cellar chain chair chalk channel cheese cherry chimney church
circle city clock cloud clover coal coast coat coffee coin comet compass cookie copper coral corner
cottage cotton crab cradle crane crayon creek cricket crown cup curtain cushion daisy dancer desert
diamond dinner doctor dolphin donkey door dragon drawer dream drum eagle engine envelope falcon
farm feather fence fern ferry field finger flag flame flute forest fork fountain fox frog garden
garlic gate ghost giraffe glacier glove goat grape grass guitar hammer harbor harvest hat hawk
helmet hill hive honey horizon horse hotel island jacket jar jewel jungle kettle key kitchen kite
ladder lake lamp lantern leaf lemon letter library lighthouse lily lion lizard lobster lock meadow
melon mirror monkey moon mountain mouse museum needle nest oak ocean office olive onion orchard
otter owl oyster paddle palace panda paper parrot pasta peach pearl pebble pencil penguin pepper
piano pigeon pillow pine pirate planet plate pocket pond potato puzzle rabbit radio rainbow raven
ribbon river robot rocket rose saddle sailor salmon sandal scarf school scissors shadow shark
sheep shell ship shovel silver sketch sled snail spider spoon squirrel stable star statue stone
storm stove sugar summit swan table teapot temple tent thunder tiger timber toast tomato tower
tractor train tree trumpet tulip tunnel turtle umbrella valley vase village violin wagon wallet
walnut whale wheel whistle willow window wolf yacht zebra
""".split()

_VERBS = """
accept admire advise allow answer appear argue arrive ask bake balance bathe beg behave believe
blink boil borrow bounce breathe build bury calculate carry celebrate change chase cheer chew clap
climb collect comfort compare complain count crawl cross dance decide deliver depend describe dig
discover dive divide drift drown earn enjoy escape explain explore fetch fill float flow fold
follow forgive gather glow grab greet guard guess hammer hang harm hunt hurry imagine improve
invent invite jog juggle jump kick kneel knit knock laugh launch learn lift listen march marry
measure melt mend mix nod obey offer open order pack paint pause peel perform pinch plant play
polish pour pray preach pretend print pull punch push quit race rain reach read relax remember
repair repeat rescue rest return rinse roll rub rush sail scatter scream search shiver sing sip
skate sketch ski skip sleep slide smile sneeze sniff snore spell spill splash spray sprint squeeze
stack stare steer stir stretch swim swing talk taste teach tease thank throw tickle travel trust
tumble twist type unlock vanish visit wander warn wash watch wave weave whisper whistle wink wish
wobble worry wrap yawn yell zoom
""".split()

WORDS = tuple(sorted(set(_ADJECTIVES) | set(_NOUNS) | set(_VERBS)))
"""The common-words vocabulary (RULER samples wonderwords' nouns, adjectives and verbs)."""

KEY_WORDS = tuple(f"{a}-{n}" for a in sorted(set(_ADJECTIVES)) for n in sorted(set(_NOUNS)))
"""The needle keys of type ``words``: adjective-noun pairs, as RULER's wonderwords pairs."""


@dataclass(frozen=True)
class Example:
    """One task example. ``context + question + answer_prefix`` is the plain prompt (RULER's order);
    ``answers`` are the reference strings :func:`string_match_all` looks for; ``length`` is the prompt's tokens
    without a chat template (BOS included when the tokenizer adds one)."""

    task: str
    index: int
    seed: int
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int
    length: int


Prompt = tuple[str, str, str, tuple[str, ...]]
"""What a task family's generator returns: ``(context, question, answer_prefix, answers)``."""


@dataclass(frozen=True)
class TaskSpec:
    """A task family: ``generate(rng, size, haystack, length, **options) -> Prompt`` builds a prompt
    whose haystack has ``size`` units (noise sentences, prose words, listed words or coded words;
    at least ``min_size``), for a target ``length`` (some defaults depend on it, as in RULER);
    ``max_new_tokens`` is RULER's ``tokens_to_generate``; ``metric`` names the scoring rule.
    ``refine`` names an integer option of finer steps, searched once the size is found (the
    frequent-words padding, whose size steps can add several words at once). ``slack``: tokens a
    prompt may fall short beyond :func:`tolerance` (one haystack unit of a coarse haystack: a line
    of a needle, 64 tokens; of two UUIDs, 128). ``haystack``: the haystack RULER's
    ``scripts/synthetic.yaml`` gives the task, ``noise``, ``essay`` (:func:`essay_words`),
    ``needle`` (other needles, built in) or ``none`` (the task's text is its haystack)."""

    name: str
    generate: Callable[..., Prompt]
    max_new_tokens: int
    metric: str = "string_match_all"
    min_size: int = 0
    refine: str | None = None
    slack: int = 0
    haystack: str = "noise"

    def score(self, prediction: str, answers: Sequence[str]) -> float:
        """The task's score of one prediction, in [0, 1]."""
        return (string_match_part if self.metric == "string_match_part" else string_match_all)(prediction, answers)


# ---------------------------------------------------------------------------------------------
# haystacks
# ---------------------------------------------------------------------------------------------


def prose_words(texts: Iterable[str]) -> tuple[str, ...]:
    """The words of a prose corpus (whitespace runs collapsed, as RULER reads its essays)."""
    return tuple(" ".join(texts).split())


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The words of the shipped essay haystack (:data:`ESSAY_FILE`), RULER's essay tasks' default."""
    return prose_words([ESSAY_FILE.read_text(encoding="utf-8")])


def essay_sha256() -> str:
    """The sha256 of :data:`ESSAY_FILE`'s bytes: what a run's identity records of the essays."""
    return hashlib.sha256(ESSAY_FILE.read_bytes()).hexdigest()


def task_haystack(task: str, haystack=RULER_HAYSTACK):
    """The haystack :func:`haystack_text` takes for ``task``: with :data:`RULER_HAYSTACK`, RULER's
    (the shipped essays' words for a task whose :attr:`TaskSpec.haystack` is ``essay``, else the
    noise); ``"noise"`` for the noise; a list of prose texts for their words (every needle task
    and ``variable_tracking`` then use them). Tasks with a haystack of their own (needles, lists)
    ignore it."""
    if haystack == RULER_HAYSTACK:
        return essay_words() if TASKS[task].haystack == "essay" else "noise"
    if haystack == "noise":
        return haystack
    if isinstance(haystack, str):
        raise ValueError(f"haystack {haystack!r}: {RULER_HAYSTACK!r}, 'noise' or a list of prose texts "
                         "(attngeom.data.corpora.read_texts reads a file)")
    words = prose_words(haystack)
    if not words:
        raise ValueError("the prose haystack has no words")
    return words


def haystack_text(haystack, size: int, needles: Sequence[str], rng: random.Random) -> str:
    """The haystack of ``size`` units with the ``needles`` inserted in their order.

    - ``haystack="noise"``: ``size`` sentences of :data:`NOISE`, five to a line, lines joined by
      ``"\\n"`` (RULER repeats the whole line; a last short line lets lengths be met to a few
      tokens); each needle is a line of its own at a uniformly random line boundary, as in RULER.
    - prose (a tuple of words, :func:`prose_words`): the first ``size`` words (the corpus repeated
      if short), cut into sentences after ``.``, ``!`` or ``?``; the needles go between sentences
      at depths drawn from :data:`DEPTHS` without replacement, as RULER's essay haystack
      (whose sentences nltk cuts). Sentences and needles are joined by a space.

    The random draws do not depend on ``size``, so a larger size only adds text.
    """
    if isinstance(haystack, str):
        sentences = [NOISE_SENTENCES[i % 5] for i in range(size)]
        pieces = [" ".join(sentences[i:i + 5]) for i in range(0, size, 5)]
        positions = [min(int(rng.random() * (len(pieces) + 1)), len(pieces)) for _ in needles]
        joiner = "\n"
    else:
        words = (haystack * (size // max(len(haystack), 1) + 1))[:size]
        pieces = [p for p in re.split(r"(?<=[.!?])\s+", " ".join(words)) if p]
        depths = rng.sample(DEPTHS, len(needles)) if len(needles) <= len(DEPTHS) else [rng.choice(DEPTHS) for _ in needles]
        positions = [int(len(pieces) * d / 100) for d in depths]
        joiner = " "
    for pos, needle in reversed(list(zip(sorted(positions), needles))):   # the last first: ties keep their order
        pieces.insert(pos, needle)
    return joiner.join(pieces)


def _random_value(rng: random.Random, kind: str) -> str:
    """A needle key or value: ``numbers`` (7 digits), ``words`` (adjective-noun) or ``uuids``."""
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return rng.choice(KEY_WORDS)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}: numbers, words or uuids")


def _distinct(rng: random.Random, kind: str, n: int, taken: set[str]) -> list[str]:
    """``n`` new values of ``kind``, none in ``taken`` (which they are added to)."""
    out = []
    while len(out) < n:
        v = _random_value(rng, kind)
        if v not in taken:
            taken.add(v)
            out.append(v)
    return out


# ---------------------------------------------------------------------------------------------
# needle in a haystack
# ---------------------------------------------------------------------------------------------


def _niah(rng, size, haystack, *, num_keys=1, num_values=1, num_queries=1, key_type="words", value_type="numbers") -> Prompt:
    """RULER's ``niah`` generator: ``max(num_keys, num_queries)`` keys, ``num_values`` values each,
    every (key, value) one needle, needles shuffled; ``num_queries`` keys asked, the answers are
    all their values. Keys and values are distinct, so each needle occurs once. With one asked
    value the template is RULER's singular form ("A special magic number is hidden ...")."""
    num_keys = max(num_keys, num_queries)
    taken: set[str] = set()
    keys = _distinct(rng, key_type, num_keys, taken)
    values = [_distinct(rng, value_type, num_values, taken) for _ in keys]
    needles = [NEEDLE.format(type_v=value_type, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = rng.sample(range(num_keys), num_queries)
    queries = [keys[i] for i in asked]
    answers = tuple(v for i in asked for v in values[i])
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    if len(answers) == 1:
        t = value_type[:-1]
        preamble = f"A special magic {t} is hidden within the following text. Make sure to memorize it. I will quiz you about the {t} afterwards."
        question = f"\nWhat is the special magic {t} for {query} mentioned in the provided text?"
        prefix = f" The special magic {t} for {query} mentioned in the provided text is"
    else:
        t = value_type
        preamble = f"Some special magic {t} are hidden within the following text. Make sure to memorize it. I will quiz you about the {t} afterwards."
        question = f"\nWhat are all the special magic {t} for {query} mentioned in the provided text?"
        prefix = f" The special magic {t} for {query} mentioned in the provided text are"
    if haystack == NEEDLE_HAYSTACK:
        text = needle_haystack_text(size, needles, rng, key_type, value_type, taken)
    else:
        text = haystack_text(haystack, size, needles, rng)
    context = preamble + "\n" + text
    return context, question, prefix, answers


NEEDLE_HAYSTACK = "needle"
"""The haystack of RULER's ``niah_multikey_2`` and ``niah_multikey_3``: other needles."""


def needle_haystack_text(size: int, needles: Sequence[str], rng: random.Random, key_type: str, value_type: str,
                         taken: set[str]) -> str:
    """RULER's ``needle`` haystack: ``size`` distractor needles (:data:`NEEDLE` with keys of
    ``key_type`` and values of ``value_type``, none equal to a key or value already ``taken``, so
    the asked key occurs once), one a line, with the ``needles`` inserted at uniformly random line
    boundaries. The distractors come from a generator of their own, seeded by one draw of ``rng``:
    a larger size only adds distractors after the others (the size search of :func:`make_examples`
    needs that)."""
    own = random.Random(rng.getrandbits(64))
    lines = []
    for _ in range(size):
        key = _distinct(own, key_type, 1, taken)[0]
        lines.append(NEEDLE.format(type_v=value_type, key=key, value=_distinct(own, value_type, 1, taken)[0]))
    positions = [min(int(rng.random() * (size + 1)), size) for _ in needles]
    for pos, needle in reversed(list(zip(sorted(positions), needles))):   # the last first: ties keep their order
        lines.insert(pos, needle)
    return "\n".join(lines)


def niah_single(rng, size, haystack, length, *, key_type="words", value_type="numbers") -> Prompt:
    """One needle, one key asked (RULER's ``niah_single_1`` with the noise haystack, ``niah_single_2``
    with the essays: the tasks ``niah_single`` and ``niah_single_2``): keys are adjective-noun
    words, values 7-digit numbers by default; ``value_type="uuids"`` is ``niah_single_3``."""
    return _niah(rng, size, haystack, key_type=key_type, value_type=value_type)


def niah_multikey(rng, size, haystack, length, *, num_keys=4, key_type="words", value_type="numbers") -> Prompt:
    """``num_keys`` needles with different keys (RULER's ``niah_multikey_1``: 4), one key asked: the
    other needles are distractors."""
    return _niah(rng, size, haystack, num_keys=num_keys, key_type=key_type, value_type=value_type)


def niah_single_3(rng, size, haystack, length, *, key_type="words", value_type="uuids") -> Prompt:
    """RULER's ``niah_single_3``: one needle whose value is a UUID, in the essays (with the noise
    haystack it is the UUID variant of ``niah_single``)."""
    return _niah(rng, size, haystack, key_type=key_type, value_type=value_type)


def niah_multikey_2(rng, size, haystack, length, *, key_type="words", value_type="numbers") -> Prompt:
    """RULER's ``niah_multikey_2``: one needle in a haystack of other needles (:data:`NEEDLE_HAYSTACK`,
    whatever ``haystack`` is given): every line is a key and its number, one key asked."""
    return _niah(rng, size, NEEDLE_HAYSTACK, key_type=key_type, value_type=value_type)


def niah_multikey_3(rng, size, haystack, length, *, key_type="uuids", value_type="uuids") -> Prompt:
    """RULER's ``niah_multikey_3``: :func:`niah_multikey_2` with UUID keys and values."""
    return _niah(rng, size, NEEDLE_HAYSTACK, key_type=key_type, value_type=value_type)


def niah_multivalue(rng, size, haystack, length, *, num_values=4, key_type="words", value_type="numbers") -> Prompt:
    """One key with ``num_values`` values (RULER: 4), each its own needle; all must be returned."""
    return _niah(rng, size, haystack, num_values=num_values, key_type=key_type, value_type=value_type)


def niah_multiquery(rng, size, haystack, length, *, num_queries=4, key_type="words", value_type="numbers") -> Prompt:
    """``num_queries`` keys (RULER: 4), all asked at once ("for a, b, c, and d"); the answers are
    their values."""
    return _niah(rng, size, haystack, num_queries=num_queries, key_type=key_type, value_type=value_type)


# ---------------------------------------------------------------------------------------------
# variable tracking
# ---------------------------------------------------------------------------------------------


def _interleave(rng: random.Random, chains: list[list[str]]) -> list[str]:
    """The chains' lines merged in a random order that keeps each chain's own order."""
    heads = [list(c) for c in chains]
    out = []
    while any(heads):
        chain = rng.choice([c for c in heads if c])
        out.append(chain.pop(0))
    return out


def _vt_prompt(rng, size, haystack, num_chains, num_hops, name_length) -> Prompt:
    """One variable-tracking prompt: ``num_chains`` chains ``VAR A = 12345``, ``VAR B = VAR A``, ...
    of ``num_hops`` hops each (distinct names of ``name_length`` capital letters, distinct 5-digit
    values), hidden in the haystack; the first chain's value is asked."""
    taken: set[str] = set()
    names = []
    while len(names) < num_chains * (num_hops + 1):
        v = "".join(rng.choices(string.ascii_uppercase, k=name_length))
        if v not in taken:
            taken.add(v)
            names.append(v)
    values = rng.sample(range(10000, 100000), num_chains)
    chains = []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        lines = [f"VAR {vs[0]} = {values[c]}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(num_hops)]
        chains.append(lines if isinstance(haystack, str) else [line.strip() + "." for line in lines])
    text = haystack_text(haystack, size, _interleave(rng, chains), rng).replace(". \n", ".\n")
    value = values[0]
    context = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n" + text
    question = f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
    prefix = (f" Answer: According to the chain(s) of variable assignment in the text above, {num_hops + 1} "
              f"variables are assigned the value {value}, they are: ")
    return context, question, prefix, tuple(names[:num_hops + 1])


def variable_tracking(rng, size, haystack, length, *, num_chains=1, num_hops=4, fewshot=True) -> Prompt:
    """RULER's ``vt``: ``num_chains`` chains (1) of ``num_hops`` hops (4) in the haystack; the answers
    are the chain's ``num_hops + 1`` variables. Hop lines keep RULER's trailing space
    (``"VAR B = VAR A "``); in prose each line is a sentence ending in ``.``.

    RULER puts one solved example first (3-letter names; its answer follows the prefix after a
    space, then ``"\\n"``), sized to 500 tokens; here its haystack has ``min(80, length // 40)``
    noise sentences (80 sentences is about RULER's 500 tokens) or ``min(300, length // 30)`` prose
    words, so short targets still fit. ``fewshot=False`` leaves it out.
    """
    shot = ""
    if fewshot:
        shot_size = min(80, length // 40) if isinstance(haystack, str) else min(300, length // 30)
        c, q, p, a = _vt_prompt(rng, shot_size, haystack, num_chains, num_hops, name_length=3)
        shot = c + q + p + " " + " ".join(a) + "\n"
    context, question, prefix, answers = _vt_prompt(rng, size, haystack, num_chains, num_hops, name_length=5)
    return shot + context, question, prefix, answers


# ---------------------------------------------------------------------------------------------
# aggregation: common words (cwe) and frequent words (fwe)
# ---------------------------------------------------------------------------------------------

_CWE_PREAMBLE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                 "Memorize the ones that appear most often.\n")


def _cwe_list(rng, vocab, num_words, freq_cw, freq_ucw, num_cw, extend=True) -> tuple[str, tuple[str, ...]]:
    """A numbered list ("1. w 2. w ...") of ``num_words`` distinct words, the first ``num_cw`` of
    them ``freq_cw`` times each, the others ``freq_ucw`` times, shuffled; and the common words.
    The words are a shuffle of ``vocab``, continued (``extend``) by random :data:`KEY_WORDS`
    pairs when more are needed, so one more word only adds entries."""
    if num_words > len(vocab) and not extend:
        raise ValueError(f"common_words needs {num_words} distinct words but the vocabulary has {len(vocab)}")
    chosen = list(vocab)
    rng.shuffle(chosen)
    taken = set(chosen)
    while len(chosen) < num_words:
        w = rng.choice(KEY_WORDS)
        if w not in taken:
            taken.add(w)
            chosen.append(w)
    chosen = chosen[:num_words]
    common = tuple(chosen[:num_cw])
    entries = list(common) * freq_cw + chosen[num_cw:] * freq_ucw
    rng.shuffle(entries)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries)), common


def common_words(rng, size, haystack, length, *, num_cw=10, freq_cw=None, freq_ucw=None, num_fewshot=1, words=None) -> Prompt:
    """RULER's ``cwe``: a numbered list of ``size`` distinct words, ``num_cw`` (10) of them common;
    the answers are the common words. RULER's repeats depend on the length: below 4096 tokens
    common words appear 6 times and the others once, with a solved example of 20 words (3 and 1
    times); from 4096, 30 and 3 times, the example 40 words (10 and 3). The haystack argument is
    not used (the list is the haystack). The words are the built-in :data:`WORDS`; past their
    number (about 750, reached near 16k tokens) the list goes on with adjective-noun pairs of
    :data:`KEY_WORDS` (RULER switches to a larger English word list there). ``words`` replaces
    them (and is not extended).
    """
    short = length < 4096
    freq_cw = freq_cw if freq_cw is not None else (6 if short else 30)
    freq_ucw = freq_ucw if freq_ucw is not None else (1 if short else 3)
    shot_words, shot_cw, shot_ucw = (20, 3, 1) if short else (40, 10, 3)
    vocab = tuple(words) if words is not None else WORDS
    extend = words is None
    question = f"\nQuestion: What are the {num_cw} most common words in the above list?"
    prefix = f" Answer: The top {num_cw} words that appear most often in the list are:"
    shots = []
    for _ in range(num_fewshot):
        text, common = _cwe_list(rng, vocab, shot_words, shot_cw, shot_ucw, num_cw, extend)
        shots.append(_CWE_PREAMBLE + text + question + prefix + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(common)))
    text, common = _cwe_list(rng, vocab, size, freq_cw, freq_ucw, num_cw, extend)
    return "\n".join(shots) + "\n" + _CWE_PREAMBLE + text, question, prefix, common


def _zeta(alpha: float) -> float:
    """Riemann zeta of ``alpha > 1`` (a partial sum and its Euler-Maclaurin tail; error < 1e-12)."""
    n = 1000
    return sum(k ** -alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + n ** -alpha / 2 + alpha * n ** (-alpha - 1) / 12


def frequent_words(rng, size, haystack, length, *, alpha=2.0, coded_wordlen=6, vocab_size=None, pad=0) -> Prompt:
    """RULER's ``fwe``: ``vocab_size`` coded words (random strings of ``coded_wordlen`` lowercase
    letters; RULER's default ``length // 50``, at least 4 here) ranked in a random order; the word of
    rank ``k`` appears ``int(size * k**-alpha / zeta(alpha))`` times (Zipf, ``alpha`` 2), shuffled.
    Rank 1 is ``"..."`` (noise, which the question says to ignore); the answers are ranks 2-4. The
    haystack argument is not used.

    One more unit of ``size`` can add several coded words at once (tens of tokens), so
    :func:`make_examples` then tops the text up with ``pad`` extra ``"..."`` words (one token or
    so each) to meet the length; only the noise word's count grows. (RULER steps by
    ``max_seq_length // 32`` words and accepts the shortfall.)
    """
    vocab_size = vocab_size if vocab_size is not None else max(4, length // 50)
    vocab = _distinct_coded(rng, vocab_size, coded_wordlen)
    vocab[0] = "..."
    z = _zeta(alpha)
    text = [w for k, w in enumerate(vocab, 1) for _ in range(int(size * k ** -alpha / z))] + ["..."] * pad
    rng.shuffle(text)
    context = ("Read the following coded text and track the frequency of each coded word. "
               "Find the three most frequently appeared coded words. " + " ".join(text))
    question = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appeared words in the above coded text?")
    prefix = " Answer: According to the coded text above, the three most frequently appeared words are:"
    return context, question, prefix, tuple(vocab[1:4])


def _distinct_coded(rng, n, length) -> list[str]:
    """``n`` distinct random lowercase strings of ``length`` letters, in a random order."""
    taken: set[str] = set()
    out = []
    while len(out) < n:
        w = "".join(rng.choices(string.ascii_lowercase, k=length))
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


TASKS: dict[str, TaskSpec] = {
    "niah_single": TaskSpec("niah_single", niah_single, 128),
    "niah_multikey": TaskSpec("niah_multikey", niah_multikey, 128, haystack="essay"),
    "niah_multivalue": TaskSpec("niah_multivalue", niah_multivalue, 128, haystack="essay"),
    "niah_multiquery": TaskSpec("niah_multiquery", niah_multiquery, 128, haystack="essay"),
    "niah_single_2": TaskSpec("niah_single_2", niah_single, 128, haystack="essay"),
    "niah_single_3": TaskSpec("niah_single_3", niah_single_3, 128, haystack="essay"),
    "niah_multikey_2": TaskSpec("niah_multikey_2", niah_multikey_2, 128, slack=64, haystack="needle"),
    "niah_multikey_3": TaskSpec("niah_multikey_3", niah_multikey_3, 128, slack=128, haystack="needle"),
    "variable_tracking": TaskSpec("variable_tracking", variable_tracking, 30),
    "common_words": TaskSpec("common_words", common_words, 120, min_size=10, haystack="none"),
    "frequent_words": TaskSpec("frequent_words", frequent_words, 50, min_size=100, refine="pad", haystack="none"),
}
"""The task families by name, each with RULER's haystack (``scripts/synthetic.yaml``: the essays
for ``niah_single_2``/``_3``, ``niah_multikey`` (RULER's ``niah_multikey_1``), ``niah_multivalue``
and ``niah_multiquery``; the noise for ``niah_single`` (``niah_single_1``) and
``variable_tracking``). ``max_new_tokens`` is RULER's ``tokens_to_generate`` (niah 128, vt 30,
cwe 120, fwe 50); all score by ``string_match_all`` (:func:`string_match_all`)."""


# ---------------------------------------------------------------------------------------------
# sizes in tokens
# ---------------------------------------------------------------------------------------------


def tolerance(length: int) -> int:
    """How far below ``length`` an example may fall: ``max(16, ceil(2 % of length))`` tokens."""
    return max(16, math.ceil(0.02 * length))


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` with the tokenizer's special tokens (BOS), without a chat template."""
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


def _largest(build: Callable[[int], tuple[Prompt, int]], lo: int, length: int) -> tuple[int, tuple[Prompt, int]]:
    """The largest ``x >= lo`` with ``build(x)`` at most ``length`` tokens (doubling, then binary
    search), given that ``build(lo)`` is; and that build's result."""
    best = build(lo)
    hi = max(2 * lo, lo + 8)
    while (trial := build(hi))[1] <= length:
        lo, best, hi = hi, trial, 2 * hi
    while hi - lo > 1:                        # tokens(lo) <= length < tokens(hi)
        mid = (lo + hi) // 2
        trial = build(mid)
        if trial[1] <= length:
            lo, best = mid, trial
        else:
            hi = mid
    return lo, best


def _fit(tokenizer, spec: TaskSpec, rng_seed: str, length: int, haystack, options: dict) -> tuple[Prompt, int]:
    """The prompt of the largest haystack size whose tokens are at most ``length`` (as RULER's
    binary search), then of the largest ``spec.refine`` option if the task has one; and its token
    count. Raises ValueError when even ``spec.min_size`` is too long."""
    def build(size, at=length, **extra):
        prompt = spec.generate(random.Random(rng_seed), size, haystack, at, **options, **extra)
        return prompt, count_tokens(tokenizer, "".join(prompt[:3]))

    smallest = build(spec.min_size)
    if smallest[1] > length:
        need = smallest[1]             # a prompt that grows with the length asked (variable_tracking's few-shot
        for _ in range(64):            # example) needs more at its own count: follow it to where it fits
            if (more := build(spec.min_size, at=need)[1]) <= need:
                break
            need = more
        raise ValueError(f"{spec.name}: {length} tokens is too short; its smallest prompt has {need}")
    size, best = _largest(build, spec.min_size, length)
    if spec.refine and spec.refine not in options:
        best = _largest(lambda x: build(size, **{spec.refine: x}), 0, length)[1]
    return best


def make_examples(tokenizer, task: str, length: int, n: int, seed: int = 0, haystack=RULER_HAYSTACK, first: int = 0,
                  **task_options) -> list[Example]:
    """``n`` examples of ``task`` (a key of :data:`TASKS`), numbered ``first .. first + n - 1``,
    whose prompt (context + question + answer prefix, plain text, BOS included, no chat template)
    has at most ``length`` tokens of ``tokenizer`` and at least ``length - tolerance(length)``
    (less the task's ``slack``: :data:`TASKS`).

    ``haystack`` is :data:`RULER_HAYSTACK` (RULER's: the shipped essays for the essay tasks, the
    noise for the others), ``"noise"`` or a list of prose texts (e.g.
    ``attngeom.data.corpora.read_texts``; used by the niah tasks and variable_tracking):
    :func:`task_haystack`. ``task_options`` go to the task's generator
    (e.g. ``num_keys=8``, ``value_type="uuids"``, ``num_hops=2``). Example ``i`` depends only on
    ``(task, seed, i)``, the options, the haystack and the tokenizer.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; one of {', '.join(TASKS)}")
    spec = TASKS[task]
    hay = task_haystack(task, haystack)
    out = []
    for index in range(first, first + n):
        (context, question, prefix, answers), tokens = _fit(tokenizer, spec, f"ruler:{task}:{seed}:{index}", length, hay, task_options)
        if tokens < length - tolerance(length) - spec.slack:
            raise RuntimeError(f"{task}: {tokens} tokens, more than {tolerance(length) + spec.slack} below {length}")
        out.append(Example(task, index, seed, context, question, prefix, tuple(answers), spec.max_new_tokens, tokens))
    return out


# ---------------------------------------------------------------------------------------------
# encoding, with or without a chat template
# ---------------------------------------------------------------------------------------------


def encode_example(example: Example, tokenizer, chat: bool | None = None) -> tuple[list[int], list[int], bool]:
    """``(context_ids, question_ids, chat_applied)``: the prompt's token ids split where the question
    begins (question_ids hold the question, the answer prefix and whatever the template puts
    between), and whether a chat template was applied.

    ``chat=None`` applies the template when ``tokenizer.chat_template`` is set. With it, the user
    message is ``context + question``, rendered with ``add_generation_prompt=True`` and the answer
    prefix appended after the assistant header (as RULER does); the rendered string is tokenized
    without adding special tokens (the template writes them). Without it, the text is
    ``context + question + answer_prefix`` with the tokenizer's special tokens (BOS). The split is
    found by character offsets (a fast tokenizer is needed): the first token starting at or after
    the question's first character. The question begins with ``"\\n"``, which the usual
    pre-tokenizers cut before; a token that straddles the boundary raises ValueError.
    ``context_ids + question_ids`` is always the tokenization of the whole rendered prompt.
    """
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    user = example.context + example.question
    if chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
        start = rendered.rfind(user)
        if start < 0:
            raise ValueError("the chat template changed the user message; the question cannot be located")
        text, q_start = rendered + example.answer_prefix, start + len(example.context)
    else:
        text, q_start = user + example.answer_prefix, len(example.context)
    enc = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    if any(s < q_start < e for s, e in offsets):
        raise ValueError("a token straddles the start of the question; the context cannot be split from it")
    split = next((i for i, (s, e) in enumerate(offsets) if s >= q_start and e > s), len(ids))
    return ids[:split], ids[split:], chat


# ---------------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------------


def postprocess(prediction: str) -> str:
    """RULER's postprocessing of a prediction: control characters become newlines, ends stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all`` for one prediction: the share of ``answers`` found in it as
    substrings, case-insensitive, in [0, 1] (RULER reports the mean times 100)."""
    p = postprocess(prediction).lower()
    return sum(a.lower() in p for a in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_part`` (its QA tasks): 1.0 when any of ``answers`` is found, else 0.0."""
    p = postprocess(prediction).lower()
    return float(any(a.lower() in p for a in answers))


# ---------------------------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------------------------


def write_jsonl(examples: Iterable[Example], path) -> Path:
    """Write one JSON object per example (every field; ``answers`` as a list) to ``path``."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(dataclasses.asdict(ex), ensure_ascii=False) + "\n")
    return path


def read_jsonl(path) -> list[Example]:
    """The examples :func:`write_jsonl` wrote; anything else is one
    :class:`~attngeom.errors.InputError` naming the file and line (a missing field, a field of
    another type, a line that is not a JSON object, or what :func:`attngeom.kvcache.examples.check_examples`
    refuses: a field out of range, an example given twice, ...)."""
    from attngeom.data.corpora import input_path, json_object, utf8_text
    from attngeom.errors import InputError
    from attngeom.kvcache.examples import check_examples

    path = input_path(path, "examples file")
    if path.is_dir():
        raise InputError(f"{path}: an examples file is a JSONL file, not a folder")
    types = {f.name: f.type for f in dataclasses.fields(Example)}
    out, wheres = [], []
    for k, line in enumerate(utf8_text(path.read_bytes(), str(path)).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{k}"
        obj = json_object(line, where)
        missing = [n for n in types if n not in obj]
        if missing:
            raise InputError(f"{where}: an example needs the fields {', '.join(missing)}")
        for n, t in types.items():
            v = obj[n]
            ok = isinstance(v, list) and all(isinstance(a, str) for a in v) if n == "answers" else \
                isinstance(v, int) and not isinstance(v, bool) if t in ("int", int) else isinstance(v, str)
            if not ok:
                raise InputError(f"{where}: field {n!r} must be " + ("a list of strings" if n == "answers" else
                                                                      "a whole number" if t in ("int", int) else "a string"))
        out.append(Example(**{n: obj[n] for n in types} | {"answers": tuple(obj["answers"])}))
        wheres.append(where)
    if not out:
        raise InputError(f"{path}: no examples")
    check_examples(out, wheres)                      # ranges, contents, each (task, index) once
    return out
