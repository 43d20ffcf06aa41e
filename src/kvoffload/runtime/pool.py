"""The paged block pool: K/V and activations in fixed-size token blocks, grouped into extents.

Logical level. Every request owns blocks of ``block_tokens`` consecutive positions; a block id means
the same tokens in every layer, so one allocator serves all layers. `BlockAllocator` keeps the free
list (lowest id first), the owner and first position of every block and each request's block table
(its blocks in position order). Only full blocks live in the pool: a request's newest, partial block
stays in a GPU tail (`tail_*` in the decode state) and is written to the pool when it fills, so the pool
never stores or moves padding.

Physical level. Per layer and kind, blocks are grouped into extents of ``extent_blocks`` blocks; an
extent is one array -- K and V ``[E, n_kv, blk, d]``, activations X ``[E, blk, H]`` -- in pinned host
memory (offloading policies) or device memory (a device pool). Block id b lives in extent b // E at slot
b % E. A host pool may store its extents in int4 (``host_dtype="int4"``): each K, V and X extent is
then a ``QuantizedInt`` of three arrays (codes, step, min; groups along the last axis, d or H; K with
``int4_k_quant="channel"``: a step and min per channel of each block, [E, n_kv, 1, d]; with
``int4_k_quant="int8"`` K's codes are int8, one a value, in per-token groups; with ``int4_k_quant="native"``
K stays a plain array in the model's dtype) with the same leading axes,
written and moved as they are and dequantized on the GPU. Why extents: only an eager ``device_put`` of a whole
array overlaps the jitted compute dispatched after it, and each array costs ~80 us however small (docs/ARCHITECTURE.md), so bulk
fetches must move few, large arrays; an extent of tens of MiB moves at the PCIe floor. Every extent
of a run has one shape, so no program compiles again as a generation grows. Allocation is lowest id
first and the prompt is laid out position-major (block j of every request before block j + 1), so the
blocks in use are dense in the first extents and the lowest positions come first: a recompute split at an
extent boundary recomputes the oldest tokens and fetches the rest, and a bulk fetch moves at most one
partly filled extent beyond the real tokens.

Attention reads an extent through per-extent block tables (``table [n_ext, B, E]`` local slots,
``count [n_ext, B]``), with ``ops.paged_decode_attention``; results of the extents and the tail are
folded left to right into one fp32 accumulator, so a device pool (the same pool in device memory)
and the offloading policies run the same programs over the same blocks in the same order.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.errors import KVOffloadError
from kvoffload.models.common import pytree_dataclass
from kvoffload.ops import QuantizedInt, quantize_int4, quantize_int8

KINDS = ("kv", "act")


class PoolExhausted(KVOffloadError):
    """A request needs a block and the pool has none free (the planner sized it too small)."""


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockClass:
    """A kind of block with its own extents: what it stores ("kv": K and V, "act": the
    activation X to recompute them from), where (``device``: GPU memory even in a host pool, so it is
    never moved) and its ``share`` of every request's blocks (a per-request KV:ACT ratio)."""

    kind: str
    device: bool = False
    share: float = 1.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"block kind must be one of {KINDS}, got {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Static shape of a pool: ``prompt_extents`` extents of ``extent_blocks`` blocks (the prompts'
    blocks, split evenly), then extents of ``gen_extent_blocks`` blocks (each a whole number of lockstep
    flushes: one block per request per flush), ``num_extents`` in all. ``kv_extents`` /
    ``act_extents``: the extent range [start, stop) that holds that kind (a split store keeps
    activations below its split and K/V above it; an empty range means the kind is not stored).

    Block classes: with ``classes`` set, extent e holds blocks of class
    ``extent_class[e]`` only (its kind and placement) and has ``extent_sizes[e]`` blocks; a block's class
    is its extent's, so a request's blocks of each class are those the allocator places in that class's
    extents (a planner tags a device pool's extents so that each request's follow the
    shares); kv_extents/act_extents are unused."""

    block_tokens: int
    extent_blocks: int
    num_extents: int
    prompt_extents: int = -1  # -1: every extent has extent_blocks blocks
    gen_extent_blocks: int = 0
    kv_extents: tuple = (0, 0)
    act_extents: tuple = (0, 0)
    classes: tuple = ()  # of BlockClass
    extent_class: tuple = ()  # per extent: its class
    extent_sizes: tuple = ()  # per extent: blocks (classes only)
    # the most blocks one request can own (its prompt's full blocks plus one per flush): what a per-request
    # buffer must hold (selective policies); 0: not known, bounded by the whole pool
    request_blocks: int = 0

    def __post_init__(self):
        blk = int(self.block_tokens)
        if blk < 1 or blk & (blk - 1):
            raise ValueError(f"block_tokens must be a power of two (GPU kernels tile by it), got {blk}")
        if self.extent_blocks < 1 or self.num_extents < 0:
            raise ValueError(f"bad pool layout: {self}")
        if self.prompt_extents < 0:
            object.__setattr__(self, "prompt_extents", self.num_extents)
        if self.gen_extent_blocks < 1:
            object.__setattr__(self, "gen_extent_blocks", self.extent_blocks)
        if self.classes:
            if not (len(self.extent_class) == len(self.extent_sizes) == self.num_extents):
                raise ValueError(f"a classed layout needs a class and a size per extent: {self}")
            if min(self.extent_sizes, default=1) < 1 or max(self.extent_class, default=0) >= len(self.classes):
                raise ValueError(f"bad classed pool layout: {self}")
            object.__setattr__(self, "_starts", tuple(np.concatenate([[0], np.cumsum(self.extent_sizes)]).tolist()))

    def size(self, e: int) -> int:
        """Blocks of extent e."""
        if self.classes:
            return self.extent_sizes[e]
        return self.extent_blocks if e < self.prompt_extents else self.gen_extent_blocks

    def start(self, e: int) -> int:
        """First block id of extent e."""
        if self.classes:
            return self._starts[e]
        p = min(e, self.prompt_extents)
        return p * self.extent_blocks + (e - p) * self.gen_extent_blocks

    @property
    def num_blocks(self) -> int:
        return self.start(self.num_extents)

    def locate(self, ids):
        """(extent, slot) of block ids (numpy)."""
        ids = np.asarray(ids, np.int64)
        if self.classes:
            starts = np.asarray(self._starts, np.int64)
            e = np.searchsorted(starts, ids, side="right") - 1
            return e, ids - starts[e]
        cut = self.prompt_extents * self.extent_blocks
        e = np.where(ids < cut, ids // self.extent_blocks, self.prompt_extents + (ids - cut) // self.gen_extent_blocks)
        slot = np.where(ids < cut, ids % self.extent_blocks, (ids - cut) % self.gen_extent_blocks)
        return e, slot

    def has(self, kind: str, e: int) -> bool:
        if self.classes:
            return self.classes[self.extent_class[e]].kind == kind
        a, b = self.kv_extents if kind == "kv" else self.act_extents
        return a <= e < b

    def extents_of(self, kind: str):
        if self.classes:
            return tuple(e for e in range(self.num_extents) if self.has(kind, e))
        a, b = self.kv_extents if kind == "kv" else self.act_extents
        return range(a, b)

    def on_device(self, e: int) -> bool:
        """Extent e lives in GPU memory whatever the pool's placement (a device-resident class)."""
        return bool(self.classes) and self.classes[self.extent_class[e]].device

    def block_class(self) -> np.ndarray:
        """Class of every block id."""
        if not self.classes:
            return np.zeros(self.num_blocks, np.int64)
        return np.repeat(np.asarray(self.extent_class, np.int64), self.extent_sizes)


def extent_blocks_for(block_bytes: int, prompt_blocks: int, target_bytes: float) -> int:
    """Blocks per extent: about target_bytes per extent array, with the prompt's blocks split evenly
    over whole extents (so the prompt wastes less than one block per extent)."""
    want = max(1, int(target_bytes // max(1, block_bytes)))
    if prompt_blocks <= 0:
        return want
    n = max(1, -(-prompt_blocks // want))
    return -(-prompt_blocks // n)


# ---------------------------------------------------------------------------------------------
# the allocator (host side)
# ---------------------------------------------------------------------------------------------


class BlockAllocator:
    """Free list and block tables of one pool (host numpy; never read from the device). One free list
    whatever the layout: a classed layout tags whole extents with a class, so a block's
    class is where the lowest-id-first allocation puts it -- exactly where a device pool's allocator puts the
    same block."""

    def __init__(self, num_blocks: int, num_requests: int, block_tokens: int):
        self.num_blocks = int(num_blocks)
        self.block_tokens = int(block_tokens)
        self.free = list(range(self.num_blocks))  # a heap: lowest id first
        self.owner = np.full(self.num_blocks, -1, np.int64)
        self.first_pos = np.full(self.num_blocks, -1, np.int64)
        self.tables: list[list[int]] = [[] for _ in range(num_requests)]

    def copy(self) -> "BlockAllocator":
        new = BlockAllocator.__new__(BlockAllocator)
        new.num_blocks, new.block_tokens = self.num_blocks, self.block_tokens
        new.free, new.owner, new.first_pos = list(self.free), self.owner.copy(), self.first_pos.copy()
        new.tables = [list(t) for t in self.tables]
        return new

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, request: int) -> int:
        """One block for the request's next block of positions; returns its id."""
        if not self.free:
            raise PoolExhausted(f"the block pool is full: no free block among {self.num_blocks} blocks of "
                                f"{self.block_tokens} tokens; the memory plan must reserve blocks for every generated token")
        b = heapq.heappop(self.free)
        self.owner[b] = request
        self.first_pos[b] = len(self.tables[request]) * self.block_tokens
        self.tables[request].append(b)
        return b

    def reserve_below(self, n: int) -> None:
        """Takes the free ids below n out of use (the prompt extents' spare slots), so generated blocks
        start at the first generated extent, aligned: each lockstep flush is then one contiguous run."""
        for b in self.free:
            if b < n:
                self.owner[b] = -2
        self.free = [b for b in self.free if b >= n]
        heapq.heapify(self.free)

    def release(self, request: int) -> list[int]:
        """Frees every block of a finished request."""
        ids = self.tables[request]
        for b in ids:
            self.owner[b] = -1
            self.first_pos[b] = -1
            heapq.heappush(self.free, b)
        self.tables[request] = []
        return ids

    def check(self) -> None:
        """Invariants: each block is free xor owned by exactly one table entry; positions follow tables."""
        seen = np.zeros(self.num_blocks, np.int64)
        for r, t in enumerate(self.tables):
            for j, b in enumerate(t):
                assert self.owner[b] == r and self.first_pos[b] == j * self.block_tokens, (r, j, b)
                seen[b] += 1
        for b in self.free:
            assert self.owner[b] == -1
            seen[b] += 1
        seen[self.owner == -2] += 1  # reserved
        assert (seen == 1).all(), "a block is leaked or shared"

    def used_extents(self, layout: "PoolLayout") -> int:
        """Extents [0, n) hold every used block (allocation is lowest id first)."""
        used = np.flatnonzero(self.owner >= 0)
        return 0 if used.size == 0 else int(layout.locate(used.max())[0]) + 1

    def extents_in_use(self, layout: "PoolLayout") -> np.ndarray:
        """Per extent: whether any request has a block there."""
        used = np.flatnonzero(self.owner >= 0)
        out = np.zeros(layout.num_extents, bool)
        out[np.unique(layout.locate(used)[0])] = True
        return out

    def blocks_in_use(self, layout: "PoolLayout") -> np.ndarray:
        """Per extent: blocks owned by a request."""
        used = np.flatnonzero(self.owner >= 0)
        return np.bincount(layout.locate(used)[0], minlength=layout.num_extents) if used.size else np.zeros(
            layout.num_extents, np.int64)

    def device_tables(self, layout: PoolLayout, where=None) -> "BlockTables":
        """Per-extent block tables for the attention programs (one upload per change, shared by all layers);
        where: a device or sharding to commit them to (a tensor-parallel mesh: replicated), None: uncommitted."""
        n_ext, n_req = layout.num_extents, len(self.tables)
        tables = [np.zeros((n_req, layout.size(e)), np.int32) for e in range(n_ext)]
        count = np.zeros((n_ext, n_req), np.int32)
        for r, t in enumerate(self.tables):
            es, ss = layout.locate(t)
            for e, s in zip(es, ss):
                tables[e][r, count[e, r]] = s
                count[e, r] += 1
        pos = np.where(self.first_pos >= 0, self.first_pos, 0).astype(np.int32)
        firsts = [pos[layout.start(e):layout.start(e) + layout.size(e)] for e in range(n_ext)]
        owned = self.owner[:layout.num_blocks]
        owner = np.where(owned >= 0, owned, -1).astype(np.int32)
        from kvoffload.device.sharding import put

        table, cnt, first, owner = put((tables, list(count), firsts, owner), where)  # one transfer
        return BlockTables(table=tuple(table), count=tuple(cnt), first_pos=tuple(first), owner=owner)


@pytree_dataclass
class BlockTables:
    table: tuple  # per extent [B, E_e] int32: local slots of each request's blocks there, position order
    count: tuple  # per extent [B] int32: how many
    first_pos: tuple  # per extent [E_e] int32: first token position of each slot's block (recomputation's RoPE)
    # [num_blocks] int32, block-id order: each block's request, -1 where none. Built with the tables on the host,
    # so the selective policies' layer programs do not rebuild it (a scatter per extent, in every layer);
    # None (tables built by hand): derived from the tables (a selective policy's own)
    owner: Any = None


# ---------------------------------------------------------------------------------------------
# extents: building at prefill, writing flushed blocks
# ---------------------------------------------------------------------------------------------


def prompt_blocks_of(lengths, block_tokens: int) -> np.ndarray:
    """Full blocks of each prompt (the partial rest stays in the GPU tail)."""
    return np.asarray(lengths, np.int64) // block_tokens


def allocate_prompts(alloc: BlockAllocator, lengths) -> None:
    """Position-major: block j of every request that has it, then block j + 1 (see the module doc)."""
    full = prompt_blocks_of(lengths, alloc.block_tokens)
    for j in range(int(full.max(initial=0))):
        for r in np.flatnonzero(full > j):
            alloc.allocate(int(r))


def allocate_prompts_aligned(alloc: BlockAllocator, layout: "PoolLayout", lengths) -> None:
    """Prompts position-major, then the prompt extents' spare slots reserved (see reserve_below)."""
    allocate_prompts(alloc, lengths)
    alloc.reserve_below(layout.start(layout.prompt_extents))


def extent_sources(alloc: BlockAllocator, layout: PoolLayout, e: int, t_blocks: int):
    """For building extent e from a prefill's [B, ..., T] arrays: flat source block index r * t_blocks
    + j of each slot, and which slots are used."""
    ids = np.arange(layout.start(e), layout.start(e) + layout.size(e))
    owner, pos = alloc.owner[ids], alloc.first_pos[ids]
    valid = owner >= 0
    src = np.where(valid, owner * t_blocks + pos // layout.block_tokens, 0)
    return jnp.asarray(src, jnp.int32), jnp.asarray(valid)


@functools.partial(jax.jit, static_argnames=("blk",))
def gather_kv_extent(k, src, valid, blk):
    """Extent [E, n_kv, blk, d] of the blocks src (flat r * T/blk + j) of k [B, n_kv, T, d]."""
    b, n_kv, t, d = k.shape
    blocks = k.reshape(b, n_kv, t // blk, blk, d).transpose(0, 2, 1, 3, 4).reshape(b * (t // blk), n_kv, blk, d)
    return jnp.where(valid[:, None, None, None], blocks[src], jnp.zeros((), k.dtype))


@functools.partial(jax.jit, static_argnames=("blk",))
def gather_act_extent(x, src, valid, blk):
    """Extent [E, blk, H] of the blocks src of x [B, T, H]."""
    b, t, h = x.shape
    blocks = x.reshape(b * (t // blk), blk, h)
    return jnp.where(valid[:, None, None], blocks[src], jnp.zeros((), x.dtype))


@functools.partial(jax.jit, static_argnames=("group_size", "scales", "bits"))
def quantize_blocks(a, group_size: int, scales: str = "token", bits: int = 4) -> QuantizedInt:
    """K, V or X blocks / an extent [..., n] (n = d or H) as an int4 host pool stores them
    (ops.quantize_int4: packed uint8 codes [..., n/2], float32 step and min [..., n/group_size]).
    scales="channel" (K blocks [..., blk, d] only): a step and min per channel over each block's blk
    tokens, [..., 1, d]. Every block quantized is whole (prompt blocks, and the tail's oldest blk tokens
    at a flush; an unused slot is all zeros), so a block's min / max cover only its own tokens. bits=8:
    int8 codes [..., n] in per-token groups (ops.quantize_int8; K with int4_k_quant="int8")."""
    return quantize_int8(a, group_size) if bits == 8 else quantize_int4(a, group_size, scales)


def _arrays(ext, blocks):
    """(the extent's arrays, the blocks' arrays, rebuild(new extent arrays) -> extent) for a K, V or X extent as the
    pool stores it: an int4 / int8 extent (QuantizedInt) gets the blocks quantized with its group size (unless they
    already are) and has three arrays (codes, step, min)."""
    if not isinstance(ext, QuantizedInt):
        return [ext], [blocks], lambda new: new[0]
    if not isinstance(blocks, QuantizedInt):
        blocks = quantize_blocks(blocks, ext.group_size, ext.scales, ext.bits)
    if (blocks.group_size, blocks.scales, blocks.bits) != (ext.group_size, ext.scales, ext.bits):
        raise ValueError(f"blocks quantized with group_size={blocks.group_size}, scales={blocks.scales!r}, "
                         f"bits={blocks.bits} cannot be written to an extent of group_size={ext.group_size}, "
                         f"scales={ext.scales!r}, bits={ext.bits}")
    return ([ext.codes, ext.step, ext.mn], [blocks.codes, blocks.step, blocks.mn],
            lambda new: QuantizedInt(*new, ext.group_size, ext.scales, ext.bits))


def _per_array(write, ext, blocks):
    """write(extent array, blocks array) for each array of a K, V or X extent as the pool stores it (`_arrays`)."""
    exts, blks, rebuild = _arrays(ext, blocks)
    return rebuild([write(e, b) for e, b in zip(exts, blks)])


def write_stored_blocks(ext, blocks, slots):
    """write_blocks for a K, V or X extent as the pool stores it (`_per_array`: each array of an int4 extent in
    place with write_blocks)."""
    return _per_array(lambda e, b: write_blocks(e, b, slots), ext, blocks)


def write_stored_blocks_many(exts, blocks, slots):
    """`write_stored_blocks` of several extents (any mix of kinds and layers: a flush's K, V and X blocks of
    every layer into one extent id) at the same slots, through `write_blocks_many`: one program per memory
    space, not one per array (a per-layer flush of a 32-layer step was ~465 programs)."""
    parts = [_arrays(e, b) for e, b in zip(exts, blocks)]
    new = iter(write_blocks_many([a for p in parts for a in p[0]], [b for p in parts for b in p[1]], slots))
    return [rebuild([next(new) for _ in arrays]) for arrays, _, rebuild in parts]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_blocks(ext, blocks, slots):
    # slots outside [0, E) are dropped: one program for every extent a flush touches
    return ext.at[slots].set(blocks.astype(ext.dtype), mode="drop")


_WRITE_OK = {}  # (path, memory kind) -> whether that in-place write compiles and runs on this backend


def _in_place(ext, path: str, call, also=()):
    """call() (an in-place write program of `path` into ext, and into the arrays `also` of ext's memory kind),
    or None where this backend cannot compile that write into ext's memory kind (remembered: `_WRITE_OK`); a
    failure after it once ran is raised."""
    kind = getattr(ext.sharding, "memory_kind", None)
    if not _WRITE_OK.get((path, kind), True):
        return None
    try:
        out = call()
    except Exception:  # noqa: BLE001  (a backend that cannot compile this write into host memory)
        if _WRITE_OK.get((path, kind)) is True or any(a.is_deleted() for a in (ext, *also)):
            raise
        _WRITE_OK[(path, kind)] = False
        return None
    _WRITE_OK[(path, kind)] = True
    return out


def _contiguous(slots, size: int) -> bool:
    """Whether host slots are one run of consecutive ids inside an extent of `size` blocks."""
    return bool((slots == slots[0] + np.arange(len(slots))).all()) and 0 <= slots[0] and slots[-1] < size


def write_blocks(ext, blocks, slots):
    """ext with blocks [n, ...] written at slots (host ints; entries >= E skipped), in place: one
    dynamic_update_slice when the slots are one contiguous run of all n blocks (a lockstep flush into an
    aligned extent: the common case, measured in place on an H200 at ~50 us per 1 MiB block), else a
    scatter; where the backend cannot compile either into host memory, through the device and back."""
    slots = np.asarray(slots)
    paths = (("run", lambda: int(slots[0])),) if _contiguous(slots, ext.shape[0]) else ()
    for path, arg in paths + (("scatter", lambda: jnp.asarray(slots, jnp.int32)),):
        out = _in_place(ext, path, lambda p=path, a=arg: _write_program(ext.sharding, 1, p)((ext,), (blocks,),
                                                                                          a())[0])
        if out is not None:
            return out
    from kvoffload.device import memory as M

    dev = jax.device_put(ext, M.device_sharding())
    return jax.device_put(_scatter_blocks(dev, blocks, jnp.asarray(slots, jnp.int32)), ext.sharding)


@functools.lru_cache(maxsize=None)
def _write_program(sharding, n: int, path: str):
    """A donated in-place write of n arrays held on `sharding`, each with its blocks at the same slots, in one
    program: the blocks are moved into the arrays' memory inside the program (an update must share its operand's
    memory space), then written with one dynamic_update_slice each ("run": contiguous slots, `at` the first) or a
    scatter ("scatter": `at` the slots, those past an array's end dropped)."""
    def run(exts, blocks, at):
        out = []
        for ext, b in zip(exts, blocks):
            b = jax.device_put(b.astype(ext.dtype), sharding)
            out.append(jax.lax.dynamic_update_slice_in_dim(ext, b, at, axis=0) if path == "run"
                       else ext.at[at].set(b, mode="drop"))
        return tuple(out)

    return jax.jit(run, donate_argnums=(0,), out_shardings=(sharding,) * n)


def write_blocks_many(exts, blocks, slots):
    """[write_blocks(e, b, slots) for e, b in zip(exts, blocks)] with one program for all the arrays that share a
    sharding (memory space and placement; blocks [n, ...] each, every one written at the same slots, in place).
    Where that program cannot be compiled into the arrays' memory, array by array (`write_blocks`'s fallbacks)."""
    slots = np.asarray(slots)
    out = list(exts)
    groups = {}
    for i, e in enumerate(exts):
        groups.setdefault(e.sharding, []).append(i)
    for sharding, idx in groups.items():
        ext0, group = exts[idx[0]], tuple(exts[i] for i in idx)
        sizes = {exts[i].shape[0] for i in idx}
        run = len(sizes) == 1 and _contiguous(slots, sizes.pop())
        path, arg = ("run", lambda: int(slots[0])) if run else ("scatter", lambda: jnp.asarray(slots, jnp.int32))
        new = None
        if len(idx) > 1:  # remembered apart from the one-array writes: a failure here must not turn those off
            new = _in_place(ext0, path + " many", lambda: _write_program(sharding, len(idx), path)(
                group, tuple(blocks[i] for i in idx), arg()), also=group[1:])
        if new is None:
            new = [write_blocks(exts[i], blocks[i], slots) for i in idx]
        for i, a in zip(idx, new):
            out[i] = a
    return out


def write_block_trees(dsts, srcs, slots):
    """`write_blocks_many` over pytrees: each dsts[i] (extent arrays [E, ...], a policy's per-block metadata) with
    srcs[i] (the same structure, blocks [n, ...]) written at slots, one program per sharding for all their leaves."""
    flat = [jax.tree.leaves(d) for d in dsts]
    written = iter(write_blocks_many([a for f in flat for a in f], [a for s in srcs for a in jax.tree.leaves(s)],
                                     slots))
    return [jax.tree.unflatten(jax.tree.structure(d), [next(written) for _ in f]) for d, f in zip(dsts, flat)]
