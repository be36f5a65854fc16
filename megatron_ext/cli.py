"""``megatron-ext`` (also ``python -m megatron_ext``): demo, benchmarks and checkpoint tools."""

from __future__ import annotations

import argparse
import logging
import math
import sys
import warnings


def _number(kind, low: float, inclusive: bool = True):
    """An argparse type: a finite ``kind`` >= ``low`` (> ``low`` when not ``inclusive``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole number' if kind is int else 'number'}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{text} must be {'>=' if inclusive else '>'} {low:g}")
        return value

    return parse


POSITIVE_INT, NONNEG_INT = _number(int, 1), _number(int, 0)
POSITIVE, NONNEG = _number(float, 0, inclusive=False), _number(float, 0)


def _bench_engine(sub) -> None:
    p = sub.add_parser("engine", help="engine vs torch.save, DCP async_save and an O_DIRECT write")
    p.add_argument("--size-gb", type=POSITIVE, default=2.0, help="state size in GB (default 2)")
    p.add_argument("--cache-gb", type=POSITIVE, default=None, help="host cache in GiB (default: the state size)")
    p.add_argument("--compute-s", type=NONNEG, default=1.0,
                   help="seconds the caller computes between save and wait_snapshot (default 1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the state lives (cuda: on the current GPU, copied by the CUDA copy stream)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory here)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    def run(args) -> int:
        from megatron_ext.bench import engine_bench

        return engine_bench.main(args)

    p.set_defaults(func=run)


def _bench_python_loop(sub) -> None:
    p = sub.add_parser("python-loop", help="a Python-bound training loop saving every iteration: this engine vs "
                                           "DCP async_save (thread, DefaultStager, process), iteration time vs none")
    p.add_argument("--size-gb", type=POSITIVE, default=0.25, help="state saved every iteration, in GB (default 0.25)")
    p.add_argument("--work-s", type=POSITIVE, default=0.8,
                   help="seconds of pure-Python work per iteration, calibrated once (default 0.8)")
    p.add_argument("--iters", type=_number(int, 2), default=8, help="iterations per run (default 8)")
    p.add_argument("--warmup", type=NONNEG_INT, default=2, help="first iterations of each run left out (default 2)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=2,
                   help="rounds, each running every mode in a fresh process, order reversed every other round "
                        "(default 2)")
    p.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                   help="none datastates dcp_async dcp_stager dcp_process (default: all)")
    p.add_argument("--account", action="store_true",
                   help="also the GIL account: the engine with one stage (copy, checksum, write, commit) off at a "
                        "time, and each thread's CPU per iteration")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the ratios as a bar chart")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory here)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    def run(args) -> int:
        from megatron_ext.bench import python_loop_bench

        if args.modes is None:
            args.modes = list(python_loop_bench.MODES)
        unknown = sorted(set(args.modes) - set(python_loop_bench.MODES))
        if unknown:
            raise ValueError(f"unknown mode(s) {', '.join(unknown)}: choose among {' '.join(python_loop_bench.MODES)}")
        if "none" not in args.modes:
            args.modes = ["none", *args.modes]  # the ratios need the baseline
        return python_loop_bench.main(args)

    p.set_defaults(func=run)


def _bench_param_sync(sub) -> None:
    p = sub.add_parser("param-sync", help="Megatron-LM's loop with --overlap-param-gather: the save with its forced "
                                          "parameter all-gather (patches 0001-0003) vs the copies waiting for the "
                                          "next forward's all-gathers (0004)")
    p.add_argument("--iters", type=_number(int, 5), default=14,
                   help="iterations per run, every one saved (default 14)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=2, help="rounds, order reversed every other (default 2)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory here)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    def run(args) -> int:
        from megatron_ext.bench import param_sync_bench

        return param_sync_bench.main(args)

    p.set_defaults(func=run)


def _bench_restore(sub) -> None:
    p = sub.add_parser("restore", help="engine restore vs torch.load, DCP load and an O_DIRECT read (cold)")
    p.add_argument("--size-gb", type=POSITIVE, default=2.0, help="state size in GB (default 2)")
    p.add_argument("--threads", type=POSITIVE_INT, default=4, help="restore_threads of the engine (default 4)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=3,
                   help="rounds of the engine's restore and the reads it is compared with (default 3)")
    p.add_argument("--megatron", default="auto", choices=("auto", "on", "off"),
                   help="also time Megatron-LM's load_checkpoint, datastates vs torch_dist (auto: when the "
                        "Megatron-LM checkout is available)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory here)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    def run(args) -> int:
        from megatron_ext.bench import restore_bench

        return restore_bench.main(args)

    p.set_defaults(func=run)


def _bench_train(sub) -> None:
    p = sub.add_parser("train", help="reference trainer: no checkpoints vs datastates vs megatron-core async save")
    p.add_argument("--iters", type=POSITIVE_INT, default=12)
    p.add_argument("--nproc", type=POSITIVE_INT, default=2, help="CPU ranks (data parallel)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")

    def run(args) -> int:
        from megatron_ext.bench import train_bench

        return train_bench.main(args)

    p.set_defaults(func=run)


def _bench_recovery(sub) -> None:
    p = sub.add_parser("recovery", help="SIGKILL a training job and restart it: recovery time and iterations lost, "
                                        "datastates vs megatron-core torch_dist")
    p.add_argument("--iters", type=POSITIVE_INT, default=12, help="iterations of each overhead run (default 12)")
    p.add_argument("--nproc", type=POSITIVE_INT, default=2, help="CPU ranks (data parallel, default 2)")
    p.add_argument("--interval", type=POSITIVE_INT, default=None,
                   help="torch_dist's checkpoint interval (default: measured, the one of equal overhead)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=3, help="kills and restarts of each way (default 3)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")

    def run(args) -> int:
        from megatron_ext.bench import recovery_bench

        return recovery_bench.main(args)

    p.set_defaults(func=run)


def _bench_replica(sub) -> None:
    p = sub.add_parser("replica", help="reference trainer with datastates, peer replicas in host memory off vs on")
    p.add_argument("--iters", type=POSITIVE_INT, default=10)
    p.add_argument("--nproc", type=POSITIVE_INT, default=4, help="CPU ranks (data parallel)")
    p.add_argument("--ranks-per-node", type=POSITIVE_INT, default=2, help="ranks per simulated node (default 2)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")

    def run(args) -> int:
        from megatron_ext.bench import replica_bench

        return replica_bench.main(args)

    p.set_defaults(func=run)


def _bench_deepspeed(sub) -> None:
    p = sub.add_parser("deepspeed", help="DeepSpeed's default checkpoint engine vs datastates, same model")
    p.add_argument("--steps", type=POSITIVE_INT, default=12)
    p.add_argument("--hidden", type=POSITIVE_INT, default=4096, help="MLP width (sets the checkpoint size)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")

    def run(args) -> int:
        from megatron_ext.bench import deepspeed_bench

        return deepspeed_bench.main(args)

    p.set_defaults(func=run)


def _bench_overload(sub) -> None:
    p = sub.add_parser("overload", help="a checkpoint every iteration on a throttled writer: wait vs supersede")
    p.add_argument("--size-mb", type=POSITIVE, default=64, help="checkpoint size in MB (default 64)")
    p.add_argument("--iters", type=POSITIVE_INT, default=20)
    p.add_argument("--compute-s", type=NONNEG, default=0.2, help="compute per iteration in seconds (default 0.2)")
    p.add_argument("--flush-factor", type=POSITIVE, default=3.0,
                   help="the throttle makes one checkpoint's flush take this many iterations (default 3)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")

    def run(args) -> int:
        from megatron_ext.bench import overload_bench

        return overload_bench.main(args)

    p.set_defaults(func=run)


def _bench_commit(sub) -> None:
    p = sub.add_parser("commit", help="one commit's latency, file-system calls and rank 0 CPU at 8 to 4,096 simulated ranks")
    p.add_argument("--ranks", type=POSITIVE_INT, nargs="+", default=[8, 64, 512, 4096])
    p.add_argument("--tensors", type=POSITIVE_INT, nargs="+", default=[50, 640], help="tensors per rank")
    p.add_argument("--checkpoints", type=POSITIVE_INT, default=3, help="commits per configuration (median)")
    p.add_argument("--sampled", type=POSITIVE_INT, default=7, help="ranks besides 0 with a committer thread")
    p.add_argument("--plot", default=None, metavar="DIR", help="write commit_*.png figures there")
    p.add_argument("--baseline", default=None, metavar="JSON",
                   help="another run's --json output (e.g. an older version's) drawn beside this one")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")

    def run(args) -> int:
        from megatron_ext.bench import commit_bench

        return commit_bench.main(args)

    p.set_defaults(func=run)


def _bench_suite(sub) -> None:
    p = sub.add_parser("suite", help="every scenario against every peer in one run: results.json, results.md, plots")
    p.add_argument("--out", default="runs/bench-suite", help="output directory (default runs/bench-suite)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer iterations (a few minutes)")

    def run(args) -> int:
        from megatron_ext.bench import suite

        return suite.main(args)

    p.set_defaults(func=run)


def _telemetry(sub) -> None:
    p = sub.add_parser("telemetry", help="tools for the engine's telemetry logs")
    tools = p.add_subparsers(dest="telemetry", required=True)
    r = tools.add_parser("report", help="timeline and throughput plots and a summary of a run's telemetry")
    r.add_argument("log", help="a telemetry .jsonl file or a directory of them (e.g. <save>/datastates_telemetry)")
    r.add_argument("--out", default="runs/telemetry-report", help="output directory (default runs/telemetry-report)")

    def run(args) -> int:
        from megatron_ext.bench import telemetry_report

        return telemetry_report.main(args)

    r.set_defaults(func=run)


def _demo(sub) -> None:
    p = sub.add_parser("demo", help="save every step of a toy training loop, then resume and check it")
    p.add_argument("--out", default="runs/demo", help="checkpoint directory (default runs/demo)")
    p.add_argument("--steps", type=_number(int, 2), default=8, help="training steps, at least 2 (default 8)")
    p.add_argument("--host-cache-size", type=POSITIVE, default=0.25, help="GiB")

    def run(args) -> int:
        from megatron_ext.testing import demo

        return demo.main(args)

    p.set_defaults(func=run)


def _main_job(sub) -> None:
    p = sub.add_parser("main-job", help="Megatron-LM's pretrain_gpt.py (a Llama-style GPT) on 8 CPU ranks or this "
                                        "node's GPUs with --use-datastates: SIGKILL, resume, bit-exact comparison")
    p.add_argument("--out", default="runs/main", help="work directory (default runs/main)")
    p.add_argument("--trainer", choices=("auto", "megatron", "reference"), default="auto",
                   help="auto (default): Megatron-LM's pretrain_gpt.py when the patched checkout is available "
                        "(scripts/fetch_megatron.sh), else the reference trainer; megatron: fail without it")
    p.add_argument("--iters", type=POSITIVE_INT, default=None,
                   help="iterations (default 10 with Megatron-LM, 12 otherwise)")
    p.add_argument("--crash-at", type=POSITIVE_INT, default=None,
                   help="every rank SIGKILLs itself after this iteration (default 6 with Megatron-LM, 7 otherwise)")
    p.add_argument("--host-cache-size", type=POSITIVE, default=0.05, help="GiB per rank")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default): CPU ranks, NCCL emulated; cuda: one rank per GPU of this node over NCCL "
                        "(needs Megatron-LM: --checkout or scripts/fetch_megatron.sh)")
    p.add_argument("--ranks", type=POSITIVE_INT, default=None,
                   help="ranks (default 8 on CPUs, the node's GPU count with --device cuda); TP 2 and PP 2 where "
                        "they divide, the rest data parallel")
    p.add_argument("--checkout", default=None,
                   help="a patched Megatron-LM checkout of the pin (default: scripts/fetch_megatron.sh's)")

    def run(args) -> int:
        from megatron_ext.testing import main_job

        if args.crash_at is not None and args.iters is not None and not args.crash_at < args.iters:
            raise ValueError(f"--crash-at {args.crash_at} must lie in [1, --iters {args.iters})")
        return main_job.main(args)

    p.set_defaults(func=run)


def _which(p: argparse.ArgumentParser, what: str) -> None:
    """DIR plus --iteration / --checkpoint, as every checkpoint tool takes them (``megatron_ext.locate``)."""
    p.add_argument("dir", help="a checkpoint root (Megatron's --save, DeepSpeed's save_dir, an engine's save_dir), "
                               "or one checkpoint's own directory (iter_*, global_step*, ...)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--iteration", type=NONNEG_INT,
                       help=f"{what} iter_NNNNNNN or global_stepN under DIR (else the checkpoint of that version)")
    which.add_argument("--checkpoint", metavar="NAME", help=f"{what} the checkpoint directory NAME under DIR")


def _print_json(value) -> None:
    import json

    print(json.dumps(value, indent=1, default=str))


def _verify(sub) -> None:
    p = sub.add_parser("verify", help="check manifests, headers, sizes and checksums of committed checkpoints")
    _which(p, "only")
    p.add_argument("--quick", action="store_true", help="sizes and headers only, no checksums")
    p.add_argument("--json", action="store_true", help="print one JSON object: checked, problems, ok")

    def run(args) -> int:
        from megatron_ext import locate
        from megatron_ext.engine.read.verify import checkpoint_bytes, checkpoints_under, verify_root
        from megatron_ext.megatron.shard_assembly import shard_problems
        from megatron_ext.progress import Progress

        root, name = locate.resolve_many(args.dir, args.iteration, args.checkpoint)
        names = [name] if name is not None else checkpoints_under(root)
        sizes = [checkpoint_bytes(root, n) for n in names]
        with Progress("verify", sum(b for b, _ in sizes), sum(f for _, f in sizes), quiet=args.quiet) as progress:
            checked, problems = verify_root(root, name, deep=not args.quick, progress=progress.update)
        intact = [c for c in checked if all(p.checkpoint != c for p in problems)]
        problems += [p for c in intact for p in shard_problems(root, c)]  # what export and convert would refuse
        ok = bool(checked) and not problems
        if args.json:
            _print_json({"root": root, "checked": checked, "ok": ok, "problems": [
                {"checkpoint": p.checkpoint, "path": p.path, "what": p.what} for p in problems]})
            return 0 if ok else 1
        for problem in problems:
            print(f"BAD  {problem}")
        if not checked:
            print(f"no committed checkpoint under {args.dir}")
            return 1
        if problems:
            print(f"{len(problems)} problem(s); first bad file: {str(problems[0]).split(': ')[0]}")
            return 1
        print(f"OK   {len(checked)} checkpoint(s) verified: {', '.join(checked)}")
        return 0

    p.set_defaults(func=run)


def _inspect(sub) -> None:
    p = sub.add_parser("inspect", help="list the checkpoints under a directory: committed or not, kind, levels, "
                                       "ranks, sizes")
    _which(p, "only")
    p.add_argument("--local-dir", default=None, help="node-local level to report on as well")
    p.add_argument("--json", action="store_true")

    def run(args) -> int:
        import os

        from megatron_ext import locate
        from megatron_ext.engine.read.inspect import describe, format_rows
        from megatron_ext.progress import Progress

        root, only = locate.resolve_many(args.dir, args.iteration, args.checkpoint)
        total = 1 if only is not None else len(os.listdir(root)) if os.path.isdir(root) else 0
        with Progress("inspect", None, total, quiet=args.quiet or total <= 8) as progress:
            rows = describe(root, args.local_dir, only, classify=locate.kind_of, progress=progress.update)
        if args.json:
            _print_json(rows)
        else:
            print(format_rows(rows))
        return 0

    p.set_defaults(func=run)


def _export(sub) -> None:
    p = sub.add_parser("export", help="a committed checkpoint's model weights as consolidated safetensors files + "
                                      "index (Megatron-LM, DeepSpeed ZeRO 0-3, engine API checkpoints)")
    _which(p, "export")
    p.add_argument("--to", choices=["safetensors"], required=True, help="output format")
    p.add_argument("out", help="new (or empty) output directory")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file, with its unit (default 5GB; "
                                                           "500MB, 2GiB, ...)")
    p.add_argument("--dtype", choices=["keep", "fp32", "bf16"], default="keep",
                   help="keep: as the model held them (DeepSpeed: the fp32 master weights); fp32/bf16: cast")
    p.add_argument("--names", choices=["megatron", "hf"], default="megatron",
                   help="megatron-core's keys, or Hugging Face GPT-2 names + config.json (standard GPT only)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")

    def run(args) -> int:
        from megatron_ext import locate
        from megatron_ext.megatron.export import export_safetensors, parse_size
        from megatron_ext.progress import Progress

        parse_size(args.max_shard_size)  # a bad size is refused before anything is read
        located = locate.resolve(args.dir, args.iteration, args.checkpoint)
        with Progress("export", quiet=args.quiet) as progress:
            summary = export_safetensors(located, out=args.out, max_shard_size=args.max_shard_size,
                                         dtype=args.dtype, names=args.names, progress=progress)
        if args.json:
            _print_json(summary)
            return 0
        print(f"exported {summary['tensors']} tensors ({summary['total_size'] / 1e9:.3f} GB) of {located.kind} "
              f"checkpoint {located.path} into {summary['files']} file(s) in {args.out}")
        if summary.get("weights"):
            print(f"  weights: {summary['weights']}")
        if summary.get("note"):
            print(f"  note: {summary['note']}")
        return 0

    p.set_defaults(func=run)


def _convert(sub) -> None:
    p = sub.add_parser("convert", help="Megatron checkpoints: datastates <-> megatron-core torch_dist, both ways")
    p.add_argument("dir", help="--to torch_dist: a datastates save directory or one iter_* of it; --to datastates: "
                               "a torch_dist save directory or one iter_* of it")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--iteration", type=NONNEG_INT,
                       help="iteration to convert (default: the newest committed / the tracker's)")
    which.add_argument("--checkpoint", metavar="NAME", help="the checkpoint directory NAME under DIR")
    p.add_argument("--to", choices=["torch_dist", "datastates"], required=True)
    p.add_argument("out", help="output save directory (gets iter_NNNNNNN/ and the tracker file)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")

    def run(args) -> int:
        from megatron_ext.megatron import convert
        from megatron_ext.progress import Progress

        with Progress(f"convert to {args.to}", quiet=args.quiet) as progress:
            if args.to == "torch_dist":
                summary = convert.to_torch_dist(args.dir, args.iteration, args.out, checkpoint=args.checkpoint,
                                                progress=progress)
            else:
                summary = convert.from_torch_dist(args.dir, args.out, args.iteration, checkpoint=args.checkpoint,
                                                  progress=progress)
        if args.json:
            _print_json(summary)
            return 0
        print(f"converted {summary['source']} to {args.to}: {summary['out']} (iteration {summary['iteration']}, "
              f"optimizer {summary.get('optimizer_format') or 'none'})")
        return 0

    p.set_defaults(func=run)


class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one line on stderr (exit 2), like every other bad input.

    A mistyped option is named as such: argparse reports missing required arguments before
    unknown ones, so ``export DIR --iteraton 2 ...`` would otherwise say "--to is required" or
    the like instead of naming ``--iteraton``.
    """

    def parse_known_args(self, args=None, namespace=None):
        self._seen_args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _unknown_options(self) -> list[str]:
        unknown = []
        for arg in getattr(self, "_seen_args", []):
            if arg == "--":
                break
            if not arg.startswith("-") or arg == "-" or _is_number(arg):
                continue
            option = arg.split("=", 1)[0]
            if option not in self._option_string_actions and not (
                    option.startswith("--") and any(o.startswith(option) for o in self._option_string_actions)):
                unknown.append(option)
        return unknown

    def error(self, message: str):
        if message.startswith("the following arguments are required"):
            unknown = self._unknown_options()
            if unknown:
                message = f"unrecognized arguments: {' '.join(unknown)}"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _quiet(p: argparse.ArgumentParser) -> None:
    """``-q`` after the command too (the top-level one sets the default)."""
    p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                   help="no progress on stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megatron-ext", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log every checkpoint")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress on stderr (verify, inspect, export, convert)")
    sub = parser.add_subparsers(dest="command", required=True)
    _main_job(sub)
    for tool in (_verify, _inspect, _export, _convert):
        tool(sub)
        _quiet(sub.choices[next(reversed(sub.choices))])
    _demo(sub)
    _telemetry(sub)
    bench = sub.add_parser("bench", help="benchmarks (figures are ratios against peers measured in the same run)")
    benches = bench.add_subparsers(dest="bench", required=True)
    _bench_engine(benches)
    _bench_python_loop(benches)
    _bench_param_sync(benches)
    _bench_restore(benches)
    _bench_train(benches)
    _bench_deepspeed(benches)
    _bench_overload(benches)
    _bench_replica(benches)
    _bench_recovery(benches)
    _bench_commit(benches)
    _bench_suite(benches)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Bad input (a damaged or foreign checkpoint, a wrong path or value) is one line on stderr and
    exit status 2, never a traceback; ``--verbose`` shows the traceback of unexpected errors."""
    args = build_parser().parse_args(argv)
    if not args.verbose:  # third-party import warnings (Apex, Transformer Engine, ...) are noise here
        warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"megatron-ext {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line
        if args.verbose:
            import traceback

            traceback.print_exc()
        message = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, (OSError, KeyError, TypeError, AttributeError, IndexError)) and type(exc).__name__ not in message:
            message = f"{type(exc).__name__}: {message}"
        print(f"megatron-ext {args.command}: error: {message}", file=sys.stderr)
        return 2
