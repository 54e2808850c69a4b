"""Self-distillation corpus builder for chat targets (Magpie-style prompts, the target's own answers).

    python -m tools.corpus.build --target smollm2 --out assets/corpus/smollm2 --work /tmp/corpus_work --seed 0

The runtime side (reading the corpus, caching target features) is flashmm.train.corpus.
"""
