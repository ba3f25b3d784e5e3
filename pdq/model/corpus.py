"""Deterministic training text for the built-in tokenizer.

The text is English-like prose, numbers, punctuation and code-like lines, generated from a
fixed word list, a seeded pseudo-word lexicon and a seeded ``random.Random``. The same seed
gives the same text on every machine and Python version (only ``random.Random`` methods whose
output is stable across versions are used: ``random``, ``randrange``, ``choice``).
"""

from __future__ import annotations

import random

WORDS = """
the of and to in is was he for it with as his on be at by had are but from or have an they
which one you were all her she there would their we him been has when who will no more if out
so up said what its about than into them can only other time new some could these two may
first then do any like my now over such our man me even most made after also did many off
before must well back through years much where your way down should because long each just
state people those too how little good world very make still own see men work here between
both life being under never day same another know while last us might great old year come
since against go came right used take three house use during without again place around
however home small found thought went say part once general high upon school every does
system number water request token batch queue model worker cache server client stream
tenant prefill decode latency deadline priority memory layer tensor vector string value
data field message error status result record signal engine network service metric trace
""".split()

ACCENTED = "café naïve über façade jalapeño résumé smörgåsbord coöperate señor déjà vu".split()
OTHER_SCRIPTS = ["日本語のテキスト", "中文文本", "русский текст", "ελληνικά", "한국어", "🙂👍🚀", "∑∫√≈≠"]

_CONSONANTS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl pr sh st th tr".split()
_VOWELS = "a e i o u ai ea ee io oo ou".split()
_PUNCT_END = [".", ".", ".", "!", "?"]
_KEYWORDS = ["def", "return", "if", "else", "for", "while", "class", "import", "from", "None"]
_OPS = ["+", "-", "*", "/", "==", "!=", "<=", ">=", "and", "or"]


def _pseudo_word(rng: random.Random) -> str:
    syllables = 1 + rng.randrange(3)
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))


def _zipf_weights(n: int) -> list[float]:
    return [1.0 / (rank + 1) for rank in range(n)]


def _number(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return str(1900 + rng.randrange(130))
    if kind == 1:
        return f"{rng.randrange(1000)}.{rng.randrange(100):02d}"
    if kind == 2:
        return f"{rng.randrange(24):02d}:{rng.randrange(60):02d}"
    if kind == 3:
        return f"{rng.randrange(100)}%"
    return str(rng.randrange(10 ** (1 + rng.randrange(6))))


def _sentence(rng: random.Random, lexicon: list[str], weights: list[float]) -> str:
    n = 4 + rng.randrange(14)
    words = rng.choices(lexicon, weights=weights, k=n)
    for i in range(n):
        r = rng.random()
        if r < 0.05:
            words[i] = _number(rng)
        elif r < 0.07:
            words[i] = rng.choice(ACCENTED)
        elif r < 0.10:
            words[i] += ","
        elif r < 0.11:
            words[i] = f'"{words[i]}"'
        elif r < 0.12:
            words[i] = f"({words[i]})"
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(_PUNCT_END)


def _code_block(rng: random.Random, lexicon: list[str]) -> str:
    def ident() -> str:
        return "_".join(rng.choice(lexicon) for _ in range(1 + rng.randrange(2)))

    name, a, b = ident(), ident(), ident()
    kind = rng.randrange(3)
    if kind == 0:
        return (
            f"def {name}({a}, {b}={_number(rng)}):\n"
            f"    if {a} {rng.choice(_OPS)} {b}:\n"
            f"        return {a}[{rng.randrange(10)}]\n"
            f"    return {rng.choice(_KEYWORDS)}\n"
        )
    if kind == 1:
        return f'{{"{a}": {_number(rng)}, "{b}": "{ident()}", "{name}": [{_number(rng)}, null]}}\n'
    return f"for (int {a} = 0; {a} < {b}.size(); ++{a}) {{ {name}[{a}] += {_number(rng)}; }}\n"


def builtin_corpus(seed: int = 0, n_paragraphs: int = 2500) -> list[str]:
    """Return the training text as a list of paragraphs (a few hundred KB in total)."""
    rng = random.Random(seed)
    lexicon = WORDS + sorted({_pseudo_word(rng) for _ in range(1500)})
    weights = _zipf_weights(len(lexicon))
    paragraphs = []
    for _ in range(n_paragraphs):
        r = rng.random()
        if r < 0.15:
            paragraphs.append(_code_block(rng, lexicon))
        elif r < 0.17:
            paragraphs.append(" ".join(rng.choices(OTHER_SCRIPTS, k=3)))
        else:
            sentences = (_sentence(rng, lexicon, weights) for _ in range(1 + rng.randrange(5)))
            paragraphs.append(" ".join(sentences) + "\n")
    return paragraphs
