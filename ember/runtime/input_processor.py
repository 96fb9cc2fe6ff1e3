"""Input processing: a user's prompt and sampling params made into what the engine queues.

Tokenizing (text, token ids, prompt dicts), `truncate_prompt_tokens`, encoder-decoder prompts,
images through the checkpoint's HF processor, validation against the model's limits (each a
ValueError naming the field and the limit, raised before anything is queued), logits controls
and structured-output grammars. It holds no request state: the scheduler owns that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.runtime.config import EngineConfig
from ember.runtime.logits import LogitsControls
from ember.runtime.logits import resolve as resolve_controls
from ember.runtime.multimodal import (
    ImageInputs,
    VisionGeometry,
    as_image_list,
    build_image_inputs,
    is_image,
)
from ember.runtime.request import SamplingParams
from ember.runtime.structured import GrammarCompiler, GrammarState

PromptType = str | dict[str, Any] | list[int]


@dataclass(frozen=True)
class ProcessedPrompt:
    """A checked prompt of a generation request: its text (None for token ids), ids, the
    encoder's ids (encoder-decoder models), images, how many tokens it may generate, its
    logits controls and its compiled grammar (with the ids it starts after)."""

    text: str | None
    token_ids: list[int]
    encoder_token_ids: list[int] | None
    images: ImageInputs | None
    max_tokens: int
    controls: LogitsControls | None
    grammar: Any
    grammar_wait_for: list[int] | None


def _check_image_count(num_tokens: int, processor: Any, images: list[Any]) -> None:
    if num_tokens != len(images):
        raise ValueError(
            f"the prompt has {num_tokens} image tokens ({processor.image_token!r}, id "
            f"{processor.image_token_id}) for {len(images)} images; they must be equal"
        )


class InputProcessor:
    """Prompts of one engine's model made into checked token ids (and images, grammars)."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        model_config: Any,
        num_input_ids: int,
        vocab_size: int,
        eos_ids: list[int],
        vision_geometry: VisionGeometry | None,
    ) -> None:
        """`num_input_ids`: rows of the input embeddings (prompt ids must index them);
        `vocab_size`: width of the logits; `eos_ids`: every id that ends a request as EOS."""
        self.config = config
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.num_input_ids = num_input_ids
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.vision_geometry = vision_geometry
        self._processor: Any = None  # a vision-language model's HF processor, on first use
        self._grammar_compiler: GrammarCompiler | None = None

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids")
            if self.config.model_spec.multimodal is not None:
                # A vision-language model's text-only prompt goes through its HF processor, as
                # its image prompts do (Mllama's puts the BOS in where the tokenizer does not).
                return prompt, self._processor_token_ids(prompt)
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a token-id list or a dict, got {type(prompt)}")

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        """The checked prompt of a generation request; ValueError for bad input."""
        encoder_ids = images = None
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if mm_data is not None:
            text, token_ids, images = self._process_images(prompt, mm_data)  # type: ignore[arg-type]
            token_ids = self._truncate(token_ids, params.truncate_prompt_tokens)
            if len(token_ids) != len(images.starts):
                raise ValueError(
                    "truncate_prompt_tokens cannot cut a prompt with images (it would cut the "
                    "images' place in the prompt)"
                )
        elif self.config.task == "encdec":
            text, token_ids, encoder_ids = self._tokenize_encoder_decoder(
                prompt, params.truncate_prompt_tokens
            )
        else:
            text, token_ids = self.tokenize(prompt)
            token_ids = self._truncate(token_ids, params.truncate_prompt_tokens)
        self._validate_prompt(token_ids, params)
        stop_ids = [*params.stop_ids, *self.eos_ids]
        controls = resolve_controls(params, self.vocab_size, self.tokenizer, stop_ids)
        grammar, wait_for = None, None
        if params.structured_outputs is not None:
            grammar = self.grammars().compile(params.structured_outputs)
            after = params.structured_outputs.start_after
            if after:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs.start_after needs a tokenizer")
                wait_for = list(self.tokenizer.encode(after, add_special_tokens=False))
        max_tokens = min(
            params.max_tokens or self.config.max_model_len,
            self.config.max_model_len - len(token_ids),
        )
        return ProcessedPrompt(
            text, token_ids, encoder_ids, images, max_tokens, controls, grammar, wait_for
        )

    def grammar_state(self, prompt: ProcessedPrompt) -> GrammarState | None:
        """A fresh matcher of the prompt's grammar (one per sequence), or None."""
        if prompt.grammar is None:
            return None
        return self.grammars().matcher(prompt.grammar, prompt.grammar_wait_for)

    def process_embed(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        """(text, ids) of prompt `index` of an embedding call (the model is no encoder-decoder:
        the engine checks that first); ValueError naming the prompt."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            raise ValueError(f"prompt {index}: LLM.embed takes no multi_modal_data")
        text, ids = self.tokenize(prompt)
        limit = min(self.config.max_model_len, self.config.max_num_batched_tokens)
        if len(ids) > limit:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; embedding inputs must have at most "
                f"min(max_model_len, max_num_batched_tokens)={limit}"
            )
        self._check_token_ids(ids, f"prompt {index}")
        return text, ids

    def _truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """`truncate_prompt_tokens`: the last `keep` tokens (-1: the last max_model_len - 1,
        which leaves room for one output token)."""
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.config.max_model_len - 1
        return token_ids[-keep:]

    def _tokenize_encoder_decoder(
        self, prompt: PromptType, truncate: int | None = None
    ) -> tuple[str | None, list[int], list[int]]:
        """(encoder text, decoder prompt ids, encoder ids) of an encoder-decoder prompt.

        A string / token list / `{"prompt": ...}` is the encoder input; or
        `{"encoder_prompt": ..., "decoder_prompt": ...}` with either part a string, a token list
        or `{"prompt_token_ids": [...]}`. The decoder prompt starts with the model's
        decoder_start_token_id: it is prepended unless the decoder prompt already starts with
        it (HF `generate`'s rule for `decoder_input_ids`); a text decoder prompt is tokenized
        without special tokens. `truncate` (`truncate_prompt_tokens`) cuts the encoder input.
        """
        decoder: Any = None
        if isinstance(prompt, dict) and "encoder_prompt" in prompt:
            encoder, decoder = prompt["encoder_prompt"], prompt.get("decoder_prompt")
        else:
            encoder = prompt
        text, encoder_ids = self.tokenize(encoder)
        encoder_ids = self._truncate(encoder_ids, truncate)
        start = getattr(self.model_config, "decoder_start_token_id", None)
        if start is None:
            raise ValueError(f"model {self.config.model!r} has no decoder_start_token_id")
        decoder_ids: list[int] = []
        if isinstance(decoder, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids")
            decoder_ids = list(self.tokenizer(decoder, add_special_tokens=False)["input_ids"])
        elif decoder is not None:
            decoder_ids = self.tokenize(decoder)[1]
        if not decoder_ids or decoder_ids[0] != int(start):
            decoder_ids.insert(0, int(start))
        limit = self.model_config.max_position_embeddings
        if len(encoder_ids) > limit:
            raise ValueError(
                f"encoder prompt has {len(encoder_ids)} tokens; it must have at most "
                f"max_position_embeddings={limit}"
            )
        self._check_token_ids(encoder_ids, "encoder prompt")
        return text, decoder_ids, encoder_ids

    def _check_token_ids(self, token_ids: list[int], what: str) -> None:
        """`what` ("prompt", "prompt 3", ...) must be non-empty ids in the vocabulary."""
        if not token_ids:
            raise ValueError(f"{what} is empty: it must have at least 1 token")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.num_input_ids]
        if bad:
            raise ValueError(
                f"{what} token ids must be in [0, {self.num_input_ids}); got {bad[:5]}"
            )

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len={self.config.max_model_len} "
                "leaves no room for output (prompt must be shorter than max_model_len)"
            )
        self._check_token_ids(token_ids, "prompt")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs={self.config.max_logprobs}")

    def _process_images(
        self, prompt: dict[str, Any], mm_data: Any
    ) -> tuple[str | None, list[int], ImageInputs]:
        """(prompt text, prompt ids, images) of a prompt with `multi_modal_data`: a text prompt
        goes through the checkpoint's HF processor (which also places the BOS token as HF
        does), a token-id prompt's images through its image processor."""
        spec = self.config.model_spec
        if spec.multimodal is None:
            raise ValueError(
                f"multi_modal_data: model {self.config.model!r} ({spec.architecture}) takes "
                "no images or other multimodal inputs"
            )
        if not isinstance(mm_data, dict) or not mm_data or set(mm_data) - {"image"}:
            raise ValueError(
                f'multi_modal_data must be {{"image": image or list of images}} for this model, '
                f"got {mm_data!r:.100}"
            )
        pictures = as_image_list(mm_data["image"])
        for picture in pictures:
            if not is_image(picture):
                raise ValueError(
                    "multi_modal_data['image'] takes PIL images (or HWC/CHW arrays and "
                    f"tensors), got {type(picture).__name__}"
                )
        limit = self.config.limit_mm_per_prompt.get("image", 0)
        if not 1 <= len(pictures) <= limit:
            raise ValueError(
                f"multi_modal_data has {len(pictures)} images; a prompt takes 1 to "
                f"limit_mm_per_prompt['image']={limit}"
            )
        processor = self._image_processor()
        geometry = self.vision_geometry
        assert geometry is not None
        try:
            if "prompt_token_ids" in prompt:
                text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
                features = processor.image_processor(images=[pictures], return_tensors="np")
            else:
                text = prompt.get("prompt")
                if not isinstance(text, str):
                    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
                _check_image_count(text.count(processor.image_token), processor, pictures)
                features = processor(images=[pictures], text=[text], return_tensors="np")
                token_ids = [int(t) for t in features["input_ids"][0]]
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001  (PIL and the processor raise their own types)
            raise ValueError(
                f"multi_modal_data: the image processor failed: {type(e).__name__}: {e}"
            ) from e
        image_token = processor.image_token_id
        _check_image_count(sum(1 for t in token_ids if t == image_token), processor, pictures)
        if features["pixel_values"].shape[2] != geometry.tiles:
            raise ValueError(
                f"the image processor makes {features['pixel_values'].shape[2]} tiles per image, "
                f"the model's vision tower takes {geometry.tiles}"
            )
        return text, token_ids, build_image_inputs(token_ids, image_token, features, geometry)

    def _processor_token_ids(self, text: str) -> list[int]:
        """The ids the checkpoint's HF processor makes of a text with no images."""
        try:
            ids = self._image_processor()(text=[text])["input_ids"][0]
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001  (the processor raises its own types)
            raise ValueError(f"the processor failed on the prompt: {type(e).__name__}: {e}") from e
        return [int(t) for t in ids]

    def image_token(self) -> str | None:
        """The prompt text that stands for one image (`<|image|>`), or None for a model that
        takes no images."""
        if self.config.model_spec.multimodal is None:
            return None
        return str(self._image_processor().image_token)

    def _image_processor(self) -> Any:
        """The checkpoint's HF processor (tokenizer + image processor), loaded on first use."""
        if self._processor is None:
            from transformers import AutoProcessor  # noqa: PLC0415

            try:
                self._processor = AutoProcessor.from_pretrained(
                    self.config.model_spec.model_dir,
                    local_files_only=True,
                    trust_remote_code=False,
                )
            except Exception as e:  # noqa: BLE001
                raise ValueError(
                    f"model {self.config.model!r} has no usable image processor "
                    f"(processor_config.json / preprocessor_config.json): {e}"
                ) from e
        return self._processor

    def grammars(self) -> GrammarCompiler:
        """The structured-output grammar compiler, made on first use (xgrammar's tokenizer
        info takes ~0.2 s for a 150k vocabulary)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(
                self.tokenizer, self.vocab_size, self.eos_ids
            )
        return self._grammar_compiler
