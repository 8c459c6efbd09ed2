"""The CPU panel route: a tile's scores never exist all at once.

On CPU the block route never holds a tile's full score rows: queries are ranked in label
order, so a tile's label blocks form one run of columns, scored first; the remaining
columns follow in panels, each read while it is still in the core's cache; the rows of
successive panels that reach their band are copied aside and compared together.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace
from recall_at_k.ranking.bands import (
    Band,
    Found,
    RankOptions,
    Route,
    TileScan,
    block_scan,
    ignore_in_place,
    label_run,
    near_block,
    saturate,
    scan,
)
from recall_at_k.ranking.gallery import Gallery, Queries, product

CPU_STACK_BYTES = 4 * 2**20
"""On CPU the panel rows that reach their band are copied, panel after panel, into a
buffer of about this many bytes, then compared with the band's edges at once."""


def panel_band(
    queries: Tensor,
    tile: Queries,
    gallery: Gallery,
    bound: Tensor,
    options: RankOptions,
    route: Route,
    workspace: Workspace,
    tile_rows: int = 0,
) -> Band:
    """:func:`block_band` of a tile whose scores never exist all at once (CPU).

    The tile's queries are in label order, so their label blocks together are one
    run of columns ``[lo, hi)``: those scores come first and give each query's s*_f and
    band; the other columns follow in panels of about ``route.panel_bytes``, each
    scanned while still in cache. Panels are as wide for a smaller last tile as for
    ``tile_rows`` rows: the BLAS keeps its packing buffer of the widest panel (about
    ``width x 128 x 4`` bytes: 3 MiB at 6,000 columns) and allocates a second one for
    a wider panel.
    """
    num_rows, num_gallery = queries.shape[0], gallery.embeddings.shape[0]
    run = label_run(queries, tile, gallery, options, workspace)
    lo, hi = run.first, run.stop
    state = block_scan(
        run.scores,
        run.tile,
        gallery.groups[lo:hi],
        gallery.labels[lo:hi],
        bound,
        options,
        workspace,
        lo,
        num_gallery,
    )
    width = max(1, route.panel_bytes // (max(num_rows, tile_rows) * queries.element_size()))
    panels = [(a, min(a + width, lo)) for a in range(0, lo, width)]
    panels += [(a, min(a + width, num_gallery)) for a in range(hi, num_gallery, width)]
    # Each query lies in its own label block, so only same-group exclusion, or an id
    # shared by items of different labels, ignores anything outside [lo, hi).
    self_outside = (tile.self_column >= 0) & ((tile.self_column < lo) | (tile.self_column >= hi))
    ignore_outside = options.exclude == "same_group" or bool(self_outside.any())
    widest_panel = max((stop - first for first, stop in panels), default=0)
    stack = Stack(
        state.lo, state.hi, state.greater, state.found, widest_panel, workspace, route.panel_bytes
    )
    for first, stop in panels:
        scores = product(queries, gallery, first, stop, options.similarity, workspace)
        if ignore_outside:
            ignore_in_place(scores, tile, gallery, options.exclude, first)
        # The rows that reach lo (or hold an ignored item): one read of the panel.
        peak = scores.amax(dim=1, keepdim=True)
        if state.near is not None:
            # A panel lies outside the tile's label blocks: no column has a row's label.
            near_block(scores, peak, state.near, None, first, False, workspace)
        if panel_rows(scores, peak, first, state, stack, workspace):
            saturate(state.lo, state.greater, options.max_k)  # panels hold no positive
    stack.flush()
    return state.band()


def panel_rows(
    scores: Tensor, peak: Tensor, first: int, state: TileScan, stack: Stack, workspace: Workspace
) -> bool:
    """Scan a panel of scores (columns ``first:``; no positive among them) whose rows'
    largest scores are ``peak`` for the band: the rows that reach it go to ``stack``,
    or the whole panel when most do (overwriting it). Whether the counts grew (the
    panel compared, or the stack)."""
    rows = (peak < state.lo).logical_not_().view(-1).nonzero().view(-1)
    if 2 * rows.shape[0] > scores.shape[0]:  # most rows: compare the whole panel
        scan(scores, state.lo, state.hi, first, state.greater, state.found, False, workspace, True)
        return True
    if rows.shape[0]:
        return stack.add(scores, rows, first)
    return False


class Stack:
    """Copies of the panel rows that reach their band, from successive panels of one
    tile and of one width, compared with the band's edges together (fewer, larger
    operations than per panel)."""

    def __init__(
        self,
        lo: Tensor,
        hi: Tensor,
        greater: Tensor,
        found: Found,
        width: int,
        workspace: Workspace,
        stack_bytes: int = CPU_STACK_BYTES,
    ) -> None:
        self.lo, self.hi, self.greater, self.found = lo, hi, greater, found
        self.workspace = workspace
        stack_bytes = min(stack_bytes, CPU_STACK_BYTES)
        capacity = max(lo.shape[0], stack_bytes // max(1, width * lo.element_size()))
        self.buffer = workspace.get("stack", (capacity, width), lo.dtype, lo.device)
        self.used = 0
        self.rows: list[Tensor] = []
        self.firsts: list[int] = []

    def add(self, scores: Tensor, rows: Tensor, first: int) -> bool:
        """Copy ``rows`` of a panel whose first gallery column is ``first`` (a narrower
        panel is padded with -inf, which no band reaches); whether the rows copied
        before were compared first (the buffer was full)."""
        count = rows.shape[0]
        flushed = self.used + count > self.buffer.shape[0]
        if flushed:
            self.flush()
        target = self.buffer[self.used : self.used + count]
        if scores.shape[1] == target.shape[1]:
            torch.index_select(scores, 0, rows, out=target)
        else:
            narrow = self.workspace.get(
                "narrow", (count, scores.shape[1]), target.dtype, rows.device
            )
            target[:, : scores.shape[1]] = torch.index_select(scores, 0, rows, out=narrow)
            target[:, scores.shape[1] :] = -math.inf
        self.used += count
        self.rows.append(rows)
        self.firsts.append(first)
        return flushed

    def flush(self) -> None:
        """What :func:`scan` does, on every row copied so far."""
        if not self.rows:
            return
        candidates = self.buffer[: self.used]
        rows = torch.cat(self.rows)
        counts = torch.tensor([r.shape[0] for r in self.rows], device=rows.device)
        firsts = torch.tensor(self.firsts, device=rows.device).repeat_interleave(counts)
        lo, hi = self.lo.index_select(0, rows), self.hi.index_select(0, rows)
        marks = self.workspace.get("marks", tuple(candidates.shape), lo.dtype, lo.device)
        dtype = self.greater.dtype
        reach = torch.ge(candidates, lo, out=marks).sum(dim=1, dtype=dtype)
        above = candidates.gt_(hi)
        marks.sub_(above)  # score >= lo and not above hi
        above = above.sum(dim=1, dtype=dtype)
        self.greater.index_add_(0, rows, above)
        if not torch.equal(reach, above):
            banded = (reach > above).nonzero().view(-1)
            row, column = marks.index_select(0, banded).nonzero(as_tuple=True)
            self.found.append((rows[banded][row], firsts[banded][row] + column, None))
        self.used = 0
        self.rows, self.firsts = [], []
