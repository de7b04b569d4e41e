"""A tiny random Llama config for tests that need a model but not a good one."""

from transformers import LlamaConfig


def tiny_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.3, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
