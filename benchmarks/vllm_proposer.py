"""vLLM plain, vLLM with its n-gram proposer, and vLLM with VeriCache drafting, side by side.

Run in the vLLM venv (`scripts/setup_vllm.sh`):

    .venv-vllm/bin/python benchmarks/vllm_proposer.py --lengths 2048 8192 --batches 1 4 --kinds code qa

Each cell (prompt kind, context length, batch) is generated twice per method: once with one new token, whose wall
time is the time to first token (TTFT) and which fills vLLM's prefix cache, then with `--new-tokens` tokens
(`ignore_eos`), whose wall time, the prompt now cached, is the decode time. A batch's prompts share their context:
code prompts differ in their HumanEval problem, QA prompts are one question repeated. Accepted tokens per step are
vLLM's own spec-decode counters (accepted drafts per drafting row and step). Greedy outputs are compared with
plain vLLM's, token for token.

With `--rounds N` the methods run in turn N times, so each round's ratios compare runs minutes apart, not a whole
run's drift; the table gives each method's median over the rounds, and each round's ratio to plain beside it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path
from statistics import median

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: one start-up per method


def prompts(tokenizer, kind: str, length: int, batch: int) -> list[list[int]]:
    from vericache_tools.prompts import humaneval_problems, long_code_prompt, long_document_qa_example

    if kind == "code":
        texts = [long_code_prompt(tokenizer, problem, length) for problem in humaneval_problems()[:batch]]
    else:
        texts = [long_document_qa_example(tokenizer, length)["prompt"]] * batch
    return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]


def counters(llm) -> dict[str, float]:
    wanted = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
    return {m.name: float(m.value) for m in llm.get_metrics() if m.name in wanted and hasattr(m, "value")}


def measure(llm, cells: dict, new_tokens: int) -> dict:
    from vllm import SamplingParams

    first = SamplingParams(temperature=0.0, max_tokens=1)
    full = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    results = {}
    for name, batch in cells.items():
        requests = [{"prompt_token_ids": ids} for ids in batch]
        started = time.perf_counter()
        llm.generate(requests, first, use_tqdm=False)
        ttft = time.perf_counter() - started
        before = counters(llm)
        started = time.perf_counter()
        outputs = llm.generate(requests, full, use_tqdm=False)
        decode = time.perf_counter() - started
        after = counters(llm)
        drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
        accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
            "vllm:spec_decode_num_accepted_tokens", 0
        )
        results[name] = {
            "ttft_s": ttft,
            "decode_tok_s": len(batch) * new_tokens / decode,
            "accepted_per_step": accepted / drafts if drafts else 0.0,
            "tokens": [list(out.outputs[0].token_ids) for out in outputs],
        }
        print(name, {k: v for k, v in results[name].items() if k != "tokens"}, flush=True)
    return results


def method_config(method: str, args) -> dict | None:
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": args.max_draft, "prompt_lookup_max": 4}
    from vericache_hf import VeriCacheConfig
    from vericache_hf.vllm import speculative_config

    config = VeriCacheConfig(
        compressor=args.compressor,
        compression_ratio=args.ratio,
        max_draft_length=args.max_draft,
        draft_length=4,
    )
    return speculative_config(config)


def run_method(method: str, args, model: str, cells: dict, longest: int, out: str) -> None:
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(
        model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=longest + args.new_tokens + args.max_draft + 8,
        disable_log_stats=False,
        speculative_config=method_config(method, args),
        distributed_executor_backend="uni",
    )
    print(method, f"started in {time.perf_counter() - started:.0f} s", flush=True)
    Path(out).write_text(json.dumps(measure(llm, cells, args.new_tokens)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2 copy)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--kinds", nargs="+", default=["code", "qa"], choices=["code", "qa"])
    parser.add_argument("--cells", nargs="*", default=None, help="only these cells, e.g. code-2048-b1")
    parser.add_argument("--methods", nargs="+", default=["plain", "ngram", "vericache"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--compressor", default="snapkv")
    parser.add_argument("--ratio", type=float, default=0.875)
    parser.add_argument("--max-draft", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=1, help="run the methods in turn this many times")
    parser.add_argument("--out", default="bench-results/vllm_proposer.json")
    args = parser.parse_args()

    import torch
    import transformers
    import vllm
    from transformers import AutoTokenizer

    from vericache_tools.embedded import MODEL_SUBDIR, default_cache_dir

    model = args.model or str(default_cache_dir() / MODEL_SUBDIR)
    tokenizer = AutoTokenizer.from_pretrained(model)
    cells = {}
    for kind in args.kinds:
        for length in args.lengths:
            for batch in args.batches:
                name = f"{kind}-{length}-b{batch}"
                if args.cells is None or name in args.cells:
                    cells[name] = prompts(tokenizer, kind, length, batch)
    longest = max(len(ids) for batch in cells.values() for ids in batch)
    rounds = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for number in range(args.rounds):
        runs = {}
        for method in args.methods:
            # each method in a process of its own: vLLM's CPU build fails to start a third engine in one process
            part = Path(args.out).with_suffix(f".{method}.{number}.json")
            context = multiprocessing.get_context("spawn")
            child = context.Process(target=run_method, args=(method, args, model, cells, longest, str(part)))
            child.start()
            child.join()
            if child.exitcode != 0:
                raise SystemExit(f"the {method} run failed (exit {child.exitcode}); see its output above")
            runs[method] = json.loads(part.read_text())
        rounds.append(runs)
    report = {
        "command": "python benchmarks/vllm_proposer.py " + " ".join(sys.argv[1:]),
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(),
        },
        "args": vars(args),
        "rounds": rounds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(table(report))


def table(report: dict) -> str:
    """Per cell and method: the median over rounds of decode tokens/s, TTFT and accepted drafts per step; the median
    of each round's ratio to plain, with the rounds' ratios beside it where there are several."""
    rounds = report.get("rounds") or [report["runs"]]  # a one-run report keeps its methods under "runs"
    lines = [
        "| cell | method | decode tok/s | vs plain | TTFT s | accepted/step | greedy = plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in next(iter(rounds[0].values())):
        for method in rounds[0]:
            rows = [runs[method][cell] for runs in rounds]
            bases = [runs.get("plain", {}).get(cell) for runs in rounds]
            ratio, same = "-", "-"
            if all(bases):
                ratios = [
                    row["decode_tok_s"] / base["decode_tok_s"] for row, base in zip(rows, bases, strict=True)
                ]
                ratio = f"{median(ratios):.2f}x"
                if len(ratios) > 1 and method != "plain":
                    ratio += " (" + ", ".join(f"{r:.2f}" for r in ratios) + ")"
                equal = all(row["tokens"] == base["tokens"] for row, base in zip(rows, bases, strict=True))
                same = "yes" if equal else "NO"
            lines.append(
                f"| {cell} | {method} | {median(r['decode_tok_s'] for r in rows):.2f} | {ratio} | "
                f"{median(r['ttft_s'] for r in rows):.1f} | {median(r['accepted_per_step'] for r in rows):.2f} | "
                f"{same} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
