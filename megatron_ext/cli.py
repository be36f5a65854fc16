"""``megatron-ext`` (also ``python -m megatron_ext``): demo, benchmarks and checkpoint tools."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from megatron_ext.arg_types import NONNEG_INT, POSITIVE, POSITIVE_INT, number


def _telemetry(sub) -> None:
    p = sub.add_parser("telemetry", help="tools for the engine's telemetry logs")
    tools = p.add_subparsers(dest="telemetry", required=True)
    r = tools.add_parser("report", help="timeline and throughput plots and a summary of a run's telemetry")
    r.add_argument("log", help="a telemetry .jsonl file or a directory of them (e.g. <save>/datastates_telemetry)")
    r.add_argument("--out", default="runs/telemetry-report", help="output directory (default runs/telemetry-report)")
    r.add_argument("--json", action="store_true", help="print the per-checkpoint rows and the files written as JSON")

    def run(args) -> int:
        from megatron_ext.bench import telemetry_report

        return telemetry_report.main(args)

    r.set_defaults(func=run)


def _demo(sub) -> None:
    p = sub.add_parser("demo", help="save every step of a toy training loop, then resume and check it")
    p.add_argument("--out", default="runs/demo", help="checkpoint directory (default runs/demo)")
    p.add_argument("--steps", type=number(int, 2), default=8, help="training steps, at least 2 (default 8)")
    p.add_argument("--host-cache-size", type=POSITIVE, default=0.25, help="GiB")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end (the progress lines go to stderr)")

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
    p.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object (progress lines go to stderr)")

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


def _refuse_url(path: str, what: str, why: str) -> None:
    """A tool that works on file-system paths only, given a URL (``s3://`` or another scheme): one line naming it
    (``os.makedirs`` would otherwise make a local directory named ``s3:``)."""
    from megatron_ext.engine.config import url_refusal

    if url_refusal(path, what) is not None:
        raise ValueError(f"{what} {path!r} is a URL: {why}")


def _refuse_other_url(path: str, what: str) -> None:
    """Where an ``s3://`` root is taken: any other URL (``gs://``, ``msc://``) refused in one line."""
    from megatron_ext.engine.config import url_refusal

    problem = url_refusal(path, what, object_ok=True)
    if problem is not None:
        raise ValueError(problem)


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
        from megatron_ext.engine.format.catalog import checkpoint_dirs
        from megatron_ext.engine.object_store import is_object_url
        from megatron_ext.engine.read.inspect import describe, format_rows
        from megatron_ext.progress import Progress

        root, only = locate.resolve_many(args.dir, args.iteration, args.checkpoint)
        if only is not None:
            total = 1
        elif is_object_url(root):  # one listing of the prefixes under the root
            total = len(checkpoint_dirs(root))
        else:
            total = len(os.listdir(root)) if os.path.isdir(root) else 0
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
    p.add_argument("--to", choices=["safetensors", "hf"], required=True,
                   help="safetensors: the weights (names: --names); hf: a Hugging Face model directory "
                        "(config.json + safetensors), LlamaForCausalLM for a Llama-style run, GPT2LMHeadModel for a "
                        "standard GPT (the same as --to safetensors --names hf)")
    p.add_argument("out", help="new (or empty) output directory")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file, with its unit (default 5GB; "
                                                           "500MB, 2GiB, ...)")
    p.add_argument("--dtype", choices=["keep", "fp32", "bf16"], default="keep",
                   help="keep: as the model held them (DeepSpeed: the fp32 master weights); fp32/bf16: cast")
    p.add_argument("--names", choices=["megatron", "hf"], default=None,
                   help="megatron-core's keys (the default), or Hugging Face names + config.json (Llama-style or "
                        "standard GPT; what --to hf writes)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")

    def run(args) -> int:
        from megatron_ext import locate
        from megatron_ext.megatron.export import export_safetensors, parse_size
        from megatron_ext.progress import Progress

        parse_size(args.max_shard_size)  # a bad size is refused before anything is read
        _refuse_url(args.out, "the output directory", "export writes local files: give a path")
        if args.to == "hf" and args.names == "megatron":
            raise ValueError("--to hf writes Hugging Face names; --names megatron goes with --to safetensors")
        names = "hf" if args.to == "hf" else args.names or "megatron"
        located = locate.resolve(args.dir, args.iteration, args.checkpoint)
        with Progress("export", quiet=args.quiet) as progress:
            summary = export_safetensors(located, out=args.out, max_shard_size=args.max_shard_size,
                                         dtype=args.dtype, names=names, progress=progress)
        if args.json:
            _print_json(summary)
            return 0
        print(f"exported {summary['tensors']} tensors ({summary['total_size'] / 1e9:.3f} GB) of {located.kind} "
              f"checkpoint {located.path} into {summary['files']} file(s) in {args.out}")
        if summary.get("architecture"):
            print(f"  architecture: {summary['architecture']} (transformers.AutoModelForCausalLM loads it)")
        if summary.get("weights"):
            print(f"  weights: {summary['weights']}")
        if summary.get("note"):
            print(f"  note: {summary['note']}")
        return 0

    p.set_defaults(func=run)


def _convert(sub) -> None:
    p = sub.add_parser("convert", help="Megatron checkpoints: datastates <-> megatron-core torch_dist, both ways; "
                                       "a Hugging Face Llama directory to datastates")
    p.add_argument("dir", help="--to torch_dist: a datastates save directory or one iter_* of it; --to datastates: "
                               "a torch_dist save directory or one iter_* of it, or a Hugging Face model directory "
                               "(config.json + safetensors) of a LlamaForCausalLM")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--iteration", type=NONNEG_INT,
                       help="iteration to convert (default: the newest committed / the tracker's)")
    which.add_argument("--checkpoint", metavar="NAME", help="the checkpoint directory NAME under DIR")
    p.add_argument("--to", choices=["torch_dist", "datastates"], required=True)
    p.add_argument("out", help="output save directory (gets iter_NNNNNNN/ or release/, and the tracker file)")
    hf = p.add_argument_group("from a Hugging Face directory (the layout of the run that loads it)")
    hf.add_argument("--tp", type=POSITIVE_INT, default=None, help="tensor-parallel size (default 1)")
    hf.add_argument("--pp", type=POSITIVE_INT, default=None, help="pipeline-parallel size (default 1)")
    hf.add_argument("--dp", type=POSITIVE_INT, default=None, help="data-parallel size (default 1; any loads it)")
    hf.add_argument("--make-vocab-size-divisible-by", type=POSITIVE_INT, default=None,
                    help="Megatron-LM's vocabulary padding, as the run passes it (default 128)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")

    def run(args) -> int:
        import os

        from megatron_ext.megatron import convert, hf_import
        from megatron_ext.progress import Progress

        # megatron-core reads and writes torch_dist through the file system, and a Hugging Face directory is
        # read there: only the datastates side of a conversion may be an s3:// prefix.
        if args.to == "torch_dist":
            _refuse_url(args.out, "the output directory", "megatron-core writes torch_dist through the file "
                        "system: give a path (the datastates source may be s3://)")
        else:
            _refuse_url(args.dir, "DIR", "convert reads torch_dist and Hugging Face directories through the file "
                        "system: give a path (the datastates output may be s3://)")
            _refuse_other_url(args.out, "the output directory")
        layout_flags = {"--tp": args.tp, "--pp": args.pp, "--dp": args.dp,
                        "--make-vocab-size-divisible-by": args.make_vocab_size_divisible_by}
        from_hf = os.path.isdir(args.dir) and hf_import.is_hf_directory(args.dir)
        if from_hf and args.to != "datastates":
            raise ValueError(f"{args.dir} is a Hugging Face model directory: it converts --to datastates "
                             "(the reverse is `megatron-ext export DIR --to hf OUT`)")
        if from_hf and (args.iteration is not None or args.checkpoint is not None):
            raise ValueError(f"{args.dir} is a Hugging Face model directory: --iteration/--checkpoint do not apply")
        given = [flag for flag, value in layout_flags.items() if value is not None]
        if not from_hf and given:
            raise ValueError(f"{' '.join(given)}: for a Hugging Face source only (a Megatron checkpoint keeps its "
                             f"layout); {args.dir} has no config.json")
        if from_hf:
            with Progress("convert to datastates", quiet=args.quiet) as progress:
                summary = hf_import.import_hf(args.dir, args.out, tp=args.tp or 1, pp=args.pp or 1, dp=args.dp or 1,
                                              divisible_by=args.make_vocab_size_divisible_by or 128,
                                              progress=progress)
            if args.json:
                _print_json(summary)
                return 0
            layout = summary["layout"]
            print(f"converted {summary['architecture']} {args.dir} to datastates: {summary['out']} (TP {layout['tp']} "
                  f"x PP {layout['pp']} x DP {layout['dp']}, weights only; load with --finetune)")
            print(f"  model arguments: {summary['megatron_args']}")
            return 0
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

    ``declare``: a function that adds this parser's arguments when it is first used, so that a
    command whose declarations import heavy modules (``bench``) costs nothing to the others.
    """

    def __init__(self, *args, declare=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._declare = declare

    def parse_known_args(self, args=None, namespace=None):
        self._seen_args = list(sys.argv[1:] if args is None else args)
        if self._declare is not None:
            declare, self._declare = self._declare, None
            declare(self)
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


def bench_modules() -> tuple:
    """The benchmark modules, in the order ``bench --help`` lists them. Each declares its subcommand:
    ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``main(args) -> int`` (exit status)."""
    from megatron_ext.bench import (commit_bench, deepspeed_bench, engine_bench, ft_bench, megatron_e2e_bench,
                                    object_store_bench, offload_bench, overload_bench, param_sync_bench,
                                    python_loop_bench, recovery_bench, replica_bench, restore_bench, suite, train_bench)

    return (engine_bench, python_loop_bench, param_sync_bench, restore_bench, train_bench, megatron_e2e_bench,
            ft_bench, deepspeed_bench, overload_bench, replica_bench, recovery_bench, commit_bench, offload_bench,
            object_store_bench, suite)


def _declare_benches(bench: argparse.ArgumentParser) -> None:
    """``megatron-ext bench NAME``, one subcommand per benchmark module (imported only for ``bench``)."""
    benches = bench.add_subparsers(dest="bench", required=True)
    for module in bench_modules():
        p = benches.add_parser(module.NAME, help=module.HELP)
        module.add_arguments(p)
        p.set_defaults(func=module.main)


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
    sub.add_parser("bench", help="benchmarks (figures are ratios against peers measured in the same run)",
                   declare=_declare_benches)
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
