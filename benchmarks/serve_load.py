"""Load on `transformers serve`, plain and with VeriCache (`vericache-hf serve`), side by side in one run.

Each server runs in its own process on a free loopback port, one after the other, on the same model. N clients send
long chat requests (code prompts of `--contexts` tokens, each opening with its own task line, so no two share a
prefix) all at once, streaming, greedy, through the `openai` client. Reports output tokens/s (all the requests'
completion tokens over the wall time from the first send to the last answer), time to first token, p50/p99
inter-token latency (the gaps between streamed chunks that carry text; a VeriCache chunk may carry several accepted
tokens), and whether every answer equals the first server's (plain: stock `generate`) answer to the same prompt.
`--servers` picks which run: plain and VeriCache, each sequential (transformers' runner, one `generate` at a time) or
with `--continuous-batching` (transformers' paged batch loop; VeriCache's engine, whose cohorts share passes).

    python benchmarks/serve_load.py --requests 8 --contexts 4096,8192 --max-new-tokens 256 \\
        --servers plain,vericache,vericache-cb --out docs/benchmarks/serve-load-8x4k-8k-256-tokens
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def prompts(model_dir: str, count: int, low: int, high: int, seed: int) -> list[str]:
    from transformers import AutoTokenizer

    from vericache_tools.prompts import code_context, humaneval_problems

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    problems, rng = humaneval_problems(), random.Random(seed)
    texts = []
    for index in range(count):
        tokens = rng.randint(low, high)
        problem = problems[index % len(problems)]["prompt"]
        head = f"Task {index + 1} of {count}: read this source, then complete the function at the end.\n\n"
        budget = tokens - len(tokenizer(head + problem)["input_ids"]) - 16
        texts.append(head + code_context(tokenizer, budget) + "\n\n" + problem)
    return texts


def start_server(command: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    from vericache_tools.redis_server import free_port

    port = free_port()
    command = [*command, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {process.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return process, url
        except OSError:
            time.sleep(1)
    process.kill()
    raise RuntimeError(f"the server did not answer within 600 s; see {log}")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def ask(client, model: str, text: str, max_new_tokens: int) -> dict:
    sent = time.perf_counter()
    arrivals, pieces, usage = [], [], None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_new_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            pieces.append(chunk.choices[0].delta.content)
    return {
        "sent": sent,
        "ended": time.perf_counter(),
        "ttft_s": arrivals[0] - sent if arrivals else float("nan"),
        "gaps_s": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
        "text": "".join(pieces),
        "completion_tokens": usage.completion_tokens if usage else None,
        "prompt_tokens": usage.prompt_tokens if usage else None,
    }


def load(url: str, texts: list[str], max_new_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=3600, max_retries=0)
    model = client.models.list().data[0].id
    ask(client, model, "Say hello.", 4)  # warm-up: first-call costs are not the load's
    results: list[dict | None] = [None] * len(texts)

    def run(index: int) -> None:
        results[index] = ask(client, model, texts[index], max_new_tokens)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = max(r["ended"] for r in results) - min(r["sent"] for r in results)
    tokens = sum(r["completion_tokens"] or 0 for r in results)
    ttfts = [r["ttft_s"] for r in results]
    gaps = [gap for r in results for gap in r["gaps_s"]]
    return {
        "wall_s": wall,
        "completion_tokens": tokens,
        "prompt_tokens": [r["prompt_tokens"] for r in results],
        "tokens_per_s": tokens / wall,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "texts": [r["text"] for r in results],
    }


def versions() -> dict:
    import torch
    import transformers

    import vericache_hf

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vericache_hf": vericache_hf.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "cpu": next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor(),
    }


#: the servers a run can start: (label, VeriCache's, with --continuous-batching)
SERVERS = {
    "plain": ("transformers serve", False, False),
    "vericache": ("vericache-hf serve", True, False),
    "plain-cb": ("transformers serve --continuous-batching", False, True),
    "vericache-cb": ("vericache-hf serve --continuous-batching", True, True),
}
#: ratios reported, where both servers ran: (numerator, denominator)
RATIOS = (("vericache", "plain"), ("vericache-cb", "plain-cb"), ("vericache-cb", "plain"))


def table(measured: dict[str, dict], identical: dict[str, int], count: int) -> str:
    rows = [
        ("output tokens/s", "tokens_per_s", "{:.2f}"),
        ("wall time (s)", "wall_s", "{:.1f}"),
        ("time to first token, mean (s)", "ttft_mean_s", "{:.1f}"),
        ("time to first token, p50 (s)", "ttft_p50_s", "{:.1f}"),
        ("time to first token, p99 (s)", "ttft_p99_s", "{:.1f}"),
        ("inter-token latency, p50 (ms)", "itl_p50_ms", "{:.0f}"),
        ("inter-token latency, p99 (ms)", "itl_p99_ms", "{:.0f}"),
    ]
    names = list(measured)
    ratios = [(a, b) for a, b in RATIOS if a in measured and b in measured]
    header = [SERVERS[name][0] for name in names] + [f"{a} / {b}" for a, b in ratios]
    lines = ["| | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for label, key, form in rows:
        cells = [form.format(measured[name][key]) for name in names]
        for a, b in ratios:
            base = measured[b][key]
            cells.append(f"{measured[a][key] / base:.2f}x" if base else "n/a")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    same = [f"{identical[name]}/{count}" if name in identical else "" for name in names]
    reference = "plain (stock generate)" if names[0] == "plain" else SERVERS[names[0]][0]
    lines.append(f"| answers identical to {reference} | " + " | ".join(same + [""] * len(ratios)) + " |")
    return "\n".join(lines)


def main() -> None:
    from vericache_tools.embedded import embedded_model_dir

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder or Hub id (default: the embedded model)")
    parser.add_argument("--requests", type=int, default=8, help="concurrent chat requests")
    parser.add_argument("--contexts", default="4096,8192", help="prompt length range in tokens: low,high")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vericache-args", default="--compressor snapkv --compression-ratio 0.75")
    parser.add_argument(
        "--servers",
        default="plain,vericache,vericache-cb",
        help=f"comma-separated, run in this order, the first being the reference answers: {', '.join(SERVERS)}",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/serve-load"))
    args = parser.parse_args()
    low, high = (int(value) for value in args.contexts.split(","))
    model = args.model or str(embedded_model_dir())
    args.out.mkdir(parents=True, exist_ok=True)
    texts = prompts(model, args.requests, low, high, args.seed)

    bin_dir = Path(sys.executable).parent
    names = args.servers.split(",")
    unknown = sorted(set(names) - set(SERVERS))
    if unknown:
        parser.error(f"unknown servers {unknown}; known: {', '.join(SERVERS)}")
    measured = {}
    for name in names:
        _, vericache, batching = SERVERS[name]
        command = (
            [sys.executable, "-m", "vericache_tools.cli", "serve", model, *shlex.split(args.vericache_args)]
            if vericache
            else [str(bin_dir / "transformers"), "serve", model]
        )
        command += ["--continuous-batching"] if batching else []
        process, url = start_server(command, args.out / f"{name}-server.log")
        try:
            measured[name] = load(url, texts, args.max_new_tokens)
        finally:
            stop_server(process)
        print(f"{name}: {measured[name]['tokens_per_s']:.2f} tokens/s", flush=True)

    reference = measured[names[0]]["texts"]
    identical = {
        name: sum(a == b for a, b in zip(reference, result["texts"], strict=True))
        for name, result in measured.items()
        if name != names[0]
    }
    report = table(measured, identical, len(texts))
    command_line = "python benchmarks/serve_load.py " + shlex.join(sys.argv[1:])
    # answers as digests: the comparison above is of the texts, and the texts themselves are not the result
    for result in measured.values():
        result["answer_sha256"] = [hashlib.sha256(text.encode()).hexdigest() for text in result.pop("texts")]
    record = {"command": command_line, "versions": versions(), "results": measured, "identical": identical}
    (args.out / "results.json").write_text(json.dumps(record, indent=1))
    (args.out / "table.md").write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
