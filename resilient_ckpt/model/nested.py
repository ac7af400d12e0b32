"""Walking, mapping, splitting and merging nested state dicts.

Containers are ``dict`` and ``list`` (as in Megatron-core); everything else, tuples included,
is a leaf. Splitting keeps list positions: where a leaf went to the other side, the list
holds :data:`HOLE`, so ``merge(*split(x, p))`` rebuilds ``x`` exactly even for lists that mix
tensors and plain values (Megatron-core loses positions there).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Tuple, Union

from ..errors import ValidationError

Path = Tuple[Union[str, int], ...]


class _Hole:
    """Marks a list position whose value lives in the other half of a split."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "HOLE"

    def __reduce__(self):
        return (_Hole, ())


HOLE = _Hole()


def is_container(x: Any) -> bool:
    return isinstance(x, (dict, list))


def nested_values(x: Any) -> Iterator[Any]:
    """Leaves of ``x`` in deterministic (insertion) order, holes skipped."""
    if isinstance(x, dict):
        for v in x.values():
            yield from nested_values(v)
    elif isinstance(x, list):
        for v in x:
            yield from nested_values(v)
    elif x is not HOLE:
        yield x


def nested_items(x: Any, prefix: Path = ()) -> Iterator[Tuple[Path, Any]]:
    """``(path, leaf)`` pairs of ``x``; the path names the leaf in error messages."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from nested_items(v, prefix + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from nested_items(v, prefix + (i,))
    elif x is not HOLE:
        yield prefix, x


def map_leaves(f: Callable[[Any], Any], x: Any) -> Any:
    """Out-of-place map over leaves; containers are rebuilt, holes kept."""
    if isinstance(x, dict):
        return {k: map_leaves(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [map_leaves(f, v) for v in x]
    if x is HOLE:
        return x
    return f(x)


def map_leaves_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """In-place map over leaves of dicts and lists; returns ``x`` (or ``f(x)`` for a leaf)."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = map_leaves_inplace(f, v)
        return x
    if isinstance(x, list):
        for i, v in enumerate(x):
            x[i] = map_leaves_inplace(f, v)
        return x
    if x is HOLE:
        return x
    return f(x)


def split(x: Any, predicate: Callable[[Any], bool]) -> Tuple[Any, Any]:
    """Split ``x`` into ``(matching, rest)`` keeping the hierarchy.

    Dict keys appear on the side(s) that hold a value below them; empty containers stay on
    the ``rest`` side (as in Megatron-core). Lists keep their length on both sides with
    :data:`HOLE` where the value went to the other side.
    """
    if isinstance(x, dict):
        match: dict = {}
        rest: dict = {}
        for k, v in x.items():
            if is_container(v):
                m, r = split(v, predicate)
                if nonempty(m):
                    match[k] = m
                if nonempty(r) or not v:
                    rest[k] = r
            elif predicate(v):
                match[k] = v
            else:
                rest[k] = v
        return match, rest
    if isinstance(x, list):
        match_l: list = []
        rest_l: list = []
        for v in x:
            if is_container(v) and v:
                m, r = split(v, predicate)
                match_l.append(m if nonempty(m) else HOLE)
                rest_l.append(r if nonempty(r) else HOLE)
            elif not is_container(v) and predicate(v):
                match_l.append(v)
                rest_l.append(HOLE)
            else:
                match_l.append(HOLE)
                rest_l.append(v)
        return (match_l if nonempty(match_l) else []), rest_l
    raise TypeError(f"split() needs a dict or list at the top level, got {type(x).__name__}")


def nonempty(x: Any) -> bool:
    """A container holding something: a non-empty dict, a list with a non-HOLE entry (a
    leaf counts as something)."""
    if isinstance(x, dict):
        return bool(x)
    if isinstance(x, list):
        return any(v is not HOLE for v in x)
    return True


def merge(x1: Any, x2: Any, path: Path = ()) -> Any:
    """Merge ``x2`` into ``x1`` (in place where possible) and return the result.

    Lists must have equal length unless one side is an empty list produced by :func:`split`;
    :data:`HOLE` positions take the other side's value. Two leaves at one path are an error
    naming the path.
    """
    if x1 is HOLE:
        return x2
    if x2 is HOLE:
        return x1
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, path + (k,)) if k in x1 else v2
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if not x2:
            return x1
        if not x1:
            return x2
        if len(x1) != len(x2):
            raise ValidationError(
                f"cannot merge lists of different lengths ({len(x1)} vs {len(x2)}) at {_fmt(path)}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, path + (i,))
        return x1
    raise ValidationError(
        f"both halves hold a value at {_fmt(path)}: {type(x1).__name__} and {type(x2).__name__}"
    )


def fill_holes(x: Any) -> Any:
    """List positions nobody filled become None: the HOLE marker is internal and never
    reaches a caller (dicts are updated in place, lists rebuilt)."""
    if isinstance(x, dict):
        for k, v in x.items():
            if isinstance(v, (dict, list)):
                x[k] = fill_holes(v)
        return x
    if isinstance(x, list):
        return [None if v is HOLE else fill_holes(v) for v in x]
    return x


def has_holes(x: Any) -> bool:
    if isinstance(x, dict):
        return any(has_holes(v) for v in x.values())
    if isinstance(x, list):
        return any(v is HOLE or has_holes(v) for v in x)
    return False


def _fmt(path: Path) -> str:
    return "/".join(map(str, path)) or "<root>"


format_path = _fmt
