"""The class head reads each sequence at its last real token, whichever side is padded; the
oracle is the model run on each sequence alone, unpadded."""

import pytest
import torch

from gptmini.finetune import accuracy_and_confusion, add_class_head, class_logits
from gptmini.model import GPTConfig, GPTModel


@pytest.mark.parametrize("position", ["learned", "rope"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_the_class_of_a_padded_batch_is_each_sequence_alone_at_its_last_token(side, position):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=50, context_length=12, emb_dim=16, n_heads=2,
                               n_layers=2, drop_rate=0.0, position=position))
    model = add_class_head(model, 3).double().eval()
    lengths = [12, 5, 1, 9]
    seqs = [torch.randint(0, 50, (n,)) for n in lengths]
    ids = torch.full((len(seqs), 12), 49)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        cols = slice(12 - len(seq), 12) if side == "left" else slice(0, len(seq))
        ids[row, cols], mask[row, cols] = seq, 1
    with torch.no_grad():
        batch = class_logits(model, ids, mask)
        alone = torch.stack([model(seq[None])[0, -1] for seq in seqs])
    assert batch.shape == (4, 3)
    torch.testing.assert_close(batch, alone, atol=1e-10, rtol=0)


def test_a_sequence_without_a_real_token_is_named():
    model = add_class_head(GPTModel(GPTConfig(vocab_size=50, context_length=8, emb_dim=16,
                                              n_heads=2, n_layers=1)), 2)
    with pytest.raises(ValueError, match="has no real token"):
        class_logits(model, torch.zeros(2, 4, dtype=torch.long),
                     torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]))


def test_accuracy_and_the_confusion_table_by_hand():
    labels = torch.tensor([0, 0, 1, 2, 2, 2])
    predicted = torch.tensor([0, 1, 1, 2, 0, 2])
    accuracy, confusion = accuracy_and_confusion(predicted, labels, 3)
    assert accuracy == 4 / 6
    assert confusion.tolist() == [[1, 1, 0], [0, 1, 0], [1, 0, 2]]


def test_the_books_position_minus_one_reads_padding_where_the_last_real_token_does_not():
    """The book's chapter 6 reads `logits[:, -1, :]` of batches padded to the longest text
    (its SpamDataset pads with <|endoftext|>): a shorter text is classified at a pad. Ours
    reads each row's last real token; docs/finetuning.md says so beside the book's 95.67%."""
    torch.manual_seed(0)
    model = add_class_head(GPTModel(GPTConfig(vocab_size=50, context_length=8, emb_dim=16,
                                              n_heads=2, n_layers=2, drop_rate=0.0)), 2)
    model = model.double().eval()
    short = torch.tensor([5, 6, 7])
    ids = torch.tensor([[5, 6, 7, 49, 49, 49]])  # right-padded, as both pad for training
    mask = torch.tensor([[1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        alone = model(short[None])[0, -1]
        book = model(ids)[0, -1]
        ours = class_logits(model, ids, mask)[0]
    torch.testing.assert_close(ours, alone, atol=1e-12, rtol=0)
    assert not torch.allclose(book, alone, atol=1e-3)
