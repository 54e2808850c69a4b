"""The engine: one draft → verify → commit loop over a batch of B >= 1 rows (``loop``), what
``model.generate``'s arguments become and what it returns (``generation``), and the public face that
puts a model and a drafter behind ``generate`` (``api``: ``flashmm.wrap``, ``SpeculativeModel``)."""
