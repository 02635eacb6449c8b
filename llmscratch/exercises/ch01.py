"""Chapter 1's exercises: tokenization, checked against ``llmscratch.text.tokenizer`` / ``llmscratch.text.data``.

Write it yourself: merging one pair, encoding with a merge table, training merges inside the
pre-split chunks, and cutting a token stream into (input, target) windows. Extend the package:
BPE-dropout (encoding with randomly skipped merges), adding special tokens to a trained
tokenizer, and the fixed sinusoidal position encodings of "Attention Is All You Need" as a
module that replaces ``GPT``'s learned position embedding.
"""

import copy
import warnings

import torch
from torch import nn

from llmscratch.exercises.ch01_references import bpe, merge, sinusoids, train_naively, windows
from llmscratch.exercises.checking import (Chapter, Mismatch, attempt, describe, diagnose, expect_close, expect_equal,
                                           fresh_generator, random_int)
from llmscratch.exercises.fixtures import build_module
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.text.tokenizer import ENDOFTEXT, GPT2_SPLIT_PATTERN, BPETokenizer

CHAPTER = Chapter("ch01", "Tokenization: from text to token ids")

WHOLE_TEXT = r"(?s).+"  # a split pattern that keeps the whole text in one chunk (no pre-splitting)
TRAINING_TEXT = (
    "The whale rose beside the ship, and the sailors watched the whale in silence.\n"
    "The whale dived; the ship turned; the sea was calm again.\n\n\n\n"
    "In 1851 the crew of the whaler counted 12 whales: 3 white, 9 grey!  Then the whale sang.\n"
    "A café, a naïve harpooneer, a 鲸 and a 🐳 (the 🐳 is a whale too)."
)


def _show(value: str | list, limit: int = 60) -> str:
    """A text (or list) as it is written in Python, cut short when long."""
    shown = repr(value)
    if len(shown) <= limit:
        return shown
    return f"{shown[:limit]}... ({len(value)} {'characters' if isinstance(value, str) else 'items'})"


def _random_text(generator: torch.Generator, length: int, alphabet: str = "ab c.\n") -> str:
    picks = torch.randint(len(alphabet), (length,), generator=generator)
    return "".join(alphabet[i] for i in picks.tolist())


def _excerpt(generator: torch.Generator, longest: int = 60) -> str:
    """A random stretch of TRAINING_TEXT, 1 to ``longest`` characters: words the small tokenizer has merges for."""
    length = random_int(generator, 1, longest)
    start = random_int(generator, 0, len(TRAINING_TEXT) - length)
    return TRAINING_TEXT[start:start + length]


def _tokenizer(pattern: str = GPT2_SPLIT_PATTERN, n_merges: int = 60) -> BPETokenizer:
    """A small tokenizer trained on TRAINING_TEXT, with ``<|endoftext|>`` as its special token."""
    return BPETokenizer.train(TRAINING_TEXT, 256 + n_merges + 1, pattern=pattern, special_tokens=[ENDOFTEXT])


def _train(text: str, n_merges: int, pattern: str) -> list[tuple[int, int]]:
    """The package's merges (fewer when the text runs out of pairs: no warning about it here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(BPETokenizer.train(text, 256 + n_merges, pattern=pattern).merges)


# --------------------------------------------------------------------------- write it yourself
@CHAPTER.exercise("merge_pair", title="Merge one pair everywhere", difficulty="warm-up",
                  section="3. Byte-pair encoding by hand", kind="write it yourself")
def check_merge_pair(answer) -> int:
    generator = torch.Generator().manual_seed(1)
    cases = [([], (1, 2), 256), ([5], (5, 6), 256), ([1, 2], (1, 2), 256), ([1, 2, 3], (1, 2), 256),
             ([3, 1, 2], (1, 2), 256), ([7, 7, 7], (7, 7), 300), ([7, 7, 7, 7, 7], (7, 7), 300),
             ([50255, 50256, 50255, 50256, 50256], (50255, 50256), 50257)]
    for source in [generator] * 4 + [fresh_generator()] * 3:  # the fresh ones: no table of the fixed cases holds them
        ids = torch.randint(4, (30,), generator=source).tolist()
        cases.append((ids, (ids[3], ids[4]), 256))
    for ids, pair, new_id in cases:
        case, given = f"merge_pair({ids}, {pair}, {new_id})", list(ids)
        got = attempt(answer, given, pair, new_id, case=case)
        expected = merge(ids, pair, new_id)
        first = next((i for i in range(len(ids) - 1) if (ids[i], ids[i + 1]) == pair), None)
        hint = diagnose(got, {
            "a for loop's `i += 1` does not skip the second id of a merged pair: use a while loop that steps "
            "by 2 after a merge": lambda: [new_id if tuple(ids[i:i + 2]) == pair else ids[i] for i in range(len(ids))],
            "the last id is lost when no merge uses it: the loop must run to the end of the list, not to len - 1":
                lambda: expected[:-1] if expected and expected[-1] != new_id else expected,
            "merge from left to right: in [7, 7, 7] the first two ids merge, giving [new_id, 7]":
                lambda: merge(ids[::-1], pair[::-1], new_id)[::-1],
            "replace every occurrence of the pair, not only the first":
                lambda: ids[:first] + [new_id] + ids[first + 2:],
        }, "walk left to right; where ids[i], ids[i + 1] is the pair, emit new_id and skip both")
        expect_equal(got, expected, case=case, hint=hint)
        expect_equal(given, ids, case=case + ", the list passed in, afterwards",
                     hint="build a new list: the list you were given must not change")
    return len(cases)


@CHAPTER.exercise("encode_with_merges", title="Encode with a merge table", difficulty="medium",
                  section="3. Byte-pair encoding by hand", kind="write it yourself",
                  forbidden=("llmscratch.text.tokenizer.BPETokenizer.encode_ordinary",
                             "llmscratch.text.tokenizer.BPETokenizer.encode"))
def check_encode_with_merges(answer) -> int:
    generator = torch.Generator().manual_seed(3)
    tiny = "the cat sat on the mat; the rat sat on the hat"
    tiny_merges = _train(tiny, 10, WHOLE_TEXT)
    cases = [("", tiny_merges), ("a", tiny_merges), ("aaaaa", [(97, 97), (256, 97)]), ("abb", [(97, 98), (98, 98)]),
             ("aaaab", [(97, 98), (97, 97)]), (tiny, tiny_merges),
             ("the café 🐳 of the whale", _train(TRAINING_TEXT, 40, WHOLE_TEXT))]
    cases += [(_random_text(generator, 80), _train(_random_text(generator, 300), 20, WHOLE_TEXT)) for _ in range(3)]
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(_random_text(fresh, random_int(fresh, 1, 80)),
               _train(_random_text(fresh, 300), random_int(fresh, 1, 20), WHOLE_TEXT)) for _ in range(2)]
    for text, merges in cases:
        case = f"encode_with_merges({_show(text)}, merges) with merges = {_show(merges, 80)}"
        got = attempt(answer, text, list(merges), case=case)
        expected = BPETokenizer(merges, pattern=WHOLE_TEXT).encode_ordinary(text)
        rank = {pair: new_id for new_id, pair in enumerate(merges, start=256)}
        data = list(text.encode("utf-8"))
        hint = diagnose(got, {
            "BPE works on UTF-8 bytes, not characters: start from list(text.encode('utf-8')), not ord(c)":
                lambda: bpe([ord(c) for c in text], rank),
            "you merged the most frequent pair of this text (that is training): encoding applies the merges in "
            "the order they were learned, merges[0] first": lambda: bpe(data, rank, order="frequency"),
            "you applied the last-learned merge first: merges[0] (id 256) comes first":
                lambda: bpe(data, rank, order="latest"),
            "merge from left to right: 'aaa' with the merge (a, a) makes [aa, a], not [a, aa]":
                lambda: bpe(data, rank, rightmost=True),
        }, "start from the UTF-8 bytes; then, for each merge in order, replace its pair everywhere by 256 + index")
        expect_equal(got, expected, case=case, hint=hint)
    return len(cases)


@CHAPTER.exercise("train_merges", title="Train BPE merges inside the pre-split chunks", difficulty="hard",
                  section="4. Pre-splitting, and training on a whole novel", kind="write it yourself",
                  forbidden=("llmscratch.text.tokenizer.BPETokenizer.train",))
def check_train_merges(answer) -> int:
    generator = torch.Generator().manual_seed(4)
    cases = [("", 3, GPT2_SPLIT_PATTERN), ("ab", 5, GPT2_SPLIT_PATTERN), ("aaaa", 3, GPT2_SPLIT_PATTERN),
             ("xy ab", 2, GPT2_SPLIT_PATTERN), ("the cat. the hat.\n\nthe mat", 10, GPT2_SPLIT_PATTERN),
             (TRAINING_TEXT, 30, GPT2_SPLIT_PATTERN), (TRAINING_TEXT, 20, r"\S+|\s+")]
    cases += [(_random_text(generator, 300), 25, GPT2_SPLIT_PATTERN) for _ in range(2)]
    fresh, patterns = fresh_generator(), (GPT2_SPLIT_PATTERN, r"\S+|\s+", WHOLE_TEXT)
    cases += [(_random_text(fresh, random_int(fresh, 1, 300)), random_int(fresh, 1, 25),
               patterns[random_int(fresh, 0, len(patterns) - 1)]) for _ in range(2)]
    for text, n_merges, pattern in cases:
        shown = "GPT2_SPLIT_PATTERN" if pattern == GPT2_SPLIT_PATTERN else repr(pattern)
        case = f"train_merges({_show(text)}, {n_merges}, pattern={shown})"
        got = attempt(answer, text, n_merges, pattern, case=case)
        expected = _train(text, n_merges, pattern)
        hint = diagnose(got, {
            "return the merges as tuples (left id, right id), e.g. [(97, 98)], not lists":
                lambda: [list(pair) for pair in expected],
            "you counted pairs across chunk boundaries: split with regex.findall(pattern, text) first, and count "
            "only pairs inside a chunk": lambda: train_naively(text, n_merges, WHOLE_TEXT, min),
            "ties between equally frequent pairs go to the pair seen first in your counts (Counter.most_common, "
            "max(counts, key=counts.get)): break them by the smaller pair, "
            "min(counts, key=lambda p: (-counts[p], p))":
                lambda: train_naively(text, n_merges, pattern, lambda tied: tied[0]),
            "ties go to the pair of smaller ids, not the larger": lambda: train_naively(text, n_merges, pattern, max),
        }, "each step: count the pairs inside every chunk, merge the most frequent (ties: the smaller pair) "
           "into id 256 + step everywhere; stop early when no pair is left")
        expect_equal(got, expected, case=case, hint=hint)
    return len(cases)


@CHAPTER.exercise("sliding_windows", title="Cut a token stream into (input, target) windows", difficulty="warm-up",
                  section="7. Sliding windows: from a token stream to training examples", kind="write it yourself",
                  forbidden=("llmscratch.text.data.SlidingWindowDataset",))
def check_sliding_windows(answer) -> int:
    generator = torch.Generator().manual_seed(7)
    cases = [([], 4, 4), ([1, 2, 3, 4], 4, 4), ([1, 2, 3, 4, 5], 4, 4), (list(range(6)), 1, 1),
             (list(range(11)), 4, 3), (list(range(10)), 3, 5), ([50256, 0, 50255, 50256, 1], 2, 2)]
    cases += [(torch.randint(50257, (n,), generator=generator).tolist(), 8, 5) for n in (29, 34)]
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    for _ in range(3):
        n, max_length, stride = (int(torch.randint(low, high, (1,), generator=fresh)) for low, high in
                                 [(2, 40), (1, 9), (1, 9)])
        cases.append((torch.randint(50257, (n,), generator=fresh).tolist(), max_length, stride))
    for ids, max_length, stride in cases:
        case = f"sliding_windows({_show(ids, 70)}, max_length={max_length}, stride={stride})"
        got = attempt(answer, list(ids), max_length, stride, case=case)
        inputs, targets = windows(ids, max_length, stride)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Mismatch(case, "a tuple (inputs, targets)", describe(got), "return the two tensors as a tuple")
        for name, part, expected in [("inputs", got[0], inputs), ("targets", got[1], targets)]:
            hint = diagnose(part, {
                "the targets are the inputs shifted by ONE token: window[1:], not the inputs themselves":
                    lambda: inputs,
                "the last window is missing: a window may start at any s with s + max_length + 1 <= len(ids)":
                    lambda: expected[:-1],
                "the next window starts `stride` tokens later, not max_length tokens later":
                    lambda: windows(ids, max_length, max_length)[name == "targets"],
            }, f"{name}: row k is ids[k * stride + {0 if name == 'inputs' else 1}:][:max_length], for every k whose "
               f"window (max_length + 1 tokens) fits")
            expect_equal(part, expected, case=f"{case}, the {name}", hint=hint)
    return len(cases)


# --------------------------------------------------------------------------- extend the package
def _expect_ids(got, vocab_size: int, case: str) -> None:
    """Mismatch unless ``got`` is a list of token ids that the tokenizer can decode."""
    if not (isinstance(got, list) and all(isinstance(i, int) and 0 <= i < vocab_size for i in got)):
        raise Mismatch(case, f"a list of ints in 0 .. {vocab_size - 1}", describe(got),
                       "return the ids as a list of Python ints (tokenizer ids, e.g. [464, 3290])")


def _check_dropout_edges(answer, tokenizer: BPETokenizer, texts: list[str]) -> int:
    """p = 0 is the tokenizer's own encoding, p = 1 the bytes, whatever the random numbers."""
    bytes_to_ids = {byte: token_id for token_id, byte in enumerate(tokenizer.byte_order)}
    for p in (1.0, 0.0):
        for text in texts:
            case = f"encode_with_dropout({tokenizer.name} tokenizer, {_show(text)}, p={p}, generator)"
            got = attempt(answer, tokenizer, text, p, torch.Generator().manual_seed(0), case=case)
            as_bytes = [bytes_to_ids[b] for b in text.encode("utf-8")]
            expected = as_bytes if p == 1 else tokenizer.encode_ordinary(text)
            hint = diagnose(got, {
                "p is the probability of SKIPPING a merge: p=0 is the tokenizer's own encoding, p=1 only bytes":
                    lambda: tokenizer.encode_ordinary(text) if p == 1 else as_bytes,
                "the id of byte b is not b: it is its position in tokenizer.byte_order (GPT-2 puts the printable "
                "bytes first)": lambda: list(text.encode("utf-8")),
                "you merged across the pre-split chunks: split with regex.findall(tokenizer.pattern, text) first, "
                "and merge inside each chunk": lambda: BPETokenizer(
                    list(tokenizer.merges), pattern=WHOLE_TEXT, byte_order=tokenizer.byte_order).encode_ordinary(text),
            }, "per chunk: start from the bytes' ids; each step, merge the lowest-id pair of those not skipped")
            expect_equal(got, expected, case=case, hint=hint)
    return 2 * len(texts)


def _check_dropout_random(answer, tokenizer: BPETokenizer, text: str, word: str) -> int:
    """0 < p < 1: always the same text back, reproducible from the generator, and many segmentations."""
    results = []
    for seed in range(12):
        case = f"encode_with_dropout({tokenizer.name} tokenizer, {_show(text)}, p=0.5, generator seeded {seed})"
        got = attempt(answer, tokenizer, text, 0.5, torch.Generator().manual_seed(seed), case=case)
        _expect_ids(got, tokenizer.vocab_size, case)
        expect_equal(tokenizer.decode(got), text, case=case + ", decoded",
                     hint="every merge you make must be one of tokenizer.merges, so that the ids decode to the text")
        again = attempt(answer, tokenizer, text, 0.5, torch.Generator().manual_seed(seed), case=case + ", again")
        expect_equal(again, got, case=case + ", run twice", hint="draw every random number from `generator` "
                     "(torch.rand(n, generator=generator)), so that the same seed gives the same ids")
        results.append(got)
    full, n_bytes = len(tokenizer.encode_ordinary(text)), len(text.encode("utf-8"))
    mean = sum(map(len, results)) / len(results)
    if not full < mean < n_bytes:
        raise Mismatch(f"{len(results)} seeds, p=0.5, {_show(text)}", f"between {full} and {n_bytes} ids on average",
                       f"{mean:.1f}", "half the merges skipped must give more ids than p=0, fewer than p=1")
    splits = {tuple(attempt(answer, tokenizer, word, 0.5, torch.Generator().manual_seed(s), case=word))
              for s in range(12)}
    if len(splits) < 3:
        raise Mismatch(f"encode_with_dropout({tokenizer.name} tokenizer, {word!r}, p=0.5) with 12 seeds",
                       "at least 3 different segmentations", f"{len(splits)}: {sorted(splits)}",
                       "skip merges independently at every step: one draw for the whole text (or chunk) only "
                       "gives 'all merged' or 'all bytes'")
    return len(results) + 1


def _check_dropout_per_pair(answer) -> int:
    """Each step draws afresh for each candidate pair: in 'aaaa' one (a, a) may merge while another does not."""
    tokenizer = BPETokenizer([(97, 97)], name="toy")
    segmentations = {tuple(attempt(answer, tokenizer, "aaaa", 0.5, torch.Generator().manual_seed(seed),
                                   case=f"encode_with_dropout(toy tokenizer, 'aaaa', p=0.5, generator seeded {seed})"))
                     for seed in range(20)}
    if not any(256 in ids and 97 in ids for ids in segmentations):
        raise Mismatch("encode_with_dropout(toy tokenizer whose one merge is (a, a) -> 256, 'aaaa', p=0.5) with 20 "
                       "seeds", "some segmentation that merges one 'aa' and not another, e.g. (256, 97, 97)",
                       f"only {sorted(segmentations)}", "skip candidate PAIRS at each merge step, not merge rules "
                       "for the whole word: draw afresh for every pair that could merge now, so that one (a, a) merges "
                       "while another is skipped, and a pair skipped at one step may merge at the next")
    return 1


@CHAPTER.exercise("encode_with_dropout", title="BPE-dropout: encode with randomly skipped merges", difficulty="hard",
                  section="5. GPT-2's tokenizer, rebuilt", kind="extend the package")
def check_encode_with_dropout(answer) -> int:
    small, fresh = _tokenizer(), fresh_generator()  # each edge check also on a fresh excerpt
    small.name = "small"
    passed = _check_dropout_edges(answer, small, ["", "a", "the whale", "The whale sang.\n\n\nIn 🐳 1851",
                                                  _excerpt(fresh)])
    passed += _check_dropout_random(answer, small, TRAINING_TEXT[:120], " whale")
    passed += _check_dropout_per_pair(answer)
    gpt2 = BPETokenizer.gpt2()
    passed += _check_dropout_edges(answer, gpt2, ["Hello", "word...\n\nNext  page, 1851: 鲸 🐳", _excerpt(fresh)])
    return passed + _check_dropout_random(answer, gpt2, "Tokenization: 🐳 from text to token ids", " harpooneer")


def _check_added(answer, tokenizer: BPETokenizer, tokens: list[str], parts: list[str]) -> None:
    """The new tokenizer knows the old and new special tokens and encodes the rest as ``tokenizer`` did."""
    before = (tokenizer.vocab_size, dict(tokenizer.special_tokens))
    case = f"add_special_tokens({tokenizer.name} tokenizer, {tokens})"
    got = attempt(answer, tokenizer, list(tokens), case=case)
    if not isinstance(got, BPETokenizer):
        raise Mismatch(case, "a BPETokenizer", describe(got), "return a new BPETokenizer(merges, pattern=..., ...)")
    expect_equal((tokenizer.vocab_size, tokenizer.special_tokens), before,
                 case=case + ", then (vocab_size, special_tokens) of the tokenizer passed in",
                 hint="return a NEW tokenizer: the one you were given must not change")
    specials = dict(tokenizer.special_tokens)
    for token in tokens:
        specials.setdefault(token, tokenizer.vocab_size + len(specials) - len(tokenizer.special_tokens))
    hint = ("keep the tokenizer's own special tokens, skip the tokens it already has, and give the new ones the "
            "next free ids, from tokenizer.vocab_size on")
    expect_equal(got.special_tokens, specials, case=case + ", its special_tokens", hint=hint)
    expect_equal(got.vocab_size, tokenizer.vocab_size + len(specials) - len(tokenizer.special_tokens),
                 case=case + ", its vocab_size", hint=hint)
    text = "".join(parts)
    expected = [token_id for part in parts
                for token_id in ([specials[part]] if part in specials else tokenizer.encode_ordinary(part))]
    encoded = attempt(got.encode, text, allowed_special="all", case=f"{case}.encode({_show(text)})")
    mistakes = {
        "keep the tokenizer's byte_order: GPT-2's ids 0-255 are the bytes in its own order":
            lambda: BPETokenizer(list(tokenizer.merges), pattern=tokenizer.pattern, special_tokens=specials).encode(
                text, allowed_special="all"),
        "keep the tokenizer's split pattern (tokenizer.pattern), not the default one":
            lambda: BPETokenizer(list(tokenizer.merges), special_tokens=specials, byte_order=tokenizer.byte_order
                                 ).encode(text, allowed_special="all")}
    hint = diagnose(encoded, mistakes, "the same merges, pattern and byte_order, plus the new special tokens")
    expect_equal(encoded, expected, case=f"{case}.encode({_show(text)}, allowed_special='all')", hint=hint)
    expect_equal(got.decode(expected), text, case=f"{case}.decode(...)", hint="decoding must give the text back")


@CHAPTER.exercise("add_special_tokens", title="Add special tokens to a trained tokenizer", difficulty="medium",
                  section="6. Special tokens and compression", kind="extend the package")
def check_add_special_tokens(answer) -> int:
    small, trailing_spaces = _tokenizer(), _tokenizer(pattern=r"\S+\s*|\s+")  # chunks such as "whale, "
    small.name, trailing_spaces.name = "small", "trailing-space"
    parts = ["<|user|>", "The whale, the ship.  ", ENDOFTEXT, "\n\n", "<|assistant|>", "A 🐳 in 1851!"]
    cases = [(small, [], parts[1:4]), (small, ["<|user|>"], parts[:4]),
             (small, ["<|user|>", "<|assistant|>", ENDOFTEXT], parts),
             (trailing_spaces, ["<|user|>", "<|assistant|>"], parts),
             (BPETokenizer.gpt2(), ["<|im_start|>", "<|im_end|>"],
              ["<|im_start|>", "user\nHello  world", "<|im_end|>"])]
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    for _ in range(2):
        tokens = _fresh_special_tokens(fresh, random_int(fresh, 1, 3))
        parts = [part for token in tokens for part in (_excerpt(fresh, 30), token)]
        cases.append(((small, trailing_spaces)[random_int(fresh, 0, 1)], tokens, parts))
    for tokenizer, tokens, text_parts in cases:
        _check_added(answer, tokenizer, tokens, text_parts)
    return len(cases)


def _fresh_special_tokens(generator: torch.Generator, count: int) -> list[str]:
    """``count`` different special tokens with random names, such as ``<|fcb|>``; ``<|endoftext|>`` may be one."""
    tokens: list[str] = []
    while len(tokens) < count:
        token = ENDOFTEXT if random_int(generator, 0, 4) == 0 else f"<|{_random_text(generator, 3, 'abcdefgh')}|>"
        tokens += [token] if token not in tokens else []
    return tokens


def _module(answer, context_length: int, d_model: int, case: str) -> nn.Module:
    hint = "subclass nn.Module and call super().__init__()"
    return build_module(answer, context_length, d_model, case=case, hint=hint)


@CHAPTER.exercise("SinusoidalPositions", title="Sinusoidal position encodings in GPT", difficulty="medium",
                  section="8. Token and position embeddings", kind="extend the package")
def check_sinusoidal_positions(answer) -> int:
    passed, fresh = 0, fresh_generator()
    sizes = [(1, 2, False), (8, 2, False), (16, 6, False), (12, 16, False)]
    sizes += [(random_int(fresh, 1, 20), 2 * random_int(fresh, 1, 12), True) for _ in range(2)]  # no table holds them
    for context_length, d_model, drawn in sizes:
        case = f"SinusoidalPositions(context_length={context_length}, d_model={d_model})"
        module = _module(answer, context_length, d_model, case)
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        expect_equal(trainable, 0, case=case + ", its trainable parameters", hint="the encodings are fixed: "
                     "register the table with register_buffer, not as an nn.Parameter or nn.Embedding")
        for positions in ([torch.randint(context_length, (random_int(fresh, 1, 8),), generator=fresh)] if drawn else
                          [torch.arange(context_length), torch.tensor([context_length - 1]),
                           torch.arange(context_length // 2, context_length)]):
            call = f"{case}({describe(positions)})"
            got = attempt(module, positions, case=call)
            hint = diagnose(got, {
                "interleave: sin on the even dimensions 0, 2, 4, ..., cos on the odd ones, not sin in the first "
                "half and cos in the second": lambda: sinusoids(context_length, d_model, "halves")[positions],
                "sin goes on the even dimensions (2i), cos on the odd ones (2i + 1)":
                    lambda: sinusoids(context_length, d_model, "swapped")[positions],
                "dimensions 2i and 2i + 1 share one frequency, 1 / 10000^(2i / d_model); you used each dimension's "
                "own index": lambda: sinusoids(context_length, d_model, "dimension")[positions],
                "the exponent is 2i / d_model (i the pair's index), not i / d_model":
                    lambda: sinusoids(context_length, d_model, "pair")[positions],
            }, "PE[pos, 2i] = sin(pos / 10000^(2i/d_model)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d_model))")
            expect_close(got, sinusoids(context_length, d_model)[positions].float(), case=call, hint=hint,
                         dtype=torch.float32)
            passed += 1
    return passed + _check_sinusoids_in_gpt(answer)


def _check_sinusoids_in_gpt(answer) -> int:
    """Plugged in as GPT's position_embedding, the module gives the logits of the reference table."""
    config = GPTConfig(vocab_size=50, context_length=12, d_model=16, n_layers=1, n_heads=2)
    torch.manual_seed(8)
    reference = GPT(config).eval()
    model = copy.deepcopy(reference)
    case = "a GPT(vocab_size=50, context_length=12, d_model=16) whose position_embedding is your module"
    model.position_embedding = _module(answer, config.context_length, config.d_model, case)
    table = sinusoids(config.context_length, config.d_model).float()
    reference.position_embedding = nn.Embedding.from_pretrained(table)
    generator = torch.Generator().manual_seed(9)
    batches = [torch.tensor([[49]]), torch.randint(50, (1, 12), generator=generator),
               torch.randint(50, (3, 7), generator=generator)]
    for idx in batches:
        call = f"{case}, on ids of shape {tuple(idx.shape)}"
        with torch.no_grad():
            got = attempt(model, idx, case=call)
            expected = reference(idx)
        expect_close(got, expected, case=call, hint="the model adds your module(positions), (T, d_model), to the "
                     "token embeddings: return the rows of the positions asked, as float32")
    return len(batches)
