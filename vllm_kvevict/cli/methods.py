"""``vllm-kvevict methods``: list every eviction method with its description and parameters."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "methods",
        help="list the eviction methods and their parameters",
        description="List every eviction method usable with --kv-eviction, its parameters and defaults.",
    )
    parser.set_defaults(handler=run)


def format_methods() -> list[str]:
    """One line per method: ``name  description  (param=default, ...)``."""
    from vllm_kvevict.policies.registry import available_methods

    methods = available_methods()
    width = max(len(m.name) for m in methods)
    lines = []
    for method in methods:
        params = ", ".join(f"{key}={value!r}" for key, value in method.params.items())
        lines.append(f"{method.name:<{width}}  {method.description}  ({params or 'no parameters'})")
    return lines


def run(args: argparse.Namespace) -> int:
    for line in format_methods():
        print(line)
    return 0
