"""Persistent (immutable) containers the core needs beyond `immutables.Map`.

`PSortedSet` holds the held-turn order and the timers; `Record` is the base of the
core's records (a replica, a run, a turn as the core sees them).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from math import isqrt
from typing import Any, ClassVar, Generic, TypeVar

K = TypeVar("K", bound=tuple[Any, ...])
R = TypeVar("R", bound="Record")

_CHUNK = 32  # keys per chunk at least; a chunk splits at twice its size


class PSortedSet(Generic[K]):
    """An immutable sorted set of tuples; `add` and `remove` return a new set.

    A sorted tuple of sorted chunks (the shape of `sortedcontainers`, made persistent):
    `min` is O(1); `add`/`remove` make O(log n) comparisons by bisection, then copy
    one chunk and the tuple of chunk references, both as single C-level slices.  A
    chunk splits once it holds twice max(32, sqrt(n)) keys, so both copies stay near
    sqrt(n) references: ~200 at 10^4 keys, ~2,000 at 10^6.  Earlier versions stay
    valid and share every other chunk.  For the sizes the core meets (10^4..10^6 held
    turns or timer entries) this beats a pointer-based balanced tree in Python by a
    wide margin."""

    __slots__ = ("_chunks", "_len", "_maxes")

    def __init__(
        self,
        chunks: tuple[tuple[K, ...], ...] = (),
        maxes: tuple[K, ...] = (),
        size: int = 0,
    ) -> None:
        self._chunks = chunks
        self._maxes = maxes
        self._len = size

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, key: object) -> bool:
        i = bisect_left(self._maxes, key)  # type: ignore[call-overload]
        if i == len(self._maxes):
            return False
        chunk = self._chunks[i]
        j = bisect_left(chunk, key)
        return j < len(chunk) and chunk[j] == key

    def __iter__(self) -> Iterator[K]:
        for chunk in self._chunks:
            yield from chunk

    def min(self) -> K:
        """The smallest key, O(1).  Raises ValueError when empty."""
        if not self._chunks:
            raise ValueError("min() of an empty PSortedSet")
        return self._chunks[0][0]

    def add(self, key: K) -> PSortedSet[K]:
        """A set with `key` added; the key must not be present already."""
        chunks, maxes = self._chunks, self._maxes
        if not chunks:
            return PSortedSet(((key,),), (key,), 1)
        i = bisect_left(maxes, key)
        if i == len(maxes):
            # Beyond every key (a timer's new entry, nearly always): append to the last
            # chunk, and it is the new maximum.
            i -= 1
            chunk = chunks[i] + (key,)
            j = len(chunk) - 1
        else:
            chunk = chunks[i]
            j = bisect_left(chunk, key)
            chunk = chunk[:j] + (key,) + chunk[j:]
        half = max(_CHUNK, isqrt(self._len))
        if len(chunk) <= 2 * half:
            new_chunks = chunks[:i] + (chunk,) + chunks[i + 1 :]
            new_maxes = maxes[:i] + (key,) + maxes[i + 1 :] if j == len(chunk) - 1 else maxes
        else:
            lo, hi = chunk[:half], chunk[half:]
            new_chunks = chunks[:i] + (lo, hi) + chunks[i + 1 :]
            new_maxes = maxes[:i] + (lo[-1], hi[-1]) + maxes[i + 1 :]
        return PSortedSet(new_chunks, new_maxes, self._len + 1)

    def remove(self, key: K) -> PSortedSet[K]:
        """A set without `key`; raises KeyError when absent."""
        chunks, maxes = self._chunks, self._maxes
        i = bisect_left(maxes, key)
        if i == len(maxes):
            raise KeyError(key)
        chunk = chunks[i]
        j = bisect_left(chunk, key)
        if j == len(chunk) or chunk[j] != key:
            raise KeyError(key)
        if len(chunk) == 1:
            rest = chunks[:i] + chunks[i + 1 :]
            return PSortedSet(rest, maxes[:i] + maxes[i + 1 :], self._len - 1)
        chunk = chunk[:j] + chunk[j + 1 :]
        new_maxes = maxes if j < len(chunk) else maxes[:i] + (chunk[-1],) + maxes[i + 1 :]
        return PSortedSet(chunks[:i] + (chunk,) + chunks[i + 1 :], new_maxes, self._len - 1)


_EMPTY: PSortedSet[Any] = PSortedSet()


def empty() -> PSortedSet[Any]:
    """The empty set (shared)."""
    return _EMPTY


class Record:
    """A record with named fields, immutable: what the core used NamedTuples for, as a
    plain class.

    A subclass lists its fields in `_FIELDS` (and `__slots__`), in the order of its
    `__init__`, which sets each once as `Final`: mypy rejects any later assignment, and
    compiled (luftpause/native.py) the attribute itself is read-only.  Compiled, each
    record is a native class: building one costs ~30 ns against ~270 ns for a
    NamedTuple (whose `__new__` stays interpreted), and a field is read as a C struct
    member; 1.27x the compiled core's decisions per second (bench/RESULTS.md).
    Equality, hash and repr are by field, in order, as a NamedTuple's; unlike one, a
    record is no tuple (no indexing, iteration or ordering), and compiled it cannot be
    copied or pickled.  `_replace` builds a changed copy (TypeError for a field it
    does not have); the hot paths build theirs whole."""

    __slots__ = ()
    _FIELDS: ClassVar[tuple[str, ...]] = ()

    def _values(self) -> tuple[Any, ...]:
        return tuple([getattr(self, name) for name in self._FIELDS])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return type(other) is type(self) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={v!r}" for n, v in zip(self._FIELDS, self._values(), strict=True))
        return f"{type(self).__name__}({fields})"

    def _replace(self: R, **changes: Any) -> R:
        values = dict(zip(self._FIELDS, self._values(), strict=True))
        unknown = changes.keys() - values.keys()
        if unknown:
            raise TypeError(f"{type(self).__name__} has no fields {sorted(unknown)}")
        values.update(changes)
        build: Any = type(self)  # a subclass: its __init__ takes the fields
        record: R = build(**values)
        return record
