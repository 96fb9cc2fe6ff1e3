"""Running a model: engine config, requests, scheduler, block manager, batch building, the model
runner, sampler, outputs, the engine loop and the `LLM` API."""
