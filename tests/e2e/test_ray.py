"""Scale-out with Ray on a local Ray instance started by the test (2 CPUs): a Ray Serve
application of 2 ember replicas answers requests routed to both, with the same greedy outputs as
offline `LLM.generate`, one replica reads the prompt blocks the other wrote to their shared
`prefix_cache_dir`, and Ray Data's `map_batches` with `EmberPredictor` equals it too. About
40 s on 2 cores, so it stays in the default run."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import fastapi  # noqa: F401  (Ray Serve's HTTP proxy)
import ray
import ray.serve  # noqa: F401

from ember import LLM, SamplingParams

ENGINE = {"compile": False, "dtype": "float32", "kv_cache_gib": 0.02, "max_model_len": 256}
PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time", "A river of stone"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(port: int, body: dict) -> tuple[str, dict]:
    """(the replica that answered, the response) of a /v1/completions request."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.headers["x-ember-replica"], json.loads(r.read())


def _shared_prefix_is_read_across_replicas(port: int, greedy: dict) -> None:
    """The replicas share one `prefix_cache_dir`. One replica answers a long prompt first and
    writes its blocks; then the same prompt goes out 8 times at once, so the router spreads it
    over both replicas (one after the other, Serve may keep choosing one). The other replica
    reports the prefix cached: its memory never held it, so its first answer read the blocks
    from the directory (later ones may hit what that read put in memory)."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": "tiny", "prompt": list(range(5, 45)), **greedy}  # 2 full 16-token blocks
    first, out = _complete(port, body)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    time.sleep(0.5)  # the writer thread puts the blocks on disk meanwhile
    for _ in range(3):
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _complete(port, body), range(8)))
        others = [out for replica, out in answers if replica != first]
        if others:
            assert all(o["usage"]["prompt_tokens_details"]["cached_tokens"] == 32 for o in others)
            return
    raise AssertionError(f"every request went to replica {first}")


def test_ray_serve_replicas_and_ray_data_match_offline_generate(checkpoint_dir, tmp_path):
    from ray import serve

    from ember.serve.ray import EmberPredictor, deployment

    d = checkpoint_dir("tiny-llama")
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    want = [o.outputs[0].text for o in LLM(model=d, **ENGINE).generate(
        PROMPTS, SamplingParams(**greedy), use_tqdm=False)]  # fmt: skip
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = deployment(d, num_replicas=2, served_model_name="tiny", num_cpus=0.5, threads=1,
                         prefix_cache_dir=str(tmp_path / "prompts"), **ENGINE)  # fmt: skip
        serve.run(app, route_prefix="/", name="ember")
        replicas = set()
        for i in range(16):
            body = {"model": "tiny", "prompt": PROMPTS[i % 4], **greedy}
            replica, out = _complete(port, body)
            replicas.add(replica)
            assert out["choices"][0]["text"] == want[i % 4]
        assert len(replicas) == 2  # Serve routed requests to both replicas
        _shared_prefix_is_read_across_replicas(port, greedy)
        serve.shutdown()
        ds = ray.data.from_items([{"prompt": p} for p in PROMPTS])
        rows = ds.map_batches(
            EmberPredictor, fn_constructor_kwargs={"model": d, "sampling": greedy, **ENGINE},
            concurrency=1, batch_size=2, num_cpus=1,
        ).take_all()  # fmt: skip
        got = {r["prompt"]: r["generated_text"] for r in rows}
        assert [got[p] for p in PROMPTS] == want
        assert all(r["num_generated_tokens"] == 8 for r in rows)
    finally:
        ray.shutdown()
