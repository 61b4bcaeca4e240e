"""The ``gemc`` command line.

Exit codes (``gemc.exits``): 0 success, 2 bad input or usage, 1 internal error, 130 / 143
interrupted by SIGINT / SIGTERM. Every path and number a command takes is checked before the
command starts its work (``gemc.checks``), so a mistake costs a second, not a compile.

The parser, ``--help`` and those checks import no torch (a second and a half a process):
each command imports what does its work only once its arguments have passed, so a usage
error, a mistyped path or ``--set`` is answered at once. tests/test_cli_lazy_imports.py
fails if an import here (or in a module these paths reach) brings torch back.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gemc import checks
from gemc.entrypoint_args import parse_sets, split_entrypoint
from gemc.errors import GemcUserError
from gemc.exits import (
    EXIT_OK,
    EXIT_USAGE,
    ignore_further_interrupts,
    interrupt_behind,
    interrupt_code,
    report_crash,
    signal_handlers,
    signal_name,
)
from gemc.fp8_recipe import MIN_SQNR_DB
from gemc.plan import TABLE_OPTIMIZERS

if TYPE_CHECKING:
    from gemc.config import CompileConfig

_Parser = checks.ArgumentParser


class Progress:
    """One line per stage with elapsed seconds; rewritten in place on a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.stage = "start"  # the last stage entered: where an interrupt stopped the compile

    def __call__(self, stage: str) -> None:
        self.stage = stage
        if not self.enabled:
            return
        text = f"[gemc {time.perf_counter() - self.start:6.1f}s] {stage}"
        sys.stderr.write(f"\r\033[K{text}" if self.tty else text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        """End the rewritten line (once, however many exits call it)."""
        if self.enabled and self.tty:
            sys.stderr.write("\n")
        self.enabled = False


_MAX_SQNR_DB = 300.0  # fp32 against itself is exact; no useful threshold lies above this
_SQNR_DB = checks.float_in(0.0, _MAX_SQNR_DB)


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
    c.add_argument("--out", required=True,
                   help="where to write plan.json (a file; checked writable before compiling)")
    c.add_argument("--dump-dir", help="write numbered pass dumps and manifest.json here (a "
                   "directory, created if missing; checked writable before compiling)")
    c.add_argument("--dump-mode", default="all", help="all | changed | failure")
    c.add_argument(
        "--passes", default=None, metavar="SPEC",
        help="the pipeline as a pass spec: pass names in the default order, each with "
             "optional options, e.g. 'classify-ops,collect-tables,count-flops-bytes,"
             "assign-regions,predict-time,fuse{max_outputs=2},place-default' (default: "
             "every pass)",
    )
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
        type=checks.positive_float,
        default=None,
        metavar="SECONDS",
        help="CP-SAT's search budget in deterministic seconds (reproducible work units, "
        "about a core-second each; a number > 0; default: sized by the tables, 0.25 up to "
        "64 tables, rising to 2 at 512 and more: the local search hands it a near-optimal "
        "hint)",
    )
    c.add_argument("--table-optimizer", default=None, choices=(*TABLE_OPTIMIZERS, "auto"),
                   help="optimizer of the embedding tables, priced (state bytes per row) and "
                   "recorded in the plan for the runner; auto: adam where it fits, else "
                   "rowwise_adagrad (1 state value per row); default: rowwise_adagrad, the "
                   "runner's default, priced and recorded")
    c.add_argument("--table-precision", default=None, choices=("fp32", "bf16", "fp8", "auto"),
                   help="storage precision of the embedding tables, chosen with their "
                   "sharding under memory: fp32 (default); bf16 / fp8: the lowest allowed, "
                   "kept where the plan predicts faster or fp32 does not fit; auto: fp32 "
                   "unless lowering (largest tables first, bf16 before fp8) is needed to fit. "
                   "Recorded per table in the plan with the reason")
    c.add_argument("--exchange-precision", default=None, metavar="{fp32,bf16,fp8,auto}",
                   help="wire precision of the sharded tables' pooled exchange (the "
                   "all-to-all of pooled rows forward, of their gradients backward): fp32 "
                   "(default); bf16; fp8 (e4m3 with a scale per row forward, bf16 backward); "
                   "auto: the lowest whose SQNR holds and that the plan predicts faster "
                   "(needs a solver planner). Recorded in the plan with the reason")
    c.add_argument("--calibration", default="auto",
                   help="auto (the file shipped for the topology's GPU, roofline where none "
                   "ships), none (roofline), or a file written by gemc calibrate (checked "
                   "before compiling)")
    c.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                   help="GEMM precision: auto (bf16, fp8 where measured accurate and faster), "
                   "or bf16 / fp32 everywhere")
    c.add_argument("--fp32-matmul", default="ieee", choices=("ieee", "tf32"),
                   help="how the run executes fp32 GEMMs (sites kept fp32, a model without "
                   "autocast): ieee (PyTorch's default) or tf32; priced so, and the runner "
                   "sets torch.backends.cuda.matmul.allow_tf32 from the plan")
    c.add_argument("--min-sqnr-db", type=_SQNR_DB, default=MIN_SQNR_DB,
                   help="lowest SQNR (dB vs fp32) a GEMM may have in bf16 or fp8 "
                   f"(0..{_MAX_SQNR_DB:g}; default {MIN_SQNR_DB:g}; gemc run's fp8 audit "
                   "holds the fp8 GEMMs to it during training)")
    c.add_argument("--min-block-sqnr-db", type=_SQNR_DB, default=23.0,
                   help="lowest SQNR of a block (region) run with its chosen precisions "
                   f"(0..{_MAX_SQNR_DB:g}; default 23)")
    c.add_argument("--fp8-quantisation", default="eager", choices=("eager", "compiled"),
                   help="the fp8 quantisation the precision pass prices: eager (default: "
                   "separate kernels) or compiled (fused by torch.compile, as graph mode "
                   "runs it; opt-in until measured on the GPU)")
    c.add_argument("--host-randomness", default="error", choices=("error", "freeze"),
                   help="a forward that draws from Python's random or NumPy's global "
                        "generator: error (default: torch.export would keep the drawn value "
                        "as a constant of every step) or freeze (keep it; listed in the "
                        "plan's warnings)")
    c.add_argument("--quiet", action="store_true", help="no progress display")

    cal = sub.add_parser("calibrate", help="measure this GPU and write a calibration file")
    cal.add_argument("--out", required=True, help="calibration file to write (JSON)")
    cal.add_argument("--quick", action="store_true", help="fewer sizes (under a minute)")
    cal.add_argument("--from-run", nargs="+", metavar="RUN_JSON", default=None,
                     help="fold these gemc run reports into --base instead of measuring: "
                     "per-op-kind time factors and an activation-memory factor, fitted "
                     "across the runs (no GPU needed)")
    cal.add_argument("--base", default="auto",
                     help="with --from-run: the calibration to refine (a file, or auto: the "
                     "one shipped for the runs' GPU)")

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
    from gemc.backends.torch.kernel_choices import add_record_choices_parser

    add_run_parser(sub)
    add_record_choices_parser(sub)
    return p


def _cmd_compile(args: argparse.Namespace) -> int:
    _check_compile_paths(args)
    kwargs = parse_sets(args.sets)
    _read_compile_inputs(args)
    # torch from here on: the config's checks build the pipeline (its passes)
    config = compile_config(args)
    from gemc.api import compile as gemc_compile
    from gemc.explain import planner_line

    progress = Progress(not args.quiet)
    try:
        plan = gemc_compile(args.entrypoint, kwargs, config, out=args.out, progress=progress)
    except KeyboardInterrupt as exc:
        ignore_further_interrupts()
        progress.done()
        kept = " (the file already there is left as it was)" if Path(args.out).exists() else ""
        dumps = (f"; {args.dump_dir}/manifest.json lists the passes dumped before the stop"
                 if args.dump_dir and Path(args.dump_dir, "manifest.json").is_file() else "")
        print(f"gemc: interrupted by {signal_name(exc)} during '{progress.stage}'; "
              f"{args.out} was not written{kept}{dumps}", file=sys.stderr)
        return interrupt_code(exc)
    finally:
        progress.done()
    for warning in plan["warnings"]:
        print(f"gemc: warning: {warning}", file=sys.stderr)
    pred = plan["predicted"]
    step = f"{pred['step_ms']:.2f} ms" if pred.get("step_ms") is not None else "not predicted"
    print(
        f"wrote {args.out}: {len(plan['regions'])} regions, {len(plan['tables'])} tables, "
        f"{plan['mesh']['world_size']} ranks, planner {planner_line(plan)}, step {step}"
    )
    return EXIT_OK


def compile_config(args: argparse.Namespace) -> CompileConfig:
    """``gemc compile``'s flags as the API's one typed config (checked before capture)."""
    from gemc.config import CompileConfig
    from gemc.passes.precision import PrecisionOptions

    config = CompileConfig(
        topology=args.topology,
        planner=args.planner,
        calibration=args.calibration,
        solver={} if args.time_limit is None else {"time_limit_s": args.time_limit},
        table_optimizer=args.table_optimizer,
        table_precision=args.table_precision,
        exchange_precision=args.exchange_precision,
        fp32_matmul=args.fp32_matmul,
        host_randomness=args.host_randomness,
        precision=PrecisionOptions(mode=args.precision, min_sqnr_db=args.min_sqnr_db,
                                   min_block_sqnr_db=args.min_block_sqnr_db,
                                   quantisation=args.fp8_quantisation),
        disabled_passes=tuple(args.disable_pass),
        passes=args.passes,
        dump_dir=args.dump_dir,
        dump_mode=args.dump_mode,
    )
    config.validate()
    return config


def _check_compile_paths(args: argparse.Namespace) -> None:
    """Every path ``gemc compile`` writes or reads, before the minutes of capture and
    planning: a mistake here must not cost the compile."""
    checks.output_file(args.out, "--out")
    if args.dump_dir is not None:
        checks.output_dir(args.dump_dir, "--dump-dir")
        if Path(args.dump_dir).resolve() == Path(args.out).resolve():
            raise GemcUserError("--out and --dump-dir name the same path", where="--out",
                                fix="give --out a file and --dump-dir a directory")
    if args.calibration not in ("auto", "none"):
        checks.input_file(args.calibration, "--calibration", what="calibration file",
                          fix="give a file written by gemc calibrate --out FILE, or use "
                          "--calibration auto (the shipped file) or none (roofline)")
    topo = args.topology
    if topo.endswith((".json", ".yaml", ".yml")) or os.path.sep in topo or os.path.exists(topo):
        checks.input_file(topo, "--topology", what="topology file",
                          fix="give GPU:HOSTSxGPUS_PER_HOST (h200:1x8) or a topology file "
                          "(examples/topologies/)")


def _read_compile_inputs(args: argparse.Namespace) -> None:
    """The entrypoint's form and model file, the topology and a calibration file, read
    before torch is imported (a second and a half): a mistake in them is answered at once.
    ``gemc.compile`` reads them again, after the config's checks (from Python, the order of
    its errors is unchanged); the messages are the same functions' either way."""
    split_entrypoint(args.entrypoint)
    from gemc.cost_model.topology import parse_topology  # networkx (a tenth of a second)

    parse_topology(args.topology)
    if args.calibration not in ("auto", "none"):
        from gemc.cost_model.calibration import load_calibration  # numpy

        load_calibration(args.calibration)


def _cmd_explain(args: argparse.Namespace) -> int:
    from gemc.explain import explain
    from gemc.plan import load_plan

    print(explain(load_plan(_plan_file(args.plan, "explain"))))
    return EXIT_OK


def _plan_file(path: str, command: str) -> str:
    return str(checks.input_file(path, f"gemc {command}", what="plan file",
                                 fix="give the plan file gemc compile --out wrote"))


def _cmd_diff(args: argparse.Namespace) -> int:
    from gemc.diff import diff
    from gemc.plan import read_plan

    a, b = _plan_file(args.a, "diff"), _plan_file(args.b, "diff")
    print(diff(read_plan(a), read_plan(b), names=(args.a, args.b)))
    return EXIT_OK


def _cmd_validate(args: argparse.Namespace) -> int:
    from gemc.explain import planner_line
    from gemc.plan import load_plan

    plan = load_plan(_plan_file(args.plan, "validate"))
    print(
        f"{args.plan}: valid plan (schema {plan['schema_version']}, planner {planner_line(plan)}, "
        f"{plan['mesh']['world_size']} ranks)"
    )
    return EXIT_OK


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if args.from_run:
        from gemc.cost_model.run_fit import calibrate_from_runs, read_run, resolve_base

        base = resolve_base(args.base, [read_run(p) for p in args.from_run])
        doc = calibrate_from_runs(args.from_run, base, args.out)
        fit = doc["run_fit"]
        print(f"wrote {args.out}: factors {fit['factors']}, activation factor "
              f"{fit['activation_factor']}")
        for r in fit["residuals"]:
            print(f"  {r['run']}: measured {r['measured_step_ms']:.2f} ms, predicted "
                  f"{r['predicted_step_ms']:.2f}, fitted {r['fitted_step_ms']:.2f} "
                  f"({r['step_residual_pct']:+.1f}%)")
        return EXIT_OK
    from gemc.cost_model.calibrate import run_calibration

    run_calibration(args.out, quick=args.quick)
    return EXIT_OK


def _cmd_report(args: argparse.Namespace) -> int:
    checks.input_dir(args.dump_dir, "gemc report", what="dump directory",
                     fix="give the directory gemc compile --dump-dir wrote")
    checks.output_file(args.out, "--out")
    if args.plan is not None:
        _plan_file(args.plan, "report --plan")
    for run_json in args.run:
        checks.input_file(run_json, "--run", what="run report",
                          fix="give the PLAN.run.json gemc run wrote")
    from gemc.report import write_report

    out = write_report(args.dump_dir, args.out, plan=args.plan, runs=args.run)
    print(f"wrote {out}")
    return EXIT_OK


COMMANDS = {"compile": _cmd_compile, "calibrate": _cmd_calibrate, "explain": _cmd_explain,
            "diff": _cmd_diff, "validate": _cmd_validate}


COMMANDS["report"] = _cmd_report


def _cmd_run(args: argparse.Namespace) -> int:
    from gemc.backends.torch.cli import cmd_run

    try:
        return cmd_run(args)
    except KeyboardInterrupt as exc:  # cmd_run has said where the run stopped
        return interrupt_code(exc)


COMMANDS["run"] = _cmd_run


def _cmd_record_choices(args: argparse.Namespace) -> int:
    from gemc.backends.torch.kernel_choices import cmd_record_choices

    return cmd_record_choices(args)


COMMANDS["record-choices"] = _cmd_record_choices


def main(argv: Sequence[str] | None = None) -> int:
    with signal_handlers():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except GemcUserError as exc:
        print(f"gemc: error: {exc.render()}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:  # from anywhere, the CP-SAT solve included: exit 130
        return _interrupted(exc)
    except BrokenPipeError:  # `gemc explain plan.json | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # a bug in gemc: say so, keep the traceback in a file
        interrupt = interrupt_behind(exc)  # or Ctrl-C that a C extension reported as its own
        return report_crash(exc) if interrupt is None else _interrupted(interrupt)


def _interrupted(exc: KeyboardInterrupt) -> int:
    ignore_further_interrupts()
    print(f"gemc: interrupted by {signal_name(exc)}", file=sys.stderr)
    return interrupt_code(exc)


if __name__ == "__main__":
    sys.exit(main())
