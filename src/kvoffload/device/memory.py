"""Host memory for the offloaded store: memory kinds, shardings, transfers, what is available.

The store lives in the ``pinned_host`` memory kind (``jax.device_put(x, sharding.with_memory_kind(
"pinned_host"))``): pinned host <-> GPU copies run at full PCIe speed both ways at once, pageable
numpy only at a fraction. Where a backend lacks ``pinned_host`` the store falls back to
``unpinned_host`` and, failing that, to device memory, and `host_memory_kind` says so in its note.

XLA caps its pinned host pool at ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` (64 GB by default): the
memory plan (plan/memory.py) refuses a store that would not fit under it.
"""

from __future__ import annotations

import functools
import os
import weakref

import jax

HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_HOST_LIMIT_GB = 64.0
GB = 1e9


def default_device():
    return jax.local_devices()[0]


def memory_kinds(dev=None) -> tuple[str, ...]:
    dev = dev or default_device()
    try:
        return tuple(m.kind for m in dev.addressable_memories())
    except Exception:  # pragma: no cover - very old jax
        return ()


@functools.lru_cache(maxsize=None)
def _host_kind(dev) -> tuple[str | None, str]:
    kinds = memory_kinds(dev)
    if "pinned_host" in kinds:
        return "pinned_host", "host store in pinned_host memory"
    if "unpinned_host" in kinds:
        return "unpinned_host", (f"{dev.platform} has no pinned_host memory kind (has {list(kinds)}): the host "
                                 "store uses unpinned_host; transfers run at pageable-memory speed")
    return None, (f"{dev.platform} has no host memory kind (has {list(kinds)}): the 'host' store stays in device "
                  "memory; results are exact but nothing is offloaded")


def host_memory_kind(dev=None) -> tuple[str | None, str]:
    """(kind, note): the memory kind the host store uses on dev and a one-line explanation."""
    return _host_kind(dev or default_device())


def host_sharding(dev=None):
    """Where the host store lives: on dev, or (dev a Sharding, e.g. a tensor-parallel NamedSharding) with
    that sharding's layout."""
    if isinstance(dev, jax.sharding.Sharding):
        kind, _ = host_memory_kind(min(dev.addressable_devices, key=lambda d: d.id))
        return dev.with_memory_kind(kind) if kind else dev
    dev = dev or default_device()
    kind, _ = host_memory_kind(dev)
    return jax.sharding.SingleDeviceSharding(dev, memory_kind=kind or "device") if kind else \
        jax.sharding.SingleDeviceSharding(dev)


def device_sharding(dev=None):
    if isinstance(dev, jax.sharding.Sharding):  # a sharding's layout in device memory
        return dev.with_memory_kind("device")
    dev = dev or default_device()
    if "device" in memory_kinds(dev):
        return jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    return jax.sharding.SingleDeviceSharding(dev)


_POOL = {"live": 0, "high": 0}  # bytes kvoffload holds in host memory kinds now / at most


def _track(tree):
    for a in jax.tree.leaves(tree):
        try:
            n = int(a.size * a.dtype.itemsize)
            weakref.finalize(a, _release, n)
        except TypeError:  # not weak-referenceable: not counted
            continue
        _POOL["live"] += n
        _POOL["high"] = max(_POOL["high"], _POOL["live"])


def _release(n):
    _POOL["live"] -= n


def pool_slack_bytes() -> int:
    """Host-memory bytes kvoffload allocated earlier in this process and has freed since: XLA's pinned
    pool keeps them (they are not back in MemAvailable) and reuses them for the next store."""
    return max(0, _POOL["high"] - _POOL["live"])


def transfer(tree, where):
    """``jax.device_put(tree, where)`` (where: one sharding or a tree of them), asynchronous. Under
    jax.distributed an array spanning processes whose layout stays (only its memory kind changes) moves as
    its own shards, one single-device copy each, and is reassembled: device_put would send a committed
    array of a multi-process mesh down JAX's cross-host transfer path instead."""
    leaves, treedef = jax.tree.flatten(tree)
    if all(getattr(a, "is_fully_addressable", True) for a in leaves):
        return jax.device_put(tree, where)
    targets = [where] * len(leaves) if isinstance(where, jax.sharding.Sharding) else treedef.flatten_up_to(where)
    local, src, dst, out = [], [], [], list(leaves)
    for i, (a, s) in enumerate(zip(leaves, targets)):
        if (isinstance(a, jax.Array) and not a.is_fully_addressable and isinstance(s, jax.sharding.Sharding)
                and s.with_memory_kind(a.sharding.memory_kind).is_equivalent_to(a.sharding, a.ndim)):
            local.append((i, s, len(src)))
            for shard in a.addressable_shards:
                src.append(shard.data)
                dst.append(jax.sharding.SingleDeviceSharding(shard.device, memory_kind=s.memory_kind))
        else:
            out[i] = jax.device_put(a, s)
    moved = jax.device_put(src, dst)
    for i, s, first in local:
        n = len(leaves[i].addressable_shards)
        out[i] = jax.make_array_from_single_device_arrays(leaves[i].shape, s, moved[first:first + n])
    return jax.tree.unflatten(treedef, out)


def to_host(tree, dev=None):
    """Asynchronous copy of a pytree of arrays to the host memory kind (returns at once)."""
    out = transfer(tree, host_sharding(dev))
    _track(out)
    return out


def to_kind(tree, kind: str):
    """Each array of tree moved to memory kind `kind` keeping its own sharding (on a mesh each device moves
    only its shard over its own link): one transfer of the whole tree, as on one device."""
    return transfer(tree, jax.tree.map(lambda a: a.sharding.with_memory_kind(kind), tree))


def to_host_like(tree, kind: str):
    """to_kind into host memory kind `kind`, tracked like to_host."""
    out = to_kind(tree, kind)
    _track(out)
    return out


def to_device(tree, dev=None):
    """Asynchronous copy of a pytree of arrays to device memory (returns at once)."""
    return transfer(tree, device_sharding(dev))


def memory_kind_of(x) -> str | None:
    try:
        return x.sharding.memory_kind
    except Exception:
        return None


def on_host(tree) -> bool:
    """Whether every array leaf of tree lives in a host memory kind."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(memory_kind_of(a) in ("pinned_host", "unpinned_host") for a in leaves)


def host_pool_cap_bytes(platform: str | None = None) -> float | None:
    """XLA's pinned host pool cap on GPU (env XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, 64 GB default);
    None on platforms without the cap (CPU: host memory is the device memory)."""
    platform = platform or default_device().platform
    if platform not in ("gpu", "cuda", "rocm"):
        return None
    raw = os.environ.get(HOST_LIMIT_ENV)
    try:
        gb = float(raw) if raw else DEFAULT_HOST_LIMIT_GB
    except ValueError:
        gb = DEFAULT_HOST_LIMIT_GB
    return gb * GB


def available_host_bytes() -> float | None:
    """Host memory a new store can use: MemAvailable plus what kvoffload freed back into XLA's
    pinned pool earlier in this process; None where it cannot be read."""
    avail = None
    try:
        import psutil  # type: ignore

        avail = float(psutil.virtual_memory().available)
    except Exception:
        avail = proc_field_bytes("/proc/meminfo", "MemAvailable")
    return None if avail is None else avail + pool_slack_bytes()


def proc_field_bytes(path: str, key: str) -> float | None:
    """A "key: N kB" field of a /proc file (/proc/meminfo, /proc/self/status) in bytes; None where it
    cannot be read (no /proc, no such field)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_device_bytes(dev=None) -> float | None:
    """Free accelerator memory (bytes_limit - bytes_in_use), None on CPU / where unknown."""
    dev = dev or default_device()
    if dev.platform == "cpu":
        return None
    try:
        stats = dev.memory_stats() or {}
    except Exception:
        return None
    if "bytes_limit" not in stats:
        return None
    return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def resident_device_bytes(tree, dev=None) -> int:
    """Bytes of tree's arrays held in dev's device memory (their shards there): what a plan that counts those
    arrays must add back to `available_device_bytes`, which has them in use already (a model's weights, loaded
    before its run is planned)."""
    dev = dev or default_device()
    total = 0
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array) or memory_kind_of(x) not in (None, "device"):
            continue
        total += sum(s.data.nbytes for s in x.addressable_shards if s.device == dev)
    return total
