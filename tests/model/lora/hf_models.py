"""Tiny random Hugging Face models and PEFT adapters on them: the oracle of the LoRA tests."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96
# architecture -> (config class, model class, config fields)
KINDS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
    )),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )),
}  # fmt: skip


def make_hf(kind: str, path: Path, seed: int = 0, **changes: object) -> torch.nn.Module:
    """A tiny random float32 model of `kind` (its config fields changed by `changes`), saved at
    `path`; returned in eval mode."""
    import transformers

    config_cls, model_cls, fields = KINDS[kind]
    config = getattr(transformers, config_cls)(
        **{**fields, **changes}, bos_token_id=0, eos_token_id=1
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(path)
    return model


def randomize_lora_b(peft_model: torch.nn.Module, seed: int = 1) -> None:
    """PEFT starts B at zero (no change); random B makes every update show in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def tokens(n: int = 24, batch: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))
