"""Serving: what runs the engine for users. ``pipelines`` (CaptionPipeline over images and videos),
``cli`` with ``cli_options``, ``cli_generate`` and ``cli_export`` (the ``flashmm`` command),
``collate`` (items' processor outputs as one batch), ``chat`` (caption prompts through a chat
template), ``caption_results`` (result lines, shards, locks)."""
