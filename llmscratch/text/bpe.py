"""The byte-pair-encoding algorithms, as free functions on lists of token ids.

A merge table maps a pair of ids to the id of the token they make, ``{(left, right): new_id}``;
new ids count up from 256 in the order the merges were learned, so a smaller id is an earlier
merge. ``learn_merges`` builds such a table from the chunks of a text, ``apply_merges`` encodes
one chunk with it, and ``merges_from_ranks`` recovers it from a tiktoken-style ranks table.
``llmscratch.text.tokenizer.BPETokenizer`` wraps them with pre-splitting, special tokens and files.
"""

import heapq
from collections import Counter, defaultdict
from collections.abc import Callable

Pair = tuple[int, int]

_NO_MERGE = 1 << 62  # larger than any token id
# Chunks up to this many ids take the simple rescanning merge: it is quadratic, but quicker
# than the rank-by-rank merge below about 30 bytes, and nearly every chunk of prose is short.
_SHORT_CHUNK = 32


# --------------------------------------------------------------------------- encoding
def apply_merges(ids: list[int], merges: dict[Pair, int]) -> list[int]:
    """BPE on one pre-split chunk: apply the earliest-learned merge until none applies (``ids`` is reused)."""
    if len(ids) <= _SHORT_CHUNK:
        return merge_by_scanning(ids, merges)
    return merge_rank_by_rank(ids, merges)


def merge_by_scanning(ids: list[int], merges: dict[Pair, int]) -> list[int]:
    """BPE by rescanning: each step merges the lowest-ranked pair, the leftmost among equals.

    Quadratic in ``len(ids)``, and the quickest on the few-byte chunks of ordinary text.
    """
    rank = merges.get
    ranks = [rank(pair, _NO_MERGE) for pair in zip(ids, ids[1:])]  # ranks[i]: ids[i], ids[i+1]
    while ranks:
        new_id = min(ranks)
        if new_id == _NO_MERGE:
            break
        i = ranks.index(new_id)  # leftmost occurrence first, as GPT-2 does
        ids[i : i + 2] = [new_id]
        del ranks[i]
        if i > 0:  # the pair to the left now ends in the new token
            ranks[i - 1] = rank((ids[i - 1], new_id), _NO_MERGE)
        if i < len(ranks):  # and the pair to the right starts with it
            ranks[i] = rank((new_id, ids[i + 1]), _NO_MERGE)
    return ids


def merge_rank_by_rank(ids: list[int], merges: dict[Pair, int]) -> list[int]:
    """The same tokens as ``merge_by_scanning`` in O(n log n): take the ranks in increasing
    order and merge each rank's pairs from left to right.

    A merge only creates pairs of a higher rank than its own, so when a rank comes up all its
    pairs are already noted, and taking them left to right is the leftmost-first rule.
    """
    rank = merges.get
    n = len(ids)
    # A linked list of the parts: a part merged into its left neighbour gets the id -1.
    after = list(range(1, n + 1))  # after[i]: the next live part (n: none)
    before = list(range(-1, n - 1))  # before[i]: the previous live part (-1: none)
    noted: dict[int, list[int]] = {}  # rank -> left parts of its pairs (some stale)
    for i, pair in enumerate(zip(ids, ids[1:])):
        if (r := rank(pair)) is not None:
            noted.setdefault(r, []).append(i)
    pending = list(noted)  # a min-heap of the ranks with noted pairs
    heapq.heapify(pending)
    while pending:
        r = heapq.heappop(pending)
        for i in sorted(noted.pop(r)):
            j = after[i]
            if j == n or rank((ids[i], ids[j])) != r:
                continue  # stale: a part of this pair went into an earlier merge
            ids[i], ids[j] = r, -1
            k = after[i] = after[j]
            new_pairs = []
            if k < n:
                before[k] = i
                new_pairs.append(((r, ids[k]), i))
            if (h := before[i]) >= 0:
                new_pairs.append(((ids[h], r), h))
            for pair, left in new_pairs:
                if (s := rank(pair)) is not None:
                    if s not in noted:
                        noted[s] = []
                        heapq.heappush(pending, s)
                    noted[s].append(left)
    return [token for token in ids if token >= 0]


# --------------------------------------------------------------------------- the merges of a ranks table
def merges_from_ranks(ranks: dict[bytes, int]) -> tuple[list[int], dict[Pair, int]]:
    """The byte order and merge table behind a tiktoken-style ranks table (token bytes -> rank).

    Token ``r`` is the merge of the two tokens that BPE, using only the merges of rank below
    ``r``, makes of its bytes; ``byte_order[i]`` is the byte of id ``i``.
    """
    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    if [rank for _, rank in by_rank] != list(range(len(by_rank))) or any(len(t) != 1 for t, _ in by_rank[:256]):
        raise ValueError("ranks must be the integers 0..n-1, each used once, and ranks 0-255 the 256 single bytes")
    byte_order = [token[0] for token, _ in by_rank[:256]]
    byte_to_id = {byte: token_id for token_id, byte in enumerate(byte_order)}
    merges: dict[Pair, int] = {}  # grows one merge at a time: rank r sees the merges below r
    for token, rank in by_rank[256:]:
        parts = apply_merges([byte_to_id[b] for b in token], merges)
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not a merge of two earlier tokens")
        merges[parts[0], parts[1]] = rank
    return byte_order, merges


# --------------------------------------------------------------------------- training
class _Symbols:
    """Every distinct chunk's bytes end to end in one linked list, each weighted by its chunk's count.

    No link crosses from a chunk to the next; a merged-away symbol is -1. ``where[pair]`` holds
    the positions where ``pair`` starts (some stale), so a merge touches only those.
    """

    def __init__(self, chunk_counts: dict[bytes, int]):
        self.symbols, self.weight, self.after, self.before = [], [], [], []
        for data, count in chunk_counts.items():
            start, end = len(self.symbols), len(self.symbols) + len(data)
            self.symbols.extend(data)
            self.weight.extend([count] * len(data))
            self.after.extend(range(start + 1, end + 1))
            self.before.extend(range(start - 1, end - 1))
            if data:
                self.after[-1], self.before[start] = -1, -1
        self.counts: Counter[Pair] = Counter()  # pair -> occurrences weighted by chunk count
        self.where: defaultdict[Pair, list[int]] = defaultdict(list)
        for i, j in enumerate(self.after):
            if j >= 0:
                pair = self.symbols[i], self.symbols[j]
                self.counts[pair] += self.weight[i]
                self.where[pair].append(i)

    def merge(self, pair: Pair, new_id: int) -> set[Pair]:
        """Merge ``pair`` everywhere, left to right as a scan would (``aaa`` makes ``(aa)a``),
        updating pair counts and positions; return the pairs made."""
        symbols, weight, after, before, where = self.symbols, self.weight, self.after, self.before, self.where
        count = self._count
        left, right = pair
        made = set()
        for i in sorted(where.pop(pair)):
            j = after[i]
            if symbols[i] != left or j < 0 or symbols[j] != right:
                continue  # stale: a part of this pair went into an earlier merge
            w, h, k = weight[i], before[i], after[j]
            count(pair, -w)
            if h >= 0:  # the pair to the left now ends in the new symbol
                count((symbols[h], left), -w)
                made.add(new := (symbols[h], new_id))
                count(new, w)
                where[new].append(h)
            if k >= 0:  # and the pair to the right starts with it
                count((right, symbols[k]), -w)
                made.add(new := (new_id, symbols[k]))
                count(new, w)
                where[new].append(i)
                before[k] = i
            symbols[i], symbols[j], after[i] = new_id, -1, k
        return made

    def _count(self, pair: Pair, change: int) -> None:
        """Add ``change`` to a pair's count, dropping pairs that reach zero (the heap skips them)."""
        count = self.counts[pair] + change
        if count:
            self.counts[pair] = count
        else:
            del self.counts[pair]


def learn_merges(chunk_counts: dict[bytes, int], n_merges: int,
                 on_merge: Callable[[int], object] | None = None) -> list[Pair]:
    """Merge the most frequent pair (ties: smaller ids first) until ``n_merges`` or no pair is left.

    chunk_counts: each distinct pre-split chunk's bytes and how often it occurs; a merge never
    crosses from one chunk to another. Pair counts are updated only where a merge happens,
    never recounted. on_merge(1) is called after each merge (a progress bar's ``update``).
    """
    symbols = _Symbols(chunk_counts)
    counts = symbols.counts
    # A max-heap by (count, smaller ids first). Entries go stale as counts drop; a
    # stale entry is re-pushed with its current count when it reaches the top.
    heap = [(-count, pair) for pair, count in counts.items()]
    heapq.heapify(heap)
    merges: list[Pair] = []
    while len(merges) < n_merges and heap:
        neg_count, pair = heapq.heappop(heap)
        current = counts.get(pair, 0)
        if current != -neg_count:
            if current > 0:
                heapq.heappush(heap, (-current, pair))
            continue
        merges.append(pair)
        for new_pair in symbols.merge(pair, 255 + len(merges)):
            if new_pair in counts:  # some made pairs are gone again, e.g. (new, a) in "aaaa"
                heapq.heappush(heap, (-counts[new_pair], new_pair))
        if on_merge is not None:
            on_merge(1)
    return merges
