"""The house rules that code review would otherwise have to remember."""

import ast
import pathlib
import re

from anygpu.backend.targets import TARGETS

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "anygpu"

# Imports go downward only.  A layer may import itself and the layers listed before it.
# quant, nn, optim and tunable share a rank (they may use each other); models, engine/serve follow.
LAYERS = ["backend", "kernels", "ops", "testing", "quant", "models", "engine", "serve", "bench", "diagnostics", "cli"]
RANK = {name: i for i, name in enumerate(LAYERS)}
RANK.update({"nn": RANK["quant"], "optim": RANK["quant"], "tunable": RANK["quant"], "diagnostics": RANK["bench"],
             "integrations": RANK["models"],  # bridges to peft / bitsandbytes: above nn, optim and ops
             "_version": -1, "_progress": -1, "__init__": len(LAYERS), "__main__": len(LAYERS)})


def _layer_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0].removesuffix(".py")


def _imported_layers(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    depth = len(path.relative_to(PKG).parts) - 1  # how many packages below anygpu/
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb to anygpu/ and read the first component
                if node.level - 1 < depth:
                    continue  # inside the same layer
                target = (node.module or "").split(".")[0] or (node.names[0].name if node.names else "")
            elif node.module and node.module.startswith("anygpu."):
                target = node.module.split(".")[1]
            elif node.module == "anygpu":
                for alias in node.names:
                    yield node.lineno, alias.name
                continue
            else:
                continue
            yield node.lineno, target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("anygpu."):
                    yield node.lineno, alias.name.split(".")[1]


def test_imports_go_downward_only():
    bad = []
    for path in PKG.rglob("*.py"):
        layer = _layer_of(path)
        for line, target in _imported_layers(path):
            if target in RANK and RANK[target] > RANK[layer]:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {target}")
    assert not bad, "\n".join(bad)


def test_kernel_and_op_files_pair_up():
    from anygpu.kernels import KERNEL_MODULES
    from anygpu.ops import ALL_OPS

    for name, op in ALL_OPS.items():
        assert (PKG / "ops" / f"{name}.py").exists()
        if op.gpu_kernel:
            assert op.gpu_kernel.split(":")[0] in KERNEL_MODULES


def test_every_kernel_module_has_interpreter_tests():
    from anygpu.kernels import KERNEL_MODULES

    tested = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for name in KERNEL_MODULES:
        assert f"anygpu.kernels.{name} import" in tested, f"kernels/{name}.py has no test under tests/"


def test_readme_lists_every_target_and_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    for arch in TARGETS:
        assert re.search(rf"^\| {arch} \|", readme, re.M), arch
    assert "make run" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def _imported_modules(path: pathlib.Path):
    """(line, dotted module path) of every anygpu module ``path`` imports, relative imports resolved; for
    ``from X import name`` also ``X.name`` when that names a module (``from ..ops import _x``)."""
    package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            if module[:1] != ["anygpu"]:
                continue
            yield node.lineno, module
            for alias in node.names:
                candidate = ROOT.joinpath(*module, alias.name)
                if candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists():
                    yield node.lineno, module + [alias.name]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("anygpu."):
                    yield node.lineno, alias.name.split(".")


def test_private_modules_stay_in_their_package():
    """A ``_name`` module below anygpu/<package>/ is that package's own: another package imports a public
    module instead (one that says it is shared), so a private module can change without a search of the tree."""
    bad = []
    for path in PKG.rglob("*.py"):
        layer = _layer_of(path)
        for line, module in _imported_modules(path):
            if len(module) < 3 or module[1] == layer:
                continue
            if any(part.startswith("_") and not part.startswith("__") for part in module[2:]):
                bad.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {'.'.join(module)}")
    assert not bad, "\n".join(bad)


DOCS = ROOT / "docs"
DOC_KINDS = ("guide", "design", "perf")  # how to use it / why it is built so / dated measurement records
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_DOCS_PATH = re.compile(r"(?<![\w./-])docs/[\w./-]+\.md")


def _markdown_files():
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_docs_are_sorted_into_guide_design_and_perf():
    """docs/ holds the three kinds and at most an index: a page dropped at the root has no kind, and the README's
    table of contents (which points into the kinds) would not list it."""
    stray = [p.name for p in DOCS.iterdir() if p.is_file() and p.name not in ("README.md", "index.md")]
    assert not stray, f"docs/ root: move {stray} into docs/{{{','.join(DOC_KINDS)}}}/"
    folders = {p.name for p in DOCS.iterdir() if p.is_dir()}
    assert folders <= set(DOC_KINDS), f"docs/ has {sorted(folders - set(DOC_KINDS))}: use {DOC_KINDS}"
    undated = [p.name for p in (DOCS / "perf").glob("*.md") if not re.match(r"\d{4}-\d{2}-\d{2}-", p.name)]
    assert not undated, f"docs/perf/ records are named YYYY-MM-DD-what.md: {undated}"


def test_doc_links_resolve():
    """Every relative markdown link, and every docs/...md path a page names in its text, points at a file that
    exists: moving a page has to update the pages that point at it."""
    bad = []
    for page in _markdown_files():
        text = page.read_text()
        for target in _LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (http:, mailto:) or an anchor in the same page
            path = target.split("#")[0]
            if not (page.parent / path).exists():
                bad.append(f"{page.relative_to(ROOT)}: link ({target})")
        for path in _DOCS_PATH.findall(text):
            if not (ROOT / path).exists():
                bad.append(f"{page.relative_to(ROOT)}: names {path}")
    assert not bad, "\n".join(bad)


def test_readme_is_a_short_table_of_contents():
    """The README introduces and points into docs/ (issue 26): the detail lives in the guides."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 10 * 1024, f"README.md is {len(readme.encode())} bytes: move detail into docs/"
    linked = {target.split("#")[0] for target in _LINK.findall(readme)}
    for kind in DOC_KINDS:
        assert any(t.startswith(f"docs/{kind}/") for t in linked), f"README.md links nothing in docs/{kind}/"


def test_every_guide_and_design_page_is_reachable_from_the_readme():
    """Following links from README.md reaches every page of docs/guide/ and docs/design/ (perf records hang off
    docs/perf/, which the README links as a folder): a page nothing links to is a page nobody finds."""
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        for target in _LINK.findall(page.read_text()):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target) and not target.startswith("#"):
                todo.append((page.parent / target.split("#")[0]).resolve())
    orphans = [str(p.relative_to(ROOT)) for kind in ("guide", "design") for p in sorted((DOCS / kind).glob("*.md"))
               if p.resolve() not in seen]
    assert not orphans, f"no link from README.md leads to {orphans}"
