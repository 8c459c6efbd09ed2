"""The embedding ranking, a module a step. ``EmbeddingRecallAtK`` and
``functional.embedding_recall_at_k`` build one :mod:`~recall_at_k.ranking.plan` and hand
it to :func:`recall_at_k.ranking.engine.rank`:

- ``stored``: the stored rows, read without a whole copy (every process's under DDP);
- ``plan``: stored rows -> sides -> the one copy in label order;
- ``blocks``: one block holding the gallery (``LocalSource``) or a gallery sharded
  across processes passing by (``ShardedSource``);
- ``score``: the canonical score and the certified bound on the fast product's error;
- ``scan``: a block of queries against a block of items: positives, band, counts surely
  above it, pairs inside it;
- ``decide``: the in-band pairs re-scored canonically: ``s*``, ties, order at ``s*``;
- ``engine``: the walk over the blocks, the counts summed over directions and processes;
- ``budget``: every size, from ``chunk_bytes``; ``workers``: the CPU's worker threads;
  ``progress``: the optional progress bar.

Nothing here is a Metric or reads a metric's state."""
