"""How ``EmbeddingRecallAtK`` stores its items: flat embedding values and one int64
metadata row per item (label, group, id, role flags, width), and the checks only the
whole stored data can make (one width, groups where ``exclude`` reads them).

Embeddings are stored 1-D, so a process without data sends an empty block of the same
layout. Each batch is stored in the wider of float32 and its own dtype
(:func:`stored_dtype`) and ranked in the widest stored (as ``torch.cat`` would promote),
whatever dtype the module is cast to."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from recall_at_k.ranking.blocks import Processes
from recall_at_k.ranking.plan import GALLERY, QUERY, Items
from recall_at_k.ranking.stored import (
    FLOAT_FLOOR,
    BroadcastRows,
    StoredRows,
    broadcast_blocks,
    process_rows,
    widest_float,
)

LABEL, GROUP, ID, FLAGS, WIDTH = range(5)
META_COLUMNS = 5
IS_QUERY, IS_GALLERY, HAS_GROUP, HAS_ID = 1, 2, 4, 8
ROLE_FLAGS = {"query": IS_QUERY, "gallery": IS_GALLERY, "both": IS_QUERY | IS_GALLERY}
_ROLE_NAMES = {flags: role for role, flags in ROLE_FLAGS.items()}


def stored_dtype(embeddings: Tensor) -> torch.dtype:
    """The stored dtype of a batch: the wider of float32 and its own (widening is exact)."""
    return torch.promote_types(embeddings.dtype, FLOAT_FLOOR)


def metadata(
    labels: Tensor, groups: Tensor | None, ids: Tensor | None, role: str, width: int
) -> Tensor:
    """int64 ``[B, META_COLUMNS]`` rows of one batch of items."""
    flags = ROLE_FLAGS[role]
    flags |= HAS_GROUP if groups is not None else 0
    flags |= HAS_ID if ids is not None else 0
    zeros = torch.zeros(labels.shape[0], dtype=torch.int64, device=labels.device)
    columns = [
        labels.to(torch.int64),
        groups.to(torch.int64) if groups is not None else zeros,
        ids.to(torch.int64) if ids is not None else zeros,
        torch.full_like(zeros, flags),
        torch.full_like(zeros, width),
    ]
    return torch.stack(columns, dim=1)


def check_width(meta_blocks: list[Tensor], width: int, role: str) -> None:
    """A new batch of ``role`` has the width of the items stored before it."""
    first = next((block for block in meta_blocks if block.numel()), None)
    if first is not None and int(first[0, WIDTH]) != width:
        first_role = _ROLE_NAMES[int(first[0, FLAGS]) & (IS_QUERY | IS_GALLERY)]
        raise ValueError(
            f"`embeddings` of role {role!r} have width {width}, but earlier embeddings"
            f" (role {first_role!r}) have width {int(first[0, WIDTH])}; queries and"
            " gallery must come from one embedding space"
        )


def blocks(state: Any) -> list[Tensor]:
    """The non-empty blocks of a cat state (a list, or one tensor once gathered)."""
    parts = [state] if isinstance(state, Tensor) else list(state)
    return [block for block in parts if block.numel()]


def stored_blocks(
    values_state: Any, meta_state: Any, check_values: bool = True
) -> tuple[list[Tensor], int, Tensor]:
    """The (possibly gathered) embeddings as stored: views of ``[b, D]`` blocks, in order and
    stored dtype, their width ``D``, and the metadata ``[N, META_COLUMNS]`` (``check_values``:
    that the blocks hold the metadata's items). Nothing is copied whole."""
    values = blocks(values_state)
    metas = [m.reshape(-1, META_COLUMNS) for m in blocks(meta_state)]
    if not metas:
        return [], 0, torch.zeros(0, META_COLUMNS, dtype=torch.int64)
    device = values[0].device if values else metas[0].device
    # One block (a gathered state) is read as it is: no copy of every item's metadata.
    meta = (metas[0] if len(metas) == 1 else torch.cat(metas)).to(torch.int64).to(device)
    num = meta.shape[0]
    widths = meta[:, WIDTH]
    width_min, width_max = (int(v) for v in torch.aminmax(widths))
    if width_min != width_max:
        raise ValueError(
            "`embeddings` must all have one width: got widths"
            f" {sorted(set(widths.tolist()))} across query and gallery"
            " embeddings (on this or another process)"
        )
    held = sum(block.numel() for block in values)
    if check_values and held != num * width_min:
        raise ValueError(
            f"`embeddings`: the state holds {held} values for {num} items of"
            f" width {width_min}; it was corrupted"
        )
    return [block.reshape(-1, width_min) for block in values], width_min, meta


def check_groups(meta: Tensor, exclude: str) -> None:
    """Every item has a group when ``exclude`` reads them (even after ``merge_state``)."""
    if exclude == "none":
        return
    missing = int(((meta[:, FLAGS] & HAS_GROUP) == 0).sum())
    if missing:
        raise ValueError(
            f"`groups` are required with exclude={exclude!r}, but {missing} stored"
            " item(s) have none (merged from a metric updated without `groups`?)"
        )


def missing_side(name: str, index: int, what: str) -> str:
    """The error when direction ``index`` has no ``what`` (queries or gallery) at ``compute()``."""
    query_role, gallery_role = ("query", "gallery") if index == 0 else ("gallery", "query")
    arrow = "query -> gallery" if index == 0 else "gallery -> query"
    role = query_role if what == "queries" else gallery_role
    return (
        f"`role`: direction {name!r} ({arrow}) has no {what} at compute(): add"
        f" embeddings with role={role!r} or role='both' first"
    )


def items_of(meta: Tensor) -> Items:
    """The stored items' ``Items``, views of ``meta``'s columns where they can be."""
    flags = meta[:, FLAGS]
    roles = (flags & IS_QUERY != 0).to(torch.int64) * QUERY
    roles |= (flags & IS_GALLERY != 0).to(torch.int64) * GALLERY
    return Items(meta[:, LABEL], meta[:, GROUP], meta[:, ID], (flags & HAS_ID) != 0, roles)


def stored_rows(
    values: Any,
    meta: Any,
    local: tuple[list[Tensor], list[Tensor]] | None,
    processes: Processes | None,
    device: torch.device,
) -> tuple[StoredRows | BroadcastRows, Tensor]:
    """The stored (or gathered) rows, read without a whole copy, and their metadata; with
    ``local`` (within ``sync_context``) every process's rows, read where they are."""
    if local is None:
        rows, width, metadata_ = stored_blocks(values, meta)
        return StoredRows(rows, width, device), metadata_
    local_meta = [m.reshape(-1, META_COLUMNS) for m in blocks(local[1])]
    rows = blocks(local[0])
    device = local_meta[0].device if local_meta else device
    count = sum(block.shape[0] for block in local_meta)
    held = sum(block.numel() for block in rows)
    mine = widest_float([block.dtype for block in rows])
    assert processes is not None
    group = processes.group
    counts, helds, dtype = process_rows(count, held, mine, group, device)
    gathered = broadcast_blocks(local_meta, counts, META_COLUMNS, device, group)
    _, width, metadata_ = stored_blocks([], [gathered], False)
    if any(h != c * width for h, c in zip(helds, counts, strict=True)):
        raise ValueError(
            f"`embeddings`: the processes hold {helds} values for {counts} items of"
            f" width {width}; the state was corrupted"
        )
    return BroadcastRows(StoredRows(rows, width, device), counts, dtype, group), metadata_
