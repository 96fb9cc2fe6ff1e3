"""Scale-out with Ray, as vLLM does it: N ember replicas behind Ray Serve's HTTP proxy (each
replica one engine and the OpenAI-compatible app of `ember.serve.server`), and offline batch
inference over a Ray Data dataset with `EmberPredictor` in `map_batches`. No cluster code of
ember's own: Ray places the replicas and routes the requests.

    from ember.serve.ray import deployment
    serve.run(deployment("path/to/model", num_replicas=2), route_prefix="/")

    ds.map_batches(EmberPredictor, fn_constructor_kwargs={"model": "path/to/model"},
                   concurrency=2, batch_size=32)

`ember serve MODEL --ray --replicas N` does the first on a local (or `RAY_ADDRESS`) cluster.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def _build_replica(
    model: str,
    engine_kwargs: dict[str, Any],
    api_key: str | None,
    served_model_name: str | None,
    threads: int | None,
    lora_modules: list[str] | None,
    chat_template: str | None = None,
    tool_options: dict[str, Any] | None = None,
) -> Any:
    """One replica's ASGI app (run on the replica by Ray Serve's ingress builder)."""
    import torch  # noqa: PLC0415

    from ember.runtime.config import EngineArgs  # noqa: PLC0415
    from ember.runtime.engine import LLMEngine  # noqa: PLC0415
    from ember.serve.async_engine import AsyncLLMEngine  # noqa: PLC0415
    from ember.serve.chat_outputs import ChatTools  # noqa: PLC0415
    from ember.serve.server import build_app, parse_lora_modules  # noqa: PLC0415

    if threads:
        torch.set_num_threads(threads)
    loras = parse_lora_modules(lora_modules)
    config = EngineArgs(model=model, **engine_kwargs).create_engine_config()
    llm_engine = LLMEngine.from_config(config, show_progress=False)
    for lora in loras.values():
        assert llm_engine.lora is not None, "--lora-modules needs enable_lora=True"
        llm_engine.lora.add(lora)
    engine = AsyncLLMEngine(llm_engine)
    tools = ChatTools(llm_engine.tokenizer, **(tool_options or {}))
    app = build_app(engine, served_model_name or model, api_key, loras, chat_template, tools)
    replica = f"{os.uname().nodename}:{os.getpid()}"

    @app.middleware("http")
    async def name_replica(request: Any, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers["x-ember-replica"] = replica  # which replica answered
        return response

    return app


def deployment(
    model: str,
    num_replicas: int = 2,
    api_key: str | None = None,
    served_model_name: str | None = None,
    num_cpus: float = 1.0,
    threads: int | None = None,
    lora_modules: list[str] | None = None,
    chat_template: str | None = None,
    tool_options: dict[str, Any] | None = None,
    **engine_kwargs: Any,
) -> Any:
    """A Ray Serve application of `num_replicas` ember servers (`serve.run` deploys it).
    `num_cpus`: Ray's CPU reservation per replica; `threads`: torch threads per replica
    (default: torch's own); `lora_modules`: `name=path` adapters as in `ember serve`;
    `chat_template`: a Jinja template over the tokenizer's (`--chat-template`);
    `tool_options`: `ChatTools`' keyword arguments (tool-call and reasoning parsers);
    `engine_kwargs`: `EngineArgs` fields."""
    from ray import serve  # noqa: PLC0415

    def build() -> Any:
        return _build_replica(
            model, engine_kwargs, api_key, served_model_name, threads, lora_modules,
            chat_template, tool_options,
        )  # fmt: skip

    cls = serve.ingress(build)()
    return serve.deployment(
        cls, name="ember", num_replicas=num_replicas, ray_actor_options={"num_cpus": num_cpus}
    ).bind()


class EmberPredictor:
    """For Ray Data's `map_batches`: one engine per actor; each batch's `prompt` column
    (strings) gets a `generated_text` column (and `num_generated_tokens`). `sampling`: the
    `SamplingParams` fields; `engine_kwargs`: `EngineArgs` fields."""

    def __init__(
        self, model: str, sampling: dict[str, Any] | None = None, **engine_kwargs: Any
    ) -> None:
        from ember.runtime.llm import LLM  # noqa: PLC0415
        from ember.runtime.request import SamplingParams  # noqa: PLC0415

        self.llm = LLM(model=model, use_tqdm=False, **engine_kwargs)
        self.params = SamplingParams(**(sampling or {}))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.llm.generate([str(p) for p in batch["prompt"]], self.params, use_tqdm=False)
        batch["generated_text"] = np.array([o.outputs[0].text for o in outs], dtype=object)
        batch["num_generated_tokens"] = np.array([len(o.outputs[0].token_ids) for o in outs])
        return batch


def serve_with_ray(
    engine_args: Any,
    host: str,
    port: int,
    api_key: str | None,
    model_name: str | None,
    replicas: int,
    lora_modules: list[str] | None = None,
    chat_template: str | None = None,
    tool_options: dict[str, Any] | None = None,
) -> None:
    """`ember serve --ray --replicas N`: deploy on the Ray cluster at `RAY_ADDRESS` (else a
    local one), with Serve's HTTP proxy on host:port, until interrupted."""
    import dataclasses  # noqa: PLC0415
    import time  # noqa: PLC0415

    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    kwargs = dataclasses.asdict(engine_args)
    model = kwargs.pop("model")
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    app = deployment(
        model, replicas, api_key, model_name, lora_modules=lora_modules,
        chat_template=chat_template, tool_options=tool_options, **kwargs,
    )  # fmt: skip
    serve.run(app, route_prefix="/", name="ember")
    print(f"ember: {replicas} replicas of {model_name or model} on http://{host}:{port}")
    try:
        while True:
            time.sleep(3600)
    finally:
        serve.shutdown()
        ray.shutdown()
