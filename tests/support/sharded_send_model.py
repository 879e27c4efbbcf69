"""The tiny model tests/weight_transfer/test_sharded_send.py trains one step, sharded (in its ranks) or not."""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Tied and untied output head.
VARIANTS = ("tied", "untied")
#: The transfer bucket: a few tensors of the model, far below its size.
BUCKET_BYTES = 16 * 1024


def stepped_model(variant: str, before_step: Callable[[torch.nn.Module], None] = lambda m: None,
                  steps: int = 1) -> torch.nn.Module:
    """A seeded tiny Qwen2 (``variant`` head) after ``steps`` Adam steps on a fixed batch; ``before_step`` shards it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=variant == "tied")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    before_step(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model
