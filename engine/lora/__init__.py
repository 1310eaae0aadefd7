"""LoRA adapters: read in PEFT's format, applied per row of a batch."""
