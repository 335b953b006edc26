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
