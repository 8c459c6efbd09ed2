"""Image <-> text Recall@K of a two-tower model, five captions per image (no download).

The COCO / Flickr30k retrieval protocol on synthetic data: 1,000 test images and 5,000
captions (five per image), every image ranked against all captions (image -> text: a hit
when any of its five captions is in the top K) and every caption against all images
(text -> image: a hit when its own image is in the top K).

The data: each image has a hidden "content" vector; its image features and each of its
five captions are noisy linear views of that content. The two towers are linear
encoders into one 16-dimensional space, fitted in closed form on 2,000 training images
(in the spirit of LiT: the image tower is fixed, here a PCA of the image features, and
the text tower is a ridge regression of the captions onto their images' embeddings).

Evaluation goes through a caption-indexed loader, as with real caption datasets: item
``i`` is (caption ``i``, its image, the image id), so every image arrives five times.
:class:`recall_at_k.EmbeddingRecallAtK` gets the images with ``role="query"`` and the
captions with ``role="gallery"``, labels = image id, and ``bidirectional=True`` ranks both
ways (keys ``i2t/recall@K`` and ``t2i/recall@K``). ``ids=image_id`` on the images makes
each image count once; without it the text -> image gallery holds five copies of every
image, so each wrong image is counted five times above the right one and the text ->
image numbers drop (Recall@5 falls to what Recall@1 is); ``compute()`` warns about the
duplicate gallery items and ``protocol_report()`` counts them. Image -> text is unchanged
here only because every image repeats equally often (five identical queries average to
the same value); with uneven caption counts it would be reweighted too. Each value is
printed with its 95% Wilson interval (``confidence_interval()``).

Run: ``python examples/cross_modal.py``
"""

from __future__ import annotations

import textwrap
import warnings
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from recall_at_k import EmbeddingRecallAtK

CAPTIONS_PER_IMAGE = 5
CONTENT_DIM, IMAGE_DIM, TEXT_DIM, EMBEDDING_DIM = 24, 64, 48, 16
KS = (1, 5, 10)


def make_pairs(
    num_images: int, views: tuple[Tensor, Tensor], generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Image features ``[N, IMAGE_DIM]`` and caption features ``[5 N, TEXT_DIM]``.

    Caption ``i`` describes image ``i // 5``.
    """
    to_image, to_text = views
    content = torch.randn(num_images, CONTENT_DIM, generator=generator)
    images = content @ to_image + torch.randn(num_images, IMAGE_DIM, generator=generator)
    repeated = content.repeat_interleave(CAPTIONS_PER_IMAGE, dim=0)
    noise = torch.randn(len(repeated), TEXT_DIM, generator=generator)
    captions = repeated @ to_text + 6.0 * noise
    return images, captions


def fit_towers(images: Tensor, captions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Image tower (PCA to 16-d), its centre, and text tower (ridge onto image embeddings)."""
    mean = images.mean(dim=0)
    _, _, vh = torch.linalg.svd(images - mean, full_matrices=False)
    image_tower = vh[:EMBEDDING_DIM].T  # [IMAGE_DIM, EMBEDDING_DIM]
    targets = ((images - mean) @ image_tower).repeat_interleave(CAPTIONS_PER_IMAGE, dim=0)
    ridge = 1.0 * torch.eye(TEXT_DIM)
    text_tower = torch.linalg.solve(captions.T @ captions + ridge, captions.T @ targets)
    return image_tower, mean, text_tower


class Evaluation(NamedTuple):
    recall: dict[str, float]
    interval: dict[str, tuple[float, float]]  # 95% Wilson interval of each value
    report: dict[str, dict[str, int]]  # protocol_report(), one dict per direction
    warnings: list[str]  # what compute() warned


def evaluate(
    loader: DataLoader[tuple[Tensor, ...]], towers: tuple[Tensor, Tensor, Tensor], use_ids: bool
) -> Evaluation:
    image_tower, mean, text_tower = towers
    # --8<-- [start:loop]
    metric = EmbeddingRecallAtK(k=KS, bidirectional=True, directions=("i2t", "t2i"))
    for image, caption, image_id in loader:
        image_embedding = (image - mean) @ image_tower
        text_embedding = caption @ text_tower
        # ids on one modality only: an image id repeated within the queries counts once.
        metric.update(image_embedding, image_id, role="query", ids=image_id if use_ids else None)
        metric.update(text_embedding, image_id, role="gallery")
    # --8<-- [end:loop]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = metric.compute()
    interval = metric.confidence_interval(0.95)
    report = metric.protocol_report()
    return Evaluation(
        {key: float(value) for key, value in result.items()},
        {key: (float(low), float(high)) for key, (low, high) in interval.items()},
        {name: dict(counts) for name, counts in report.items() if isinstance(counts, dict)},
        [str(w.message) for w in caught],
    )


def evaluate_unique_images(
    test: tuple[Tensor, Tensor], towers: tuple[Tensor, Tensor, Tensor]
) -> dict[str, float]:
    """The same protocol with each image added exactly once, by hand."""
    images, captions = test
    image_tower, mean, text_tower = towers
    metric = EmbeddingRecallAtK(k=KS, bidirectional=True, directions=("i2t", "t2i"))
    image_ids = torch.arange(len(images))
    metric.update((images - mean) @ image_tower, image_ids, role="query")
    caption_ids = image_ids.repeat_interleave(CAPTIONS_PER_IMAGE)
    metric.update(captions @ text_tower, caption_ids, role="gallery")
    result = metric.compute()
    assert isinstance(result, dict)
    return {key: float(value) for key, value in result.items()}


def caption_loader(test: tuple[Tensor, Tensor], seed: int) -> DataLoader[tuple[Tensor, ...]]:
    """Item ``i``: (image of caption ``i``, caption ``i``, image id), shuffled."""
    images, captions = test
    image_id = torch.arange(len(captions)) // CAPTIONS_PER_IMAGE
    dataset = TensorDataset(images[image_id], captions, image_id)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=256, shuffle=True, generator=generator)


def print_table(title: str, evaluation: Evaluation) -> None:
    """Recall@K with its 95% interval, then the protocol report and any warning."""
    print(title)
    print(f"  {'direction':14s}" + "".join(f"{f'R@{k} [95% interval]':>28s}" for k in KS))
    for direction, name in (("i2t", "image -> text"), ("t2i", "text -> image")):
        cells = ""
        for k in KS:
            key = f"{direction}/recall@{k}"
            low, high = evaluation.interval[key]
            cells += f"{evaluation.recall[key]:10.4f} [{low:.4f}, {high:.4f}]"
        print(f"  {name:14s}{cells}")
    for direction, counts in evaluation.report.items():
        print(f"  protocol_report()[{direction!r}]: {counts}")
    for message in evaluation.warnings:
        print("  warning: " + textwrap.fill(message, 86, subsequent_indent="    "))


def main() -> dict[str, dict[str, float]]:
    generator = torch.Generator().manual_seed(0)
    views = (
        torch.randn(CONTENT_DIM, IMAGE_DIM, generator=generator),
        torch.randn(CONTENT_DIM, TEXT_DIM, generator=generator),
    )
    towers = fit_towers(*make_pairs(2000, views, generator))
    test = make_pairs(1000, views, generator)
    loader = caption_loader(test, seed=0)

    with_ids = evaluate(loader, towers, use_ids=True)
    without_ids = evaluate(loader, towers, use_ids=False)
    results = {
        "with ids": with_ids.recall,
        "without ids": without_ids.recall,
        "unique images": evaluate_unique_images(test, towers),
    }
    print("1,000 test images x 5,000 captions, fed through a caption-indexed loader")
    print("(every image arrives five times, once per caption)\n")
    print_table("no ids (each image counted five times):", without_ids)
    print()
    print_table("ids=image_id on the images (each image counts once):", with_ids)
    print()
    same = results["with ids"] == results["unique images"]
    print(f"with ids, the result equals each image added once by hand: {same}")
    with_r, without = results["with ids"], results["without ids"]
    duplicates = without_ids.report["t2i"]["duplicate_gallery_items"]
    print(
        f"without ids, text -> image R@5 is {without['t2i/recall@5']:.4f} instead of"
        f" {with_r['t2i/recall@5']:.4f}: every wrong image above the right one counts five"
        f" times. protocol_report() shows it ({duplicates} duplicate gallery items) and"
        " compute() warns; with ids both are gone."
    )
    print(
        "without ids the image -> text interval is also too narrow: it counts"
        f" {without_ids.report['i2t']['queries']} queries where there are"
        f" {with_ids.report['i2t']['queries']} images."
    )
    return results


if __name__ == "__main__":
    main()
