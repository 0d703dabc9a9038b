"""Low-rank adapters (LoRA): the adapter as gptserve holds it, its PEFT files, and its products."""
