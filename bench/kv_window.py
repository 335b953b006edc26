"""KV-cache bytes per token of local/global layer patterns beside MHA and GQA.

At the default run's shape (4 layers of 4 heads of 64, context 128) and GPT-2 124M's (12
layers of 12 heads of 64, context 1024), float32, one sequence filled to its context:

    MHA        every layer caches every token's keys and values
    GQA        a key/value head per 4 query heads
    1:1, 5:1   GPTConfig.layer_windows from window_pattern: gpt-oss's alternation and
               Gemma 3's five local layers per global one, windows of context / 4; a
               windowed layer's WindowKVCache holds window - 1 tokens whatever the length

Each row gives the bytes the definition says (held tokens x 2 x kv_heads x head_dim x 4
bytes, over the context's tokens) and the bytes the model's caches really hold after a
prompt of half the context and decoding to its end (their buffers, doubling slack
included), measured by running the model (a 256-token vocabulary: the vocabulary does not
change the cache).

The second table is the engine's paged blocks (gptmini.generate.engine, blocks of 16): the
bytes of the blocks one sequence holds (`Engine.held_bytes`) once it has grown from a
prompt of half the context to its end, over its tokens. The global layers' pool grows with
the sequence; a local/global model's windowed layers have a pool of their own whose blocks
behind the window go back, and a model whose layers are all windowed gives back the blocks
behind its window from its one pool.

    python bench/kv_window.py
"""

import torch
from machine import cpu_description

from gptmini.generate.engine import Engine
from gptmini.model import GPTConfig, GPTModel, window_pattern

BLOCK = 16  # the engine's default block_size

SHAPES = {
    "default (4 x 256, context 128)": {"emb_dim": 256, "n_heads": 4, "n_layers": 4,
                                       "context_length": 128},
    "124M (12 x 768, context 1024)": {"emb_dim": 768, "n_heads": 12, "n_layers": 12,
                                      "context_length": 1024},
}


def variants(shape: dict) -> dict[str, dict]:
    """The options of each row at `shape`."""
    window, layers = shape["context_length"] // 4, shape["n_layers"]
    return {
        "MHA": {},
        "GQA (kv heads / 4)": {"n_kv_heads": shape["n_heads"] // 4},
        f"local/global 1:1 (window {window})": {
            "layer_windows": window_pattern("1:1", window=window, n_layers=layers)},
        f"local/global 3:1 (window {window})": {
            "layer_windows": window_pattern("3:1", window=window, n_layers=layers)},
        f"local/global 5:1 (window {window})": {
            "layer_windows": window_pattern("5:1", window=window, n_layers=layers)},
    }


def defined_bytes(cfg: GPTConfig, tokens: int) -> int:
    """Bytes the caches must hold for `tokens` tokens, by the definition."""
    per_token = 2 * (cfg.n_kv_heads or cfg.n_heads) * (cfg.emb_dim // cfg.n_heads) * 4
    held = [tokens if w is None else min(tokens, max(w - 1, 1))
            for w in (cfg.window_of(i) for i in range(cfg.n_layers))]
    return sum(held) * per_token


@torch.inference_mode()
def measured_bytes(cfg: GPTConfig) -> int:
    """Bytes of the caches' buffers after a prompt of half the context, then decoding one
    token at a time to its end."""
    torch.manual_seed(0)
    model = GPTModel(cfg).eval()
    caches = model.new_kv_caches()
    half = cfg.context_length // 2
    model(torch.randint(0, cfg.vocab_size, (1, half)), kv_caches=caches)
    for _ in range(cfg.context_length - half):
        model(torch.randint(0, cfg.vocab_size, (1, 1)), kv_caches=caches)
    return sum(cache.nbytes for cache in caches)


@torch.inference_mode()
def engine_held(cfg: GPTConfig) -> tuple[int, int, int]:
    """(bytes, global pool blocks, local pool blocks) the engine's blocks hold for one
    sequence at its last step: a prompt of half the context, then decoding to its end."""
    torch.manual_seed(0)
    engine = Engine(GPTModel(cfg).eval(), block_size=BLOCK, max_batch=1)
    half = cfg.context_length // 2
    request = engine.add_request(torch.randint(0, cfg.vocab_size, (half,)).tolist(),
                                 max_new_tokens=cfg.context_length - half)
    held = (0, 0, 0)
    while engine.has_work:
        engine.step()
        if not request.done:  # (once done, its blocks are back)
            local = 0 if engine.local_blocks is None else engine.local_blocks.in_use()
            held = (engine.held_bytes, engine.blocks.in_use(), local)
    return held


def main():
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"machine: {cpu_description()}; float32, one sequence filled to its context\n")
    for shape_name, shape in SHAPES.items():
        print(shape_name)
        print(f"  {'':<36} {'bytes/token':>12} {'measured':>12} {'vs MHA':>7}")
        mha = None
        for name, options in variants(shape).items():
            cfg = GPTConfig(vocab_size=256, drop_rate=0.0, position="rope", **shape, **options)
            tokens = cfg.context_length
            defined = defined_bytes(cfg, tokens) / tokens
            measured = measured_bytes(cfg) / tokens
            mha = mha or defined
            print(f"  {name:<36} {defined:>12,.0f} {measured:>12,.0f} {defined / mha:>7.2f}")
        print()
    print(f"the engine's paged blocks ({BLOCK} tokens) held by one sequence at its end\n")
    for shape_name, shape in SHAPES.items():
        print(shape_name)
        print(f"  {'':<36} {'global blocks':>13} {'local blocks':>12} {'bytes/token':>12} "
              f"{'vs MHA':>7}")
        mha = None
        for name, options in variants(shape).items():
            cfg = GPTConfig(vocab_size=256, drop_rate=0.0, position="rope", **shape, **options)
            held, global_blocks, local_blocks = engine_held(cfg)
            per_token = held / cfg.context_length
            mha = mha or per_token
            local = "-" if Engine.local_window(cfg) is None else f"{local_blocks}"
            print(f"  {name:<36} {global_blocks:>13} {local:>12} {per_token:>12,.0f} "
                  f"{per_token / mha:>7.2f}")
        print()


if __name__ == "__main__":
    main()
