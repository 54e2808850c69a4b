"""The drafters' networks (torch modules), apart from the methods that run them: ``eagle3_net`` (the
EAGLE-3 head), ``flash_modules`` (FLASH's decoder, visual compressor and units)."""
