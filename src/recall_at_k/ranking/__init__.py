"""The embedding ranking: one subsystem, one module a step.

``EmbeddingRecallAtK.compute()`` and ``functional.embedding_recall_at_k`` call
:func:`recall_at_k.ranking.rank.rank` (one process) or
:func:`recall_at_k.ranking.rank.rank_shared` (queries shared among processes); the
steps below it, in the order a tile meets them:

- :mod:`~recall_at_k.ranking.score`: the canonical score, prepared rows, and the
  certified bound on the fast float32 product's rounding error;
- :mod:`~recall_at_k.ranking.gallery`: who is a query, who is in the gallery, label order,
  the fast products;
- :mod:`~recall_at_k.ranking.bands`: each query's band around its best positive, scans of
  a tile against it, the routes;
- :mod:`~recall_at_k.ranking.symmetric` (leave-one-out, each score once) and
  :mod:`~recall_at_k.ranking.panels` (CPU panels): the CPU routes;
- :mod:`~recall_at_k.ranking.decide`: canonical re-scoring of the in-band pairs, the
  counts;
- :mod:`~recall_at_k.ranking.rank`: the entry: pick a route, run it, turn the counts into
  a rank histogram, sum it over tiles and processes.

Nothing here is a Metric, and nothing here reads a metric's state.
"""
