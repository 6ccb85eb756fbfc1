"""Entry point of the ``vllm-kvevict`` tool: one sub-command per module in this package.

Each sub-command module exposes ``register(subparsers)``, which adds its parser and sets ``handler`` to a
function ``(argparse.Namespace) -> int``. Modules are imported only when listed here, so that a heavy
import (torch, vLLM) is paid only by the sub-command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES: tuple[str, ...] = (
    "vllm_kvevict.cli.prepare_model",
    "vllm_kvevict.cli.methods",
    "vllm_kvevict.cli.eval",
    "vllm_kvevict.cli.bench",
    "vllm_kvevict.cli.soak",
    "vllm_kvevict.cli.calibrate",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-kvevict", description="Per-head KV-cache eviction for vLLM: tools."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
