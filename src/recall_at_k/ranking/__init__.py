"""The embedding ranking: one engine, one plan, one budget; a module a step.

``EmbeddingRecallAtK`` (``compute()``, ``query_outcomes()``, ``protocol_report()``) and
``functional.embedding_recall_at_k`` build one :mod:`~recall_at_k.ranking.plan` and hand
it to :func:`recall_at_k.ranking.engine.rank`; the steps below it:

- :mod:`~recall_at_k.ranking.stored`: the stored rows, read without a whole copy (every
  process's under DDP);
- :mod:`~recall_at_k.ranking.plan`: stored rows -> sides -> the one copy in label order;
- :mod:`~recall_at_k.ranking.blocks`: the blocks a ranking reads: one block holding the
  gallery (:class:`~recall_at_k.ranking.blocks.LocalSource`) or a gallery sharded
  across processes passing by (:class:`~recall_at_k.ranking.blocks.ShardedSource`);
- :mod:`~recall_at_k.ranking.score`: the canonical score and the certified bound on the
  fast product's rounding error;
- :mod:`~recall_at_k.ranking.scan`: a block of queries against a block of items: the
  positives, the band, the counts surely above it, the pairs inside it;
- :mod:`~recall_at_k.ranking.decide`: the in-band pairs re-scored canonically: ``s*``,
  the ties, the order at ``s*``;
- :mod:`~recall_at_k.ranking.engine`: the walk over the blocks (tiles, leave-one-out
  squares, sharded passes), the counts summed over directions and processes;
- :mod:`~recall_at_k.ranking.budget`: every size, from ``chunk_bytes``;
  :mod:`~recall_at_k.ranking.workers`: the CPU's worker threads;
  :mod:`~recall_at_k.ranking.progress`: the optional progress bar.

Nothing here is a Metric, and nothing here reads a metric's state.
"""
