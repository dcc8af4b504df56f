"""`vericache-hf bench`: full cache, compressed-only, VeriCache and HF's lossless peers, side by side.

CPU settings that do not change any output are applied first: glibc malloc settings that keep the verify pass's
large buffers mapped. They only act from process start, so the command re-executes itself once with them
(`--no-reexec` skips that).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from vericache_hf.drafting.draft_model import DRAFT_MATMULS

from ..arguments import HelpFormatter, comma_list
from .methods import PEERS, PROPOSERS
from .workloads import KINDS

#: Settings that change speed, never results (see the project's field notes on where the time goes on CPU).
CPU_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",
    "MALLOC_TRIM_THRESHOLD_": "17179869184",
    "MALLOC_TOP_PAD_": "1073741824",
}
#: `--quick`. 112 new tokens: SmolLM2's full-cache answer to HumanEval/0 at 2k context (a fenced function of
#: about 100 tokens) is then complete, so the parse check has a whole function to judge. Of the peers it keeps
#: prompt lookup: HF's early-exit assisting takes about five minutes alone here.
QUICK = dict(
    kinds=["code"], contexts=[2048], batch_sizes=[1], num_prompts=1, max_new_tokens=112, compressors=["snapkv"],
    ratios=[0.75], repeats=2, peers=["prompt_lookup"],
)  # fmt: skip


def add_bench_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="throughput and quality of full cache, compressed-only, VeriCache and HF peers",
        description="Full cache, compressed-only, VeriCache and HF's lossless peers, side by side. Lists are "
        "comma-separated.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few minutes on 2 CPU cores: 1 code prompt, 2k context, batch 1, 112 new tokens, prompt lookup "
        "(overrides the sizes below)",
    )
    parser.add_argument(
        "--kinds", type=comma_list(choices=KINDS), metavar="NAME,...", default="code,qa", help="workloads"
    )
    parser.add_argument(
        "--contexts",
        type=comma_list(int),
        metavar="N,...",
        default="2048,4096,8192",
        help="prompt lengths in tokens",
    )
    parser.add_argument(
        "--batch-sizes", type=comma_list(int), metavar="N,...", default="1,4", help="prompts decoded together"
    )
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per workload")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument(
        "--compressors",
        type=comma_list(),
        metavar="NAME,...",
        default="snapkv,streaming_llm,kivi",
        help="draft-tier methods",
    )
    parser.add_argument(
        "--ratios",
        type=comma_list(float),
        metavar="RATIO,...",
        default="0.75,0.875",
        help="compression ratios",
    )
    parser.add_argument("--draft-length", type=int, default=8, help="VeriCache's starting draft length")
    parser.add_argument(
        "--draft-schedules",
        type=comma_list(),
        metavar="NAME,...",
        default=None,
        help="VeriCache once per draft-length schedule, side by side, such as cost_aware,adaptive,fixed (None: "
        "VeriCacheConfig's default schedule only)",
    )
    parser.add_argument(
        "--proposers",
        type=comma_list(choices=("none", *PROPOSERS)),
        metavar="NAME,...",
        default="none,prompt_lookup",
        help="VeriCache once per proposer, side by side: none (the draft tier alone) and prompt_lookup "
        "(hierarchical drafting: prompt lookup proposes, the draft tier checks, the full tier verifies)",
    )
    parser.add_argument(
        "--draft-dtypes",
        type=comma_list(choices=("model", "bfloat16", "float16", "float32", "float64")),
        metavar="NAME,...",
        default="model",
        help="VeriCache once per draft-tier float type, side by side: model (the model's own weights) and a float "
        "type such as bfloat16 (drafts on a copy of the weights in it; the verify pass keeps the model's)",
    )
    parser.add_argument(
        "--draft-matmuls",
        type=comma_list(choices=DRAFT_MATMULS),
        metavar="NAME,...",
        default="measured",
        help="VeriCache once per way of running the draft tier's linear layers, side by side: measured (the "
        "fastest layout of each product for its row count, timed on first use) and stock (the model's linear)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="interleaved timing repeats (medians are reported)"
    )
    parser.add_argument(
        "--peers",
        type=comma_list(choices=PEERS),
        metavar="NAME,...",
        default="prompt_lookup,early_exit",
        help="HF lossless peers",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip the HF peers")
    parser.add_argument(
        "--no-lossy", action="store_true", help="skip compressed-only decoding (the lossy baselines)"
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="run each method side by side with a full-cache call, the two taking turns in half-second slices, and "
        "take its ratios to that call: a shared machine's drift then falls on both (needs --no-lossy)",
    )
    parser.add_argument("--model", default=None, help="a Hub id or folder (None: the embedded SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (None: torch's choice)")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="folder for JSON, Markdown, PNGs"
    )
    parser.add_argument(
        "--no-reexec", action="store_true", help="do not restart with the CPU malloc settings"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep what --out holds from a run with the same settings (ended workloads, and the repeats measured "
        "in one that was cut short) and run only the rest; results are saved after every repeat of a batch",
    )
    parser.set_defaults(run=run_bench_command)


def apply_quick(args: argparse.Namespace) -> argparse.Namespace:
    """`--quick` overrides the sizes with a run of a few minutes on a 2-core CPU."""
    if args.quick:
        args.kinds, args.contexts, args.batch_sizes = QUICK["kinds"], QUICK["contexts"], QUICK["batch_sizes"]
        args.num_prompts, args.max_new_tokens = QUICK["num_prompts"], QUICK["max_new_tokens"]
        args.compressors, args.ratios, args.repeats = QUICK["compressors"], QUICK["ratios"], QUICK["repeats"]
        args.peers = QUICK["peers"]
    return args


#: Settings that change what a workload's rows mean; a resumed run must share them with the saved one.
RESUME_KEYS = (
    "model", "num_prompts", "max_new_tokens", "compressors", "ratios", "draft_length", "draft_schedules",
    "repeats", "peers", "no_peers", "proposers", "no_lossy", "paired", "draft_dtypes",
    "draft_matmuls",
)  # fmt: skip


#: What files written before a key of RESUME_KEYS existed were made with.
BEFORE_THE_KEY = {
    "draft_schedules": ["adaptive"], "proposers": ["none"], "no_lossy": False, "paired": False,
    "draft_dtypes": ["model"], "draft_matmuls": ["stock"],
}  # fmt: skip


def run_settings(args: argparse.Namespace) -> dict:
    """What a run records about itself, as JSON values. The draft schedules are recorded as run (the default
    schedule when none is named), so that a change of `VeriCacheConfig`'s default is a change of settings."""
    from vericache_hf import VeriCacheConfig

    settings = {key: (str(v) if isinstance(v, Path) else v) for key, v in vars(args).items() if key != "run"}
    settings["draft_schedules"] = args.draft_schedules or [VeriCacheConfig().draft_schedule]
    return settings


#: The samples of the workloads that have not ended yet, saved after every repeat of a batch (removed once all
#: have ended).
IN_PROGRESS = "in_progress.json"


def _saved(path: Path, settings: dict) -> dict | None:
    """`path`'s JSON, checked to come from a run with the same `RESUME_KEYS` settings (None when there is no
    such file)."""
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    for key in RESUME_KEYS:
        made_with = saved["settings"].get(key, BEFORE_THE_KEY.get(key))
        if made_with != settings.get(key):
            raise SystemExit(
                f"--resume: {path} was made with {key}={made_with!r}, this run asks for "
                f"{settings.get(key)!r}. Run with the same settings, or choose another --out."
            )
    return saved


def resumed_rows(out_dir: Path, settings: dict) -> list[dict]:
    """The rows of the workloads that ended in `out_dir/results.json`, made with the same settings."""
    saved = _saved(out_dir / "results.json", settings)
    return saved["rows"] if saved else []


def resumed_samples(out_dir: Path, settings: dict) -> list:
    """The samples of the batches measured so far in the workloads that had not ended (`IN_PROGRESS`)."""
    from .runner import Sample

    saved = _saved(out_dir / IN_PROGRESS, settings)
    return [Sample.from_dict(data) for data in saved["samples"]] if saved else []


def save_in_progress(out_dir: Path, settings: dict, samples: list) -> None:
    """Write the samples of the workloads that have not ended, or remove the file when there are none."""
    path = out_dir / IN_PROGRESS
    if not samples:
        path.unlink(missing_ok=True)
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "settings": {key: settings.get(key) for key in RESUME_KEYS},
        "samples": [s.to_dict() for s in samples],
    }
    path.write_text(json.dumps(data, default=str))


def code_version() -> str:
    """The package version, and the git commit when run from a checkout (`+dirty` with uncommitted changes)."""
    from vericache_hf import __version__

    root = Path(__file__).resolve().parents[3]  # the checkout, for an editable install
    if not (root / "src" / "vericache_tools").is_dir():
        return __version__  # installed from a wheel: no checkout to ask
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty=+dirty", "--exclude=*"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return __version__
    return f"{__version__} ({commit})" if commit else __version__


def _reexec_with_cpu_env(args: argparse.Namespace) -> None:
    missing = {k: v for k, v in CPU_ENV.items() if os.environ.get(k) is None}
    if args.no_reexec or not missing or os.environ.get("VERICACHE_BENCH_REEXEC"):
        return
    env = {**os.environ, **missing, "VERICACHE_BENCH_REEXEC": "1"}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "vericache_tools.cli", *sys.argv[1:]], env)


def _load(name: str | None):
    if name is None:
        from ..embedded import load_embedded_model

        return load_embedded_model()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
    return model, tokenizer


def run_bench_command(args: argparse.Namespace) -> int:
    if sys.argv[1:2] == ["bench"]:  # this process is the bench command itself, not a test or a notebook
        _reexec_with_cpu_env(args)
    args = apply_quick(args)
    if args.paired and not args.no_lossy:
        raise SystemExit(
            "--paired needs --no-lossy: compressed-only decoding is not HF generate, so it cannot take turns."
        )
    import torch

    from .methods import build_methods
    from .plots import plot_all
    from .report import OVERVIEW_KEY, markdown_table, overview_table, summarize, time_table, write_report
    from .runner import run_bench
    from .workloads import build_workloads

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, tokenizer = _load(args.model)
    workloads = build_workloads(
        tokenizer,
        args.kinds,
        args.contexts,
        args.batch_sizes,
        args.num_prompts,
        max_positions=getattr(model.config, "max_position_embeddings", None),
        max_new_tokens=args.max_new_tokens,
    )
    methods = build_methods(
        args.compressors,
        args.ratios,
        peers=[] if args.no_peers else args.peers,
        draft_length=args.draft_length,
        draft_schedules=args.draft_schedules,
        proposers=args.proposers,
        lossy=not args.no_lossy,
        draft_dtypes=args.draft_dtypes,
        draft_matmuls=args.draft_matmuls,
    )
    settings = run_settings(args)
    settings.update(torch_threads=torch.get_num_threads(), env={k: os.environ.get(k) for k in CPU_ENV})
    rows = resumed_rows(args.out, settings) if args.resume else []
    done = {row["workload"] for row in rows}
    in_progress = resumed_samples(args.out, settings) if args.resume else []
    version = code_version()  # the code this process runs, whatever happens to the checkout meanwhile

    def report(complete: bool) -> tuple[Path, Path]:
        wall = round(time.perf_counter() - started, 1)
        return write_report(rows, args.out, {**settings, "wall_seconds": wall, "complete": complete})

    # An interrupted run keeps what it measured: the repeats of the batch it was in, the batches of the workload it
    # was in, and every ended workload.
    def save_repeat(workload, group) -> None:
        batch = {(s.workload, s.batch_index) for s in group}
        in_progress[:] = [s for s in in_progress if (s.workload, s.batch_index) not in batch] + group
        save_in_progress(args.out, settings, in_progress)

    def save_workload(workload, samples) -> None:
        # A resumed run may span code changes: each workload's rows say which code measured them.
        rows.extend({**row, "code_version": version} for row in summarize(samples, [workload], tokenizer))
        report(complete=False)
        in_progress[:] = [s for s in in_progress if s.workload != workload.name]
        save_in_progress(args.out, settings, in_progress)

    run_bench(
        model,
        [w for w in workloads if w.name not in done],
        methods,
        args.max_new_tokens,
        repeats=args.repeats,
        progress=not args.no_progress,
        on_workload=save_workload,
        on_repeat=save_repeat,
        measured=in_progress,
        paired=args.paired,
    )
    json_path, md_path = report(complete=True)
    figures = plot_all(json.loads(json_path.read_text())["rows"], args.out)
    print(f"\n{overview_table(rows)}\n\n{OVERVIEW_KEY}\n\n{markdown_table(rows)}")
    print("\nWhere VeriCache's time goes:\n\n" + time_table(rows))
    print(f"\nWrote {json_path}, {md_path} and {', '.join(str(f) for f in figures)}.")
    lossless_ok = all(r.get("identical_share", 1.0) == 1.0 for r in rows if r["lossless"] and "na" not in r)
    if not lossless_ok:
        print("A lossless method's output differed from the full-cache output: see identical share above.")
    return 0 if lossless_ok else 1
