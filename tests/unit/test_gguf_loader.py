"""GGUF loader: tiny Llama GGUFs written with gguf.GGUFWriter checked against what was written
and against transformers' own GGUF loading, the tokenizer against the tokenizer the file was made
from, and typed errors. (Dequantization and q/k row order: test_gguf_quants.py.)"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from ballast.models.weights.gguf_loader import gguf_tokenizer, hf_tensor_name, load_gguf
from ballast.models.weights.gguf_reader import GGUFError, GGUFUnsupportedError, read_gguf
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as QT
from ggufdata import F16_FIELDS, hf_to_gguf_permute, random_blocks
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# ---- tiny Llama GGUFs ---------------------------------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
CORPUS = [
    "The capital of France is Paris. It has 2148271 people in 105 square km.",
    "Hello world! What's up? I'm fine, thanks; we'll see.",
    "def add(a, b):\n    return a + b  # 12 + 30 = 42",
    "Numbers like 3.14159 and 2026 split into digits for some tokenizers.",
] * 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# which type each tensor kind is stored as, per layer: every supported type appears
LAYER_TYPES = [
    {"attn_q": QT.Q4_K, "attn_k": QT.Q6_K, "attn_v": QT.Q4_0, "attn_output": QT.Q4_1,
     "ffn_gate": QT.F16, "ffn_up": QT.BF16, "ffn_down": QT.Q8_0},
    {"attn_q": QT.Q6_K, "attn_k": QT.Q4_K, "attn_v": QT.Q8_0, "attn_output": QT.F32,
     "ffn_gate": QT.Q4_1, "ffn_up": QT.Q4_0, "ffn_down": QT.Q4_K},
]  # fmt: skip


def train_tokenizer(pre: str) -> Tokenizer:
    """A small byte-level BPE trained here: the reference the GGUF's tokenizer must reproduce."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if pre == "smollm":
        # trained without it, so digit merges exist: a loader that ignored the digit split
        # would merge "20" where the reference keeps "2", "0"
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    return tok


@dataclass
class TinyGGUF:
    path: Path
    expected: dict[str, np.ndarray]  # HF name -> float32 values in HF row order
    reference_tokenizer: Tokenizer
    vocab_size: int


def _tensor_data(qtype: QT, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Data as GGUFWriter takes it: packed uint8 rows for block types, else float arrays."""
    rows, cols = shape
    if qtype in F16_FIELDS:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        return random_blocks(qtype, rows * cols // block, rng).reshape(rows, cols // block * block_bytes)
    values = rng.standard_normal(shape).astype(np.float32) * 0.05
    if qtype == QT.BF16:
        return quants.quantize(values, QT.BF16)
    return values.astype(np.float16) if qtype == QT.F16 else values


# Two layers' quant types: layer 0 every linear 4-bit; layer 1 attention with one Q8_0 part (held
# dense: a block is packed whole or not at all), the MLP 4-bit.
MIXED_Q4_LAYERS = [
    {"attn_q": QT.Q4_1, "attn_k": QT.Q4_0, "attn_v": QT.Q4_1, "attn_output": QT.Q4_1,
     "ffn_gate": QT.Q4_1, "ffn_up": QT.Q4_0, "ffn_down": QT.Q4_1},
    {"attn_q": QT.Q4_1, "attn_k": QT.Q8_0, "attn_v": QT.Q4_1, "attn_output": QT.Q4_1,
     "ffn_gate": QT.Q4_1, "ffn_up": QT.Q4_1, "ffn_down": QT.Q4_1},
]  # fmt: skip


def write_tiny_llama(
    path: Path,
    pre: str = "gpt2",
    tied: bool = True,
    seed: int = 0,
    arch: str = "llama",
    extra_tokens: tuple[str, ...] = (),
    rope_freqs: np.ndarray | None = None,
    layer_types: list[dict[str, QT]] | None = None,
) -> TinyGGUF:
    """A 2-layer model of `arch` (llama, qwen2: q/k/v biases, qwen3: q/k norms) with every
    supported tensor type; only llama's q/k rows are permuted, as llama.cpp's converter does."""
    rng = np.random.default_rng(seed)
    tok = train_tokenizer(pre)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__) + list(extra_tokens)
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    # qwen3 as in the real ones: heads * head_dim != hidden (transformers assumes its 128)
    head_dim = 128 if arch == "qwen3" else HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-test")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)  # llama.cpp writes these
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, qtype: QT, shape: tuple[int, ...], n_head: int | None = None) -> None:
        data = (
            rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
            if len(shape) == 1
            else _tensor_data(qtype, (shape[0], shape[1]), rng)
        )
        expected[hf_tensor_name(gguf_name)] = quants.dequantize(data.view(np.uint8), qtype).reshape(shape)
        w.add_tensor(gguf_name, hf_to_gguf_permute(data, n_head) if n_head else data, raw_dtype=qtype)

    add("token_embd.weight", QT.Q8_0, (len(tokens), HIDDEN))
    for i, types in enumerate(layer_types or LAYER_TYPES):
        add(f"blk.{i}.attn_norm.weight", QT.F32, (HIDDEN,))
        add(f"blk.{i}.ffn_norm.weight", QT.F32, (HIDDEN,))
        permuted = arch == "llama"
        add(
            f"blk.{i}.attn_q.weight",
            types["attn_q"],
            (HEADS * head_dim, HIDDEN),
            n_head=HEADS if permuted else None,
        )
        add(
            f"blk.{i}.attn_k.weight",
            types["attn_k"],
            (KV_HEADS * head_dim, HIDDEN),
            n_head=KV_HEADS if permuted else None,
        )
        if arch == "qwen2":
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                add(f"blk.{i}.attn_{proj}.bias", QT.F32, (rows * head_dim,))
        if arch == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", QT.F32, (head_dim,))
            add(f"blk.{i}.attn_k_norm.weight", QT.F32, (head_dim,))
        add(f"blk.{i}.attn_v.weight", types["attn_v"], (KV_HEADS * head_dim, HIDDEN))
        add(f"blk.{i}.attn_output.weight", types["attn_output"], (HIDDEN, HEADS * head_dim))
        add(f"blk.{i}.ffn_gate.weight", types["ffn_gate"], (FFN, HIDDEN))
        add(f"blk.{i}.ffn_up.weight", types["ffn_up"], (FFN, HIDDEN))
        add(f"blk.{i}.ffn_down.weight", types["ffn_down"], (HIDDEN, FFN))
    add("output_norm.weight", QT.F32, (HIDDEN,))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if not tied:
        add("output.weight", QT.Q6_K, (len(tokens), HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return TinyGGUF(path, expected, tok, len(tokens))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyGGUF:
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_metadata_and_tensor_table_match_gguf_reader(tiny: TinyGGUF) -> None:
    ours = read_gguf(tiny.path)
    ref = gguf.GGUFReader(tiny.path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's pseudo-fields for the header
        want = field.contents()
        got = ours.metadata[key]
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    assert set(ours.metadata) == {k for k in ref.fields if not k.startswith("GGUF.")}
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type
        assert info.shape == tuple(reversed([int(d) for d in t.shape]))
        assert np.array_equal(ours.raw(t.name), t.data.view(np.uint8).reshape(-1))


def test_tensors_are_what_was_written_in_hf_order(tiny: TinyGGUF) -> None:
    model = load_gguf(tiny.path)
    assert set(model.tensors) == set(tiny.expected)
    for name, want in tiny.expected.items():
        got = model.tensors[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, name
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7, err_msg=name)


def test_config_maps_the_metadata(tiny: TinyGGUF) -> None:
    cfg = load_gguf(tiny.path).config
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (HIDDEN, FFN, LAYERS)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        HEADS,
        KV_HEADS,
        HIDDEN // HEADS,
    )
    assert cfg["vocab_size"] == tiny.vocab_size
    assert cfg["max_position_embeddings"] == 512
    assert cfg["rope_theta"] == 50000.0 and cfg["rope_scaling"] is None
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert cfg["tie_word_embeddings"] is True
    vocab = tiny.reference_tokenizer.get_vocab()
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (vocab["<|im_start|>"], vocab["<|im_end|>"])


def test_untied_output_is_loaded_as_lm_head(tmp_path: Path) -> None:
    tiny = write_tiny_llama(tmp_path / "untied.gguf", tied=False, seed=3)
    model = load_gguf(tiny.path)
    assert model.config["tie_word_embeddings"] is False
    np.testing.assert_allclose(
        model.tensors["lm_head.weight"].numpy(), tiny.expected["lm_head.weight"], rtol=1e-6
    )


def test_llama3_rope_freqs_become_llama3_rope_parameters(tmp_path: Path) -> None:
    """llama.cpp stores Llama 3.1 rope scaling as per-frequency divisors; the config we derive
    must make transformers compute the same frequencies as the original parameters."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def inv_freq(config: dict[str, object]) -> torch.Tensor:
        return ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**config), "cpu")[0].double()

    original = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip
    base = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "rope_theta": 50000.0}  # the writer's theta
    head_dim = HIDDEN // HEADS
    plain = 50000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    want = inv_freq({**base, "rope_scaling": original})
    assert not torch.allclose(want, plain)  # the scaling does change some frequencies
    tiny = write_tiny_llama(tmp_path / "llama3.gguf", rope_freqs=(plain / want).numpy())
    model = load_gguf(tiny.path)
    assert "rope_freqs.weight" not in model.tensors and set(model.tensors) == set(tiny.expected)
    assert model.config["rope_scaling"]["rope_type"] == "llama3"
    got = inv_freq({**base, "rope_scaling": model.config["rope_scaling"]})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path: Path) -> None:
    tiny = write_tiny_llama(tmp_path / "odd.gguf", rope_freqs=np.linspace(1.0, 3.0, HIDDEN // HEADS // 2))
    with pytest.raises(GGUFUnsupportedError, match="rope_freqs"):
        load_gguf(tiny.path)


def test_bfloat16_load(tiny: TinyGGUF) -> None:
    model = load_gguf(tiny.path, dtype=torch.bfloat16)
    for name, want in tiny.expected.items():
        assert model.tensors[name].dtype == torch.bfloat16
        assert torch.equal(model.tensors[name], torch.from_numpy(want).to(torch.bfloat16)), name


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_matches_transformers_gguf_loading(tmp_path: Path, arch: str) -> None:
    """transformers dequantizes through gguf-py and undoes the permutation itself: same names,
    same values, and a model built by transformers from our config and tensors gives its logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = write_tiny_llama(tmp_path / f"{arch}.gguf", arch=arch, seed=7)
    ref = AutoModelForCausalLM.from_pretrained(
        str(tiny.path.parent), gguf_file=tiny.path.name, dtype=torch.float32
    )
    ref_state = ref.state_dict()
    model = load_gguf(tiny.path)
    assert set(ref_state) - set(model.tensors) == {"lm_head.weight"}  # tied: transformers lists it too
    for name, got in model.tensors.items():
        torch.testing.assert_close(got, ref_state[name], rtol=1e-6, atol=1e-7, msg=name)

    config = AutoConfig.for_model(**model.config)
    ours = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = ours.load_state_dict(model.tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    ids = torch.tensor([[5, 17, 42, 99, 7, 250, 3]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


# ---- tokenizer ----------------------------------------------------------------------------------

TEXTS = [
    "Hello world! What's up?",
    "The year 2026 has 365 days; pi is 3.14159.",
    "  leading spaces and\ttabs\nnewlines  ",
    "unicode: café, naïve, 東京, emoji 🙂",
    "<|im_start|>user\nHi<|im_end|>",
]


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
def test_tokenizer_reproduces_the_source_tokenizer(tmp_path: Path, pre: str) -> None:
    tiny = write_tiny_llama(tmp_path / f"{pre}.gguf", pre=pre)
    tok = gguf_tokenizer(tiny.path)
    for text in TEXTS:
        want = tiny.reference_tokenizer.encode(text).ids
        assert tok.encode(text) == want, text
        assert tok.decode(want) == text
    assert tok.convert_ids_to_tokens(tok.encode("<|im_end|>")) == ["<|im_end|>"]  # control tokens stay whole


def test_llama3_pre_takes_vocabulary_pieces_whole(tmp_path: Path) -> None:
    """Llama 3 vocabularies hold pieces no merge sequence builds; llama.cpp and tokenizer.json
    (ignore_merges) take them whole. Other pre-tokenizers merge byte by byte."""
    ids = {}
    for pre in ("llama-bpe", "gpt2"):
        tiny = write_tiny_llama(tmp_path / f"{pre}.gguf", pre=pre, extra_tokens=("zzqq",))
        ids[pre] = gguf_tokenizer(tiny.path).encode("zzqq")
    assert ids["llama-bpe"] == [tiny.vocab_size - 1]
    assert len(ids["gpt2"]) > 1


def test_tokenizer_specials_and_chat_template(tiny: TinyGGUF) -> None:
    tok = gguf_tokenizer(tiny.path)
    vocab = tiny.reference_tokenizer.get_vocab()
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert tok.eos_token_id == vocab["<|im_end|>"]
    assert tok.encode("Hi")[0] != tok.bos_token_id  # add_bos_token is false in the file
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert len(tok) == tiny.vocab_size


def test_tokenizer_matches_transformers_gguf_tokenizer(tiny: TinyGGUF) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(tiny.path.parent), gguf_file=tiny.path.name)
    ours = gguf_tokenizer(tiny.path)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text


# ---- errors -------------------------------------------------------------------------------------


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(GGUFError, match="not a GGUF"):
        read_gguf(bad)


def test_truncated_file(tiny: TinyGGUF, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.path.read_bytes()[:5000])
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf(cut)


def _write_minimal(path: Path, arch: str, tensor_name: str, pre: str | None = None) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    if pre is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(["a", "b"])
        w.add_token_merges([])
    w.add_tensor(tensor_name, np.zeros((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    _write_minimal(tmp_path / "a.gguf", "falcon", "token_embd.weight")
    with pytest.raises(GGUFUnsupportedError, match="falcon"):
        load_gguf(tmp_path / "a.gguf")


def test_unknown_tensor_is_named(tmp_path: Path) -> None:
    with pytest.raises(GGUFUnsupportedError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_unknown_pre_tokenizer_is_named(tmp_path: Path) -> None:
    _write_minimal(tmp_path / "p.gguf", "llama", "token_embd.weight", pre="martian")
    with pytest.raises(GGUFUnsupportedError, match="martian"):
        gguf_tokenizer(tmp_path / "p.gguf")


def write_spm_vocab(path: Path) -> None:
    """A SentencePiece-style GGUF vocabulary (tokenizer.ggml.model "llama"): unk/bos/eos, 256 byte
    tokens, then pieces with scores in merge order and no merge list, as llama.cpp writes them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300))
    vocab = tok.get_vocab()
    pieces = sorted(vocab, key=vocab.__getitem__)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces])
    w.add_token_types([2, 3, 3, *[6] * 256, *[1] * len(pieces)])
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((259 + len(pieces), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_vocabulary_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_spm_vocab(tmp_path / "spm.gguf")
    ours = gguf_tokenizer(tmp_path / "spm.gguf")
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["Hello world! What's up?", "The capital of France is Paris.", "café 🙂 東京", "a\nb 42"]:
        # without specials: transformers 5.17 adds no BOS here, 5.24 does
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        ids = ours.encode(text)
        assert ids[0] == 1  # BOS, as llama.cpp adds for SentencePiece vocabularies
        assert ours.decode(ids, skip_special_tokens=True) == text
    # Leading spaces: SentencePiece (and llama.cpp) prefix one "▁" and keep every space, so the
    # text round-trips; transformers' converter drops one here, so it is not the reference.
    assert ours.convert_ids_to_tokens(ours.encode("  x"))[:4] == ["<s>", "▁", "▁", "▁"]
    assert ours.decode(ours.encode("  two"), skip_special_tokens=True) == "  two"
