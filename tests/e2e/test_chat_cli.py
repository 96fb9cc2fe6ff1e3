"""`ember chat` run in a pseudo-terminal as a user runs it: each
streamed reply equals the greedy `LLM.chat` reply of the same conversation in this process,
/reset, /system and /exit do what they say, a model without a chat template continues raw
prompts, and Ctrl-C stops an answer with the engine still whole. One in-process test drives
`run_chat` itself to check the KV blocks after an interrupt and a rejected message."""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import sys

import pexpect
import pytest

from ember import LLM
from ember.tools.chat_cli import PLAIN_MODE_NOTICE, PROMPT_INTERRUPT_HINT, run_chat
from tests.e2e.servers import CHAT_TEMPLATE, with_chat_template

ENGINE = dict(compile=False, kv_cache_gib=0.02, max_model_len=2048, dtype="float32")
FLAGS = ["--no-compile", "--kv-cache-gib", "0.02", "--max-model-len", "2048",
         "--dtype", "float32", "--temperature", "0"]  # fmt: skip
FIRST, SECOND = "Hello there", "How are you today?"


@pytest.fixture(scope="module")
def chat_dir(checkpoint_dir, tmp_path_factory) -> str:
    """The tiny Llama with a chat template."""
    d = str(tmp_path_factory.mktemp("chat") / "tiny-llama-chat")
    return with_chat_template(checkpoint_dir("tiny-llama"), d, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def llm(chat_dir):
    """The reference, with the engine settings the command gets."""
    llm = LLM(model=chat_dir, use_tqdm=False, **ENGINE)
    yield llm
    llm.close()


def _greedy(llm: LLM, max_tokens: int = 12, **kw):
    """The command's sampling: the model's defaults with --temperature 0 and --max-tokens."""
    return dataclasses.replace(
        llm.get_default_sampling_params(), temperature=0.0, max_tokens=max_tokens, **kw
    )


def _chat(llm: LLM, conversation: list[dict], **kw) -> str:
    return llm.chat(conversation, _greedy(llm, **kw), use_tqdm=False)[0].outputs[0].text


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _spawn(model: str, *flags: str) -> pexpect.spawn:
    """The chat command on `model` in a pseudo-terminal, at its first prompt."""
    env = dict(os.environ, TERM="dumb", PYTHONIOENCODING="utf-8")
    args = ["-m", "ember.cli", "chat", model, *FLAGS, *flags]
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=60)
    child.expect_exact(f"ember chat: {model}")
    return child


def _send(child: pexpect.spawn, line: str) -> str:
    """Type `line`; what the terminal shows after its echo, up to the next prompt."""
    child.sendline(line)
    child.expect_exact(line + "\r\n")
    child.expect_exact("\r\n> ")
    return child.before


def _terminal(text: str) -> str:
    """`text` as the terminal shows it."""
    return text.replace("\n", "\r\n")


def _exit(child: pexpect.spawn) -> None:
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_turns_reset_and_system(chat_dir, llm):
    reply1 = _chat(llm, [_user(FIRST)])
    child = _spawn(chat_dir, "--max-tokens", "12")
    child.expect_exact("> ")
    assert PLAIN_MODE_NOTICE not in child.before
    assert _send(child, FIRST) == _terminal(reply1)
    reply2 = _chat(llm, [_user(FIRST), _assistant(reply1), _user(SECOND)])
    assert _send(child, SECOND) == _terminal(reply2)
    assert "conversation cleared" in _send(child, "/reset")
    assert _send(child, FIRST) == _terminal(reply1)
    assert "conversation cleared" in _send(child, "/system be brief")
    brief = _chat(llm, [{"role": "system", "content": "be brief"}, _user(FIRST)])
    assert brief != reply1
    assert _send(child, FIRST) == _terminal(brief)
    _exit(child)


def test_plain_completion_without_chat_template(checkpoint_dir, llm):
    plain_dir = checkpoint_dir("tiny-llama")
    child = _spawn(plain_dir, "--max-tokens", "12")
    child.expect_exact(PLAIN_MODE_NOTICE)
    child.expect_exact("> ")
    line = "Once upon a time"
    expected = llm.generate(line, _greedy(llm), use_tqdm=False)[0].outputs[0].text
    assert _send(child, line) == _terminal(expected)
    child.sendeof()  # Ctrl-D leaves
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_an_answer(chat_dir, llm):
    full = _chat(llm, [_user(FIRST)], max_tokens=1000, ignore_eos=True)
    child = _spawn(chat_dir, "--max-tokens", "1000", "--ignore-eos")
    child.expect_exact("> ")
    child.sendline(FIRST)
    child.expect_exact(FIRST + "\r\n")
    child.expect(".")  # the answer has started
    child.sendintr()
    child.expect_exact("\r\n> ")
    # The terminal echoes Ctrl-C as ^C (and may drop output it had not passed on yet).
    partial = child.before.replace("^C", "")
    assert PROMPT_INTERRUPT_HINT not in partial
    assert len(partial) < len(_terminal(full))
    assert child.isalive()
    _send(child, "/reset")
    assert _send(child, FIRST) == _terminal(full)
    child.sendintr()  # at the prompt: a hint, and a second Ctrl-C in a row leaves
    child.expect_exact(PROMPT_INTERRUPT_HINT)
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_interrupt_and_rejected_message_free_their_blocks(llm, monkeypatch):
    """Ctrl-C in the 5th step of the first answer keeps its 5 tokens in the conversation; a
    message longer than max_model_len is an error line; neither holds a KV block after."""
    partial = _chat(llm, [_user(FIRST)], max_tokens=5)
    reply2 = _chat(llm, [_user(FIRST), _assistant(partial), _user(SECOND)])
    engine = llm.llm_engine
    free = engine.num_free_blocks()
    step, steps = engine.step, []

    def step_then_ctrl_c():
        outputs = step()
        steps.append(outputs)
        if len(steps) == 5:
            signal.raise_signal(signal.SIGINT)
        return outputs

    monkeypatch.setattr(engine, "step", step_then_ctrl_c)
    too_long = " ".join(["word"] * 3000)
    stdin = io.StringIO(f"{FIRST}\n{SECOND}\n{too_long}\n/exit\n")
    stdout = io.StringIO()
    assert run_chat(llm, _greedy(llm), stdin=stdin, stdout=stdout) == 0
    _, *answers, after_exit = stdout.getvalue().split("\n> ")
    assert len(answers) == 3 and after_exit == ""
    assert answers[:2] == [partial, reply2]
    assert answers[2].startswith("error: prompt has")
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks() == free
