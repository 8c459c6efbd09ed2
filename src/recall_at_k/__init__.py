"""recall-at-k: exact, fast, constant-memory Recall@K for PyTorch and torchmetrics."""

from importlib.metadata import PackageNotFoundError, version

from recall_at_k._outcomes import QueryOutcomes
from recall_at_k._paired import PairedComparison, paired_comparison
from recall_at_k.embedding import EmbeddingRecallAtK
from recall_at_k.metric import RetrievalRecallAtK

try:
    __version__ = version("recall-at-k")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "EmbeddingRecallAtK",
    "PairedComparison",
    "QueryOutcomes",
    "RetrievalRecallAtK",
    "__version__",
    "paired_comparison",
]
