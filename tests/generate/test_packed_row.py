"""The engine's packed row: one step's sequences in one row, and how attention reads them."""

import torch

from gptmini.attention import MultiHeadAttention
from gptmini.attention.context import AttentionContext
from gptmini.generate.engine import PackedRow


def test_a_packed_row_lays_packed_tokens_out_one_sequence_per_row_and_back():
    """Three sequences with 2, 1 and 3 new tokens after 4, 6 and 0 cached ones: each row
    holds its own tokens, left-padded, its new tokens the last of its keys."""
    ragged = PackedRow([2, 1, 3], [4, 6, 0])
    packed = torch.arange(6.0).view(1, 1, 6, 1)  # token i carries the value i
    rows = ragged.unpack(packed)  # (3, 1, 3, 1)
    assert rows.shape == (3, 1, 3, 1)
    assert rows[0, 0, 1:, 0].tolist() == [0, 1] and rows[1, 0, 2:, 0].tolist() == [2]
    assert rows[2, 0, :, 0].tolist() == [3, 4, 5]
    assert torch.equal(ragged.pack(rows), packed)
    assert ragged.num_keys == 7 and ragged.context.num_tokens == 3
    allowed = ragged.context.dense()[:, 0]  # (3, 3 queries, 7 keys)
    # row 0: keys 1..6 are its 6 tokens; its last query (token 5) sees all of them
    assert allowed[0, 2].tolist() == [False] + [True] * 6
    assert allowed[0, 1].tolist() == [False] + [True] * 5 + [False]  # token 4: causal
    assert allowed[2, 0].tolist() == [False] * 4 + [True, False, False]  # its first token


def test_the_new_tokens_places_come_back_in_packed_order():
    """`new_of` picks the new tokens' values out of per-key rows: their places in their own
    sequences, sequence after sequence, are the positions the runner gives them."""
    ragged = PackedRow([2, 1, 3], [4, 6, 0])
    assert ragged.new_of(ragged.key_index).tolist() == [4, 5, 6, 0, 1, 2]


def test_attention_over_a_packed_row_is_each_sequence_alone():
    """What attention asks of the layout (unpack, context_for, pack) is enough: two
    sequences attended packed in one row give what each gives by itself."""
    torch.manual_seed(0)
    attention = MultiHeadAttention(8, 8, 16, 0.0, 2).double().eval()
    first, second = torch.randn(1, 3, 8).double(), torch.randn(1, 5, 8).double()
    layout = PackedRow([3, 5], [0, 0], attention.settings)

    class Cache:  # each row's keys, left-padded, as the engine's pool returns them
        def __len__(self):
            return 0  # nothing cached before the new tokens

        def update(self, keys, values, positions=None):
            return layout.unpack(keys), layout.unpack(values)  # (2, heads, 5, head_dim)

    positions = layout.new_of(layout.key_index)[None]  # (1, 8)
    context = AttentionContext.build(1, 8, positions=positions, uses_cache=True,
                                     ragged=layout, settings=attention.settings)
    packed = attention(torch.cat([first, second], 1), kv_cache=Cache(), context=context)
    assert torch.allclose(packed[:, :3], attention(first), atol=1e-12)
    assert torch.allclose(packed[:, 3:], attention(second), atol=1e-12)
