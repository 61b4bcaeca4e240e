"""The ``gemc`` command line. Exit codes: 0 success, 2 bad input or usage, 1 internal error."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence

from gemc.errors import GemcUserError
from gemc.plan import TABLE_OPTIMIZERS

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors name the fix and exit 2 like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"gemc: error: {message}\n  fix: see `{self.prog} --help`\n")
        raise SystemExit(EXIT_USAGE)


class Progress:
    """One line per stage with elapsed seconds; rewritten in place on a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, stage: str) -> None:
        if not self.enabled:
            return
        text = f"[gemc {time.perf_counter() - self.start:6.1f}s] {stage}"
        sys.stderr.write(f"\r\033[K{text}" if self.tty else text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="gemc", description="Compile a PyTorch recommendation model into a training plan."
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    c = sub.add_parser("compile", help="compile a model entrypoint into a plan")
    c.add_argument(
        "entrypoint", help="FILE.py:FUNC or package.module:FUNC returning a gemc.ModelSpec"
    )
    c.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the entrypoint (JSON scalar, else string); repeatable",
    )
    c.add_argument(
        "--topology",
        default="h200:1x8",
        help="GPU:HOSTSxGPUS_PER_HOST (h200:1x8) or a topology file",
    )
    c.add_argument("--out", required=True, help="where to write plan.json")
    c.add_argument("--dump-dir", help="write numbered pass dumps and manifest.json here")
    c.add_argument("--dump-mode", default="all", help="all | changed | failure")
    c.add_argument(
        "--disable-pass",
        action="append",
        default=[],
        metavar="NAME",
        help="skip a pass (bisecting)",
    )
    c.add_argument(
        "--planner",
        default="cpsat",
        choices=["cpsat", "greedy", "naive", "default"],
        help="cpsat: CP-SAT over every strategy and sharding (default); greedy: TorchRec-style "
        "largest table first; naive: FSDP + table-wise round-robin; default: place-default",
    )
    c.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="CP-SAT's search budget in deterministic seconds (reproducible work units, "
        "about a core-second each; default 10)",
    )
    c.add_argument("--table-optimizer", default=None, choices=(*TABLE_OPTIMIZERS, "auto"),
                   help="optimizer of the embedding tables, priced (state bytes per row) and "
                   "recorded in the plan for the runner; auto: adam where it fits, else "
                   "rowwise_adagrad (1 state value per row); default: priced as AdamW, "
                   "run as the runner's default")
    c.add_argument("--calibration", default="auto",
                   help="auto (shipped file for the GPU), none (roofline), or a gemc calibrate file")
    c.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                   help="GEMM precision: auto (bf16, fp8 where measured accurate and faster), "
                   "or bf16 / fp32 everywhere")
    c.add_argument("--min-sqnr-db", type=float, default=25.0,
                   help="lowest SQNR (dB vs fp32) a GEMM may have in bf16 or fp8")
    c.add_argument("--min-block-sqnr-db", type=float, default=23.0,
                   help="lowest SQNR of a block (region) run with its chosen precisions")
    c.add_argument("--quiet", action="store_true", help="no progress display")

    cal = sub.add_parser("calibrate", help="measure this GPU and write a calibration file")
    cal.add_argument("--out", required=True, help="calibration file to write (JSON)")
    cal.add_argument("--quick", action="store_true", help="fewer sizes (under a minute)")

    e = sub.add_parser("explain", help="print a plan as tables")
    e.add_argument("plan")
    d = sub.add_parser("diff", help="what changed between two plans and why the costs differ")
    d.add_argument("a", help="the first plan (the baseline)")
    d.add_argument("b", help="the second plan")
    v = sub.add_parser("validate", help="check a plan file")
    v.add_argument("plan")
    r = sub.add_parser("report", help="one static HTML page about a compile (its dump dir)")
    r.add_argument("dump_dir", help="the directory given to gemc compile --dump-dir")
    r.add_argument("-o", "--out", default="report.html", help="where to write the HTML page")
    r.add_argument("--plan", help="the plan to show (default: DUMP_DIR/plan.json)")
    r.add_argument("--run", action="append", default=[], metavar="RUN_JSON",
                   help="a run report (default: *.run.json in DUMP_DIR and next to the plan)")
    from gemc.backends.torch.cli import add_run_parser

    add_run_parser(sub)
    return p


def _cmd_compile(args: argparse.Namespace) -> int:
    from gemc.api import compile as gemc_compile
    from gemc.entrypoint import parse_sets
    from gemc.passes.precision import precision_options

    kwargs = parse_sets(args.sets)
    progress = Progress(not args.quiet)
    try:
        with precision_options(mode=args.precision, min_sqnr_db=args.min_sqnr_db,
                               min_block_sqnr_db=args.min_block_sqnr_db):
            plan = gemc_compile(
                args.entrypoint,
                kwargs,
                topology=args.topology,
                out=args.out,
                dump_dir=args.dump_dir,
                dump_mode=args.dump_mode,
                disabled_passes=args.disable_pass,
                planner=args.planner,
                solver={} if args.time_limit is None else {"time_limit_s": args.time_limit},
                table_optimizer=args.table_optimizer,
                progress=progress,
            )
    finally:
        progress.done()
    for warning in plan["warnings"]:
        print(f"gemc: warning: {warning}", file=sys.stderr)
    pred = plan["predicted"]
    step = f"{pred['step_ms']:.2f} ms" if pred.get("step_ms") is not None else "not predicted"
    print(
        f"wrote {args.out}: {len(plan['regions'])} regions, {len(plan['tables'])} tables, "
        f"{plan['mesh']['world_size']} ranks, planner {plan['planner']}, step {step}"
    )
    return EXIT_OK


def _cmd_explain(args: argparse.Namespace) -> int:
    from gemc.explain import explain
    from gemc.plan import load_plan

    print(explain(load_plan(args.plan)))
    return EXIT_OK


def _cmd_diff(args: argparse.Namespace) -> int:
    from gemc.diff import diff
    from gemc.plan import load_plan

    print(diff(load_plan(args.a), load_plan(args.b), names=(args.a, args.b)))
    return EXIT_OK


def _cmd_validate(args: argparse.Namespace) -> int:
    from gemc.plan import load_plan

    plan = load_plan(args.plan)
    print(
        f"{args.plan}: valid plan (schema {plan['schema_version']}, planner {plan['planner']}, "
        f"{plan['mesh']['world_size']} ranks)"
    )
    return EXIT_OK


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from gemc.cost_model.calibrate import run_calibration

    run_calibration(args.out, quick=args.quick)
    return EXIT_OK


def _cmd_report(args: argparse.Namespace) -> int:
    from gemc.report import write_report

    out = write_report(args.dump_dir, args.out, plan=args.plan, runs=args.run)
    print(f"wrote {out}")
    return EXIT_OK


COMMANDS = {"compile": _cmd_compile, "calibrate": _cmd_calibrate, "explain": _cmd_explain,
            "diff": _cmd_diff, "validate": _cmd_validate}


COMMANDS["report"] = _cmd_report


def _cmd_run(args: argparse.Namespace) -> int:
    from gemc.backends.torch.cli import cmd_run

    return cmd_run(args)


COMMANDS["run"] = _cmd_run


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except GemcUserError as exc:
        print(f"gemc: error: {exc.render()}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("gemc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gemc explain plan.json | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # a bug in gemc: say so, keep the traceback in a file
        fd, path = tempfile.mkstemp(prefix="gemc-crash-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            traceback.print_exc(file=f)
        print(
            f"gemc: internal error (a bug in gemc, please report it): {type(exc).__name__}: {exc}\n"
            f"  traceback: {path}",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
