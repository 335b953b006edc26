"""Vocabulary growth: a chat template's new tokens get rows in a pretrained model, at the mean
of the rows it had, so its predictions do not move until fine-tuning teaches them."""

import torch

from gptmini.chat import GPTMINI, add_template_tokens
from gptmini.finetune import grow_vocab
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import get_tokenizer


def test_gptminis_tokens_grow_the_vocabulary_and_the_model_with_mean_rows():
    byte = get_tokenizer("byte")
    grown = add_template_tokens(byte, GPTMINI)
    assert grown.n_vocab == byte.n_vocab + 4 and add_template_tokens(grown, GPTMINI) is grown
    assert grown.encode("hi") == byte.encode("hi")  # old ids unchanged
    for tied in (True, False):
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=257, context_length=16, emb_dim=8, n_heads=2, n_layers=1,
                        tie_weights=tied)
        model = GPTModel(cfg).eval()
        ids = torch.tensor([[1, 2, 3]])
        before = model(ids)
        old_emb = model.tok_emb.weight.detach().clone()
        grow_vocab(model, grown.n_vocab)
        assert model.cfg.vocab_size == 261 and model.tok_emb.weight.shape[0] == 261
        assert (model.out_head.weight is model.tok_emb.weight) == tied
        torch.testing.assert_close(model.tok_emb.weight[257:],
                                   old_emb.mean(0).expand(4, -1))
        after = model(ids)
        torch.testing.assert_close(after[..., :257], before)  # the old logits do not move
        assert after.shape[-1] == 261
