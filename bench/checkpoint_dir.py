"""Random-weight Hugging Face directories in the real checkpoint layout, for the GPU benchmarks.

    python -m ballast.bench.checkpoint_dir SHAPE OUT_DIR [--device cuda] [--fp8]
    python -m ballast.bench.checkpoint_dir --list

Writes config.json, generation_config.json, safetensors shards of at most --shard-gib with
model.safetensors.index.json, and a real tokenizer (SmolLM2's byte-level BPE with its chat
template, the default model's), so `ballast serve`, `transformers serve` and `generate` all load
the directory as they would a downloaded checkpoint. Shapes: llama-1b / llama-3b / llama-8b
(Llama 3.2-1B, 3.2-3B, 3.1-8B), qwen3-next-6b (Qwen3-Next-80B-A3B's layers with 26 of its 512
experts: 6.2B parameters, the hybrid MoE of the GPU figures), qwen3-next-80b (the real config: 48
layers, 512 experts top-10; --fp8 writes the fine-grained FP8 layout of the released FP8
checkpoint: float8 weights with 128 x 128 block scales, ~80 GB instead of 160 GB), and tiny-llama /
tiny-qwen3-next, small stand-ins for a check on the CPU.

Weights are drawn on --device (cuda when there is one) in bfloat16, N(0, 0.02) for matrices, ones
for norm and bias vectors, one tensor at a time, so an 8B directory takes seconds plus the disk.
The parameter names and shapes are those of ballast's own model for the config (built on the meta
device), which match the Hugging Face checkpoints by construction.

The tokenizer: the GPU machine has no network, so it cannot fetch the default model. Its files
come from bench/tokenizer/smollm2.tar.gz, committed in the repository (645 KB), which
`--write-tokenizer-archive` rebuilds from the default model's GGUF where that can be fetched.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import shutil
import tarfile
import time
from pathlib import Path
from typing import Any

import torch
from ballast.bench.hybrid_decode import SMALL_HYBRID_MOE
from ballast.bench.kv_capacity import LLAMA3_8B, qwen3_next_80b
from ballast.models.arch.builtin import builtin_config
from ballast.models.arch.registry import build_model

TOKENIZER_ARCHIVE = Path(__file__).parent / "tokenizer" / "smollm2.tar.gz"
FP8_BLOCK = 128
TOKENIZER_VOCAB = 49152
SMOLLM2_SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, tied: bool) -> dict[str, Any]:
    return {
        **LLAMA3_8B,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": inter,
        "tie_word_embeddings": tied,
    }


def shape_config(name: str) -> dict[str, Any]:
    """The HF config.json contents of a named shape."""
    if name == "llama-1b":
        return _llama(2048, 16, 32, 8, 8192, tied=True)
    if name == "llama-3b":
        return _llama(3072, 28, 24, 8, 8192, tied=True)
    if name == "llama-8b":
        return dict(LLAMA3_8B)
    if name == "qwen3-next-6b":
        return {**qwen3_next_80b(), "num_experts": 26, "tie_word_embeddings": False}
    if name == "qwen3-next-80b":
        return {**qwen3_next_80b(), "tie_word_embeddings": False}
    # Small stand-ins of the same kinds, for a check on the CPU (the tokenizer's vocabulary).
    if name == "tiny-llama":
        return {**builtin_config("tiny-llama"), "vocab_size": TOKENIZER_VOCAB}
    if name == "tiny-qwen3-next":
        return {**SMALL_HYBRID_MOE, "vocab_size": TOKENIZER_VOCAB}
    raise ValueError(f"unknown shape {name!r}; one of {SHAPES}")


SHAPES = (
    "llama-1b",
    "llama-3b",
    "llama-8b",
    "qwen3-next-6b",
    "qwen3-next-80b",
    "tiny-llama",
    "tiny-qwen3-next",
)
_ARCH = {"llama": "LlamaForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


def parameter_shapes(config: dict[str, Any]) -> dict[str, torch.Size]:
    """Checkpoint tensor names and shapes: ballast's model for the config on the meta device."""
    model = build_model(config, dtype=torch.bfloat16, device="meta")
    return {name: p.shape for name, p in model.named_parameters()}  # a tied head once


def _fp8_quantized(name: str, shape: torch.Size) -> bool:
    # As in the released FP8 checkpoints: the linear layers' weights, not embeddings, the output
    # head, norms, the router gates or the small recurrent parameters.
    return (
        len(shape) == 2
        and name.endswith("proj.weight")
        and not name.endswith("shared_expert_gate.weight")
        and min(shape) >= FP8_BLOCK
    )


def random_tensors(
    name: str, shape: torch.Size, device: torch.device, gen: torch.Generator, fp8: bool
) -> dict[str, torch.Tensor]:
    """One parameter's tensors on the host: the weight (and its block scales under FP8)."""
    if len(shape) < 2:
        if name.endswith("A_log"):  # decay rates of the gated delta rule: A = -exp(A_log) in -(1..16)
            t = torch.empty(shape, device=device).uniform_(0, math.log(16), generator=gen)
            return {name: t.to(torch.bfloat16).cpu()}
        return {name: torch.ones(shape, dtype=torch.bfloat16)}
    w = torch.empty(shape, device=device, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
    if not (fp8 and _fp8_quantized(name, shape)):
        return {name: w.cpu()}
    rows, cols = -(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)
    # Every block of N(0, 0.02) has about the same range: one scale per block maps it to e4m3's 448.
    scale = torch.full((rows, cols), 0.12 / 448, dtype=torch.float32, device=device)
    q = (
        w.float()
        / scale.repeat_interleave(FP8_BLOCK, 0)[: shape[0]].repeat_interleave(FP8_BLOCK, 1)[:, : shape[1]]
    )
    return {name: q.to(torch.float8_e4m3fn).cpu(), name + "_scale_inv": scale.cpu()}


def write_dir(
    name: str, out: Path, device: torch.device, fp8: bool = False, shard_gib: float = 4.0
) -> dict[str, Any]:
    """Write the directory; returns what was written (parameters, bytes, shards, seconds)."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    config = shape_config(name)
    shapes = parameter_shapes(config)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)
    shard_bytes = int(shard_gib * (1 << 30))
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for pname, shape in shapes.items():
        tensors = random_tensors(pname, shape, device, gen, fp8)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if sizes[-1] and sizes[-1] + nbytes > shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1].update(tensors)
        sizes[-1] += nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards, strict=True):
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(sizes)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    hf = {
        **config,
        **SMOLLM2_SPECIAL,
        "architectures": [_ARCH[config["model_type"]]],
        "torch_dtype": "bfloat16",
    }
    if fp8:
        hf["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    generation = {**SMOLLM2_SPECIAL, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(out)
    params = sum(math.prod(s) for s in shapes.values())
    return {
        "shape": name,
        "dir": str(out),
        "parameters": params,
        "bytes": total,
        "shards": len(files),
        "fp8": fp8,
        "seconds": time.perf_counter() - t0,
    }


def write_tokenizer(out: Path) -> None:
    """The default model's tokenizer files, from the archive committed in the repository."""
    with tarfile.open(TOKENIZER_ARCHIVE) as tar:
        for member in tar.getmembers():
            if member.isfile() and "/" not in member.name.removeprefix("./"):
                data = tar.extractfile(member)
                assert data is not None
                (out / Path(member.name).name).write_bytes(data.read())


def write_tokenizer_archive() -> None:
    """Rebuild the archive from the default model's GGUF (needs it fetched, i.e. a network once)."""
    from ballast.models.weights.default_model import default_model_path
    from ballast.models.weights.gguf_loader import load_gguf

    tmp = TOKENIZER_ARCHIVE.parent / ".tokenizer-files"
    shutil.rmtree(tmp, ignore_errors=True)
    load_gguf(default_model_path()).tokenizer.save_pretrained(tmp)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in sorted(tmp.iterdir()):
            info = tarfile.TarInfo(f.name)
            data = f.read_bytes()
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    shutil.rmtree(tmp)
    TOKENIZER_ARCHIVE.parent.mkdir(exist_ok=True)
    TOKENIZER_ARCHIVE.write_bytes(buf.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("shape", nargs="?", choices=SHAPES)
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fp8", action="store_true", help="float8 weights with 128 x 128 block scales")
    parser.add_argument("--shard-gib", type=float, default=4.0)
    parser.add_argument("--list", action="store_true", help="print each shape's parameter count")
    parser.add_argument("--write-tokenizer-archive", action="store_true")
    args = parser.parse_args()
    if args.write_tokenizer_archive:
        write_tokenizer_archive()
        print(f"wrote {TOKENIZER_ARCHIVE}")
        return
    if args.list:
        for name in SHAPES:
            params = sum(math.prod(s) for s in parameter_shapes(shape_config(name)).values())
            print(f"{name:<15} {params / 1e9:6.2f}B parameters, bf16 {2 * params / 2**30:6.1f} GiB")
        return
    if args.shape is None or args.out is None:
        parser.error("give SHAPE and OUT_DIR (or --list)")
    info = write_dir(args.shape, args.out, torch.device(args.device), args.fp8, args.shard_gib)
    print(
        f"{info['shape']}: {info['parameters'] / 1e9:.2f}B parameters, {info['bytes'] / 2**30:.1f} GiB in "
        f"{info['shards']} shards, {info['seconds']:.1f}s -> {info['dir']}"
    )


if __name__ == "__main__":
    main()
