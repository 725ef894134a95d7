"""``anygpu chat``: a conversation with a model in the terminal.

Ctrl-C while a reply streams stops that reply and returns to the prompt: the interrupt is only noted, and the
engine stops the request after the step in flight (a step cut in the middle could leave its KV blocks and
scheduler half-updated, and a GPU graph mid-launch).  What was shown of the reply stays in the conversation,
so the model sees what the user saw.  A second Ctrl-C during the same reply ends the chat, for a step that never
returns.  Ctrl-C or Ctrl-D at the prompt ends the chat.
"""

from __future__ import annotations

import contextlib
import signal

import click

from .extras import require
from .generate import ENGINE_OPTIONS, QUIET_OPTION, SAMPLING_OPTIONS, _engine, _options, _params, _stream, summary_line
from .line_editing import LineEditing


@contextlib.contextmanager
def interrupt_flag():
    """Inside: the first SIGINT sets the returned list's only item instead of raising; the next one raises
    KeyboardInterrupt as usual."""
    hit = [False]

    def on_sigint(signum, frame):
        if hit[0]:
            raise KeyboardInterrupt
        hit[0] = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, previous)


def _read_line() -> str | None:
    """The next line, or None when the user ends the chat (Ctrl-D, Ctrl-C)."""
    try:
        return input("> ")
    except (EOFError, KeyboardInterrupt):
        click.echo()
        return None


def _reply(engine, request_id, ids, params, quiet):
    """Stream one reply; returns the text shown (None when nothing was)."""
    with interrupt_flag() as hit:
        out = _stream(engine, request_id, ids, params, interrupted=lambda: hit[0])
    text = out.outputs[0].text if out is not None else ""
    if hit[0]:
        click.echo(f"(stopped after {len(out.outputs[0].token_ids) if out else 0} tokens)", err=True)
    elif not quiet:
        click.echo(summary_line(engine, out), err=True)
    return text or None


@click.command()
@click.option("--system", default=None, help="A system message.")
@_options(ENGINE_OPTIONS)
@_options(SAMPLING_OPTIONS)
@QUIET_OPTION
def chat(system, model, gguf_file, quantize, dtype, tune, max_model_len, eager, quiet, **sampling):
    """Talk with a model; the conversation so far goes through its chat template each turn.

    Line editing and history (in ~/.cache/anygpu) where readline exists. Ctrl-C stops a reply and keeps the
    conversation; at the prompt it ends the chat, as do Ctrl-D and /exit. /reset forgets the history."""
    require("llm", "anygpu chat")
    params = _params(sampling)
    engine = _engine(model, gguf_file, quantize, dtype, tune, max_model_len, eager)
    if engine.tokenizer is None or engine.tokenizer.chat_template is None:
        raise click.ClickException(f"{engine.model_name} has no chat template; use `anygpu generate --raw`")
    history = [{"role": "system", "content": system}] if system else []
    turn = 0
    with LineEditing():
        while (line := _read_line()) is not None:
            if line.strip() in ("/exit", "/quit"):
                return
            if line.strip() == "/reset":
                history = history[:1] if system else []
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            ids = engine.tokenizer.encode_chat(history)
            if len(ids) >= engine.max_model_len:
                click.echo(f"(the conversation is {len(ids)} tokens, over the context of {engine.max_model_len}: "
                           f"/reset to start again)", err=True)
                history.pop()
                continue
            turn += 1
            text = _reply(engine, f"chat-{turn}", ids, params, quiet)
            if text is None:  # stopped before a word: the question goes too, so that turns keep alternating
                history.pop()
            else:
                history.append({"role": "assistant", "content": text})
