"""Every fenced code block in README.md and docs/guide/*.md runs here, so the docs cannot drift (issue 26).

By the fence's language:

- ``python``: the block as a script in a fresh interpreter, cwd a temporary folder, with this process's
  TRITON_INTERPRET (1 in ``make test``; a run without it on a GPU machine runs the blocks on the GPU). A block
  that talks to ``127.0.0.1:8000`` (the server's documented address) gets a real ``anygpu serve`` with the
  default model on a free loopback port, the address rewritten to it.
- ``bash``, ``sh``, ``console``: each command line is its own test. In a block with ``$ `` prompts only those
  lines are commands and the others are the output they print, checked against what the command prints.
  ``anygpu ...`` is parsed by click, then runs as ``python -m anygpu.cli ...``; ``anygpu serve ...`` starts the
  server and waits until /health answers. ``pip`` lines are only parsed (the extras named must exist in
  pyproject.toml), ``make`` lines only checked against the Makefile's targets; ``python`` lines run. Any other
  command has to be marked skip.
- Anything else (``text``, ``json``, no language): output samples, not run.

Markers, HTML comments on the lines right above the fence (invisible on a rendered page):

- ``<!-- docs-test: skip (why) -->``: nothing in the block runs; a skipped python block is still compiled and
  skipped command lines are still parsed as above, so a renamed option fails even there.
- ``<!-- docs-test: skip "TEXT" (why) -->``: only the command lines containing TEXT are skipped.
- ``<!-- docs-test: synopsis -->``: a usage summary (``anygpu generate PROMPT [--seed] ...``): every option it
  shows must exist on that command.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import pathlib
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
TIMEOUT = 120  # one command or block: several times the slowest on a loaded machine; a runaway still ends
SERVER_ADDRESS = "127.0.0.1:8000"

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_MARKER = re.compile(r'^\s*<!--\s*docs-test:\s*(\w+)(?:\s+"([^"]*)")?(?:\s*\((.*)\))?\s*-->\s*$')
_ANY_MARKER = re.compile(r"<!--\s*docs-test")


@dataclasses.dataclass
class Block:
    page: str       # path relative to the repository
    line: int       # 1-based line of the opening fence
    lang: str
    code: str
    markers: list   # (kind, text or None, reason or None)

    @property
    def where(self):
        return f"{self.page}:{self.line}"

    def skip_reason(self, text=None):
        for kind, match, reason in self.markers:
            if kind == "skip" and (match is None or (text is not None and match in text)):
                return reason or "marked skip"
        return None

    @property
    def synopsis(self):
        return any(kind == "synopsis" for kind, _, _ in self.markers)


def _blocks(page):
    """The fenced blocks of a page, with the markers on the lines right above each."""
    lines = page.read_text().splitlines()
    blocks, markers, i = [], [], 0
    while i < len(lines):
        m = _MARKER.match(lines[i])
        if m:
            markers.append((m.group(1), m.group(2), m.group(3)))
            i += 1
            continue
        fence = _FENCE.match(lines[i])
        if fence:
            indent, ticks, lang = fence.groups()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(ticks[0] * len(ticks)):
                j += 1
            body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:j])
            blocks.append(Block(str(page.relative_to(ROOT)), i + 1, lang.lower(), body + "\n", markers))
            markers, i = [], j + 1
            continue
        markers = []  # a marker binds only to the fence right below it
        i += 1
    return blocks


@dataclasses.dataclass
class Command:
    block: Block
    line: int          # 1-based line in the page
    text: str          # the line as written (without the prompt)
    argv: list         # words after the VAR=value assignments
    env: dict          # those assignments
    expected: list     # output lines shown below it (console blocks)

    @property
    def skip_reason(self):
        return self.block.skip_reason(self.text)


def _commands(block):
    lines = block.code.splitlines()
    prompted = any(line.startswith("$ ") for line in lines)
    commands = []
    for k, line in enumerate(lines):
        if prompted and not line.startswith("$ "):
            if commands and line.strip():
                commands[-1].expected.append(line.strip())
            continue
        text = line[2:] if prompted else line
        words = shlex.split(text, comments=True)
        if not words:
            continue
        env = {}
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        commands.append(Command(block, block.line + 1 + k, text.strip(), words, env, []))
    return commands


def _synopses(block):
    """(command words, options shown) for each command of a usage block; an indented line continues the one
    above it."""
    entries = []
    for line in block.code.splitlines():
        line = line.split(" #")[0]
        if not line.strip():
            continue
        if line[0].isspace() and entries:
            entries[-1] += " " + line.strip()
        else:
            entries.append(line.strip())
    out = []
    for entry in entries:
        words = entry.split()
        assert words[0] == "anygpu", f"{block.where}: a synopsis line starts with anygpu: {entry}"
        path = []
        for word in words[1:]:
            if not re.fullmatch(r"[a-z][\w-]*", word):
                break
            path.append(word)
        out.append((path, sorted(set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", entry)))))
    return out


BLOCKS = [b for page in PAGES for b in _blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SYNOPSES = [b for b in BLOCKS if b.lang in SHELL and b.synopsis]
COMMANDS = [c for b in BLOCKS if b.lang in SHELL and not b.synopsis for c in _commands(b)]


def _needs_server(block):
    return SERVER_ADDRESS in block.code


def _env(tmp):
    env = dict(os.environ)
    env.pop("ANYGPU_CPU_GGUF_PACKED", None)  # conftest's fp32 override for oracle tests: the docs show the default
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)  # this checkout
    env.update(TQDM_DISABLE="1",  # progress bars would bury a failure's traceback
               XDG_CACHE_HOME=str(tmp / "cache"),  # chat history and caches stay out of the user's home
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")  # the server is local
    return env


def _tail(text, n=40):
    return "\n".join(text.splitlines()[-n:])


# --- click: every anygpu line parses, every option a synopsis shows exists ----------------------------------------

_CLICK_CHECK = r"""
import json, sys
import click
from anygpu.cli import cli

def resolve(words):
    ctx, cmd, i = click.Context(cli, info_name="anygpu"), cli, 0
    while isinstance(cmd, click.Group) and i < len(words) and cmd.get_command(ctx, words[i]) is not None:
        cmd = cmd.get_command(ctx, words[i])
        ctx = click.Context(cmd, info_name=words[i], parent=ctx)
        i += 1
    return ctx, cmd, i

req = json.load(sys.stdin)
out = {"commands": [], "synopses": []}
for argv in req["commands"]:
    ctx, cmd, i = resolve(argv)
    if isinstance(cmd, click.Group):
        out["commands"].append(f"no such command: anygpu {' '.join(argv[:i + 1])}")
        continue
    try:
        cmd.make_context(ctx.info_name, list(argv[i:]), parent=ctx.parent)
        out["commands"].append(None)
    except click.exceptions.Exit:
        out["commands"].append(None)
    except click.ClickException as e:
        out["commands"].append(f"{type(e).__name__}: {e.format_message()}")
for words, flags in req["synopses"]:
    ctx, cmd, i = resolve(words)
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | set(ctx.help_option_names)
    missing = [f for f in flags if f not in known]
    out["synopses"].append(f"anygpu {' '.join(words[:i])} has no {missing}" if missing else None)
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def click_check(tmp_path_factory):
    """Parse every anygpu line of the pages with the real command line, in one child process (click's
    callbacks set process-wide state, which the test process must not get)."""
    commands = [c.argv[1:] for c in COMMANDS if c.argv[0] == "anygpu"]
    synopses = [s for b in SYNOPSES for s in _synopses(b)]
    tmp = tmp_path_factory.mktemp("click")
    proc = subprocess.run([sys.executable, "-c", _CLICK_CHECK], input=json.dumps(
        {"commands": commands, "synopses": synopses}), capture_output=True, text=True, cwd=tmp, env=_env(tmp),
        timeout=TIMEOUT)
    assert proc.returncode == 0, _tail(proc.stderr)
    result = json.loads(proc.stdout)
    return {"commands": dict(zip(map(tuple, commands), result["commands"])),
            "synopses": dict(zip((tuple(w) for w, _ in synopses), result["synopses"]))}


# --- the server: started once per argument list, on a free loopback port ---------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _without_port(args):
    out, i = [], 0
    while i < len(args):
        if args[i] == "--port":
            i += 2
            continue
        if not args[i].startswith("--port="):
            out.append(args[i])
        i += 1
    return tuple(out)


class _Servers:
    def __init__(self, tmp):
        self.tmp, self.running = tmp, {}

    def start(self, args):
        """Start ``anygpu serve ARGS`` (its --port replaced by a free one) unless it runs already."""
        key = _without_port(args)
        if key not in self.running:
            port = _free_port()
            log = open(self.tmp / f"serve-{len(self.running)}.log", "w+")
            proc = subprocess.Popen([sys.executable, "-m", "anygpu.cli", "serve", *key, "--port", str(port)],
                                    cwd=self.tmp, env=_env(self.tmp), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)
            self.running[key] = (proc, port, log)
        return key

    def port(self, args):
        """The port of a running ``anygpu serve ARGS`` once /health answers."""
        proc, port, log = self.running[self.start(args)]
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"anygpu serve {' '.join(args)} exited {proc.returncode}:\n{_tail(log.read())}")
            try:
                with opener.open(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return port
            except OSError:
                pass
            time.sleep(0.2)
        pytest.fail(f"anygpu serve {' '.join(args)}: no /health in {TIMEOUT} s")

    def log(self, args, n=40):
        _, _, log = self.running[self.start(args)]
        log.flush()
        return _tail((self.tmp / pathlib.Path(log.name).name).read_text(), n)

    def close(self):
        for proc, _, log in self.running.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # the server's own shutdown: engine process and workers too
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()


@pytest.fixture(scope="module", autouse=True)
def servers(tmp_path_factory, request):
    servers = _Servers(tmp_path_factory.mktemp("serve"))
    # Started with the module's first test, so that loading the model overlaps the commands run before the first
    # test that needs the server (the python blocks come last for this).
    mine = [item.callspec.params for item in request.session.items
            if item.module is request.module and hasattr(item, "callspec")]
    if any(_needs_server(p["block"]) if "block" in p else p["cmd"].argv[:2] == ["anygpu", "serve"]
           for p in mine if "block" in p or "cmd" in p):
        servers.start(())
    yield servers
    servers.close()


# --- the tests ---------------------------------------------------------------------------------------------------

def test_markers_sit_above_a_fence():
    """A marker that binds to no block (a fence moved or deleted) or names text no line has is stale."""
    bad = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for k, line in enumerate(lines):
            if not _ANY_MARKER.search(line):
                continue
            m = _MARKER.match(line)
            if not m or m.group(1) not in ("skip", "synopsis"):
                bad.append(f"{page.name}:{k + 1}: not a docs-test marker: {line.strip()}")
                continue
            rest = lines[k + 1:]
            while rest and _MARKER.match(rest[0]):
                rest = rest[1:]
            if not rest or not _FENCE.match(rest[0]):
                bad.append(f"{page.name}:{k + 1}: no fence right below {line.strip()}")
    for block in BLOCKS:
        for kind, text, _ in block.markers:
            if text is not None and text not in block.code:
                bad.append(f"{block.where}: no line has {text!r}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.where) for b in SYNOPSES])
def test_synopsis_options_exist(block, click_check):
    errors = [click_check["synopses"][tuple(words)] for words, _ in _synopses(block)]
    assert not any(errors), f"{block.where}: " + "; ".join(e for e in errors if e)


def _extras():
    import tomllib

    names = (ROOT / "pyproject.toml").read_text()
    return {re.sub(r"[-_.]+", "-", k).lower() for k in tomllib.loads(names)["project"]["optional-dependencies"]}


_PIP_VALUE_OPTIONS = {"-w", "--wheel-dir", "-r", "--requirement", "-c", "--constraint", "-i", "--index-url",
                      "--extra-index-url", "-f", "--find-links", "-t", "--target"}


def _check_pip(cmd):
    argv = cmd.argv
    assert len(argv) > 2 and argv[1] in ("install", "wheel", "download"), f"pip {argv[1:2]}: not a pip command"
    reqs, i = [], 2
    while i < len(argv):
        if argv[i] in _PIP_VALUE_OPTIONS:
            i += 2
            continue
        if argv[i] in ("-e", "--editable"):
            i += 1
        elif argv[i].startswith("-"):
            i += 1
            continue
        reqs.append(argv[i])
        i += 1
    assert reqs, f"pip line names nothing to install: {cmd.text}"
    for req in reqs:
        base, _, extras = req.partition("[")
        ours = base == "." or base == "anygpu" or os.path.basename(base).startswith("anygpu-")
        if base == "." or base.startswith("./"):
            assert (ROOT / base).exists(), req
        if ours and extras:
            wanted = {re.sub(r"[-_.]+", "-", e.strip()).lower() for e in extras.rstrip("]").split(",")}
            assert wanted <= _extras(), f"{req}: pyproject.toml has no extra {sorted(wanted - _extras())}"


def _check(cmd, click_check):
    """The checks that need no run: every command kind, skipped or not."""
    name = cmd.argv[0]
    if name == "anygpu":
        error = click_check["commands"][tuple(cmd.argv[1:])]
        assert error is None, f"{cmd.text}: {error}"
    elif name == "pip":
        _check_pip(cmd)
    elif name == "make":
        makefile = (ROOT / "Makefile").read_text()
        for target in (w for w in cmd.argv[1:] if "=" not in w and not w.startswith("-")):
            assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"Makefile has no target {target}"
    elif name in ("python", "python3"):
        if cmd.argv[1:2] == ["-m"]:
            import importlib.util

            assert importlib.util.find_spec(cmd.argv[2].split(".")[0]) is not None, cmd.text
        elif len(cmd.argv) > 1 and not cmd.argv[1].startswith("-"):
            assert (ROOT / cmd.argv[1]).exists(), f"{cmd.text}: no {cmd.argv[1]}"
    elif "/" in name:
        assert (ROOT / name).exists(), f"{cmd.text}: no {name}"


_RUNS = {}  # the same command on two pages runs once


def _run(argv, env_extra, tmp, cache=True, where="", more=lambda: ""):
    key = (tuple(argv), tuple(sorted(env_extra.items())))
    if key not in _RUNS or not cache:
        try:
            _RUNS[key] = subprocess.run(argv, cwd=tmp, env={**_env(tmp), **env_extra}, capture_output=True,
                                        text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
            pytest.fail(f"{where or ' '.join(argv)}: still running after {TIMEOUT} s:\n{_tail(stderr)}{more()}")
    return _RUNS[key]


def _check_output(cmd, proc):
    """Each output line the page shows is printed; of the ``[anygpu]`` summary line (timings), the field names."""
    printed = [line.strip() for line in proc.stdout.splitlines()]
    summaries = [line for line in proc.stderr.splitlines() if line.startswith("[anygpu]")]
    for line in cmd.expected:
        if line.startswith("[anygpu]"):
            fields = re.findall(r"(\w[\w/]*)=", line)
            assert summaries and re.findall(r"(\w[\w/]*)=", summaries[-1]) == fields, \
                f"{cmd.block.where}: summary line\n  page: {line}\n  now:  {summaries[-1:]}"
        else:
            assert line in printed, f"{cmd.block.where}: the page shows {line!r}; printed:\n{_tail(proc.stdout)}"


@pytest.mark.parametrize("cmd", [pytest.param(c, id=f"{c.block.page}:{c.line}:{c.text[:60]}") for c in COMMANDS])
def test_command(cmd, tmp_path, click_check, servers):
    _check(cmd, click_check)
    if cmd.skip_reason:
        pytest.skip(cmd.skip_reason)
    name, args = cmd.argv[0], cmd.argv[1:]
    if name == "pip":
        return  # parsed above; installing is the Makefile's and CI's business
    if name == "anygpu" and args[:1] == ["serve"]:
        servers.port(args[1:])
        return
    if name == "anygpu":
        argv = [sys.executable, "-m", "anygpu.cli", *args]
    elif name in ("python", "python3"):
        argv = [sys.executable, *args]
    else:
        pytest.fail(f"{cmd.block.where}: `{cmd.text}` cannot run here: mark it "
                    f'<!-- docs-test: skip "TEXT" (why) --> or make it runnable')
    proc = _run(argv, cmd.env, tmp_path, where=f"{cmd.block.page}:{cmd.line}")
    assert proc.returncode == 0, \
        f"`{cmd.text}` exited {proc.returncode}:\n{_tail(proc.stdout, 10)}\n{_tail(proc.stderr)}"
    _check_output(cmd, proc)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.where) for b in PYTHON])
def test_python_block(block, tmp_path, servers):
    code = block.code
    compile(code, block.where, "exec")
    reason = block.skip_reason()
    if reason:
        pytest.skip(reason)
    if _needs_server(block):
        code = code.replace(SERVER_ADDRESS, f"127.0.0.1:{servers.port(())}")
    script = tmp_path / "block.py"
    script.write_text(code)
    # The server's log goes with a failure: a client's error or hang usually starts on the server's side.
    server_log = (lambda: f"\nserver log:\n{servers.log(())}") if _needs_server(block) else (lambda: "")
    proc = _run([sys.executable, str(script)], {}, tmp_path, cache=False, where=block.where, more=server_log)
    assert proc.returncode == 0, f"{block.where} failed:\n{_tail(proc.stdout, 10)}\n{_tail(proc.stderr)}{server_log()}"


def test_every_block_is_collected():
    """A fence whose language this file does not know would silently never run: name it here or fix it."""
    known = {"python"} | SHELL | {"text", "json", "yaml", "toml", "csv", "", "diff", "ini", "jinja"}
    unknown = [f"{b.where} ({b.lang})" for b in BLOCKS if b.lang not in known]
    assert not unknown, unknown


def test_pages_are_found():
    assert len(PYTHON) >= 5 and len(COMMANDS) >= 10, (len(PYTHON), len(COMMANDS))
