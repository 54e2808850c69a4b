"""The drafters' networks (torch modules and what trains them), apart from the methods that run them:
``eagle3_net`` (the EAGLE-3 head), ``flash_modules`` (FLASH's decoder, visual compressor and units),
``medusa_net``, ``hydra_net`` and ``mtp_net`` (the draft heads and multi-token-prediction modules),
``distill`` (a draft LM's distillation objective: the target's distribution on the draft's rows and
the divergences, shared by online drafting and offline training)."""
