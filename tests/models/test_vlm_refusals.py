"""Until vision-language GRPO exists, images never go silently unread: an image column or a vision-language
model is refused with one line that says what to do."""

from __future__ import annotations

import pytest
from datasets import Dataset

from grpo_ascend.data.prompts import check_prompt_dataset
from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.models.policy import load_causal_lm


@pytest.mark.parametrize("column", ["image", "images"])
def test_an_image_column_is_refused_naming_it(column):
    with pytest.raises(DataError, match=rf"image column\(s\) \['{column}'\].*remove_columns"):
        check_prompt_dataset(Dataset.from_list([{"prompt": "how many squares?", column: None}]))


def test_a_vision_language_model_is_refused():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=300, bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32))
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    with pytest.raises(ConfigError, match="vision-language model"):
        load_causal_lm(model)
