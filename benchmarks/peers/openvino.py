"""ember against OpenVINO GenAI on the same checkpoint, in one sitting: W-LAT (TTFT, TPOT) and
W-THRU (32 x 128 prompt + 128 output tokens, output tokens/s), for a 16-bit IR against ember's
default (`dtype="auto"`: the checkpoint's bf16 weights) and an int8 IR against ember's
`dtype="int8"` (per-channel int8 weights, int8 activations).

OpenVINO: `../shared/peers/openvino-venv.sh` builds its venv; this exports the IRs with its
`optimum-cli export openvino --weight-format fp16|int8` (once, next to the checkpoint) and runs
`../shared/peers/ov_bench.py` on them (ContinuousBatchingPipeline, 2 threads, the CPU plugin's
defaults: its KV-cache and inference precisions are printed). ember: `run_ember`, in a child
process per run, compiled (a warm-up run first fills the compile and weights caches). The two
engines' runs alternate (`ember.tools.bench.alternate`); each figure is the median of its
engine's runs.

`--cpu-isa avx2`: both as on an AVX2-only CPU: ember with `cpu_isa="avx2"` (its AVX2 kernels,
ATen and oneDNN capped), OpenVINO with oneDNN capped at AVX2 and f32 math (its default there).

usage: python benchmarks/peers/openvino.py CHECKPOINT_DIR [--ov-venv ~/.cache/peers/openvino]
           [--peers ../shared/peers] [--repeats 3] [--cpu-isa native|avx2] [--weights fp16,int8]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess

# ov_bench.py with CPU plugin properties added to its pipeline's (the AVX2 column's f32 math).
_OV_WITH_PROPERTIES = """
import json, runpy, sys
import openvino_genai as og
extra, bench = json.loads(sys.argv[1]), sys.argv[2]
base = og.ContinuousBatchingPipeline
og.ContinuousBatchingPipeline = lambda ir, sc, dev, props: base(ir, sc, dev, {**props, **extra})
sys.argv = [bench] + sys.argv[3:]
runpy.run_path(bench, run_name="__main__")
"""


# ember's dtype against each IR weight format: the checkpoint's bf16, or per-channel int8.
_EMBER_DTYPE = {"fp16": "auto", "int8": "int8"}


def ember_run(path: str, dtype: str, isa: str) -> dict:
    """One run of both workloads in a fresh ember child."""
    from ember.tools.bench import run_ember_child

    return run_ember_child(path, 1, cpu_isa=isa, dtype=dtype)


def openvino_run(venv: str, peers: str, ir: str, isa: str) -> dict:
    """One ov_bench.py process on `ir`: {"lat": {ttft_ms, tpot_ms}, "thru": {out_tok_s}, "kv",
    "math"}."""
    env, cmd = dict(os.environ), [f"{venv}/bin/python", f"{peers}/ov_bench.py", ir]
    if isa == "avx2":
        # An AVX2-only CPU's defaults: oneDNN capped at AVX2 (OV_CPU_MAX_ISA caps the plugin's
        # own kernels only in builds that read it), and f32 math, which the plugin picks itself
        # without AVX512-BF16 but not under the cap alone (its bf16 check reads CPUID).
        env.update(ONEDNN_MAX_CPU_ISA="AVX2", OV_CPU_MAX_ISA="AVX2")
        props = {"INFERENCE_PRECISION_HINT": "f32"}
        cmd = [cmd[0], "-c", _OV_WITH_PROPERTIES, json.dumps(props)] + cmd[1:]
    from ember.tools.bench import probe_bandwidth_gbs

    gbs = probe_bandwidth_gbs()  # before the process (it runs W-LAT first)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    run = json.loads(out.strip().splitlines()[-1])
    return {
        "lat": {"ttft_ms": run["ttft"] * 1e3, "tpot_ms": run["tpot"] * 1e3, "probe_gbs": gbs},
        "thru": {"out_tok_s": run["thru"]},
        "kv": run["kv_cache_precision"],
        # ov_bench prints a fresh Core's default, not the f32 given to its pipeline here
        "math": "f32" if isa == "avx2" else run["inference_precision"],
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
    from ember.host.isa import cpu_description
    from ember.tools.bench import alternate, tpots

    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--ov-venv", default=os.path.expanduser("~/.cache/peers/openvino"))
    parser.add_argument("--peers", default=os.path.join(here, "..", "..", "..", "shared", "peers"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-isa", default="native", choices=("native", "avx2"))
    parser.add_argument("--weights", default="fp16,int8", help="IR weight formats, in order")
    args = parser.parse_args()
    formats = args.weights.split(",")
    for f in formats:
        if f not in _EMBER_DTYPE:
            raise ValueError(f"--weights: {f!r} is not one of {', '.join(_EMBER_DTYPE)}")
    print(f"{cpu_description()}; {args.checkpoint}; --cpu-isa {args.cpu_isa}")
    print(
        "| weights | OpenVINO TTFT ms | ember | ratio | OpenVINO TPOT ms | ember | ratio | "
        "OpenVINO W-THRU tok/s | ember | ratio | caches (OV / ember) |"
    )
    print("|---" * 11 + "|", flush=True)
    for weight_format in formats:
        dtype = _EMBER_DTYPE[weight_format]
        ir = export(args.ov_venv, args.checkpoint, weight_format)
        ember_run(args.checkpoint, dtype, args.cpu_isa)  # warm-up: compile, weights caches
        e, o = alternate(
            [
                functools.partial(ember_run, args.checkpoint, dtype, args.cpu_isa),
                functools.partial(openvino_run, args.ov_venv, args.peers, ir, args.cpu_isa),
            ],
            args.repeats,
        )
        print(
            f"| {weight_format} IR / ember dtype={dtype} "
            f"| {o['lat']['ttft_ms']:.1f} | {e['lat']['ttft_ms']:.1f} "
            f"| {e['lat']['ttft_ms'] / o['lat']['ttft_ms']:.2f} "
            f"| {o['lat']['tpot_ms']:.2f} | {e['lat']['tpot_ms']:.2f} "
            f"| {e['lat']['tpot_ms'] / o['lat']['tpot_ms']:.2f} "
            f"| {o['thru']['out_tok_s']:.1f} | {e['thru']['out_tok_s']:.1f} "
            f"| {e['thru']['out_tok_s'] / o['thru']['out_tok_s']:.2f} "
            f"| {o['kv']} ({o['math']} math) / {e['kv']} |",
            flush=True,
        )
        print(
            f"  TPOT ms by run @ GB/s read just before it (probe_bandwidth_gbs), ember / OpenVINO: "
            f"{tpots(e)} / {tpots(o)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
