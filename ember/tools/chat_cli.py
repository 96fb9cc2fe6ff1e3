"""`ember chat [MODEL]`: an interactive chat in the terminal, as llama.cpp's llama-cli
conversation mode.

Each line is a user message; the conversation so far goes through the model's chat template
and the reply streams to the terminal as it is generated. Ctrl-C stops an answer (its request
is aborted, so its KV blocks are freed; the part already shown stays in the conversation). A
model without a chat template runs in plain-completion mode: each line is continued as a raw
prompt, with no history.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from ember.runtime.config import EngineArgs
from ember.runtime.engine import LLMEngine
from ember.runtime.input_processor import PromptType
from ember.runtime.llm import LLM, load_chat_template, render_chat
from ember.runtime.request import RequestOutputKind, SamplingParams

PROMPT = "> "
COMMANDS = (
    "/reset clears the conversation, /system TEXT sets the system prompt, /exit leaves; "
    "Ctrl-C stops an answer, Ctrl-D exits"
)
PLAIN_MODE_NOTICE = (
    "this model has no chat template: plain-completion mode (each line is continued as a raw "
    "prompt, with no history; --chat-template gives the model one)"
)
PROMPT_INTERRUPT_HINT = "(Ctrl-C again or /exit leaves; Ctrl-D exits)"


def add_chat_parser(
    sub: argparse._SubParsersAction,
    add_engine_args: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Add the `chat` subcommand to `sub`: an optional positional MODEL, the engine flags
    (`add_engine_args` adds `--model` and one flag per engine knob, `--seed` among them), and
    the chat's own flags. Its `func` is `cmd_chat`, which also takes the caller's model
    resolver: bind that where the parser is built."""
    p = sub.add_parser(
        "chat",
        help="chat with the model in the terminal (as llama.cpp's llama-cli conversation mode)",
    )
    p.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="model (--model works too)"
    )
    add_engine_args(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="system prompt")
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) for models without one or "
        "to replace theirs",
    )
    p.add_argument("--max-tokens", type=int, default=512, help="longest answer, in tokens")
    p.add_argument("--temperature", type=float, default=None, help="default: the model's")
    p.add_argument("--top-p", type=float, default=None, help="default: the model's")
    p.add_argument("--ignore-eos", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_chat)


def cmd_chat(
    args: argparse.Namespace, resolve: Callable[[argparse.Namespace, str | None], dict]
) -> int:
    """Run `ember chat`: build the engine from the flags, with `resolve(args, MODEL or
    --model or None)`'s `EngineArgs` overrides on top (it picks the default model when none
    is given), and chat until the user leaves. The answers sample with the model's default
    sampling parameters, with the flags given on top. Returns the exit status; raises
    ValueError for bad flags (two different models, an unreadable chat template file)."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    chat_template = load_chat_template(args.chat_template)
    engine_args = EngineArgs.from_cli_args(args, **resolve(args, args.model_tag or args.model))
    # The engine's own progress (compiling its shape buckets) stays on: it can take a while.
    llm = LLM(**dataclasses.asdict(engine_args))
    chosen = {"max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
    if args.temperature is not None:
        chosen["temperature"] = args.temperature
    if args.top_p is not None:
        chosen["top_p"] = args.top_p
    params = dataclasses.replace(llm.get_default_sampling_params(), **chosen)
    try:
        return run_chat(llm, params, system=args.system, chat_template=chat_template)
    finally:
        llm.close()


def run_chat(
    llm: LLM,
    params: SamplingParams,
    *,
    system: str | None = None,
    chat_template: str | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
) -> int:
    """The chat loop, reading lines from `stdin` and writing to `stdout` (None: the process's
    own, looked up when called); returns the exit status, 0.

    Prints a banner, then a `> ` prompt before each line. `/exit`, or the end of input
    (Ctrl-D), leaves; `/reset` clears the conversation (the system prompt stays); `/system
    TEXT` sets the system prompt (no TEXT: none) and clears the conversation; another
    `/command` prints the commands. Any other non-blank line is a user message: the system
    prompt, the conversation and the message go through the model's chat template
    (`chat_template` where given), and the reply streams to `stdout` piece by piece as each
    step makes it (flushed), then joins the conversation. A model without a chat template
    (and none given) is told once and runs in plain-completion mode: each line is continued
    as a raw prompt, without history. `params` sample each answer (streamed as DELTA
    outputs whatever their `output_kind`).

    Ctrl-C during an answer takes effect after the engine's current step: the request is
    aborted (no KV blocks are left held), the part shown so far stays in the conversation,
    and the prompt comes back. Ctrl-C at the prompt prints a hint; a second one in a row
    leaves. A message the engine rejects (ValueError, e.g. a conversation longer than
    max_model_len) or a request that fails prints the error and is left out of the
    conversation. When `stdin` and `stdout` are the process's terminal, lines are read with
    `input`, with readline's line editing and history where it is importable. Raises
    ValueError for a model without a tokenizer.
    """
    out = stdout if stdout is not None else sys.stdout
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError("ember chat needs a tokenizer; this model has none")
    chat_mode = chat_template is not None or getattr(tokenizer, "chat_template", None) is not None
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    out.write(f"ember chat: {llm.config.model}\n{COMMANDS}\n")
    if not chat_mode:
        out.write(PLAIN_MODE_NOTICE + "\n")
    out.flush()
    read = _line_reader(stdin if stdin is not None else sys.stdin, out)
    request_ids = (f"chat-{i}" for i in itertools.count())
    history: list[dict[str, Any]] = []
    interrupted_at_prompt = False
    while True:
        try:
            line = read()
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            if interrupted_at_prompt:
                out.write("\n")
                return 0
            interrupted_at_prompt = True
            out.write(f"\n{PROMPT_INTERRUPT_HINT}\n")
            continue
        interrupted_at_prompt = False
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            if text.partition(" ")[0] == "/exit":
                return 0
            system = _command(text, history, system, chat_mode, out)
            continue
        message = {"role": "user", "content": line}
        with _deferred_interrupt() as interrupted:
            try:
                prompt: PromptType = line
                if chat_mode:
                    system_messages = [{"role": "system", "content": system}] if system else []
                    conversation = [*system_messages, *history, message]
                    prompt = render_chat(tokenizer, conversation, chat_template)
                reply = _stream(engine, next(request_ids), prompt, params, out, interrupted)
            except ValueError as e:
                more = " (/reset starts a new conversation)" if chat_mode and history else ""
                out.write(f"error: {e}{more}\n")
                out.flush()
                continue
        if chat_mode:
            history += [message, {"role": "assistant", "content": reply}]


def _command(
    text: str, history: list[dict[str, Any]], system: str | None, chat_mode: bool, out: TextIO
) -> str | None:
    """Carry out the `/command` line `text` (not `/exit`): clears `history` as it says;
    returns the system prompt from now on."""
    command, _, argument = text.partition(" ")
    if command == "/reset":
        history.clear()
        out.write("(conversation cleared)\n")
    elif command == "/system" and chat_mode:
        system = argument.strip() or None
        history.clear()
        out.write(f"(system prompt {'set' if system else 'cleared'}; conversation cleared)\n")
    elif command == "/system":
        out.write("(plain-completion mode has no system prompt)\n")
    else:
        out.write(f"unknown command {command}: {COMMANDS}\n")
    return system


def _stream(
    engine: LLMEngine,
    request_id: str,
    prompt: PromptType,
    params: SamplingParams,
    out: TextIO,
    interrupted: threading.Event,
) -> str:
    """Run one DELTA request, writing each new piece of its text to `out` (flushed) as the
    engine makes it, then a newline; return its text. Once `interrupted` is set (checked
    between steps) an unfinished request is aborted, its text so far returned. Raises
    ValueError for a prompt the engine rejects (nothing written) and for a request that
    finishes with an error."""
    engine.add_request(request_id, prompt, params)
    pieces: list[str] = []
    finished = False
    try:
        while engine.has_unfinished_requests() and not interrupted.is_set():
            for output in engine.step():
                piece = output.outputs[0].text
                out.write(piece)
                out.flush()
                pieces.append(piece)
                finished = output.finished
                if output.error is not None:
                    raise ValueError(f"the request failed: {output.error}")
    finally:
        if not finished:
            engine.abort_request(request_id)
        out.write("\n")
        out.flush()
    return "".join(pieces)


@contextlib.contextmanager
def _deferred_interrupt() -> Iterator[threading.Event]:
    """While inside, Ctrl-C (SIGINT) sets the yielded event instead of raising
    KeyboardInterrupt, so it never lands inside an engine step; the previous handler comes
    back on leaving. Off the main thread, where no handler can be set (and no
    KeyboardInterrupt arrives), the event stays clear."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


def _line_reader(stdin: TextIO, out: TextIO) -> Callable[[], str]:
    """A function that writes the `> ` prompt and returns the next line without its line
    ending (EOFError at the end of input). On the process's own terminal it reads through
    `input`, with readline's line editing and history where the module is importable."""
    if stdin is sys.stdin and out is sys.stdout and stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401, PLC0415  (importing it gives `input` line editing)
        return lambda: input(PROMPT)

    def read() -> str:
        out.write(PROMPT)
        out.flush()
        line = stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    return read
