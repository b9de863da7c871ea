"""The in-memory segment index: a sorted list of non-overlapping extents in 512-byte sectors.

One `SegmentIndex` serves both as a layer's own index and as the merged index of a whole
stack (each extent then carries the tag of the layer that holds its data), so a read is
one bisect whatever the stack depth. Extents are kept in parallel Python lists because
`bisect` on a list of ints is the fastest lookup pure Python offers.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass

ZERO = -1  # tag of a zeroed extent (reads as zeros, hides lower layers)


@dataclass(frozen=True, slots=True)
class Extent:
    """One extent: [start, end) in sectors; tag = layer index (ZERO when zeroed), moff = data sector."""

    start: int
    end: int
    tag: int
    moff: int

    @property
    def length(self) -> int:
        return self.end - self.start


class SegmentIndex:
    """Sorted non-overlapping extents; `insert` overrides whatever it covers."""

    __slots__ = ("_end", "_moff", "_start", "_tag")

    def __init__(self) -> None:
        self._start: list[int] = []
        self._end: list[int] = []
        self._tag: list[int] = []
        self._moff: list[int] = []

    def __len__(self) -> int:
        return len(self._start)

    def copy(self) -> SegmentIndex:
        other = SegmentIndex()
        other._start = self._start.copy()
        other._end = self._end.copy()
        other._tag = self._tag.copy()
        other._moff = self._moff.copy()
        return other

    def __iter__(self) -> Iterator[Extent]:
        for s, e, t, m in zip(self._start, self._end, self._tag, self._moff):
            yield Extent(s, e, t, m)

    def insert(self, start: int, end: int, tag: int, moff: int) -> None:
        """Map [start, end) to (tag, moff), replacing what was mapped there before."""
        if end <= start:
            return
        ss, ee, tt, mm = self._start, self._end, self._tag, self._moff
        lo = bisect_right(ee, start)  # first extent ending after start
        hi = bisect_left(ss, end, lo)  # first extent starting at or after end
        new_s = [start]
        new_e = [end]
        new_t = [tag]
        new_m = [moff]
        if lo < hi:
            if ss[lo] < start:  # keep the left part of the first overlapped extent
                new_s.insert(0, ss[lo])
                new_e.insert(0, start)
                new_t.insert(0, tt[lo])
                new_m.insert(0, mm[lo])
            last = hi - 1
            if ee[last] > end:  # keep the right part of the last overlapped extent
                new_s.append(end)
                new_e.append(ee[last])
                new_t.append(tt[last])
                new_m.append(mm[last] + (end - ss[last]) if tt[last] != ZERO else 0)
        ss[lo:hi] = new_s
        ee[lo:hi] = new_e
        tt[lo:hi] = new_t
        mm[lo:hi] = new_m

    def lookup(self, start: int, end: int) -> list[Extent]:
        """Mapped extents clipped to [start, end), in order; gaps are unmapped (read as zeros
        unless a lower layer maps them)."""
        ss, ee, tt, mm = self._start, self._end, self._tag, self._moff
        i = bisect_right(ee, start)
        out: list[Extent] = []
        n = len(ss)
        while i < n and ss[i] < end:
            s = max(ss[i], start)
            e = min(ee[i], end)
            t = tt[i]
            m = mm[i] + (s - ss[i]) if t != ZERO else 0
            out.append(Extent(s, e, t, m))
            i += 1
        return out

    def retag(self, tag: int) -> SegmentIndex:
        """A copy with every non-zeroed extent given `tag` (a layer's own index into a stack)."""
        other = self.copy()
        other._tag = [ZERO if t == ZERO else tag for t in self._tag]
        return other

    def overlay(self, upper: SegmentIndex) -> SegmentIndex:
        """A new index: `upper`'s extents win, this index fills the gaps. Linear time."""
        us, ue = upper._start, upper._end
        out = SegmentIndex()
        j = 0
        nu = len(us)
        pieces: list[tuple[int, int, int, int]] = []
        for s, e, t, m in zip(self._start, self._end, self._tag, self._moff):
            cur = s
            while cur < e:
                while j < nu and ue[j] <= cur:
                    j += 1
                if j < nu and us[j] < e:
                    if us[j] > cur:
                        pieces.append((cur, us[j], t, m + (cur - s) if t != ZERO else 0))
                    cur = max(cur, ue[j])
                else:
                    pieces.append((cur, e, t, m + (cur - s) if t != ZERO else 0))
                    cur = e
        # merge the clipped lower pieces with all upper extents, both sorted by start
        i = k = 0
        np_ = len(pieces)
        ut, um = upper._tag, upper._moff
        while i < np_ or k < nu:
            if k >= nu or (i < np_ and pieces[i][0] < us[k]):
                s, e, t, m = pieces[i]
                i += 1
            else:
                s, e, t, m = us[k], ue[k], ut[k], um[k]
                k += 1
            out._start.append(s)
            out._end.append(e)
            out._tag.append(t)
            out._moff.append(m)
        return out
