"""The drafters' networks (torch modules and what trains them), apart from the methods that run them:
``eagle3_net`` (the EAGLE-3 head), ``flash_modules`` (FLASH's decoder, visual compressor and units),
``medusa_net``, ``hydra_net`` and ``mtp_net`` (the draft heads and multi-token-prediction modules),
``hydra_published_net`` (zankner/Hydra's published MLP heads, as that code computes them), ``vispec_net``
(ViSpec's published head: EAGLE's layer, a vision adaptor and a global visual feature),
``reduced_vocab`` (a draft LM over a reduced vocabulary: FastDraft's, PARD's, S2D's), ``pard_net``
(PARD's mask embedding), ``specdecpp_net`` (SpecDec++'s acceptance heads), ``kangaroo_net``
(Kangaroo's adapter), ``distill`` (a draft LM's distillation objective: the target's distribution
on the draft's rows and the divergences, shared by online drafting and offline training)."""
