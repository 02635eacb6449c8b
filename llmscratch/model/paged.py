"""A paged KV cache: keys and values in fixed-size blocks drawn from one pool, a table of blocks per sequence.

``KVCache`` (attention.py) gives every sequence a row as long as the context, allocated up front:
simple, and wasteful as soon as sequences are shorter than the context or many run at once. Here
memory is a pool of blocks of ``block_size`` positions, sized from a byte budget; a sequence holds
the blocks its positions fill (its block table), so memory follows the tokens really written.
vLLM's PagedAttention (Kwon et al. 2023) and nano-vLLM's block manager work this way.

Three things follow from the indirection, all here:
- shared prefixes: a full block is known by the hash of every token up to its end; a sequence that
  starts with the same tokens (a system prompt, a chat's earlier turns) takes the cached block
  instead of computing it again, and ``fork`` gives a copy of a sequence (the samples of one prompt)
  all its blocks at once. Blocks are counted by reference and copied when a sequence writes into one
  it shares (copy on write), so no sequence ever sees another's tokens;
- windows that forget: the layers of a sliding window keep their own blocks (a ``LayerGroup``) and
  give back each block once no later query can see it, so their memory is one window, not the context;
- any order of work: a step feeds each sequence any number of new tokens at its next positions, so
  prefill (in chunks), decoding and verifying guesses are the same call.

Attention reads a sequence's blocks by gathering them into a contiguous (B, n_kv, S, hs) and calling
scaled_dot_product_attention with a mask built from each gathered slot's position: one gather per layer.
FlexAttention with a block mask, compiled by torch.compile, was faster per call once compiled on this CPU
(0.87x the time of a decoding step's attention, 0.49x of a 256-token prefill chunk's: benchmarks/RESULTS.md,
"Paged KV cache"), but it compiles for 5-26 s per shape, and the engine's shapes change with every block a
sequence fills and every chunk; a mask that reads the block tables did not compile on the CPU (torch 2.13).
The gather runs eagerly on every device, and a compiled decoding step (``generate``) fuses it anyway.
"""

import collections
import dataclasses
import hashlib
import math
from collections.abc import Sequence

import torch

NULL_BLOCK = 0  # never handed out: padding writes land in it, and every table gap reads it (masked)
FAR = 2 ** 40  # the position of a slot nobody may see: later than any query


class NoFreeBlocks(Exception):
    """The pool has no block left for a write; the caller frees or preempts sequences first (``blocks_needed``)."""


@dataclasses.dataclass
class Pages:
    """What one sequence holds: a block table per layer group (logical block -> block id) and its tokens."""

    tables: list[list[int]]
    tokens: list[int]
    hashes: list[bytes]  # the chain hash of each full block of tokens (prefix sharing)

    @property
    def length(self) -> int:
        return len(self.tokens)


class LayerGroup:
    """The layers that keep the same positions: every full-attention layer, or the sliding layers of one window.

    Holds their keys and values, (n_blocks * block_size, n_kv, hs) per layer, and the bookkeeping of the blocks:
    the free ones, references, and full blocks known by hash (kept when freed, until a new block needs the space).
    """

    def __init__(self, window: int | None, layers: list[int], kv_heads: list[int], head_dim: int, n_blocks: int,
                 block_size: int, device, dtype):
        self.window = window
        self.layers = layers
        self.n_blocks = n_blocks
        shapes = [(n_blocks * block_size, n_kv, head_dim) for n_kv in kv_heads]
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for shape in shapes]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for shape in shapes]
        self.refs = [0] * n_blocks
        self.free = collections.deque(range(1, n_blocks))  # holding nothing anyone may want: taken first
        self.cached: dict[bytes, int] = {}  # hash of a full block's prefix -> the block holding it
        self.hash_of: dict[int, bytes] = {}
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, held by none: LRU first
        # What the next forward reads and writes, set by ``PagedKVCache.prepare`` for every layer of the group;
        # or, once ``PagedKVCache.freeze`` fixed the blocks, each slot's position (``frozen``): see ``PagedLayer``.
        self.write_slots = self.read_slots = self.mask = None
        self.frozen: torch.Tensor | None = None
        self.in_place: int | None = None  # frozen rows read in place: the first block of row 0 (see ``freeze``)

    def available(self) -> int:
        """Blocks a new write may take: the free ones and the cached ones nobody holds."""
        return len(self.free) + len(self.idle)

    def take(self) -> int:
        if self.free:
            block = self.free.popleft()
        elif self.idle:  # the cached block unused the longest gives up its prefix
            block, _ = self.idle.popitem(last=False)
            del self.cached[self.hash_of.pop(block)]
        else:
            raise NoFreeBlocks(f"no free block among the {self.n_blocks - 1} of the pool")
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        self.refs[block] += 1
        self.idle.pop(block, None)

    def release(self, block: int) -> None:
        if block == NULL_BLOCK:
            return
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.idle[block] = None
            else:
                self.free.append(block)

    def name(self, block: int, digest: bytes) -> None:
        """The block holds the full block of tokens whose chain hash is digest: a later prefix may take it."""
        if block != NULL_BLOCK and block not in self.hash_of and digest not in self.cached:
            self.hash_of[block] = digest
            self.cached[digest] = block

    def forget_hash(self, block: int) -> None:
        """The block's tokens are about to change: it may no longer stand for its prefix."""
        if block in self.hash_of:
            del self.cached[self.hash_of.pop(block)]
            if self.idle.pop(block, 0) is None:
                self.free.append(block)

    def copy(self, source: int, block_size: int) -> int:
        """A new block holding source's keys and values (copy on write)."""
        block = self.take()
        src, dst = slice(source * block_size, (source + 1) * block_size), slice(block * block_size,
                                                                                (block + 1) * block_size)
        for keys, values in zip(self.keys, self.values):
            keys[dst] = keys[src]
            values[dst] = values[src]
        return block

    def first_needed(self, position: int, block_size: int) -> int:
        """The first logical block a query at ``position`` (or later) can still see."""
        return 0 if self.window is None else max(0, position - self.window + 1) // block_size


class PagedLayer:
    """One attention layer's view of the cache, what ``MultiHeadAttention`` is given as its kv_cache."""

    def __init__(self, group: LayerGroup, index: int):
        self.group = group
        self.keys, self.values = group.keys[index], group.values[index]

    def attend(self, keys: torch.Tensor, values: torch.Tensor, input_pos: torch.Tensor,
               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write keys/values (B, n_kv, T, hs) into their slots; the sequences' gathered keys and values
        (B, n_kv, S, hs) and the mask (B, 1, T, S) of what each query may see. The group's mask holds the window."""
        group = self.group
        n_kv, head_dim = keys.size(1), keys.size(3)
        if group.frozen is not None:  # the blocks are fixed: the positions alone say where to write and what to see
            slots = group.read_slots[:, input_pos].flatten()  # (B * T,): input_pos (T,), the same for every row
            keys_at, queries_at = group.frozen[:, None, None, :], input_pos[:, None]  # (B, 1, 1, S), (T, 1)
            mask = keys_at <= queries_at  # (B, 1, T, S)
            if group.window is not None:
                mask = mask & (keys_at > queries_at - group.window)
        else:
            slots, mask = group.write_slots.flatten(), group.mask  # (B * T,), (B, 1, T, S)
        self.keys.index_copy_(0, slots, keys.transpose(1, 2).reshape(-1, n_kv, head_dim).to(self.keys.dtype))
        self.values.index_copy_(0, slots, values.transpose(1, 2).reshape(-1, n_kv, head_dim).to(self.values.dtype))
        read = group.read_slots  # (B, S)
        if group.frozen is not None and group.in_place is not None:  # each row's S slots follow the last row's
            shape = (read.size(0), read.size(1), n_kv, head_dim)  # (B, S, n_kv, hs)
            strides = (read.size(1) * n_kv * head_dim, n_kv * head_dim, head_dim, 1)
            offset = group.in_place * self.keys.size(0) // group.n_blocks * n_kv * head_dim
            return (self.keys.as_strided(shape, strides, offset).transpose(1, 2),
                    self.values.as_strided(shape, strides, offset).transpose(1, 2), mask)  # (B, n_kv, S, hs)
        return self.keys[read].transpose(1, 2), self.values[read].transpose(1, 2), mask  # (B, n_kv, S, hs)


class PagedKVCache:
    """Keys and values of many sequences in blocks of ``block_size`` positions, within ``memory`` bytes (or room
    for exactly ``sequences`` sequences of ``max_model_len`` positions).

    The budget is shared between the layer groups so that they run out together when every sequence is
    ``max_model_len`` long: a sliding group needs only the blocks of a window (plus ``lookahead`` positions:
    the most a step feeds at once; ``rollback``: the positions ``truncate`` may take back, kept that much longer).
    Use: ``add`` a sequence (it takes any cached prefix), then ``feed`` it tokens (``prepare`` them, run
    ``model(ids, cache.layers, input_pos=positions)``, ``commit``) as often as needed; ``free`` it when done.
    """

    def __init__(self, model, memory: int | None = None, *, sequences: int | None = None, block_size: int = 16,
                 max_model_len: int | None = None,
                 lookahead: int = 512, rollback: int = 0, prefix_sharing: bool = True, forget: bool = True):
        config = model.config
        weight = model.token_embedding.weight
        self.block_size = block_size
        self.max_model_len = config.context_length if max_model_len is None else max_model_len
        self.prefix_sharing = prefix_sharing
        self.rollback = rollback  # positions ``truncate`` may take back: a window keeps them visible that much longer
        self.forget = forget  # False: windows keep their blocks (a cache sized for whole sequences gains nothing)
        self.device = weight.device
        kinds = [config.sliding_window if kind == "sliding" else None for kind in config.attention_types]
        heads = [getattr(getattr(block, "attn", None), "n_kv_heads", config.kv_heads) for block in model.blocks]
        windows = list(dict.fromkeys(kinds))  # full and/or each window, in the order the layers first use them
        per_block = {w: 2 * block_size * config.head_dim * weight.element_size()
                     * sum(h for h, kind in zip(heads, kinds) if kind == w) for w in windows}
        self.need = {w: self.blocks_for(self.max_model_len if w is None else min(
            self.max_model_len, w - 1 + lookahead + rollback + block_size)) for w in windows}
        if sequences is None:  # how many max-length sequences the budget holds
            sequences = memory / sum(per_block[w] * self.need[w] for w in windows)
        blocks = {w: math.floor(sequences * self.need[w] + 1e-9) for w in windows}
        if sequences < 1 and None in windows and len(windows) > 1:
            # Less than one sequence of the full length: the windows get one sequence's worth first (they need no
            # more however long it grows), the full layers what is left, so the budget holds the longest it can.
            blocks.update({w: self.need[w] for w in windows if w is not None})
            rest = memory - sum(per_block[w] * self.need[w] for w in windows if w is not None)
            blocks[None] = max(1, rest // per_block[None])
        self.groups = []
        for w in windows:
            layers = [i for i, kind in enumerate(kinds) if kind == w]
            self.groups.append(LayerGroup(w, layers, [heads[i] for i in layers], config.head_dim,
                                          max(2, blocks[w] + 1), block_size, self.device, weight.dtype))
        self.bytes = sum(per_block[g.window] * g.n_blocks for g in self.groups)
        self.layers: list[PagedLayer] = [None] * config.n_layers
        for group in self.groups:
            for index, layer in enumerate(group.layers):
                self.layers[layer] = PagedLayer(group, index)
        self.pages: dict[object, Pages] = {}

    @staticmethod
    def bytes_for(model, sequences: int, length: int, block_size: int = 16, lookahead: int = 512) -> int:
        """The budget that holds ``sequences`` sequences of ``length`` positions (windows counted as they forget)."""
        config = model.config
        per_position = 2 * config.head_dim * model.token_embedding.weight.element_size()
        heads = [getattr(getattr(block, "attn", None), "n_kv_heads", config.kv_heads) for block in model.blocks]
        total = 0
        for kind, n_kv in zip(config.attention_types, heads):
            kept = length if kind != "sliding" else min(length, config.sliding_window - 1 + lookahead + block_size)
            total += -(-kept // block_size) * block_size * n_kv
        return sequences * total * per_position

    # ------------------------------------------------------------------ sequences
    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def add(self, seq_id, prompt: Sequence[int]) -> int:
        """Start a sequence that will be fed ``prompt``; returns how many of its first tokens are already cached
        (a multiple of block_size, never the whole prompt: its last position must be fed to predict what follows)."""
        pages = Pages([[] for _ in self.groups], [], [])
        self.pages[seq_id] = pages
        if not self.prefix_sharing:
            return 0
        hashes = self._hashes(prompt, (len(prompt) - 1) // self.block_size)
        n = len(hashes)
        while n and not all(self._cached(group, hashes, n) for group in self.groups):
            n -= 1
        for group, table in zip(self.groups, pages.tables):
            first = group.first_needed(n * self.block_size, self.block_size)
            for i in range(n):
                block = group.cached[hashes[i]] if i >= first else NULL_BLOCK
                if block != NULL_BLOCK:
                    group.hold(block)
                table.append(block)
        pages.tokens, pages.hashes = list(prompt[: n * self.block_size]), hashes[:n]
        return n * self.block_size

    def _cached(self, group: LayerGroup, hashes: list[bytes], n: int) -> bool:
        first = group.first_needed(n * self.block_size, self.block_size)
        return all(h in group.cached for h in hashes[first:n])

    def _hashes(self, tokens: Sequence[int], n: int, hashes: Sequence[bytes] = ()) -> list[bytes]:
        """The chain hashes of the first n full blocks of tokens (those already known passed in ``hashes``)."""
        hashes = list(hashes)
        for i in range(len(hashes), n):
            block = tokens[i * self.block_size: (i + 1) * self.block_size]
            parent = hashes[-1] if hashes else b""
            hashes.append(hashlib.sha256(parent + b"".join(t.to_bytes(4, "little") for t in block)).digest())
        return hashes

    def fork(self, parent, child) -> None:
        """Start ``child`` as a copy of ``parent``: every block shared, copied when either writes into it."""
        source = self.pages[parent]
        for group, table in zip(self.groups, source.tables):
            for block in table:
                if block != NULL_BLOCK:
                    group.hold(block)
        self.pages[child] = Pages([list(t) for t in source.tables], list(source.tokens), list(source.hashes))

    def copy_sequence(self, source, target) -> None:
        """Copy the keys and values ``source`` holds into the blocks reserved for ``target`` (``reserve``): the same
        sequence, in blocks of its own."""
        pages, length = self.pages[source], self.pages[source].length
        for group_index, group in enumerate(self.groups):
            from_slots = torch.tensor([self._slot(pages.tables[group_index], p) for p in range(length)],
                                      device=self.device)
            to_slots = torch.tensor([self._slot(self.pages[target].tables[group_index], p) for p in range(length)],
                                    device=self.device)
            for tensor in group.keys + group.values:
                tensor.index_copy_(0, to_slots, tensor[from_slots])
        self.pages[target].tokens = list(pages.tokens)

    def free(self, seq_id) -> None:
        """Give back a sequence's blocks (those full and hashed stay cached for later prefixes)."""
        pages = self.pages.pop(seq_id)
        for group, table in zip(self.groups, pages.tables):
            for block in table:
                group.release(block)

    def truncate(self, seq_id, length: int) -> None:
        """Forget the positions from ``length`` on (guesses a verifier rejected, say). A window keeps what
        its queries may see again only ``rollback`` positions back: length must be at least the sequence's length
        minus rollback."""
        pages = self.pages[seq_id]
        keep = self.blocks_for(length)
        for group, table in zip(self.groups, pages.tables):
            for block in table[keep:]:
                group.release(block)
            del table[keep:]
            if length % self.block_size and table and group.refs[table[-1]] == 1:
                group.forget_hash(table[-1])  # a shared one is copied before it is written
        pages.tokens = pages.tokens[:length]
        pages.hashes = pages.hashes[: length // self.block_size]

    def length(self, seq_id) -> int:
        return self.pages[seq_id].length

    # ------------------------------------------------------------------ room
    def blocks_needed(self, seq_id, new_tokens: int) -> list[int]:
        """Per group, the blocks feeding ``new_tokens`` more would take: new ones, and copies of shared ones."""
        pages = self.pages[seq_id]
        start, end = pages.length, pages.length + new_tokens
        needed = []
        for group, table in zip(self.groups, pages.tables):
            count = max(0, self.blocks_for(end) - len(table))
            if start % self.block_size and table and group.refs[table[start // self.block_size]] > 1:
                count += 1  # the partly filled block is shared: written into, it is copied
            needed.append(count)
        return needed

    def fits(self, length: int) -> bool:
        """Whether one sequence of ``length`` positions fits in the pool alone."""
        return all(min(self.blocks_for(length), self.need[g.window]) <= g.n_blocks - 1 for g in self.groups)

    def longest(self) -> int:
        """The most positions one sequence alone may reach (at most max_model_len)."""
        return min([self.max_model_len] + [(g.n_blocks - 1) * self.block_size for g in self.groups
                                           if g.n_blocks - 1 < self.need[g.window]])

    def can_feed(self, work: dict) -> bool:
        """Whether every (seq_id: new token count) of ``work`` fits in the free blocks at once."""
        totals = [0] * len(self.groups)
        for seq_id, n in work.items():
            totals = [a + b for a, b in zip(totals, self.blocks_needed(seq_id, n))]
        return all(total <= group.available() for total, group in zip(totals, self.groups))

    def usage(self) -> float:
        """The share of the pool's blocks that sequences hold (cached blocks nobody holds count as free)."""
        held = sum(group.n_blocks - 1 - group.available() for group in self.groups)
        return held / sum(group.n_blocks - 1 for group in self.groups)

    # ------------------------------------------------------------------ a step
    def prepare(self, seq_ids: Sequence, tokens: Sequence[Sequence[int]],
                read_blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Make room for each sequence's new tokens at its next positions; (ids (B, T), positions (B, T)) to feed.

        Rows shorter than the longest are padded: the padding repeats the row's last token at its last position,
        and its keys and values are written into the null block, where nothing reads them unmasked. A seq_id of
        None is a dummy row (a batch of fixed shape): its token sits at position 0 of the null block. read_blocks:
        read at least this many blocks a row (masked past its own), so that the shapes, and with them the
        arithmetic of each row, do not depend on the other rows.
        NoFreeBlocks if the pool cannot hold them (``can_feed`` says beforehand).
        """
        width = max(map(len, tokens))
        starts = [0 if s is None else self.pages[s].length for s in seq_ids]
        ids = [list(t) + [t[-1]] * (width - len(t)) for t in tokens]
        positions = [[start + min(j, len(t) - 1) for j in range(width)] for start, t in zip(starts, tokens)]
        for seq_id, new in zip(seq_ids, tokens):
            if seq_id is not None:
                self._make_room(seq_id, len(new))
        queries = torch.tensor(positions, device=self.device)[:, :, None]  # (B, T, 1)
        ends = torch.tensor([start + len(new) for start, new in zip(starts, tokens)], device=self.device)  # (B,)
        offsets = torch.arange(self.block_size, device=self.device)  # (bs,)
        for group_index, group in enumerate(self.groups):
            write, read, firsts = [], [], []
            for seq_id, start, new in zip(seq_ids, starts, tokens):
                table = [] if seq_id is None else self.pages[seq_id].tables[group_index]  # None: a dummy row
                slots = [self._slot(table, p) if table else 0 for p in range(start, start + len(new))]
                write.append(slots + [NULL_BLOCK * self.block_size] * (width - len(new)))
                firsts.append(group.first_needed(start, self.block_size))
                read.append(table[firsts[-1]:])
            longest = max(read_blocks, *map(len, read))
            blocks = torch.tensor([r + [NULL_BLOCK] * (longest - len(r)) for r in read], device=self.device)  # (B, n)
            logical = torch.tensor(firsts, device=self.device)[:, None] + torch.arange(longest, device=self.device)
            key_pos = (logical[:, :, None] * self.block_size + offsets).flatten(1)  # (B, S): each slot's position
            key_pos = key_pos.masked_fill(key_pos >= ends[:, None], FAR)  # unwritten, or another row's padding
            group.write_slots = torch.tensor(write, device=self.device)  # (B, T)
            group.read_slots = (blocks[:, :, None] * self.block_size + offsets).flatten(1)  # (B, S)
            keys = key_pos[:, None, :]  # (B, 1, S)
            mask = keys <= queries  # (B, T, S)
            if group.window is not None:
                mask &= keys > queries - group.window
            group.mask = mask[:, None]  # (B, 1, T, S), shared by the heads
        for seq_id, new in zip(seq_ids, tokens):
            if seq_id is not None:
                self.pages[seq_id].tokens += list(new)
        return (torch.tensor(ids, device=self.device),
                torch.tensor(positions, device=self.device))  # (B, T) each

    def _make_room(self, seq_id, new_tokens: int) -> None:
        """Blocks for positions length..length+new_tokens-1 in every group: new ones, and copies of shared ones."""
        pages = self.pages[seq_id]
        start, end = pages.length, pages.length + new_tokens
        for group, table in zip(self.groups, pages.tables):
            index = start // self.block_size
            if start % self.block_size and index < len(table):
                block = table[index]
                if group.refs[block] > 1:  # shared: this sequence gets its own copy before writing
                    table[index] = group.copy(block, self.block_size)
                    group.release(block)
                else:
                    group.forget_hash(block)
            while len(table) < self.blocks_for(end):
                table.append(group.take())

    def freeze(self, seq_ids: Sequence, length: int) -> None:
        """Give the sequences every block up to ``length`` positions now, and from then on let the positions fed
        (one tensor (T,) for all rows, as ``generate`` steps them together) say where keys go and what each query
        sees. The shapes stay the same from step to step, and no Python runs between them, so a compiled decoding
        step is compiled once (and replays as a CUDA graph). Nothing is forgotten or shared any more."""
        for seq_id in seq_ids:
            self._make_room(seq_id, length - self.pages[seq_id].length)
        for group_index, group in enumerate(self.groups):
            rows = [self.pages[s].tables[group_index] for s in seq_ids]
            tables = torch.tensor(rows, device=self.device)  # (B, n)
            group.read_slots = (tables[:, :, None] * self.block_size
                                + torch.arange(self.block_size, device=self.device)).flatten(1)  # (B, S)
            group.frozen = torch.arange(group.read_slots.size(1), device=self.device).expand_as(group.read_slots)
            # Rows whose blocks follow one another, each row after the last (what ``reserve`` gives sequences made
            # one after the other): attention reads them in place, a view, instead of gathering a copy each step.
            first, n = rows[0][0], len(rows[0])
            in_order = all(row == list(range(first + r * n, first + (r + 1) * n)) for r, row in enumerate(rows))
            group.in_place = first if in_order else None

    def reserve(self, seq_id, length: int) -> None:
        """Give a new sequence its blocks for ``length`` positions now: sequences reserved one after the other get
        blocks in order, which ``freeze`` then reads in place."""
        self._make_room(seq_id, length - self.pages[seq_id].length)

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def commit(self, seq_ids: Sequence) -> None:
        """After the forward: name the blocks that became full (for later prefixes), forget what no window sees."""
        for seq_id in seq_ids:
            pages = self.pages[seq_id]
            full = pages.length // self.block_size
            known = len(pages.hashes)
            if self.prefix_sharing and full > known:
                pages.hashes = self._hashes(pages.tokens, full, pages.hashes)
                for group, table in zip(self.groups, pages.tables):
                    for i in range(known, full):
                        group.name(table[i], pages.hashes[i])
            for group, table in zip(self.groups, pages.tables if self.forget else ()):
                for i in range(group.first_needed(max(0, pages.length - self.rollback), self.block_size)):
                    if table[i] != NULL_BLOCK:
                        group.release(table[i])
                        table[i] = NULL_BLOCK


def feed(model, cache: PagedKVCache, seq_ids: Sequence, tokens: Sequence[Sequence[int]],
         read_blocks: int = 0, last_only: bool = False) -> torch.Tensor:
    """The one step every decoding path takes: each sequence's new tokens fed at its next positions, their keys and
    values kept; the logits (B, T, V) (rows padded to the longest: see ``PagedKVCache.prepare``). last_only: the
    logits of each row's last token alone (B, 1, V) (a padded row's last column repeats its last token)."""
    ids, positions = cache.prepare(seq_ids, tokens, read_blocks)
    logits = model(ids, cache.layers, input_pos=positions, last_only=last_only)  # (B, T or 1, V)
    cache.commit([s for s in seq_ids if s is not None])
    return logits


def describe(cache: PagedKVCache) -> str:
    """One line: the budget, blocks and how many full-length sequences fit."""
    blocks = " + ".join(f"{g.n_blocks - 1:,} blocks for {len(g.layers)} "
                        f"{'full' if g.window is None else f'window-{g.window}'} layers" for g in cache.groups)
    fit = min((g.n_blocks - 1) // cache.need[g.window] for g in cache.groups)
    room = (f"{fit:,} sequences of {cache.max_model_len:,} positions fit" if fit else
            f"one sequence of at most {cache.longest():,} positions fits")
    return f"paged KV cache {cache.bytes / 2 ** 20:,.1f} MiB ({blocks}, {cache.block_size} positions each; {room})"
