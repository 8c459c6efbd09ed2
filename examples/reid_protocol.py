"""Person re-identification: how self-matches and same-camera "junk" inflate Recall@1.

Re-ID asks: given a photo of a person seen by one camera, is the same person among the
top K photos taken by the *other* cameras? Consecutive frames of one person in one camera
are near-duplicates, so a protocol that lets them count as matches measures frame
similarity, not re-identification. This example builds synthetic identities and cameras
(no download) and evaluates the same embeddings under four protocols:

1. the query images are also in the gallery and nothing is excluded: every query finds
   itself at rank 1 (R@1 = 1.0 whatever the model);
2. the query itself is not counted (``ids`` shared by the query and gallery roles: a
   gallery item with the query's id is that same photo and is ignored): the other frames
   of the same person in the same camera still make R@1 look (nearly) perfect;
3. ``exclude="same_label_and_group"`` with ``groups=camera``: gallery photos of the
   query's identity taken by the query's camera are ignored (the Market-1501 "junk"
   rule); queries of people seen by one camera only now have no valid match and count
   as misses (``empty_target_action="neg"``, the default);
4. the Market-1501 protocol: as 3, and queries without a cross-camera match are not
   counted (``empty_target_action="skip"``).

A fifth row shows ``exclude="same_group"``, a different (stricter) protocol that ignores
every photo from the query's camera, other people's included.

Each row also shows the 95% Wilson interval of R@1 (``confidence_interval()``) and what
``protocol_report()`` detects: in row 1 every query has a bitwise-identical copy of
itself in the gallery (``compute()`` warns), in row 2 the other frames of its track are
near-duplicates (``near_duplicate=0.95``) and make most rank-1 hits; the junk rule
removes them.

The synthetic data: every identity has an appearance vector; each camera adds a shift
shared by everyone it films (lighting, viewpoint); each (identity, camera) track adds its
own offset (pose, background); each frame adds a little noise. Cameras: 6; identities:
200, seen by one to four cameras, four frames per camera; one query per (identity,
camera) track.

Run: ``python examples/reid_protocol.py``
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK

NUM_IDENTITIES, NUM_CAMERAS, FRAMES_PER_TRACK, DIM = 200, 6, 4, 32
KS = (1, 5)
NEAR_DUPLICATE = 0.95  # cosine: frames of one track score about 0.99, other photos less


@dataclass
class ReIDData:
    embeddings: Tensor  # [N, DIM] one row per photo (frame)
    identity: Tensor  # [N]
    camera: Tensor  # [N]
    is_query: Tensor  # [N] bool: the first frame of every track


def make_data(seed: int = 0) -> ReIDData:
    gen = torch.Generator().manual_seed(seed)
    appearance = torch.randn(NUM_IDENTITIES, DIM, generator=gen)
    camera_shift = 0.6 * torch.randn(NUM_CAMERAS, DIM, generator=gen)
    rows: list[Tensor] = []
    identity: list[int] = []
    camera: list[int] = []
    is_query: list[bool] = []
    for person in range(NUM_IDENTITIES):
        num_cameras = int(torch.randint(1, 5, (1,), generator=gen))
        for cam in torch.randperm(NUM_CAMERAS, generator=gen)[:num_cameras].tolist():
            track = appearance[person] + camera_shift[cam]
            track = track + 0.7 * torch.randn(DIM, generator=gen)
            frames = track + 0.15 * torch.randn(FRAMES_PER_TRACK, DIM, generator=gen)
            rows.append(frames)
            identity += [person] * FRAMES_PER_TRACK
            camera += [cam] * FRAMES_PER_TRACK
            is_query += [True] + [False] * (FRAMES_PER_TRACK - 1)
    return ReIDData(
        torch.cat(rows), torch.tensor(identity), torch.tensor(camera), torch.tensor(is_query)
    )


class Outcome(NamedTuple):
    recall: dict[str, float]
    interval: tuple[float, float]  # 95% Wilson interval of R@1
    report: dict[str, int]  # protocol_report()
    warned: bool  # whether compute() warned about identical positives


def recall(
    data: ReIDData, *, use_ids: bool, exclude: str = "none", empty_target_action: str = "neg"
) -> Outcome:
    """Queries against the whole set of photos (the queries included), under a protocol."""
    metric = EmbeddingRecallAtK(
        k=KS,
        exclude=exclude,
        empty_target_action=empty_target_action,
        near_duplicate=NEAR_DUPLICATE,
    )
    photo_id = torch.arange(len(data.identity))
    q = data.is_query
    metric.update(
        data.embeddings[q],
        data.identity[q],
        role="query",
        groups=data.camera[q],
        ids=photo_id[q] if use_ids else None,
    )
    metric.update(
        data.embeddings,
        data.identity,
        role="gallery",
        groups=data.camera,
        ids=photo_id if use_ids else None,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = metric.compute()
    low, high = (float(v) for v in metric.confidence_interval(0.95)["recall@1"])
    report = metric.protocol_report()
    assert isinstance(report, dict)
    return Outcome(
        {key: float(value) for key, value in result.items()},
        (low, high),
        {key: int(value) for key, value in report.items() if isinstance(value, int)},
        any("protocol_report()" in str(w.message) for w in caught),
    )


def queries_with_a_cross_camera_match(data: ReIDData) -> int:
    # One query per (identity, camera) track: an identity's query count is its cameras.
    cameras_seen = torch.bincount(data.identity[data.is_query], minlength=NUM_IDENTITIES)
    return int((cameras_seen[data.identity[data.is_query]] > 1).sum())


def main() -> dict[str, dict[str, float]]:
    data = make_data()
    num_queries = int(data.is_query.sum())
    matched = queries_with_a_cross_camera_match(data)
    print(
        f"{NUM_IDENTITIES} identities, {NUM_CAMERAS} cameras, {len(data.identity)} photos,"
        f" {num_queries} queries ({num_queries - matched} of them of people seen by one"
        " camera only)\n"
    )
    junk = "same_label_and_group"
    protocols: dict[str, Outcome] = {
        "1. queries also in gallery, nothing excluded": recall(data, use_ids=False),
        "2. query itself not counted (ids)": recall(data, use_ids=True),
        "3. + same-camera junk ignored (exclude)": recall(data, use_ids=True, exclude=junk),
        "4. Market-1501: + skip queries w/o a match": recall(
            data, use_ids=True, exclude=junk, empty_target_action="skip"
        ),
        "5. (another protocol) exclude='same_group'": recall(
            data, use_ids=True, exclude="same_group", empty_target_action="skip"
        ),
    }
    width = max(len(name) for name in protocols)
    print(
        f"{'protocol':{width}s}  {'queries':>7s}"
        + "".join(f"{f'R@{k}':>8s}" for k in KS)
        + f"  {'R@1 95% interval':>16s}  {'identical+':>10s}  {'near+':>5s}  {'near@1':>6s}"
    )
    for name, outcome in protocols.items():
        cells = "".join(f"{outcome.recall[f'recall@{k}']:8.4f}" for k in KS)
        low, high = outcome.interval
        report = outcome.report
        print(
            f"{name:{width}s}  {report['queries']:7d}{cells}  [{low:.4f}, {high:.4f}]"
            f"  {report['identical_positive']:10d}  {report['near_positive']:5d}"
            f"  {report['near_hits_at_1']:6d}"
        )
    print(
        "\nidentical+: queries with a bitwise-identical photo of their identity in their"
        f" gallery; near+ / near@1: with a photo of their identity at cosine >= {NEAR_DUPLICATE}"
        " / whose rank-1 hit is such a photo (protocol_report(), near_duplicate="
        f"{NEAR_DUPLICATE}). compute() warned about protocol 1:"
        f" {protocols['1. queries also in gallery, nothing excluded'].warned}; about the"
        f" others: {any(o.warned for o in list(protocols.values())[1:])}."
    )
    print(
        "Rows 1 and 2 measure how alike two frames of one track are (near@1: the rank-1 hit"
        " is a near-duplicate frame); row 4 is the re-ID number to report."
    )
    assert matched == protocols["4. Market-1501: + skip queries w/o a match"].report["queries"]
    return {name: outcome.recall for name, outcome in protocols.items()}


if __name__ == "__main__":
    main()
