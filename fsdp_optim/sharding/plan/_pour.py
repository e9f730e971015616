"""Ragged balance across buckets, per bucket: whole blocks first, element-wise tensors poured into the gaps.

[Note: per-bucket ragged packing]
The stream packing of ``_stream`` (ragged buckets concatenated, cut into W contiguous pieces) gives
each rank one contiguous slice of the model. Nothing at run time needs that: a ragged bucket only
needs its ``W + 1`` rank bounds to rise (rank ``r`` owns ``[bounds[r], bounds[r+1])`` of the bucket's
buffer) and each tensor at one offset; the order of tensors in the buffer is free (the runtime reads
``BucketPlan.placements`` in offset order). So each bucket may spread over any set of ranks, and one
element-wise tensor (an embedding) may fill the gaps that whole matrices leave on many ranks: the
ranks between two of its pieces simply hold an empty segment of that bucket.

``pour_ragged(rag, w, cap)`` fills ranks 0, 1, ... in turn up to ``cap`` bytes each. Per bucket it
keeps the tensors not yet started and at most one *open* tensor (started on an earlier rank; the next
rank that takes anything of the bucket must continue it first). A rank repeatedly takes the
candidate with the coarsest granule that fits its free room:

- a whole tensor not yet started, of a bucket without an open tensor (granule: its bytes);
- the rest of an open tensor, or as many of its blocks as fit (granule: its largest block);
- the leading blocks of a tensor not yet started (it becomes the bucket's open tensor; granule: its
  largest block);

ties: whole tensor, then open, then new; then input position. Tensors of at most ``cap / _SMALL``
bytes (norms) skip all that: they are spread evenly over the ranks, each first in its rank's segment of
its bucket. Three rules keep the small pieces for the ranks that need them:

- fine granules (at most ``cap / _FINE``: element-wise tensors, norms) top a rank up only to the
  mean of the bytes still to place per rank left, not to ``cap``;
- each coarse granule (a block size) is spent at an even rate: by the end of rank ``r`` at most
  ``ceil((r+1) / W x its bytes)`` plus one granule (a quota); a rank still under the mean after that
  pass takes more regardless of the quota;
- a rank left under the mean whose first (coarsest) granule is at least ``cap / _TRIAL_MIN`` is
  refilled with 1 or 2 fewer of that granule (every move is logged and undone), and the fullest fill
  wins: one 0.43 x mean block and five of 0.12 (1.035) instead of two and one (0.974).

Within a bucket, a rank's segment is [rest of the open tensor][whole tensors][leading blocks of a new
open tensor], appended in rank order, so the bounds rise and every cut is a block boundary. The last
rank takes whatever is left; ``None`` if that exceeds ``cap``. The caller searches ``cap``. Pure,
deterministic (lists in input order, no hashing of names).

[Note: big blocks first]
Where that greedy finds no packing within ``cap``, ``pour_ragged`` tries a second one. Its failure mode:
DeepSeek-V3, Shampoo, W = 4096 holds 44,544 expert blocks of 0.0896 x the mean and 448 of 0.10-0.12;
twelve of them exceed 1.05, so a rank holds at most eleven, and 11 x 4096 leaves 64 spare places:
every rank but a few must hold eleven. The greedy picks the coarsest item first, whole tensors
included (attention's 0.23 and 0.72 x the mean), so ranks that take those hold fewer big blocks and the
last ranks are left more than they can hold at 1.05 (the stream packing's 1.075 stayed). Here blocks of
at least ``cap / d`` (``_BIG_DIVS``) are *big*:

1. the big tensors, bucket by bucket in input order, are cut as one stream: each rank takes big blocks
   until the next one would exceed ``cap`` (so each holds as many as fit: eleven above);
2. the rest (and the small tensors, spread as in the greedy) is poured into the room left, rank by rank
   with the greedy's rules, except that a bucket's rest goes only to ranks from the one holding its last
   big block on.

Per bucket the segments are then [tail of an open big tensor][whole big tensors][head of the next] on
the ranks of phase 1 and [rest] from its last big rank on (that rank holds the end of the big part
first): the bounds rise, every cut is a block boundary, at most one tensor per bucket is open at any
rank boundary (phase 1 opens one tensor at a time; phase 2 opens a bucket's rest only after its big
part closed). DeepSeek-V3 above: 1.037 (bound 1.030) instead of 1.075; Llama 3 8B, Muon, W = 64, where
the greedy fails below 1.036: 1.003. Only tried where the greedy fails, so a packing it finds is kept.
"""

from __future__ import annotations

import bisect

import numpy as np


class _Sized:
    """Tensor ids by a key (bytes), ascending keys."""

    __slots__ = ("keys", "ids")

    def __init__(self, pairs):
        by: dict[int, list[int]] = {}
        for key, t in pairs:
            by.setdefault(key, []).append(t)
        self.keys = sorted(by)
        self.ids = [by[k] for k in self.keys]

    def best(self, limit: int, started, blocked, bucket_of) -> int | None:
        """The first id (input order) under the largest key <= ``limit`` that is not started and whose
        bucket is not blocked."""
        i = bisect.bisect_right(self.keys, limit) - 1
        while i >= 0:
            for t in self.ids[i]:
                if not started[t] and not blocked[bucket_of[t]]:
                    return t
            i -= 1
        return None

    def purge(self, started) -> None:
        """Drop started ids (keeps the scans short; committed state only)."""
        keep_k, keep_i = [], []
        for k, lst in zip(self.keys, self.ids):
            if lst and (started[lst[0]] or started[lst[-1]]):
                lst = [t for t in lst if not started[t]]
            if lst:
                keep_k.append(k)
                keep_i.append(lst)
        self.keys, self.ids = keep_k, keep_i


class _Pour:
    """The state of one packing pass: per bucket its open tensor, its fill position and tensor offsets;
    every move is logged so a rank's trial fills can be undone."""

    def __init__(self, rag, small: int = 0):
        """``small`` (bytes): tensors up to this size are kept out of the greedy (``self.small``)."""
        self.rag = rag
        self.bucket_of, self.local, self.geoms, self.isz = [], [], [], []
        for j, (_, gs, _, _, isz) in enumerate(rag):
            for k, g in enumerate(gs):
                self.bucket_of.append(j)
                self.local.append(k)
                self.geoms.append(g)
                self.isz.append(isz)
        n = len(self.geoms)
        self.size_b = [g.numel * self.isz[t] for t, g in enumerate(self.geoms)]
        self.gran_b = [max(g.max_block, 1) * self.isz[t] for t, g in enumerate(self.geoms)]
        self.started = [self.size_b[t] == 0 for t in range(n)]
        self.small = [t for t in range(n) if not self.started[t] and self.size_b[t] <= small]
        greedy = [t for t in range(n) if not self.started[t] and self.size_b[t] > small]
        self.wholes = _Sized((self.size_b[t], t) for t in greedy)
        self.news = _Sized((self.gran_b[t], t) for t in greedy)
        nb = len(rag)
        self.open_t = [-1] * nb  # open tensor per bucket (-1: none)
        self.open_a = [0] * nb  # its elements already placed
        self.blocked = [False] * nb  # the bucket has an open tensor
        self.opened: list[int] = []  # buckets with an open tensor, in opening order
        self.pos = [0] * nb
        self.offsets = [[0] * len(r[1]) for r in rag]
        self.left_b = sum(self.size_b)
        self.log: list[tuple] = []

    # ---- moves (logged) ----------------------------------------------------------------
    def take_whole(self, t: int) -> int:
        j = self.bucket_of[t]
        self.started[t] = True
        self.offsets[j][self.local[t]] = self.pos[j]
        self.pos[j] += self.geoms[t].numel
        self.left_b -= self.size_b[t]
        self.log.append(("w", t))
        return self.size_b[t]

    def take_open(self, j: int, limit_b: int) -> int:
        t, a = self.open_t[j], self.open_a[j]
        g, isz = self.geoms[t], self.isz[t]
        x = g.align_down(a + limit_b // isz)
        self.pos[j] += x - a
        self.left_b -= (x - a) * isz
        idx = -1
        if x >= g.numel:
            idx = self.opened.index(j)
            self.opened.pop(idx)
            self.open_t[j], self.blocked[j] = -1, False
        else:
            self.open_a[j] = x
        self.log.append(("o", j, t, a, x, idx))
        return (x - a) * isz

    def take_new(self, t: int, limit_b: int) -> int:
        j, g, isz = self.bucket_of[t], self.geoms[t], self.isz[t]
        x = g.align_down(limit_b // isz)
        self.started[t] = True
        self.offsets[j][self.local[t]] = self.pos[j]
        self.pos[j] += x
        self.left_b -= x * isz
        opened = x < g.numel
        if opened:
            self.open_t[j], self.open_a[j], self.blocked[j] = t, x, True
            self.opened.append(j)
        self.log.append(("n", t, x, opened))
        return x * isz

    def undo_to(self, mark: int) -> None:
        while len(self.log) > mark:
            e = self.log.pop()
            if e[0] == "w":
                t = e[1]
                j = self.bucket_of[t]
                self.started[t] = False
                self.pos[j] -= self.geoms[t].numel
                self.left_b += self.size_b[t]
            elif e[0] == "o":
                _, j, t, a, x, idx = e
                self.pos[j] -= x - a
                self.left_b += (x - a) * self.isz[t]
                if idx >= 0:
                    self.opened.insert(idx, j)
                    self.open_t[j], self.blocked[j] = t, True
                self.open_a[j] = a
            else:
                _, t, x, opened = e
                j = self.bucket_of[t]
                self.started[t] = False
                self.pos[j] -= x
                self.left_b += x * self.isz[t]
                if opened:
                    self.opened.pop()
                    self.open_t[j], self.open_a[j], self.blocked[j] = -1, 0, False

    # ---- one rank ------------------------------------------------------------------------
    def fill(self, cap: int, target: int, fine: int, top: int = 0, budget: int = -1, used: int = 0,
             quota: dict | None = None, enforce: bool = True) -> tuple[int, int, int]:
        """Greedy fill of one rank (see [Note: per-bucket ragged packing]) holding ``used`` bytes so far;
        ``budget`` >= 0 caps the bytes of granule-``top`` items it takes, ``quota`` (when ``enforce``)
        those of each coarse granule. Returns ``(bytes held, first granule, its bytes taken)``."""
        gap, first, first_b = cap - used, 0, 0
        q = quota if enforce else None
        size_b, gran_b = self.size_b, self.gran_b
        while gap > 0:
            room = min(gap, max(0, target - (cap - gap)))  # for fine granules
            lim = (gap, room, fine, q, top, budget)
            tw = self._best(self.wholes, size_b, lim)
            g_w = size_b[tw] if tw is not None else 0
            bo, g_o = -1, 0  # open tensors: the coarsest granule whose next block fits
            for j in self.opened:
                t = self.open_t[j]
                lt = _limit(gran_b[t], gran_b[t], lim)
                rest = (self.geoms[t].numel - self.open_a[j]) * self.isz[t]
                gr = rest if rest <= lt else gran_b[t]
                if gr > g_o and (rest <= lt or self.geoms[t].align_up(self.open_a[j] + 1) - self.open_a[j] <= lt // self.isz[t]):
                    bo, g_o = j, gr
            tn = self._best(self.news, gran_b, lim) if g_w < gap else None
            g_n = gran_b[tn] if tn is not None else 0
            if g_w == 0 and g_o == 0 and g_n == 0:
                break
            if g_w >= g_o and g_w >= g_n:
                gr, cls = size_b[tw], gran_b[tw]
                got = self.take_whole(tw)
            elif g_o >= g_n:
                gr = cls = gran_b[self.open_t[bo]]
                got = self.take_open(bo, _limit(gr, cls, lim))
            else:
                gr = cls = gran_b[tn]
                got = self.take_new(tn, _limit(gr, cls, lim))
            if got <= 0:
                break
            if first == 0:
                first = gr
            if gr == first:
                first_b += got
            if gr == top and budget >= 0:
                budget -= got
            if quota is not None and cls > fine:
                quota[cls] -= got
            gap -= got
        return cap - gap, first, first_b

    def _best(self, index: _Sized, key_b: list[int], lim) -> int | None:
        """From ``index`` (keyed by ``key_b``: whole bytes or granule), the largest key that fits its
        limit (see ``_limit``); scans down past keys over their limit (quota spent: few)."""
        gap, room, fine = lim[0], lim[1], lim[2]
        st, bl, bo_, gran_b = self.started, self.blocked, self.bucket_of, self.gran_b
        limit = gap
        while limit > 0:
            t = index.best(limit, st, bl, bo_)
            if t is None:
                return None
            k = key_b[t]
            if k <= fine:
                return t if k <= room else index.best(room, st, bl, bo_) if room > 0 else None
            if k <= _limit(k, gran_b[t], lim):
                return t
            limit = k - 1
        return None

    def last(self) -> int:
        """The last rank takes the rest: its bytes."""
        load = self.left_b
        t = 0
        for j, (_, gs, _, _, _) in enumerate(self.rag):
            if self.open_t[j] >= 0:
                self.pos[j] += self.geoms[self.open_t[j]].numel - self.open_a[j]
            for k, g in enumerate(gs):
                if not self.started[t]:
                    self.offsets[j][k] = self.pos[j]
                    self.pos[j] += g.numel
                t += 1
        self.left_b = 0
        return load


def _limit(gr: int, cls: int, lim) -> int:
    """Bytes an item of priority granule ``gr`` (whole bytes, or block) and quota class ``cls`` (block) may
    take on the rank: ``lim = (gap, room, fine, quota or None, top, budget)``."""
    gap, room, fine, quota, top, budget = lim
    x = gap if gr > fine else room
    if quota is not None and cls > fine:
        x = min(x, max(quota[cls], 0))
    return min(x, budget) if gr == top and budget >= 0 else x


def pour_ragged(rag, w: int, cap: int):
    """Per-bucket packing of the ragged buckets ``rag`` (``_planner._ragged_item`` tuples) over ``w``
    ranks with at most ``cap`` bytes each: ``(rank bounds per bucket (elements, numpy), tensor offsets
    per bucket, largest rank bytes)``, or None. See [Note: per-bucket ragged packing]; where that
    greedy fails, [Note: big blocks first]."""
    res = _pour_greedy(rag, w, cap)
    if res is None and w > 1:
        for div in _BIG_DIVS:
            res = _pour_big_first(rag, w, cap, cap // div)
            if res is not None:
                break
    return res


def _pour_greedy(rag, w: int, cap: int):
    """The greedy of [Note: per-bucket ragged packing]: ``pour_ragged``'s result or None."""
    s = _Pour(rag, cap // _SMALL)
    bounds = np.zeros((len(rag), w + 1), dtype=np.int64)
    fine = cap // _FINE
    n_small, due = len(s.small), []  # small tensors: the i-th is due on rank i * W // n_small
    total: dict[int, int] = {}  # bytes per coarse granule: each is spent at an even rate over the ranks
    for t, gr in enumerate(s.gran_b):
        if gr > fine and not s.started[t]:
            total[gr] = total.get(gr, 0) + s.size_b[t]
    quota = dict.fromkeys(total, 0)
    max_load = 0

    def rank(target: int, q: dict, top: int = 0, budget: int = -1):
        load, first, first_b = s.fill(cap, target, fine, top, budget, used=pre, quota=q)
        if load < target:  # the quota may be exceeded to reach the mean
            more = s.fill(cap, target, fine, top, budget, used=load, quota=q, enforce=False)
            if first == 0:
                first, first_b = more[1], more[2]
            elif more[1] == first:
                first_b += more[2]
            load = more[0]
        return load, first, first_b

    for r in range(w):
        if s.left_b > (w - r) * cap:
            return None
        for gr, tot in total.items():
            quota[gr] += -(-(r + 1) * tot // w) - (-(-r * tot // w)) + (gr if r == 0 else 0)
        if r == w - 1:
            load = s.last()
            if load > cap:
                return None
        else:
            target = -(-s.left_b // (w - r))  # fine granules top a rank up to the mean of what is left
            due += s.small[-(-r * n_small // w) : -(-(r + 1) * n_small // w)]
            pre, later = 0, []
            for t in due:  # first in the rank's segment of their bucket (unless it has an open tensor)
                if s.blocked[s.bucket_of[t]]:
                    later.append(t)
                else:
                    pre += s.take_whole(t)
            due = later
            s.log.clear()
            q = dict(quota)
            load, first, first_b = rank(target, q)
            if load < target and first * _TRIAL_MIN >= cap and first_b >= first:
                # under the mean: fewer of the coarsest granule may let smaller items fill the rank better
                best = (load, 0)
                for d in range(1, _TRIES + 1):
                    if first_b - d * first < 0:
                        break
                    s.undo_to(0)
                    got = rank(target, dict(quota), first, first_b - d * first)[0]
                    if got > best[0]:
                        best = (got, d)
                s.undo_to(0)
                q = dict(quota)
                load = rank(target, q, first, first_b - best[1] * first)[0] if best[1] else rank(target, q)[0]
            quota = q
        max_load = max(max_load, load)
        bounds[:, r + 1] = s.pos
        if r % 16 == 15:
            s.wholes.purge(s.started)
            s.news.purge(s.started)
    return bounds, s.offsets, max_load


_FINE = 32
"""Granules up to ``cap / _FINE`` are fine: they top a rank up only to the mean of the bytes still to
place (left over ranks left), so they stay for the ranks filled last."""

_SMALL = 1024
"""Tensors of at most ``cap / _SMALL`` bytes (norms, biases) skip the greedy: the i-th of n goes first
into rank ``i * W // n`` (the next rank whose segment of its bucket it can start), so they spread over
the ranks: their bytes are negligible, their optimizer work per byte is not (Shampoo's 1-D blocks: ~100x
a matrix's)."""

_TRIES = 2
"""A rank left under the mean is refilled with 1.._TRIES fewer of its coarsest granule; the best fill wins."""
_TRIAL_MIN = 8
"""... only where that granule is at least ``cap / _TRIAL_MIN`` (few per rank: a different count matters)."""


def _pour_big_first(rag, w: int, cap: int, big_min: int):
    """Big blocks first, as one stream; the rest poured into the room left (see [Note: big blocks
    first]). ``(bounds, offsets, largest rank bytes)`` or None."""
    s = _Pour(rag, cap // _SMALL)
    n, nb = len(s.geoms), len(rag)
    small = set(s.small)
    rest = [t for t in range(n) if not s.started[t] and t not in small]
    big = [t for t in rest if s.gran_b[t] >= big_min]
    if not big:
        return None
    filler = [t for t in rest if s.gran_b[t] < big_min]
    s.wholes = _Sized((s.size_b[t], t) for t in filler)
    s.news = _Sized((s.gran_b[t], t) for t in filler)
    # phase 1: the big tensors, bucket by bucket, each rank filled to the cap
    big_load = [0] * w
    big_pos = np.zeros((w + 1, nb), dtype=np.int64)
    last_big = [-1] * nb
    qi, j_open = 0, -1
    for r in range(w):
        gap = cap
        while gap > 0:
            if j_open >= 0:
                got = s.take_open(j_open, gap)
                last_big[j_open] = r
                gap -= got
                if s.open_t[j_open] >= 0:
                    break
                j_open = -1
            elif qi < len(big):
                t = big[qi]
                j = s.bucket_of[t]
                if s.size_b[t] <= gap:
                    gap -= s.take_whole(t)
                    last_big[j] = r
                    qi += 1
                elif s.geoms[t].align_up(1) * s.isz[t] <= gap:
                    gap -= s.take_new(t, gap)
                    last_big[j] = r
                    j_open = j
                    qi += 1
                    break
                else:
                    break
            else:
                break
        big_load[r] = cap - gap
        big_pos[r + 1] = s.pos
        if qi >= len(big) and j_open < 0:
            big_pos[r + 1 :] = s.pos
            break
    else:
        return None
    big_total = np.asarray(s.pos, dtype=np.int64)
    # phase 2: the rest, a bucket's only on ranks from its last big one on
    s.log.clear()
    for j in range(nb):
        s.blocked[j] = last_big[j] >= 0
    unlock: dict[int, list[int]] = {}
    for j, r in enumerate(last_big):
        if r >= 0:
            unlock.setdefault(r, []).append(j)
    bounds = np.zeros((nb, w + 1), dtype=np.int64)
    fine = cap // _FINE
    n_small, due = len(s.small), []
    left_big = sum(big_load)
    max_load = 0
    for r in range(w):
        for j in unlock.get(r, ()):
            s.blocked[j] = False
        if r == w - 1:
            load = big_load[r] + s.last()
            if load > cap:
                return None
        else:
            if s.left_b + left_big > (w - r) * cap:
                return None
            target = -(-(s.left_b + left_big) // (w - r))
            due += s.small[-(-r * n_small // w) : -(-(r + 1) * n_small // w)]
            pre, later = 0, []
            for t in due:
                if s.blocked[s.bucket_of[t]]:
                    later.append(t)
                else:
                    pre += s.take_whole(t)
            due = later
            load = s.fill(cap, target, fine, used=big_load[r] + pre)[0]
            s.log.clear()
        left_big -= big_load[r]
        max_load = max(max_load, load)
        bounds[:, r + 1] = big_pos[r + 1] + np.asarray(s.pos, dtype=np.int64) - big_total
        if r % 16 == 15:
            s.wholes.purge(s.started)
            s.news.purge(s.started)
    return bounds, s.offsets, max_load


_BIG_DIVS = (16,)
"""[Note: big blocks first]: blocks of at least ``cap / d`` are big, for each d tried in turn."""
