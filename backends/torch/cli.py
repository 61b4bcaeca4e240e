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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemc.errors import GemcUserError

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE = 0, 1, 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``gemc run`` (shared by ``gemc run`` and ``python -m gemc.run``)."""
    p.add_argument("plan", help="plan.json written by gemc compile")
    p.add_argument("--steps", type=int, default=20, help="train until this many steps are done")
    p.add_argument("--checkpoint-dir", help="write DCP checkpoints here (shared by all ranks)")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="K",
        help="checkpoint every K steps (default: only at the end, when --checkpoint-dir is set)",
    )
    p.add_argument(
        "--keep-checkpoints", type=int, default=2, help="complete checkpoints to keep (default 2)"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the last complete checkpoint"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument("--report", help="run report path (default: <plan>.run.json next to the plan)")
    p.add_argument("--seed", type=int, default=0, help="init and RNG seed (default 0)")
    p.add_argument("--lr", type=float, help="AdamW learning rate for dense parameters")
    p.add_argument(
        "--embedding-optimizer",
        choices=("rowwise_adagrad", "adam"),
        help="sparse optimizer of the tables (default: the plan's, else rowwise_adagrad)",
    )
    p.add_argument("--embedding-lr", type=float, help="learning rate of the tables")
    p.add_argument(
        "--precision",
        choices=("bf16", "fp16", "fp32"),
        help="autocast the whole forward (added to the plan's precision sites)",
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
        "--graph-executor",
        choices=("inductor", "interpreter"),
        default="inductor",
        help="graph mode: torch.compile over the rewritten graph (default), or the op-by-op "
        "interpreter (a fallback: unfused)",
    )
    p.add_argument("--compile-mode", help="torch.compile mode for graph mode, e.g. "
                   "reduce-overhead (CUDA graphs)")
    p.add_argument("--measure-kernels", action="store_true",
                   help="graph mode: on the first step, time each fused group's gemc kernel "
                   "against Inductor's code for it and keep the faster (in the run report)")
    p.add_argument("--kernel-choices", metavar="FILE",
                   help="JSON {kernel name: {\"choice\": \"gemc\"|\"inductor\"}} (e.g. a run "
                   "report's graph_executor.measured): per fused group, the choice to use")
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
        kernel_modules=list(args.kernel_module),
        kernels=not args.no_kernels,
        progress=not args.quiet,
        graph_executor=args.graph_executor,
        compile_mode=args.compile_mode,
        loss_every=args.loss_every,
        measure_kernels=args.measure_kernels,
        kernel_choices=_kernel_choices(args.kernel_choices),
    )


def _kernel_choices(path: str | None) -> dict[str, Any] | None:
    """``--kernel-choices FILE``: a JSON object of per-kernel records (or a whole run report,
    whose ``graph_executor.measured`` is taken)."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise GemcUserError(f"--kernel-choices {path}: {exc}", where=path,
                            fix="pass a JSON file, e.g. a run report of --measure-kernels"
                            ) from exc
    if isinstance(data, dict) and isinstance(data.get("graph_executor"), dict):
        data = data["graph_executor"].get("measured") or {}
    if not isinstance(data, dict):
        raise GemcUserError(f"--kernel-choices {path} is not a JSON object", where=path,
                            fix="pass {kernel name: {\"choice\": \"gemc\"|\"inductor\"}}")
    return data


def _under_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _self_launch(args: argparse.Namespace, argv: Sequence[str], world: int, mesh: dict) -> int:
    """Start torchrun for a one-host plan of ``world`` ranks; returns its exit code."""
    shape = mesh.get("shape") or [1, world]
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
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        "-m",
        "gemc.run",
        *argv,
    ]
    print(f"gemc run: starting {world} processes: {' '.join(cmd[1:])}", file=sys.stderr)
    return subprocess.call(cmd)


def cmd_run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the plan (starting torchrun first when needed). ``argv`` re-creates the flags."""
    from gemc.plan import load_plan

    if not _under_launcher():
        plan = load_plan(args.plan)
        world = plan["mesh"]["world_size"]
        if world > 1:
            return _self_launch(args, list(argv) if argv is not None else _argv_of(args), world, plan["mesh"])
    from gemc.backends.torch.runner import run

    result = run(args.plan, options_from_args(args))
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
    return EXIT_OK


def _argv_of(args: argparse.Namespace) -> list[str]:
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
        "--graph-executor": args.graph_executor,
        "--compile-mode": args.compile_mode,
        "--kernel-choices": args.kernel_choices,
        "--loss-every": args.loss_every,
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
    if args.measure_kernels:
        out.append("--measure-kernels")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gemc.run PLAN ...``: exit 0, 2 on a user error, 1 on a bug in gemc."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="gemc run", description="Train a plan on torch.distributed.")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return cmd_run(args, argv)
    except GemcUserError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"gemc: error: {exc.render()}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("gemc: interrupted", file=sys.stderr)
        return 130
