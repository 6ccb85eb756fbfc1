"""What one of the job's servers would resolve, without starting it: imports, config, model, stub lookups.

    PYTHONPATH=<from unpack.py> python3 -m benchmarks.gpu.preflight --role vanilla|eviction MODEL_DIR \
        [--mock-cuda] [--json PATH]

Runs in the bundle's environment. It parses the role's ``vllm serve`` flags (``serve_flags``) with vLLM's
own serve parser after loading the general plugins (the project's flags are added by its plugin), builds
the engine config as ``vllm serve`` does, constructs the model on the meta device (dummy weights: nothing
is loaded), and records every ``torch.ops._C`` lookup. ``--mock-cuda`` forces vLLM's CUDA platform on a
CPU machine (``cuda_mock``); on the GPU host the job runs it unmocked, seconds before starting a server.
Exit status 0 when every step passed; the JSON names each step's result either way.
"""

from __future__ import annotations

import argparse
import importlib
import json
import socket
import sys
import time
import traceback
from pathlib import Path

from benchmarks.gpu import serve_flags

#: Modules a server imports on the job's path (API server, engine core, V1 worker and runner, attention).
SERVER_MODULES = (
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.core",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.sample.sampler",
    "vllm.benchmarks.serve",
)
MAX_MODEL_LEN = 2048


class LookupTrace:
    """Every ``torch.ops._C.<name>`` looked up while active, and whether it resolved."""

    def __init__(self) -> None:
        import torch._ops

        self.looked_up: dict[str, bool] = {}
        self._namespace = torch._ops._OpNamespace
        self._original = self._namespace.__getattr__
        trace = self

        def traced(namespace, name):
            try:
                found = trace._original(namespace, name)
            except AttributeError:
                if namespace.name == "_C" and not name.startswith("__"):
                    trace.looked_up.setdefault(name, False)
                raise
            if namespace.name == "_C" and not name.startswith("__"):
                trace.looked_up[name] = True
            return found

        self._namespace.__getattr__ = traced

    def stop(self) -> None:
        self._namespace.__getattr__ = self._original


def serve_args(role: str, model_dir: str) -> list[str]:
    args = (serve_flags.vanilla_args(MAX_MODEL_LEN) if role == "vanilla"
            else serve_flags.eviction_args(MAX_MODEL_LEN))
    return [model_dir, *args]


def engine_config(role: str, model_dir: str):
    """The ``VllmConfig`` ``vllm serve <model_dir> <role's flags>`` builds (vllm/entrypoints/cli/serve.py)."""
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.plugins import load_general_plugins
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    load_general_plugins()
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(serve_args(role, model_dir))
    args.model = args.model_tag
    validate_parsed_serve_args(args)
    engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
    return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def construct_model(config) -> dict:
    """The model of ``config`` on the meta device, one process group of one (gloo)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.utils import initialize_model

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(1, 1)
        with torch.device("meta"):
            model = initialize_model(vllm_config=config)
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    attention = model.model.layers[0].self_attn.attn
    return {
        "triton_attention_subclass": isinstance(attention.impl, TritonAttentionImpl),
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "attention_backend": attention.attn_backend.get_name(),
        "attention_impl": f"{type(attention.impl).__module__}.{type(attention.impl).__qualname__}",
    }


def parse_serve_command(command: list[str]):
    """The ``VllmConfig`` of one ``... vllm.entrypoints.cli.main serve MODEL FLAGS`` command line."""
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(command[command.index("serve") + 1:])
    args.model = args.model_tag
    validate_parsed_serve_args(args)
    engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
    return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def parse_bench_command(command: list[str]) -> dict:
    """``vllm bench serve`` flags parsed by vLLM's own bench parser (vllm/benchmarks/serve.py)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(command[command.index("serve") + 1:])
    return {"dataset": args.dataset_name, "request_rate": args.request_rate, "num_prompts": args.num_prompts,
            "extra_body": args.extra_body}


def check_commands(path: Path) -> dict:
    """Every server and client command line a stage's ``--dry-run`` wrote to ``path``, parsed."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    commands = json.loads(path.read_text())
    servers = {}
    role_config = _CONFIG[:]
    for name, command in commands["servers"].items():
        servers[name] = _describe(parse_serve_command(command))
    _CONFIG[:] = role_config
    clients = {name: parse_bench_command(command) for name, command in commands.get("clients", {}).items()}
    return {"servers": servers, "clients": clients}


def shape_model(role: str, shape_dir: Path) -> dict:
    """A model shape's folder (``shapes.write_model_dir``) through the role's engine config onto the meta
    device: its config parses in vLLM and the architecture builds with the role's attention."""
    return construct_model(engine_config(role, str(shape_dir)))


def run(role: str, model_dir: str, mock_cuda: bool, commands: list[Path] = (), shape_dirs: list[Path] = ()
        ) -> dict:
    """Each step's result; ``ok`` is True when all passed."""
    result: dict = {"role": role, "serve_args": serve_args(role, model_dir)[1:], "steps": {}}
    trace = LookupTrace()

    def step(name, function):
        started = time.monotonic()
        try:
            value = function()
        except BaseException as error:  # noqa: BLE001 - recorded, the remaining steps depend on it
            result["steps"][name] = {"ok": False, "error": f"{type(error).__name__}: {error}",
                                     "traceback": traceback.format_exc(limit=-8)}
            raise
        result["steps"][name] = {"ok": True, "seconds": round(time.monotonic() - started, 2), "value": value}
        return value

    try:
        if mock_cuda:
            from benchmarks.gpu.cuda_mock import force_cuda_platform

            step("mock CUDA", force_cuda_platform)
        step("platform", _platform)
        step("server modules import", lambda: [importlib.import_module(m).__name__ for m in SERVER_MODULES])
        step("flash attention patched", _flash_attention)
        config = step("engine config", lambda: _describe(engine_config(role, model_dir)))
        del config
        for path in commands:
            step(f"command lines {path.name}", lambda path=path: check_commands(path))
        step("model on meta", lambda: construct_model(_current_config()))
        for path in shape_dirs:
            step(f"model on meta {path.name}", lambda path=path: shape_model(role, path))
        step("weak_ref_tensor", _weak_ref_tensor)
    except BaseException:  # noqa: BLE001 - the failed step is in the result
        pass
    finally:
        trace.stop()
    from benchmarks.gpu.vllm_tree import stub_op_names

    result["c_ops_looked_up"] = trace.looked_up
    result["stub_ops"] = stub_op_names()
    result["ok"] = all(s["ok"] for s in result["steps"].values()) and "model on meta" in result["steps"]
    return result


_CONFIG: list = []


def _describe(config) -> dict:
    _CONFIG[:] = [config]
    attention = config.attention_config.backend
    return {
        "attention_backend": getattr(attention, "name", str(attention)),
        "attention_backend_path": attention.get_path() if attention is not None else None,
        "custom_ops": list(config.compilation_config.custom_ops),
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "ir_op_priority": {k: list(v) for k, v in vars(config.kernel_config.ir_op_priority).items()
                           if k in serve_flags.IR_OP_PRIORITY},
        "block_size": config.cache_config.block_size,
        "cache_dtype": str(config.cache_config.cache_dtype),
        "kv_eviction": (config.additional_config or {}).get("kv_eviction"),
        "architecture": config.model_config.architectures[0],
        "max_model_len": config.model_config.max_model_len,
        "num_gpu_blocks_override": config.cache_config.num_gpu_blocks_override,
        "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
    }


def _current_config():
    return _CONFIG[0]


def _platform() -> dict:
    import importlib.metadata

    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise RuntimeError(f"vLLM's platform is {type(current_platform).__name__}, not CUDA")
    return {"platform": type(current_platform).__name__, "vllm_version": importlib.metadata.version("vllm"),
            "vllm_file": vllm.__file__, "device": current_platform.get_device_name()}


def _flash_attention() -> dict:
    import vllm.vllm_flash_attn as fa

    return {"imports": True, "fa_version_2_supported": bool(fa.is_fa_version_supported(2)),
            "fa_version_3_supported": bool(fa.is_fa_version_supported(3))}


def _weak_ref_tensor() -> bool:
    import torch
    from vllm.utils.torch_utils import weak_ref_tensor

    tensor = torch.arange(4.0)
    alias = weak_ref_tensor(tensor)
    return alias.data_ptr() == tensor.data_ptr() and alias.tolist() == tensor.tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--role", choices=("vanilla", "eviction"), required=True)
    parser.add_argument("--mock-cuda", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--commands", type=Path, nargs="*", default=[],
                        help="commands-*.json a stage's --dry-run wrote: each command line is parsed too")
    parser.add_argument("--shapes", type=Path, nargs="*", default=[],
                        help="model shape folders (benchmarks.gpu.shapes write): each built on meta too")
    args = parser.parse_args(argv)
    result = run(args.role, args.model_dir, args.mock_cuda, args.commands, args.shapes)
    text = json.dumps(result, indent=1, default=str)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
