"""``gemc run``: the command line of the runner.

Two ways to launch a plan of ``W`` ranks on one host::

    torchrun --nproc_per_node=W -m gemc.run plan.json --steps 100      # explicit
    gemc run plan.json --steps 100                                    # starts torchrun itself

``gemc run`` outside torchrun with ``W > 1`` re-executes itself through
``python -m torch.distributed.run --standalone --nproc_per_node=W -m gemc.run ...`` on this
host (a plan spanning several hosts must be launched with torchrun on each host, with
``--nnodes`` and a rendezvous endpoint). Under torchrun each process runs one rank.

``add_run_parser`` / ``cmd_run`` plug this into ``gemc``'s own CLI; ``gemc.run`` is the
module torchrun executes.

Before any work: every path (the plan, ``--report``, ``--checkpoint-dir``; with ``--resume``,
a complete checkpoint in it) and every number is checked (``gemc.checks``); on the CPU,
Triton's interpreter is chosen before anything imports Triton (:func:`prepare_device_env`).
Exit codes are ``gemc.exits``'s on every rank: 2 for a user error (one message, see
:mod:`.launch`), 130 / 143 when interrupted (no partial checkpoint or report is left).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemc.backends.torch.cuda_graphs_choice import AUTO
from gemc.backends.torch.cuda_graphs_choice import MODES as COMPILE_MODES
from gemc.backends.torch.fp8_audit_cadence import DEFAULT_EVERY as AUDIT_EVERY
from gemc.backends.torch.fp8_audit_cadence import FLAG as AUDIT_FLAG
from gemc.backends.torch.kernel_choices import read_choices

from gemc import checks
from gemc.errors import GemcUserError
from gemc.exits import (
    EXIT_OK,
    EXIT_USAGE,
    ignore_further_interrupts,
    interrupt_behind,
    interrupt_code,
    raise_pending_interrupt,
    report_crash,
    signal_handlers,
    signal_name,
)
from gemc.plan import Mesh


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list of non-empty names."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _audit_every(text: str) -> int:
    """``--fp8-audit-every``: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer >= 0: give the steps between fp8 audits (default "
            f"{AUDIT_EVERY}), or 0 to turn the audit off")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``gemc run`` (shared by ``gemc run`` and ``python -m gemc.run``)."""
    p.add_argument("plan", help="plan.json written by gemc compile")
    p.add_argument("--steps", type=checks.int_at_least(1), default=20,
                   help="train until this many steps are done (an integer >= 1; default 20)")
    p.add_argument("--checkpoint-dir", help="write DCP checkpoints here (shared by all ranks; "
                   "a directory, created if missing; checked writable before the run)")
    p.add_argument(
        "--checkpoint-every",
        type=checks.int_at_least(0),
        default=0,
        metavar="K",
        help="checkpoint every K steps (an integer >= 0; default 0: only at the end, when "
        "--checkpoint-dir is set)",
    )
    p.add_argument(
        "--keep-checkpoints", type=checks.int_at_least(0), default=2,
        help="complete checkpoints to keep (an integer >= 0, 0 keeps all; default 2)"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the last complete checkpoint in "
        "--checkpoint-dir (refused when it holds none)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available; "
                   "on cpu the plan's Triton kernels run in Triton's interpreter")
    p.add_argument("--report", help="run report path (a file; default: <plan>.run.json next "
                   "to the plan; checked writable before the run)")
    p.add_argument("--seed", type=checks.int_at_least(0), default=0,
                   help="init and RNG seed (an integer >= 0; default 0)")
    p.add_argument("--lr", type=checks.positive_float,
                   help="AdamW learning rate for dense parameters (a number > 0)")
    p.add_argument(
        "--embedding-optimizer",
        choices=("rowwise_adagrad", "adam"),
        help="sparse optimizer of the tables (default: the plan's, else rowwise_adagrad)",
    )
    p.add_argument("--embedding-lr", type=checks.positive_float,
                   help="learning rate of the tables (a number > 0)")
    p.add_argument(
        "--precision",
        choices=("bf16", "fp16", "fp32"),
        help="autocast the whole forward (added to the plan's precision sites)",
    )
    p.add_argument(
        "--fp8-linears", type=checks.int_at_least(16), metavar="N",
        help="force row-wise fp8 (e4m3, all three GEMMs) on every nn.Linear whose in and out "
        "features are both >= N, whatever the plan chose (a measurement switch; linears the "
        "plan keeps fp32 are left alone); the run report lists them",
    )
    p.add_argument(
        "--divergence", choices=("off", "warn", "stop"), default="warn",
        help="loss safeguard: a non-finite loss, a jump far above the run's recent losses, or "
        "(with --reference-losses) staying well above a reference run's flags the step; warn "
        "(default) or stop, naming the plan's low-precision tables and sites to revert",
    )
    p.add_argument(
        AUDIT_FLAG, type=_audit_every, default=AUDIT_EVERY, metavar="N",
        help=f"every N steps (default {AUDIT_EVERY}; 0: off), measure each fp8 site's GEMMs "
        "(y, dx, dW) on that step's operands against fp32 (SQNR dB); a GEMM under the bound the "
        "precision pass chose it by (the plan's min_sqnr_db, default 25) runs bf16 for the "
        "rest of the run, with a warning; the run report's fp8_audit has each site's series "
        "and switches (one audited step runs each fp8 GEMM twice more, once in fp32; a "
        "compiled step is measured on an eager run of the same batch before it)",
    )
    p.add_argument(
        "--reference-losses", metavar="FILE",
        help="a reference run's losses for --divergence (a gemc run report, e.g. the same "
        "plan at fp32 tables, or a JSON list of per-step losses)",
    )
    p.add_argument(
        "--kernel-module",
        action="append",
        default=[],
        metavar="MODULE",
        help="import a module that registers kernel appliers (repeatable)",
    )
    p.add_argument(
        "--no-kernels",
        action="store_true",
        help="run the ops the plan's generated kernels replace (on several ranks the kernels "
        "need every region ddp)",
    )
    p.add_argument(
        "--skip-kernels",
        type=_names,
        default=(),
        metavar="NAMES",
        help="comma-separated kernel names or kinds of the plan (e.g. key_padding_attention) "
        "whose replaced ops run instead: bisect a numeric difference one kernel at a time",
    )
    p.add_argument(
        "--graph-executor",
        choices=("inductor", "interpreter"),
        default="inductor",
        help="graph mode: torch.compile over the rewritten graph (default), or the op-by-op "
        "interpreter (a fallback: unfused)",
    )
    p.add_argument(
        "--compile-modules",
        choices=("auto", "on", "off"),
        default="auto",
        help="a plan without graph kernels (module mode): torch.compile the model, table "
        "lookups eager; auto: on CUDA with one rank",
    )
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default=AUTO,
                   help="torch.compile mode for graph mode: reduce-overhead replays the step "
                   "as CUDA graphs, default never does; auto (the default): CUDA graphs on "
                   "one CUDA GPU where the plan predicts the host bounds the step")
    p.add_argument("--measure-kernels", action="store_true",
                   help="graph mode: on the first step, time each fused group's gemc kernel "
                   "against Inductor's code for it and keep the faster (in the run report)")
    p.add_argument("--autotune", action="store_true",
                   help="autotune gemc's hand-written kernels (jagged attention, embedding "
                   "bag, jagged copies) over every launch config that fits in shared memory, "
                   "and record the winners in the Triton cache dir for later runs; without "
                   "it a kernel runs the recorded winner, else one heuristic config (the run "
                   "report's kernel_tuning says which)")
    p.add_argument("--pointwise-autotune", action="store_true",
                   help="graph mode: let Inductor time two configs of each pointwise kernel "
                   "at its first launch, as torch.compile does; off by default (one config: "
                   "a shorter first step; the run report's graph_executor.inductor_options)")
    p.add_argument("--no-warm-kernels", action="store_true",
                   help="compile each of gemc's hand-written kernels at its first launch, in "
                   "the training process; by default the kernels the first step launches "
                   "are compiled ahead in worker processes (GEMC_WARM_WORKERS of them; the "
                   "run report's first_step.kernel_warmup says what hit)")
    p.add_argument("--kernel-choices", metavar="FILE",
                   help="JSON {kernel name: {\"choice\": \"gemc\"|\"inductor\"}} (e.g. a run "
                   "report of --measure-kernels): per fused group, the choice to use, above "
                   "the plan's recorded choices (gemc record-choices folds them into the plan)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="where Inductor's and Triton's compile and autotune caches persist "
                   "across runs (default: $GEMC_COMPILE_CACHE, else gemc-cache/ next to the "
                   "plan; TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR set by you win); none: "
                   "a cold compile that keeps nothing")
    p.add_argument("--loss-every", type=int, default=1, metavar="N",
                   help="read the loss every N steps (1: every step; N > 1: no host sync "
                   "in between, step times are block means)")
    p.add_argument("--quiet", action="store_true", help="no progress line")


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``run`` on ``gemc``'s subparsers; returns the new parser."""
    r = subparsers.add_parser("run", help="train a plan on torch.distributed")
    add_arguments(r)
    return r


def options_from_args(args: argparse.Namespace) -> Any:
    from gemc.backends.torch.runner import RunOptions

    return RunOptions(
        steps=args.steps,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        device=args.device,
        report=args.report,
        seed=args.seed,
        lr=args.lr,
        embedding_optimizer=args.embedding_optimizer,
        embedding_lr=args.embedding_lr,
        precision=args.precision,
        fp8_min_features=args.fp8_linears,
        kernel_modules=list(args.kernel_module),
        kernels=not args.no_kernels,
        skip_kernels=args.skip_kernels,
        progress=not args.quiet,
        graph_executor=args.graph_executor,
        compile_mode=args.compile_mode,
        compile_modules=args.compile_modules,
        loss_every=args.loss_every,
        measure_kernels=args.measure_kernels,
        autotune=args.autotune,
        warm_kernels=not args.no_warm_kernels,
        pointwise_autotune=args.pointwise_autotune,
        kernel_choices=read_choices(args.kernel_choices),
        cache_dir=args.cache_dir,
        divergence=args.divergence,
        reference_losses=args.reference_losses,
        fp8_audit_every=args.fp8_audit_every,
    )


def _under_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def prepare_device_env(device: str | None) -> None:
    """On the CPU, choose Triton's interpreter now, before anything imports Triton.

    Why here: ``@triton.jit`` reads ``TRITON_INTERPRET`` once, at import, and gemc's own
    capture of the model (the fingerprint check) imports the kernel modules; set later, the
    variable cannot take effect and the plan's kernels cannot run. The ranks torchrun starts
    inherit it. A value the user set is kept."""
    if "triton" in sys.modules:
        return  # too late to choose; the runner says so if the plan's kernels need it
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif device is None:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")


def check_run_paths(args: argparse.Namespace) -> None:
    """The plan, the report, the checkpoint directory (and, with ``--resume``, a complete
    checkpoint in it), before torchrun starts and the model is built."""
    checks.input_file(args.plan, "gemc run", what="plan file",
                      fix="give the plan file gemc compile --out wrote")
    plan = Path(args.plan)
    # the default report lands next to the plan: a read-only plan folder must fail now, not
    # after the whole run
    checks.output_file(args.report if args.report is not None else
                       plan.with_name(plan.name.removesuffix(".json") + ".run.json"), "--report")
    if args.checkpoint_dir is not None:
        checks.output_dir(args.checkpoint_dir, "--checkpoint-dir")
    if args.resume:
        from gemc.backends.torch.checkpoint import require_latest

        if args.checkpoint_dir is None:
            raise GemcUserError("--resume needs --checkpoint-dir", where="--resume",
                                fix="add --checkpoint-dir D (the directory of the earlier run)")
        require_latest(args.checkpoint_dir)


def _self_launch(args: argparse.Namespace, argv: Sequence[str], mesh: Mesh) -> int:
    """Start torchrun for a one-host plan of ``mesh.world_size`` ranks; returns its exit
    code."""
    world = mesh.world_size
    shape = list(mesh.shape)
    if len(shape) > 1 and shape[0] > 1:
        raise GemcUserError(
            f"the plan spans {shape[0]} hosts; gemc run starts processes on this host only",
            where=f"{args.plan}: mesh.shape {shape}",
            fix=(
                f"run on each host: torchrun --nnodes={shape[0]} --nproc_per_node={shape[-1]} "
                "--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT -m gemc.run PLAN ..."
            ),
        )
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < world:
            raise GemcUserError(
                f"the plan needs {world} GPUs on this host, {torch.cuda.device_count()} found",
                where=f"{args.plan}: mesh.world_size",
                fix=f"run on a host with {world} GPUs, or compile for h200:1x"
                f"{torch.cuda.device_count()}",
            )
    from gemc.backends.torch.launch import launch

    print(f"gemc run: starting {world} processes: torchrun --standalone "
          f"--nproc_per_node={world} -m gemc.run {' '.join(argv)}", file=sys.stderr)
    return launch(world, argv)


def cmd_run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the plan (starting torchrun first when needed). ``argv`` re-creates the flags."""
    from gemc.plan import read_plan

    # the paths and the plan first: a mistake in them is answered before torch is imported
    check_run_paths(args)
    mesh = None if _under_launcher() else read_plan(args.plan).mesh
    prepare_device_env(args.device)
    if mesh is not None and mesh.world_size > 1:
        return _self_launch(args, list(argv) if argv is not None else argv_of(args), mesh)
    from gemc.backends.torch.runner import run

    done = [0]
    options = options_from_args(args)

    def on_step(step: int) -> None:
        done[0] = step
        raise_pending_interrupt()  # a Ctrl-C that something swallowed still stops here

    options.on_step = on_step
    try:
        result = run(args.plan, options)
    except KeyboardInterrupt as exc:
        ignore_further_interrupts()
        _interrupted(exc, args, done[0])
        raise
    except Exception as exc:  # Ctrl-C inside torch's argument parsing arrives as its error
        interrupt = interrupt_behind(exc)
        if interrupt is None:
            raise
        ignore_further_interrupts()
        _interrupted(interrupt, args, done[0])
        raise interrupt from exc
    if int(os.environ.get("RANK", "0")) == 0:
        rep = result.report
        losses = result.losses
        first = f"{losses[0][1]:.5f}" if losses else "-"
        last = f"{losses[-1][1]:.5f}" if losses else "-"
        step_ms = f"{rep['step_ms']:.2f} ms/step" if rep.get("step_ms") else "no timed steps"
        sps = f", {rep['samples_per_s']:,.0f} samples/s" if rep.get("samples_per_s") else ""
        mfu = rep["mfu"]["value"]
        mfu_text = f", MFU {100 * mfu:.1f}%" if mfu is not None else ""
        print(
            f"gemc run: {rep['steps']['run']} steps (to step {rep['steps']['requested']}) on "
            f"{rep['world_size']} rank(s), loss {first} -> {last}, {step_ms}{sps}{mfu_text}"
            + (f"; report {result.report_path}" if result.report_path else "")
        )
        if rep.get("first_step"):
            print(f"gemc run: {first_step_line(rep['first_step'])}")
    return EXIT_OK


def first_step_line(acc: dict[str, Any]) -> str:
    """The report's ``first_step`` in one line: where the first step's seconds went."""
    timers = acc.get("torch_timers", {})
    phases = acc.get("torch_phases_s", {})
    tri = acc.get("triton_in_process", {})
    tracing = timers.get("bytecode_tracing", {}).get("seconds", 0.0)
    return (f"first step {acc['first_step_s']:.1f} s: torch.compile {acc['torch_compile_s']:.1f} s "
            f"(Dynamo tracing {tracing:.1f}, backward {phases.get('entire_backward_compile', 0.0):.1f}), "
            f"outside it {acc['outside_torch_compile_s']:.1f} s; Triton compiles in this "
            f"process {tri.get('compiles', 0)}: gemc's kernels {tri.get('gemc_kernels_s', 0.0):.1f} s, "
            f"others {tri.get('other_kernels_s', 0.0):.1f} s"
            + _phases_part(acc.get("phases") or {}))


def _phases_part(phases: dict[str, dict[str, float]]) -> str:
    """'; by phase: forward 38.8 (compile 30.1, kernels 2.0, running 6.7), ...'."""
    if not phases:
        return ""
    parts = [f"{name} {p['wall_s']:.1f} (compile {p['torch_compile_s']:.1f}, "
             f"kernels {p['gemc_triton_compile_s']:.1f}, running {p['rest_s']:.1f})"
             for name, p in phases.items()]
    return "; by phase: " + ", ".join(parts)


def argv_of(args: argparse.Namespace) -> list[str]:
    """Flags equivalent to ``args`` (when ``cmd_run`` is called without the raw argv)."""
    out = [args.plan, "--steps", str(args.steps)]
    pairs = {
        "--checkpoint-dir": args.checkpoint_dir,
        "--checkpoint-every": args.checkpoint_every or None,
        "--keep-checkpoints": args.keep_checkpoints,
        "--device": args.device,
        "--report": args.report,
        "--seed": args.seed,
        "--lr": args.lr,
        "--embedding-optimizer": args.embedding_optimizer,
        "--embedding-lr": args.embedding_lr,
        "--precision": args.precision,
        "--fp8-linears": args.fp8_linears,
        "--graph-executor": args.graph_executor,
        "--compile-mode": args.compile_mode,
        "--compile-modules": args.compile_modules,
        "--kernel-choices": args.kernel_choices,
        "--cache-dir": args.cache_dir,
        "--loss-every": args.loss_every,
        "--divergence": args.divergence,
        "--reference-losses": args.reference_losses,
        AUDIT_FLAG: args.fp8_audit_every,
    }
    for flag, value in pairs.items():
        if value is not None:
            out += [flag, str(value)]
    for module in args.kernel_module:
        out += ["--kernel-module", module]
    if args.resume:
        out.append("--resume")
    if args.quiet:
        out.append("--quiet")
    if args.no_kernels:
        out.append("--no-kernels")
    if args.skip_kernels:
        out += ["--skip-kernels", ",".join(args.skip_kernels)]
    if args.measure_kernels:
        out.append("--measure-kernels")
    if args.autotune:
        out.append("--autotune")
    if args.no_warm_kernels:
        out.append("--no-warm-kernels")
    if args.pointwise_autotune:
        out.append("--pointwise-autotune")
    return out


def _interrupted(exc: KeyboardInterrupt, args: argparse.Namespace, done: int) -> None:
    """Where the run stopped: the steps done, the checkpoint a ``--resume`` would load. A
    save cut short is removed (its data never became a checkpoint); no report is written."""
    rank = int(os.environ.get("RANK", "0"))
    found = None
    if args.checkpoint_dir is not None and rank == 0:
        from gemc.backends.torch.checkpoint import discard_partial, find_latest

        discard_partial(args.checkpoint_dir)
        found = find_latest(args.checkpoint_dir)
    if rank == 0:
        resume = (f"; the last complete checkpoint is {found[1]} (continue with --resume)"
                  if found else "; no checkpoint was written")
        print(f"gemc run: interrupted by {signal_name(exc)} after {done} step(s) of this "
              f"run{resume}; no report was written", file=sys.stderr)


def _user_error(exc: GemcUserError) -> None:
    """One message for the whole run: under gemc's launcher each rank leaves it to the
    launcher (which prints each distinct message once); under plain torchrun rank 0 prints."""
    from gemc.backends.torch.launch import write_rank_error

    text = f"gemc: error: {exc.render()}"
    rank = int(os.environ.get("RANK", "0"))
    if _under_launcher() and write_rank_error(text, rank):
        return
    if rank == 0:
        print(text, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gemc.run PLAN ...``: exit 0; 2 on a user error (every rank); 1 on a bug
    in gemc; 130 / 143 when interrupted by SIGINT / SIGTERM."""
    with signal_handlers():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = checks.ArgumentParser(prog="gemc run", description="Train a plan on torch.distributed.")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return cmd_run(args, argv)
    except GemcUserError as exc:
        ignore_further_interrupts()  # torchrun stops the other ranks; this one has its code
        _user_error(exc)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        ignore_further_interrupts()
        return interrupt_code(exc)
    except Exception as exc:  # a bug in gemc: one line per rank, the traceback in a file
        interrupt = interrupt_behind(exc)
        if interrupt is not None:  # Ctrl-C that a C extension reported as its own error
            ignore_further_interrupts()
            return interrupt_code(interrupt)
        return report_crash(exc, prefix=f"gemc run (rank {os.environ.get('RANK', '0')})")
