"""ember against OpenVINO GenAI on the same checkpoint, in one sitting: W-LAT (TTFT, TPOT) and
W-THRU (32 x 128 prompt + 128 output tokens, output tokens/s), for a 16-bit IR against ember's
default (`dtype="auto"`: the checkpoint's bf16 weights) and an int8 IR against ember's
`dtype="int8"` (per-channel int8 weights, int8 activations).

OpenVINO: `../shared/peers/openvino-venv.sh` builds its venv; this exports the IRs with its
`optimum-cli export openvino --weight-format fp16|int8` (once, next to the checkpoint) and runs
`../shared/peers/ov_bench.py` on them (ContinuousBatchingPipeline, 2 threads, the CPU plugin's
defaults: its KV-cache and inference precisions are printed). ember: `run_ember`, in a child
process per engine, compiled (a warm-up run first fills the compile and weights caches).

usage: python benchmarks/peers/openvino.py CHECKPOINT_DIR [--ov-venv ~/.cache/peers/openvino]
           [--peers ../shared/peers] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = """
import json, sys
from ember import LLM
from ember.tools.bench import WORKLOADS, run_ember
path, dtype, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model=path, dtype=dtype, use_tqdm=False)
out = {}
for w in ("lat", "thru"):
    r = run_ember(llm, WORKLOADS[w], repeats)
    out[w] = {"ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms, "out_tok_s": r.out_tok_s}
out["kv"] = str(llm.config.kv_dtype)
llm.close()
print(json.dumps(out))
"""


def ember_run(path: str, dtype: str, repeats: int) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, path, dtype, str(repeats)],
        capture_output=True, text=True, cwd=root,
    )  # fmt: skip
    if child.returncode != 0:
        raise RuntimeError(f"ember on {path}: {child.stderr[-2000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def openvino_run(venv: str, peers: str, ir: str, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        out = subprocess.run(
            [f"{venv}/bin/python", f"{peers}/ov_bench.py", ir],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        runs.append(json.loads(out.strip().splitlines()[-1]))
    runs.sort(key=lambda r: r["thru"])
    mid = runs[len(runs) // 2]
    lat = sorted(runs, key=lambda r: r["tpot"])[len(runs) // 2]
    return {
        "lat": {"ttft_ms": lat["ttft"] * 1e3, "tpot_ms": lat["tpot"] * 1e3},
        "thru": {"out_tok_s": mid["thru"]},
        "kv": mid["kv_cache_precision"],
        "math": mid["inference_precision"],
    }


def export(venv: str, checkpoint: str, weight_format: str) -> str:
    ir = f"{checkpoint.rstrip('/')}-ov-{weight_format}"
    if not os.path.isfile(os.path.join(ir, "openvino_model.xml")):
        subprocess.run(
            [f"{venv}/bin/optimum-cli", "export", "openvino", "-m", checkpoint, "--task",
             "text-generation-with-past", "--weight-format", weight_format, ir],
            check=True, capture_output=True,
        )  # fmt: skip
    return ir


def main() -> None:
    from ember.host import cpu_description

    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--ov-venv", default=os.path.expanduser("~/.cache/peers/openvino"))
    parser.add_argument("--peers", default=os.path.join(here, "..", "..", "..", "shared", "peers"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{cpu_description()}; {args.checkpoint}")
    print(
        "| weights | OpenVINO TTFT ms | ember | ratio | OpenVINO TPOT ms | ember | ratio | "
        "OpenVINO W-THRU tok/s | ember | ratio | caches (OV / ember) |"
    )
    print("|---" * 11 + "|", flush=True)
    for weight_format, dtype in (("fp16", "auto"), ("int8", "int8")):
        ir = export(args.ov_venv, args.checkpoint, weight_format)
        ember_run(args.checkpoint, dtype, 1)  # warm-up: compile and weights caches
        e = ember_run(args.checkpoint, dtype, args.repeats)
        o = openvino_run(args.ov_venv, args.peers, ir, args.repeats)
        print(
            f"| {weight_format} IR / ember dtype={dtype} "
            f"| {o['lat']['ttft_ms']:.1f} | {e['lat']['ttft_ms']:.1f} "
            f"| {e['lat']['ttft_ms'] / o['lat']['ttft_ms']:.2f} "
            f"| {o['lat']['tpot_ms']:.2f} | {e['lat']['tpot_ms']:.2f} "
            f"| {e['lat']['tpot_ms'] / o['lat']['tpot_ms']:.2f} "
            f"| {o['thru']['out_tok_s']:.1f} | {e['thru']['out_tok_s']:.1f} "
            f"| {e['thru']['out_tok_s'] / o['thru']['out_tok_s']:.2f} "
            f"| {o['kv']} ({o['math']} math) / {e['kv'].removeprefix('torch.')} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
