"""Model shapes the GPU job benches on dummy weights: the bundled SmolLM2-135M, Qwen2.5-1.5B, Llama-3.1-8B.

    python3 -m benchmarks.gpu.shapes write MODEL_DIR DEST [NAME ...]   # DEST/<name>/ per shape
    python3 -m benchmarks.gpu.shapes describe [NAME ...] [--gpu-gib 79.1]  # sizes, pool, limits as JSON

Weights never travel to the GPU host (64 MiB per job), a config does: ``vllm serve --load-format dummy``
serves any shape at the speed of its real weights. Each shape is a record here; ``write`` turns it into a
model folder: ``config.json`` written from the record, and the bundled model's tokenizer (``MODEL_DIR``,
``vllm-kvevict prepare-model``'s folder) as a stand-in. A stand-in tokenizer does not change the timing:
``vllm bench serve``'s random dataset draws token ids from the tokenizer it is given and the server counts
and computes the same prompt lengths whatever ids they are; the embedding and LM head keep the shape's
vocabulary (the config's ``vocab_size``), so their weights and GEMMs are the real model's, and the ids the
sampler draws past the tokenizer's end decode to nothing (``--ignore-eos`` fixes the output length).
``write`` refuses a config whose vocabulary is smaller than the tokenizer's.

The KV pool is sized from the shape: bytes per token = 2 · layers · KV heads · head dim · dtype bytes, a
pool of ``POOL_REQUESTS`` vanilla requests of the shortest workload (``pool_blocks``), and each server's
``--gpu-memory-utilization`` covers its weights, that pool and an allowance for activations, the sampler and
one request's compaction buffer (``memory_share``): ``--num-gpu-blocks-override`` allocates the pool whatever
the profile found, so a share too small would eat the other server's memory.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

GIB = 2**30
BLOCK_SIZE = 16  # serve_flags.BLOCK_SIZE (not imported: this module is also read without the job's flags)
#: Vanilla holds this many requests of the shortest workload at once: it is KV-bound.
POOL_REQUESTS = 8
#: Two servers (vanilla and eviction) share one GPU; together they may ask for this share of its memory.
TWO_SERVERS_SHARE = 0.9
#: Memory a server holds beyond weights, KV pool and activations: CUDA context, cuBLAS/Triton workspaces.
FIXED_OVERHEAD_BYTES = 2 * GIB
#: vLLM's default ``max_num_seqs`` on a large GPU: the sampler's warm-up holds that many rows of logits.
SAMPLER_ROWS = 1024
#: The GPU the dry run sizes for when no GPU answers (an H100's ``torch.cuda.mem_get_info`` total).
NOMINAL_GPU_BYTES = int(79.1 * GIB)
#: What the model folder's shape record is called beside ``config.json``.
SHAPE_FILE = "kvevict-shape.json"
#: Files of the bundled model that are not its tokenizer (the shape's config replaces them).
NOT_TOKENIZER = ("config.json", "generation_config.json", "kvevict-model.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


class ShapeDoesNotFit(ValueError):
    """Two servers of this shape and pool do not fit the GPU's memory."""


@dataclass(frozen=True)
class Shape:
    """One model architecture, as its published config gives it (weights dummy)."""

    name: str
    served_model_name: str
    architecture: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rope: dict
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    #: Config fields of this architecture beyond the common ones.
    extra: dict = field(default_factory=dict)
    #: Why a field differs from the published model, shown in the results.
    note: str = ""

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV cache bytes of one token: keys and values of every layer and KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def parameters(self) -> int:
        """Parameter count of the architecture (embedding, layers, final norm, untied LM head)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        return self.parameters() * dtype_bytes

    def hf_config(self, bos_token_id: int, eos_token_id: int, pad_token_id: int | None) -> dict:
        """The ``config.json`` of the shape (transformers 5's form: ``rope_parameters``); the special token
        ids are the stand-in tokenizer's."""
        config = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": dict(self.rope),
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "use_cache": True,
            "dtype": "bfloat16",
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            **self.extra,
        }
        if pad_token_id is not None:
            config["pad_token_id"] = pad_token_id
        return config


SHAPES = {
    shape.name: shape
    for shape in (
        Shape(
            name="smollm2-135m", served_model_name="SmolLM2-135M-Instruct", architecture="LlamaForCausalLM",
            model_type="llama", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
            intermediate_size=1536, vocab_size=49152, rope={"rope_type": "default", "rope_theta": 100000.0},
            max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=True,
            extra={"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
            note="max_position_embeddings 32768 instead of the model's 8192, so that 16k prompts are served "
                 "(dummy weights: timing only; the learned scorer's fingerprint does not read it)",
        ),
        Shape(
            name="qwen2.5-1.5b", served_model_name="Qwen2.5-1.5B-shape", architecture="Qwen2ForCausalLM",
            model_type="qwen2", num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, hidden_size=1536,
            intermediate_size=8960, vocab_size=151936, rope={"rope_type": "default", "rope_theta": 1000000.0},
            max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True,
            extra={"use_sliding_window": False, "sliding_window": None, "max_window_layers": 28},
        ),
        Shape(
            name="llama-3.1-8b", served_model_name="Llama-3.1-8B-shape", architecture="LlamaForCausalLM",
            model_type="llama", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
            intermediate_size=14336, vocab_size=128256,
            rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
            extra={"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
        ),
    )
}


def tokenizer_size(model_dir: Path) -> int:
    """Token ids the tokenizer of ``model_dir`` can produce (its vocabulary and added tokens)."""
    data = json.loads((model_dir / "tokenizer.json").read_text())
    ids = set(data["model"]["vocab"].values()) | {token["id"] for token in data.get("added_tokens", [])}
    return max(ids) + 1


def write_model_dir(shape: Shape, tokenizer_dir: Path, dest: Path) -> Path:
    """``dest`` as a model folder of ``shape``: its config, ``tokenizer_dir``'s tokenizer files (no weights,
    no config of its own), and ``SHAPE_FILE`` naming the shape and the stand-in. Raises ValueError when the
    shape's vocabulary is smaller than the tokenizer's (ids past the embedding would be served)."""
    size = tokenizer_size(tokenizer_dir)
    if shape.vocab_size < size:
        raise ValueError(f"{shape.name}: vocab_size {shape.vocab_size} is smaller than the tokenizer's "
                         f"{size} ids ({tokenizer_dir}); a stand-in tokenizer needs a vocabulary at least "
                         "as large")
    base = json.loads((tokenizer_dir / "config.json").read_text())
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for path in sorted(tokenizer_dir.iterdir()):
        if path.is_file() and path.name not in NOT_TOKENIZER and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copyfile(path, dest / path.name)
    config = shape.hf_config(base["bos_token_id"], base["eos_token_id"], base.get("pad_token_id"))
    (dest / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    record = {"shape": asdict(shape), "tokenizer": f"stand-in: {tokenizer_dir.name}'s ({size} ids)"}
    (dest / SHAPE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return dest


def shape_of(model_dir: Path) -> Shape | None:
    """The shape a folder ``write_model_dir`` made was written from; None for any other folder."""
    path = model_dir / SHAPE_FILE
    if not path.is_file():
        return None
    return Shape(**json.loads(path.read_text())["shape"])


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-tokens // block_size)


def pool_blocks(prompt_len: int, output_len: int, requests: int = POOL_REQUESTS,
                block_size: int = BLOCK_SIZE) -> int:
    """KV pool in blocks that holds ``requests`` vanilla requests of ``prompt_len + output_len`` tokens."""
    return requests * blocks_for(prompt_len + output_len, block_size)


def vanilla_requests(pool: int, prompt_len: int, output_len: int, block_size: int = BLOCK_SIZE) -> int:
    """Vanilla requests of ``prompt_len + output_len`` tokens the pool holds to their end."""
    return pool // blocks_for(prompt_len + output_len, block_size)


def pool_bytes(shape: Shape, pool: int, dtype_bytes: int = 2, block_size: int = BLOCK_SIZE) -> int:
    return pool * block_size * shape.kv_bytes_per_token(dtype_bytes)


def activation_bytes(shape: Shape, max_model_len: int) -> int:
    """An allowance for one forward pass of ``max_model_len`` tokens (eviction computes a prompt in one step),
    the sampler's logits and one request's compaction buffer (its prompt's KV)."""
    tokens = max_model_len
    forward = tokens * (3 * shape.intermediate_size + 6 * shape.hidden_size) * 2
    sampler = SAMPLER_ROWS * shape.vocab_size * 4 * 2
    compaction = tokens * shape.kv_bytes_per_token()
    return forward + sampler + compaction


def server_bytes(shape: Shape, pool: int, max_model_len: int, dtype_bytes: int = 2) -> int:
    """What one server of ``shape`` holds: weights, the pool, activations, fixed overhead."""
    return (shape.weight_bytes() + pool_bytes(shape, pool, dtype_bytes)
            + activation_bytes(shape, max_model_len) + FIXED_OVERHEAD_BYTES)


def memory_share(shape: Shape, pool: int, max_model_len: int, gpu_bytes: int, dtype_bytes: int = 2) -> float:
    """Each server's ``--gpu-memory-utilization`` (two share the GPU), rounded up to 0.01. Raises
    :class:`ShapeDoesNotFit` when two of them exceed ``TWO_SERVERS_SHARE`` of ``gpu_bytes``."""
    need = server_bytes(shape, pool, max_model_len, dtype_bytes)
    share = math.ceil(100 * need / gpu_bytes) / 100
    if 2 * share > TWO_SERVERS_SHARE:
        raise ShapeDoesNotFit(
            f"{shape.name}: one server needs {need / GIB:.1f} GiB (weights {shape.weight_bytes() / GIB:.1f}, "
            f"pool {pool_bytes(shape, pool, dtype_bytes) / GIB:.1f}, activations "
            f"{activation_bytes(shape, max_model_len) / GIB:.1f}, fixed {FIXED_OVERHEAD_BYTES / GIB:.0f}); "
            f"two are over {TWO_SERVERS_SHARE:.0%} of this GPU's {gpu_bytes / GIB:.1f} GiB"
        )
    return share


def capacity_limit(prompt_len: int, output_len: int, budget: float) -> float:
    """Requests eviction holds per vanilla request on the same pool: (P + out) / (B + out), B = budget · P."""
    return (prompt_len + output_len) / (budget * prompt_len + output_len)


def decode_limit(shape: Shape, prompt_len: int, output_len: int, budget: float, batch: int,
                 dtype_bytes: int = 2) -> float:
    """Eviction's TPOT over vanilla's at equal batch if a decode step costs its HBM reads: (weights + kept KV
    reads) / (weights + all KV reads), each request's context at the middle of its output."""
    per_token = shape.kv_bytes_per_token(dtype_bytes)
    weights = shape.weight_bytes(dtype_bytes)
    kept = batch * (budget * prompt_len + output_len / 2) * per_token
    whole = batch * (prompt_len + output_len / 2) * per_token
    return (weights + kept) / (weights + whole)


def describe(shape: Shape, prompt_lens: tuple[int, ...], output_len: int, budgets: tuple[float, ...],
             gpu_bytes: int = NOMINAL_GPU_BYTES, max_model_len: int | None = None) -> dict:
    """Sizes, the pool, each server's memory share and the limits of every (prompt length, budget)."""
    pool = pool_blocks(min(prompt_lens), output_len)
    max_len = max_model_len or max(prompt_lens) + output_len + BLOCK_SIZE
    result = {
        "shape": shape.name, "parameters": shape.parameters(),
        "weight_gib": round(shape.weight_bytes() / GIB, 2),
        "kv_bytes_per_token": shape.kv_bytes_per_token(), "pool_blocks": pool,
        "pool_gib": round(pool_bytes(shape, pool) / GIB, 2), "max_model_len": max_len,
        "memory_share": memory_share(shape, pool, max_len, gpu_bytes), "limits": {},
    }
    for prompt_len in prompt_lens:
        batch = vanilla_requests(pool, prompt_len, output_len)
        result["limits"][prompt_len] = {
            "vanilla_requests": batch,
            **{str(b): {"capacity": round(capacity_limit(prompt_len, output_len, b), 2),
                        "decode": round(decode_limit(shape, prompt_len, output_len, b, batch), 3)}
               for b in budgets},
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="DEST/<name>/: config.json and the stand-in tokenizer")
    write.add_argument("model_dir", type=Path, help="the bundled model's folder (its tokenizer)")
    write.add_argument("dest", type=Path)
    write.add_argument("names", nargs="*", default=list(SHAPES))
    show = commands.add_parser("describe", help="sizes, pool, memory share and limits as JSON")
    show.add_argument("names", nargs="*", default=list(SHAPES))
    show.add_argument("--prompt-lens", default="8192,16384")
    show.add_argument("--output-len", type=int, default=256)
    show.add_argument("--gpu-gib", type=float, default=NOMINAL_GPU_BYTES / GIB)
    args = parser.parse_args(argv)
    if args.command == "write":
        for name in args.names:
            print(write_model_dir(SHAPES[name], args.model_dir, args.dest / name))
        return 0
    lens = tuple(int(n) for n in args.prompt_lens.split(","))
    described = [describe(SHAPES[n], lens, args.output_len, (0.25, 0.1), int(args.gpu_gib * GIB))
                 for n in args.names]
    print(json.dumps(described, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
