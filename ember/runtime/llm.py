"""The user-facing `LLM` class, in vLLM's shape."""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ember.lora.adapter import LoRARequest
from ember.runtime.config import EngineArgs
from ember.runtime.engine import LLMEngine
from ember.runtime.input_processor import PromptType
from ember.runtime.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from ember.runtime.pooling import (
    activate,
    classifier_activation,
    pair_scores,
    score_pairs,
    score_prompts,
)
from ember.runtime.request import RequestOutputKind, SamplingParams


def _serialised(method: Callable[..., Any]) -> Callable[..., Any]:
    """Calls from several threads run one after another (each gets its own outputs)."""

    @functools.wraps(method)
    def locked(self: LLM, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class LLM:
    """Offline generation over a local HF checkpoint directory.

    >>> llm = LLM(model="ckpt_dir", dtype="float32", kv_cache_gib=2)
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0))

    Thread-safe: `generate`/`embed` calls from several threads are serialised (each call's
    requests run together; another thread's call waits for it).
    """

    def __init__(self, model: str, use_tqdm: bool = True, **kwargs: Any) -> None:
        """`kwargs` are the fields of `ember.runtime.config.EngineArgs` (the engine knobs);
        `compile=True` (default) compiles every shape bucket here, before the first request."""
        self._lock = threading.Lock()
        self.config = EngineArgs(model=model, **kwargs).create_engine_config()
        self.llm_engine = LLMEngine.from_config(self.config, show_progress=use_tqdm)
        self._counter = 0

    def get_tokenizer(self):  # noqa: ANN201
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without `sampling_params`: the model's generation-config
        sampling values over SamplingParams' defaults (`generation_config="auto"`, as vLLM)."""
        return SamplingParams(**self.llm_engine.default_sampling)

    @_serialised
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        raise_on_error: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        `prompts`: a string, a token-id dict (`{"prompt_token_ids": [...]}`) or a list of them.
        `sampling_params`: one for all prompts, or one per prompt.
        `raise_on_error`: if False, a request rejected for bad input comes back as a finished
        `RequestOutput` with `error` set and no completions, and the others still run; and if a
        step fails as a whole (an exception in the model), the call returns what finished and
        every unfinished request with `error` set (tokens so far, finish_reason "error")
        instead of raising. Either way the engine stays usable, with no blocks held.
        A request that fails on its own (NaN/inf in its logits, e.g. from its adapter) always
        finishes alone with `error` set; the others go on.
        `lora_request`: one adapter for all prompts, or one per prompt (None: the base model);
        needs `LLM(..., enable_lora=True)`. An adapter that does not fit the base model fails
        its own request only.
        """
        prompt_list: list[PromptType] = (
            [prompts] if isinstance(prompts, (str, dict)) else list(prompts)  # type: ignore[arg-type]
        )
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list: list[LoRARequest | None] = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(
                    f"lora_request has {len(lora_list)} entries for {len(prompt_list)} prompts"
                )
        # Only finished outputs are used here: no per-step snapshots.
        params_list = [
            dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list
        ]
        ids: list[str] = []
        rejected: dict[str, RequestOutput] = {}
        try:
            for prompt, params, lora in zip(prompt_list, params_list, lora_list, strict=True):
                request_id = str(self._counter)
                self._counter += 1
                ids.append(request_id)
                try:
                    self.llm_engine.add_request(request_id, prompt, params, lora)
                except ValueError as e:
                    if raise_on_error:
                        raise
                    rejected[request_id] = _error_output(request_id, prompt, e)
        except ValueError:
            for request_id in ids:
                self.llm_engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm, rejected, raise_on_error)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of `{"role", "content"}` messages) or
        a list of them, as vLLM's `LLM.chat`: each is rendered with the tokenizer's chat
        template (or `chat_template`) through `apply_chat_template`, tokenized without adding
        special tokens (the template has them), then generated as `generate` does.

        `content` is a string or a list of OpenAI parts; text parts are joined with newlines
        for templates that expect strings (`chat_template_content_format="auto"` or
        "string"), or passed as they are ("openai"). Raises ValueError when the model has no
        chat template and none is given.

        Vision-language models take image parts too, as vLLM does: `{"type": "image_pil",
        "image_pil": PIL.Image}`, `{"type": "image", "image": PIL.Image}` or `{"type":
        "image_url", "image_url": {"url": "data:image/...;base64,..."}}` (data URLs only:
        nothing is downloaded). With string content each message's images become the model's
        image token placed before its text (vLLM's placement); with "openai" content they
        become `{"type": "image"}` parts for the template to place.
        """
        conversations = _conversations(messages)
        image_token = self.llm_engine.image_token()
        prompts = [
            render_chat(
                self.get_tokenizer(), conv, chat_template, chat_template_content_format,
                add_generation_prompt, continue_final_message, tools, chat_template_kwargs,
                image_token,
            )
            for conv in conversations
        ]  # fmt: skip
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    @_serialised
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and validate an adapter ahead of its requests (ValueError if it does not fit)."""
        if self.llm_engine.lora is None:
            raise ValueError("add_lora needs an engine built with enable_lora=True")
        self.llm_engine.lora.add(lora_request)
        return True

    @_serialised
    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot is cleared); False if it was not known. Requests still
        running with it must finish first."""
        lora = self.llm_engine.lora
        if lora is None:
            return False
        if any(r.lora_id == lora_int_id for r in self.llm_engine.scheduler.requests.values()):
            raise ValueError(f"LoRA {lora_int_id} is in use by unfinished requests")
        return lora.remove(lora_int_id)

    def save_prefix(
        self,
        prompts: PromptType | Sequence[PromptType],
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[int]:
        """Compute the prompts' K/V and write their full blocks to the prefix cache's disk
        tier (`prefix_cache_dir`), returning once they are on disk: a later engine on this
        model and directory then starts with them (a system prompt, tool definitions; `ember
        warmup --prompt FILE`). Returns how many tokens of each prompt are saved (its full
        blocks). ValueError without `prefix_cache_dir`."""
        store = self.llm_engine.prefix_store
        if store is None:
            raise ValueError("save_prefix needs an engine with prefix_cache_dir set")
        one = SamplingParams(max_tokens=1, temperature=0.0)
        outs = self.generate(prompts, one, use_tqdm=False, lora_request=lora_request)
        store.flush()
        size = self.config.block_size
        return [len(o.prompt_token_ids) // size * size for o in outs]

    def list_loras(self) -> list[LoRARequest]:
        lora = self.llm_engine.lora
        return lora.requests() if lora is not None else []

    @_serialised
    def embed(
        self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`out.outputs.embedding`, a list of floats), input order.

        Encoder models (`BertModel`) pool as their sentence-transformers config says (else
        mean); causal LMs pool their last token. Raises ValueError for bad input before any
        work.
        """
        if self.config.task == "classify":
            raise ValueError("this model is a classifier: use LLM.classify or LLM.score")
        return self._pooled(_prompt_list(prompts), use_tqdm, "Embedding")

    def _pooled(
        self, prompt_list: list[PromptType], use_tqdm: bool, desc: str
    ) -> list[EmbeddingRequestOutput]:
        ids = [str(self._counter + i) for i in range(len(prompt_list))]
        self._counter += len(prompt_list)
        start = time.perf_counter()
        with tqdm(
            total=len(ids), desc=desc, unit="req", disable=not use_tqdm, dynamic_ncols=True
        ) as bar:
            outs = self.llm_engine.embed(ids, prompt_list)
            bar.update(len(outs))
            bar.set_postfix_str(f"{len(outs) / max(time.perf_counter() - start, 1e-9):.1f} req/s")
        return outs

    @_serialised
    def classify(
        self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True
    ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's class probabilities per prompt (`out.outputs.probs`):
        its logits through softmax, or sigmoid for one label (a checkpoint's
        sentence-transformers `activation_fn` wins). Raises ValueError for another kind of
        model or bad input, before any work."""
        if self.config.task != "classify":
            raise ValueError(
                f"LLM.classify needs a sequence classifier (*ForSequenceClassification); this "
                f"model's task is {self.config.task}"
            )
        activation = classifier_activation(self.config.model_spec.hf_config)
        outs = self._pooled(_prompt_list(prompts), use_tqdm, "Classifying")
        out = []
        for o in outs:
            probs = activate(torch.tensor(o.outputs.embedding), activation).tolist()
            out.append(ClassificationRequestOutput(
                o.request_id, o.prompt, o.prompt_token_ids, ClassificationOutput(probs)
            ))  # fmt: skip
        return out

    @_serialised
    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: one score per text pair, `data_1[i]` with `data_2[i]` (one
        `data_1` text goes with each of `data_2`). A cross-encoder (a classifier with one
        label) reads each pair as the tokenizer joins it (with its segment ids) and scores it
        through sigmoid; an embedding model scores the cosine similarity of the two texts'
        embeddings. Raises ValueError for unequal lists or another kind of model."""
        pairs = score_pairs(data_1, data_2)
        spec = self.config.model_spec
        prompts = score_prompts(self.llm_engine.tokenizer, spec, pairs)
        outs = self._pooled(prompts, use_tqdm, "Scoring")
        values = pair_scores(spec, pairs, prompts, [o.outputs.embedding for o in outs])
        if spec.task == "classify":  # one pooled request per pair
            return [
                ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(v))
                for o, v in zip(outs, values, strict=True)
            ]
        by_text = dict(zip(prompts, outs, strict=True))
        return [
            ScoringRequestOutput(
                f"score-{i}",
                by_text[a].prompt_token_ids + by_text[b].prompt_token_ids,
                ScoringOutput(v),
            )
            for i, ((a, b), v) in enumerate(zip(pairs, values, strict=True))
        ]

    def _run(
        self,
        ids: list[str],
        use_tqdm: bool,
        finished: dict[str, RequestOutput],
        raise_on_error: bool = True,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        bar = tqdm(
            total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True
        )
        start, num_out = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        num_out += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        rate = num_out / max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"out {rate:.1f} tok/s")
        except BaseException as e:  # the step was rolled back: the engine is consistent
            if raise_on_error or not isinstance(e, Exception):  # KeyboardInterrupt and the like
                for request_id in ids:
                    engine.abort_request(request_id)
                raise
            error = f"a step of the engine failed: {type(e).__name__}: {e}"
            for request_id in ids:
                if (
                    request_id not in finished
                    and (failed := engine.fail_request(request_id, error)) is not None
                ):
                    finished[request_id] = failed
        finally:
            bar.close()
        return [finished[i] for i in ids]

    @_serialised
    def close(self) -> None:
        """Abort everything and release the KV cache and the model; the LLM is unusable after
        (its methods raise RuntimeError)."""
        engine = self.__dict__.pop("llm_engine", None)
        if engine is not None:
            engine.close()

    def __getattr__(self, name: str) -> object:
        if name == "llm_engine":  # only reached once `close` has dropped it
            raise RuntimeError("this LLM is closed; create a new LLM to run more requests")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template` as vLLM reads it: the contents of a file, else the Jinja template
    itself (with backslash escapes such as `\\n` decoded, for shell arguments). A value with no
    Jinja characters that names no readable file is a ValueError, not a template."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"chat template {value!r} looks like a file path, but it cannot be read ({e})"
            ) from e
    return value.encode("latin-1", "backslashreplace").decode("unicode-escape")


def render_chat(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: str | None = None,
    content_format: str = "auto",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
    image_token: str | None = None,
) -> dict[str, Any]:
    """One conversation as a prompt dict (`prompt` text and `prompt_token_ids`, plus
    `multi_modal_data` when it has images): the chat template applied by the tokenizer,
    encoded without added special tokens (as vLLM does). `image_token`: the model's image
    placeholder (vision-language models; None: image parts are a ValueError). Raises
    ValueError for a model without a template (and none given) or bad options."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model has none")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "this model has no chat template: pass chat_template (a Jinja template string; "
            "`ember serve --chat-template FILE`)"
        )
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
    if content_format not in ("auto", "string", "openai"):
        raise ValueError(
            f"chat_template_content_format must be auto, string or openai, got {content_format!r}"
        )
    for i, message in enumerate(conversation):
        _check_message(i, message)
    images: list[Any] = []
    conversation = [_take_images(m, images, image_token) for m in conversation]
    if content_format != "openai":
        conversation = [_string_content(m, image_token) for m in conversation]
    conversation = [_tool_call_arguments(m) for m in conversation]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(kwargs or {}),
        )
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001  (Jinja's errors, and the template's own raises)
        raise ValueError(
            f"the chat template failed on these messages: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(text, str):
        raise ValueError(f"the chat template made a {type(text).__name__}, not a string")
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": list(ids)}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt


_IMAGE_PARTS = ("image", "image_pil", "image_url")


def _check_message(index: int, message: Any) -> None:
    """ValueError naming the field where message `index` is not {"role": str, "content": a
    string, a list of content parts (strings or dicts with a string "type"), or null}."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object, got {type(message).__name__}")
    if not isinstance(message.get("role"), str):
        role = message.get("role")
        raise ValueError(f"messages[{index}].role must be a string, got {role!r:.60}")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(
            f"messages[{index}].content must be a string, a list of content parts or null, "
            f"got {type(content).__name__}"
        )
    for j, part in enumerate(content):
        if not isinstance(part, str) and not (
            isinstance(part, dict) and isinstance(part.get("type"), str)
        ):
            raise ValueError(
                f"messages[{index}].content[{j}] must be a string or an object with a string "
                f"'type', got {part!r:.60}"
            )


def _take_images(
    message: dict[str, Any], images: list[Any], image_token: str | None
) -> dict[str, Any]:
    """`message` with each image part replaced by `{"type": "image"}`, its image appended to
    `images` (decoded from a data URL where given as one)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _IMAGE_PARTS:
            parts.append(part)
            continue
        if image_token is None:
            raise ValueError(f"chat content part of type {kind!r}: this model takes no images")
        value = part.get(kind)
        if kind == "image_url":
            url = value.get("url") if isinstance(value, dict) else value
            value = _data_url_image(url)
        images.append(value)
        parts.append({"type": "image"})
    return {**message, "content": parts}


def _data_url_image(url: Any) -> Any:
    """The PIL image of a `data:image/...;base64,` URL (other URLs: ValueError)."""
    import base64  # noqa: PLC0415
    import binascii  # noqa: PLC0415
    import io  # noqa: PLC0415

    if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
        raise ValueError(
            "image_url must be a data:image/...;base64 URL (ember fetches nothing), got "
            f"{str(url)[:60]!r}"
        )
    try:
        from PIL import Image  # noqa: PLC0415

        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1], validate=True)))
        image.load()
        return image
    except (binascii.Error, OSError, ValueError) as e:
        raise ValueError(f"image_url: not a readable base64 image: {e}") from e


def _conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """One conversation (a list of message dicts) or a list of them, as a list of them."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for conv in conversations:
        if not isinstance(conv, Sequence) or not conv:
            raise ValueError("each conversation must be a non-empty list of messages")
        for m in conv:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"a chat message must be a dict with a 'role', got {m!r}")
    return [list(c) for c in conversations]


def _tool_call_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's `tool_calls` with each call's `arguments` JSON string parsed into
    the dict chat templates expect (as vLLM passes them); other messages as they are."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    parsed = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                arguments = json.loads(fn["arguments"])
            except ValueError as e:
                raise ValueError(
                    f"tool_calls[].function.arguments must be a JSON object string: {e}"
                ) from e
            call = {**call, "function": {**fn, "arguments": arguments}}
        parsed.append(call)
    return {**message, "tool_calls": parsed}


def _string_content(message: dict[str, Any], image_token: str | None = None) -> dict[str, Any]:
    """`message` with list-of-parts content joined into one string: its image placeholders
    (`{"type": "image"}` parts, see `_take_images`) first, then the text parts, joined with
    newlines (vLLM's placement for string templates)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts, placeholders = [], []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            texts.append(str(part.get("text", "")))
        elif isinstance(part, dict) and part.get("type") == "image" and image_token is not None:
            placeholders.append(image_token)
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"chat content part of type {kind!r} is not supported (text only)")
    if placeholders:
        texts = [*placeholders, *texts]
    return {**message, "content": "\n".join(texts)}


def _error_output(request_id: str, prompt: PromptType, error: Exception) -> RequestOutput:
    text = (
        prompt
        if isinstance(prompt, str)
        else (prompt.get("prompt") if isinstance(prompt, dict) else None)
    )
    return RequestOutput(request_id, text, [], [], finished=True, error=f"{error}")


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)  # type: ignore[arg-type]
