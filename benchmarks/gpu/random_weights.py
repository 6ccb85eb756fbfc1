"""A seeded random checkpoint of the model's architecture, made on the GPU host (weights never travel).

    python3 -m benchmarks.gpu.random_weights CONFIG_DIR OUT_DIR [--seed 0] [--qk-scale 3]

The reference check needs vLLM and HF transformers to hold the same weights, which ``--load-format dummy``
does not give HF. This writes HF's own initialisation of the config (normal, ``initializer_range``) to
``OUT_DIR/model.safetensors`` next to a copy of the config and tokenizer. The query and key projections are
multiplied by ``--qk-scale`` so that attention is peaked, as in a trained model, and evicting entries moves
the output measurably (with HF's init alone every head attends almost uniformly).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def make_checkpoint(config_dir: Path, out: Path, seed: int = 0, qk_scale: float = 3.0) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for path in config_dir.iterdir():
        if path.is_file():
            shutil.copyfile(path, out / path.name)
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(str(config_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    model.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--qk-scale", type=float, default=3.0)
    args = parser.parse_args(argv)
    print(make_checkpoint(args.config_dir, args.out, args.seed, args.qk_scale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
