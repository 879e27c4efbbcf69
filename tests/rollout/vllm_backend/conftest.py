"""Fixtures the vLLM test modules share."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def untied_model_dir(tiny_model_dir, tmp_path_factory):
    """A copy of the tiny model whose output head is its own tensor (the embeddings' values, untied): vLLM's CPU
    build keeps a tied head's packed weights stale after an in-server reload, which the tests of a full sync avoid."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.config.tie_word_embeddings = False
    out = tmp_path_factory.mktemp("untied")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)
