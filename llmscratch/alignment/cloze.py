"""The Moby-Dick cloze set (which of four sentences truly comes next?), built from the held-out text.

Everything comes from the held-out tenth of the novel, the text that pretraining validates on
(``llmscratch.text.data.held_out_moby_dick``), so no item was seen in training. The text is cut
into paragraphs (blank lines) and each paragraph into sentences by one rule: a sentence ends
at . ! or ? (and any closing quotes or bracket) followed by whitespace and a capital letter or an
opening quote; "Mr." "Mrs." "Dr." "St." "Capt." end no sentence. Whitespace inside a sentence
becomes one space. Chapter headings and the paragraph cut in two by the split are left out.

An item is a sentence of 30 to 300 characters that has at least two sentences before it in
its paragraph. Its context is the three sentences before it, or two when three would pass 500
characters (else the item is skipped). Its choices are the true sentence and three distractors
from other paragraphs of the held-out tenth. Distractors are sentences of the same kind (at least
the third of their paragraph, at least 20 characters), so that none is likelier text by itself;
and of nearly the same length (within 15%, at least 5 characters), the true sentence's rank by
length drawn uniformly, so that length tells nothing. The true sentence's position is drawn
uniformly. No sentence that also occurs in the first 90% is used. The same seed gives the same items.

``make_items`` builds the set; ch06-alignment/make_cloze_data.py writes it (llmscratch/assets/moby_cloze.json),
and the report card (``llmscratch.alignment.report``) scores models on it.
"""

import random
import re

# A sentence end: the mark and any closing quotes or bracket, then whitespace before a capital
# (or an opening quote or bracket and a capital). "sir!” said he" goes on: a lower-case word follows.
SENTENCE_END = re.compile(r"([.!?][”’)]*)\s+(?=[“‘(]?[A-Z])")
ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.", "Capt.")  # a capital after these starts no sentence
MIN_CHARS, MAX_CHARS = 30, 300  # the length of a true sentence
MIN_DISTRACTOR_CHARS = 20  # shorter ones are mostly exclamations ("Aye, aye, sir!")
MAX_CONTEXT_CHARS = 500
N_CHOICES = 4
LENGTH_TOLERANCE = 0.15  # a distractor's length is within 15% of the true sentence's (and 5 characters)


def split_sentences(paragraph: str) -> list[str]:
    """The sentences of one paragraph (whitespace already made single spaces), by the rule above."""
    sentences: list[str] = []
    for piece in SENTENCE_END.sub("\\1\0", paragraph).split("\0"):
        if sentences and sentences[-1].endswith(ABBREVIATIONS):
            sentences[-1] += " " + piece  # "Mr. Starbuck": the title belongs to the sentence it starts
        else:
            sentences.append(piece)
    return sentences


def paragraphs(text: str) -> list[list[str]]:
    """The sentences of each paragraph of ``text``, without chapter headings and the first (cut) paragraph."""
    blocks = [" ".join(block.split()) for block in re.split(r"\n\s*\n", text)]
    return [split_sentences(block) for block in blocks[1:] if block and not block.startswith("CHAPTER")]


def context_of(sentences: list[str], index: int) -> str | None:
    """The three sentences before sentence ``index`` (two if three pass MAX_CONTEXT_CHARS), or None."""
    for count in (3, 2):
        if index >= count:
            context = " ".join(sentences[index - count : index])
            if len(context) <= MAX_CONTEXT_CHARS:
                return context
    return None


def make_items(held_out: str, training: str, seed: int = 0) -> list[dict]:
    """The cloze items of ``held_out``: {"context", "choices", "answer", "paragraph"}; ``training`` is
    the rest of the text, whose sentences are not used."""
    rng = random.Random(seed)
    seen_in_training = " ".join(training.split())
    blocks = paragraphs(held_out)
    # The distractor pool: (length, paragraph, sentence) of every sentence long enough.
    pool = [(len(s), p, s) for p, block in enumerate(blocks) for s in block[2:]
            if len(s) >= MIN_DISTRACTOR_CHARS and s not in seen_in_training]
    items = []
    for p, block in enumerate(blocks):
        for index, sentence in enumerate(block):
            context = context_of(block, index)
            if context is None or not MIN_CHARS <= len(sentence) <= MAX_CHARS or sentence in seen_in_training:
                continue
            choices = distractors(sentence, [(n, s) for n, q, s in pool if q != p], rng)
            answer = rng.randrange(N_CHOICES)
            choices.insert(answer, sentence)
            items.append({"context": context, "choices": choices, "answer": answer, "paragraph": p})
    return items


def distractors(sentence: str, pool: list[tuple[int, str]], rng: random.Random) -> list[str]:
    """N_CHOICES - 1 sentences of ``pool`` ((length, text) pairs) of nearly the length of ``sentence``.

    The true sentence's rank by length among the choices is drawn uniformly: k shorter ones and
    the rest longer, each drawn from those within LENGTH_TOLERANCE (or the nearest k, where fewer
    are that close). Drawing all from a window around it would leave it in the middle (longest
    or shortest only 1 time in 8), a clue in itself.
    """
    n_shorter = rng.randrange(N_CHOICES)
    slack = max(5, LENGTH_TOLERANCE * len(sentence))
    chosen = []
    for count, side in ((n_shorter, [(len(sentence) - n, s) for n, s in pool if n < len(sentence)]),
                        (N_CHOICES - 1 - n_shorter, [(n - len(sentence), s) for n, s in pool if n > len(sentence)])):
        nearest = [s for _, s in sorted(set(side))]  # nearest first; the same text twice counts once
        if len(nearest) < count:
            raise ValueError(f"only {len(nearest)} sentences of the pool are on one side of {len(sentence)} characters")
        close = sum(distance <= slack for distance, _ in sorted(set(side)))
        chosen += rng.sample(nearest[: max(count, close)], count)
    rng.shuffle(chosen)
    return chosen
