"""The chat page `ember serve` serves at `/`, driven in a real headless chromium (selenium):
it asks for the API key on a 401, lists the served model, streams answers that equal offline
greedy `LLM.chat` over the same conversation (system prompt and two turns included), clears
the conversation, and its Stop button aborts a long answer (the server counts an abort and
keeps answering). Skips, naming what is missing, without selenium, chromium or chromedriver."""

from __future__ import annotations

import os
import re
import shutil
import time
import urllib.error
import urllib.request

import fastapi  # noqa: F401  (`ember serve`; it, uvicorn and selenium are dev dependencies)
import pytest
import uvicorn  # noqa: F401
from selenium import webdriver
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

from ember import LLM, SamplingParams
from tests.e2e.servers import CHAT_TEMPLATE, metrics, start_serve, stop_serve, with_chat_template

MAX_LEN = 2048  # room for a long answer for Stop to cut short
ENGINE = {"compile": False, "dtype": "float32", "kv_cache_gib": 0.05, "max_model_len": MAX_LEN}
KEY = "sk-page-key"


def _browser_paths() -> tuple[str, str]:
    chromium = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
        None,
    )
    driver = shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", chromium),
                                       ("chromedriver (Debian: chromium-driver)", driver))
               if path is None]  # fmt: skip
    if missing:
        pytest.skip(
            f"the chat page test needs a headless browser: {' and '.join(missing)} not found "
            "(apt-get install chromium chromium-driver)"
        )
    return chromium, driver


@pytest.fixture(scope="module")
def browser_paths() -> tuple[str, str]:
    return _browser_paths()  # checked before a server is started


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("page") / "m")
    return with_chat_template(checkpoint_dir("tiny-llama"), d, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(browser_paths, model_dir):
    """`ember serve MODEL` on a free port, the key from EMBER_API_KEY."""
    args = [model_dir, "--no-compile", "--kv-cache-gib", str(ENGINE["kv_cache_gib"]),
            "--max-model-len", str(MAX_LEN), "--dtype", "float32", "--served-model-name", "tiny"]  # fmt: skip
    proc, url = start_serve(args, dict(os.environ, EMBER_API_KEY=KEY))
    yield url
    stop_serve(proc)


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model=model_dir, **ENGINE)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def driver(browser_paths):
    chromium, chromedriver = browser_paths
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900"):  # fmt: skip
        options.add_argument(arg)
    d = webdriver.Chrome(options=options, service=webdriver.ChromeService(chromedriver))
    yield d
    d.quit()


@pytest.fixture(scope="module")
def page(server, driver):
    """The page opened, the key entered when it asks, the models listed."""
    driver.get(server + "/")
    key = WebDriverWait(driver, 20).until(lambda d: _shown(d, "api-key"))
    key.send_keys(KEY, Keys.ENTER)
    WebDriverWait(driver, 20).until(lambda d: _options(d))
    return driver


def _shown(driver, element_id: str):
    el = driver.find_element(By.ID, element_id)
    return el if el.is_displayed() else None


def _options(driver) -> list[str]:
    return [o.get_attribute("value") for o in Select(driver.find_element(By.ID, "model")).options]


def _set(driver, element_id: str, value: str) -> None:
    el = driver.find_element(By.ID, element_id)
    el.clear()
    if value:
        el.send_keys(value)


def _answers(driver) -> list:
    return driver.find_elements(By.CSS_SELECTOR, "#messages .assistant")


def _text(el) -> str:
    return el.find_element(By.CSS_SELECTOR, ".content").get_property("textContent")


def _done(driver, el, timeout: float = 30) -> None:
    WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda d: el.get_attribute("data-done") == "true"
    )


def _ask(driver, text: str, enter: bool = True):
    """Type a message (newlines as Shift+Enter), send it (Enter or the Send button), and
    return its answer's element once that is done."""
    count = len(_answers(driver))
    box = driver.find_element(By.ID, "input")
    box.clear()
    for i, line in enumerate(text.split("\n")):
        if i:
            ActionChains(driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(
                Keys.SHIFT
            ).perform()
        box.send_keys(line)
    if enter:
        box.send_keys(Keys.ENTER)
    else:
        driver.find_element(By.ID, "send").click()
    WebDriverWait(driver, 10).until(lambda d: len(_answers(d)) == count + 1)
    answer = _answers(driver)[-1]
    _done(driver, answer)
    return answer


def _chat(offline, messages, max_tokens: int = 12) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return offline.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def test_the_page_is_served_without_the_key_and_loads_nothing_from_outside(server):
    with urllib.request.urlopen(server + "/") as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/html")
        html = r.read().decode()
    for element_id in ("model", "system", "temperature", "max-tokens", "input", "send", "stop",
                       "clear", "api-key", "messages"):  # fmt: skip
        assert f'id="{element_id}"' in html
    assert not re.search(r"https?://|\b(?:src|href)\s*=|@import|url\(", html)
    with pytest.raises(urllib.error.HTTPError) as e:  # the API still wants the key
        urllib.request.urlopen(server + "/v1/models")
    assert e.value.code == 401


def test_the_page_streams_the_greedy_answers_of_a_conversation(page, offline):
    driver = page
    assert _options(driver) == ["tiny"]
    assert not driver.find_element(By.ID, "api-key").is_displayed()
    assert driver.execute_script("return localStorage.getItem('ember.apiKey')") == KEY
    driver.refresh()  # the stored key: no question this time
    WebDriverWait(driver, 20).until(lambda d: _options(d))
    assert not driver.find_element(By.ID, "api-key").is_displayed()
    driver.execute_script("localStorage.setItem('ember.apiKey', 'wrong')")
    driver.refresh()  # a refused key: asked again
    key = WebDriverWait(driver, 20).until(lambda d: _shown(d, "api-key"))
    assert "refused" in driver.find_element(By.CSS_SELECTOR, "label[for=api-key]").text
    key.send_keys(KEY, Keys.ENTER)
    WebDriverWait(driver, 20).until(lambda d: _options(d))

    _set(driver, "temperature", "0")
    _set(driver, "max-tokens", "12")
    first = _ask(driver, "Hello there")
    messages = [{"role": "user", "content": "Hello there"}]
    want = _chat(offline, messages)
    assert want and _text(first) == want
    assert [_text(u) for u in driver.find_elements(By.CSS_SELECTOR, "#messages .user")] == [
        "Hello there"
    ]

    _set(driver, "system", "be brief")
    second = _ask(driver, "What is two plus two?\nAnswer now.", enter=False)
    messages = [{"role": "system", "content": "be brief"}, *messages,
                {"role": "assistant", "content": want},
                {"role": "user", "content": "What is two plus two?\nAnswer now."}]  # fmt: skip
    assert _text(second) == _chat(offline, messages)
    assert len(_answers(driver)) == 2
    assert driver.find_element(By.ID, "send").is_enabled()
    assert not driver.find_element(By.ID, "stop").is_enabled()

    driver.find_element(By.ID, "clear").click()
    assert driver.find_elements(By.CSS_SELECTOR, "#messages > *") == []


def test_stop_cuts_an_answer_short_and_the_server_answers_the_next(page, server, offline):
    driver = page
    driver.find_element(By.ID, "clear").click()
    _set(driver, "system", "")
    _set(driver, "temperature", "0")
    _set(driver, "max-tokens", "2000")
    before = metrics(server, KEY)
    box = driver.find_element(By.ID, "input")
    box.send_keys("Tell me a story", Keys.ENTER)
    WebDriverWait(driver, 10, poll_frequency=0.02).until(
        lambda d: _answers(d) and _text(_answers(d)[-1])
    )
    driver.find_element(By.ID, "stop").click()
    answer = _answers(driver)[-1]
    _done(driver, answer, timeout=5)
    partial = _text(answer)
    assert partial  # what had arrived stays
    assert "Stopped" in answer.find_element(By.CSS_SELECTOR, ".note").text
    assert driver.find_element(By.ID, "send").is_enabled()

    deadline = time.time() + 10
    while (m := metrics(server, KEY))["ember_num_requests_running"] and time.time() < deadline:
        time.sleep(0.1)
    assert m["ember_num_requests_running"] == 0 and m["ember_kv_blocks_used"] == 0
    assert m["ember_requests_aborted_total"] == before["ember_requests_aborted_total"] + 1
    made = m["ember_generation_tokens_total"] - before["ember_generation_tokens_total"]
    assert made < 1000, made  # stopped well before 2000 tokens

    _set(driver, "max-tokens", "12")
    follow = _ask(driver, "And then?")
    messages = [{"role": "user", "content": "Tell me a story"},
                {"role": "assistant", "content": partial},
                {"role": "user", "content": "And then?"}]  # fmt: skip
    assert _text(follow) == _chat(offline, messages)
