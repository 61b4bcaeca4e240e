"""Where a first step's wall seconds went, from a py-spy ``--format raw`` sample file.

    python benchmarks/first_step_profile.py OUT/p/gem.gemc.pyspy.txt [--top 25]

The run report's ``first_step`` section (gemc.backends.torch.first_step) reads torch's
compile timers and Triton's compiles; what it cannot name is the rest ("running"), and
cProfile cannot sample it on Python 3.12 (it shares ``sys.monitoring`` with Dynamo). py-spy
samples the process from outside, so this file splits every sampled second:

* **by owner**, walking each stack from the leaf up to the first frame of a known owner
  (Triton's compiler, Inductor's runtime autotuning, its wait on the compile workers, the
  rest of Inductor, the compiled graph running (its runtime wrappers, Triton launches:
  a frame the running code passes through, so compiling beneath it is claimed first),
  AOTAutograd, Dynamo, gemc, the model's own code, torch otherwise);
* **by frame, inclusive**: the functions most samples pass through (a frame counted once
  per sample), which is where a slow phase is named.

Samples are 1/rate seconds each (``--rate``, py-spy's ``-r``; 100 by default there).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import Counter
from pathlib import Path

OWNERS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("triton compile", re.compile(r"triton/(compiler|backends)/")),
    ("inductor runtime autotune", re.compile(
        r"^(\w+\.)?(benchmark_all_configs|autotune_to_one_config|bench\w*) \(.*_inductor/runtime/")),
    ("inductor wait on workers", re.compile(r"_inductor/(async_compile|compile_worker)")),
    ("inductor pad_mm benchmark", re.compile(r"_inductor/fx_passes/pad_mm")),
    ("inductor import of generated code", re.compile(r"^(PyCodeCache\.\w+|load_by_key_path) ")),
    ("inductor", re.compile(r"torch/_inductor/(?!runtime/)")),
    ("compiled graph running", re.compile(
        r"torch/_inductor/runtime/|_aot_autograd/runtime_wrappers|_dynamo/eval_frame|"
        r"triton/runtime/")),
    ("aot autograd", re.compile(r"torch/_functorch/")),
    ("dynamo", re.compile(r"torch/_dynamo/")),
    ("gemc", re.compile(r"/(gemc|backends|passes|cost_model)/")),
    ("model / benchmark", re.compile(r"/(examples|benchmarks)/")),
)
_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?):(?P<line>\d+)\)$")


def parse(path: Path) -> list[tuple[list[str], int]]:
    """(frames root first, sample count) per line of a collapsed-stack file."""
    stacks = []
    for raw in path.read_text(errors="replace").splitlines():
        stack, _, count = raw.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


# the training step: the runner's step loop (its forward, backward and optimizer lines) or the
# reference trainer's step on the main thread, and the autograd engine's thread (a CUDA
# backward runs there, and with it the lazily compiled backward graph); the batch's
# creation inside the loop is not step time (the runner's step time excludes it)
RUNNER = Path(__file__).resolve().parent.parent / "backends" / "torch" / "runner.py"
_RUNNER_FRAME = re.compile(r"^_run \(.*backends/torch/runner\.py:(?P<line>\d+)\)$")
_REFERENCE_STEP = re.compile(r"^ReferenceTrainer\.train_step ")
_BATCH = re.compile(r"make_batch|synthetic_batch|ReferenceTrainer\.batches ")
_BACKWARD_THREAD = re.compile(r"^BackwardCFunction\.apply ")


def step_loop_lines(source: Path = RUNNER) -> range:
    """The lines of the runner's training loop (``for step in ...`` in ``_run``), read from
    the source. Why not fixed numbers: the loop moves whenever the runner is edited, and a
    profile split by stale numbers silently drops or adds whole phases. Read the profile
    with the checkout of the commit that made it."""
    tree = ast.parse(source.read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == "_run":
            for node in ast.walk(fn):
                if isinstance(node, ast.For) and isinstance(node.target, ast.Name) \
                        and node.target.id == "step":
                    return range(node.lineno, (node.end_lineno or node.lineno) + 1)
    raise ValueError(f"{source}: no 'for step in ...' loop in _run; update step_loop_lines")


def in_step(frames: list[str], loop: range | None = None) -> bool:
    """Whether a sample is the training step's: a frame of the runner's step loop
    (``loop``: :func:`step_loop_lines`) or the reference trainer's step, not inside the
    batch's creation; or the autograd engine's thread."""
    if _BACKWARD_THREAD.search(frames[0]):
        return True
    if frames[-1].startswith("_engine_run_backward "):  # waits for the engine's thread
        return False
    loop = step_loop_lines() if loop is None else loop
    stepping = any(_REFERENCE_STEP.search(f) or ((m := _RUNNER_FRAME.search(f)) is not None
                                                 and int(m["line"]) in loop) for f in frames)
    return stepping and not any(_BATCH.search(f) for f in frames)


# owners that claim a sample wherever they sit in its stack, in this order (the frames below
# them run the compiled code: autotuning benchmarks by launching, a launch compiles first)
_ANYWHERE = ("triton compile", "inductor runtime autotune", "inductor pad_mm benchmark",
             "inductor import of generated code", "inductor wait on workers")


def owner(frames: list[str]) -> str:
    """The owner of a sample: one of ``_ANYWHERE`` if any frame is theirs, else the first
    known owner from the leaf up (a frame's function and file both count: the autotuning
    pattern names the function)."""
    patterns = dict(OWNERS)
    for name in _ANYWHERE:
        if any(patterns[name].search(f) for f in frames):
            return name
    for frame in reversed(frames):
        for name, pattern in OWNERS:
            if pattern.search(frame):
                return name
    return "torch / other"


def short(frame: str) -> str:
    """'fn (a/b/c/file.py:12)' -> 'fn (c/file.py)': one row per function, not per line."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    parts = m["file"].split("/")
    return f"{m['fn']} ({'/'.join(parts[-2:])})"


def summarise(stacks: list[tuple[list[str], int]], rate: float, top: int) -> str:
    total = sum(c for _, c in stacks)
    owners: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for frames, count in stacks:
        owners[owner(frames)] += count
        for f in {short(f) for f in frames}:
            inclusive[f] += count
    sec = 1.0 / rate
    lines = [f"{total * sec:.1f} s sampled ({total} samples at {rate:g} Hz)", "by owner:"]
    lines += [f"  {n:<28} {c * sec:7.2f} s  {100 * c / total:5.1f}%"
              for n, c in owners.most_common()]
    lines.append(f"by frame (inclusive, top {top}):")
    lines += [f"  {c * sec:7.2f} s  {f}" for f, c in inclusive.most_common(top)]
    return "\n".join(lines)


_AUTOTUNE = re.compile(r"^(\w+\.)?benchmark_all_configs \(.*_inductor/runtime/")
_GENERATED = re.compile(r"\((?P<file>[^()]*?(?P<module>c[a-z0-9]{40,})\.py):(?P<line>\d+)\)$")
_LAUNCH = re.compile(r"^\s*(?P<kernel>\w+)\.run\(")


def autotuned_sites(stacks: list[tuple[list[str], int]], code: Path | None = None
                    ) -> Counter[str]:
    """Samples of Inductor's runtime autotuning per launch site: the generated module's line
    that launched the kernel being tuned (the nearest generated-code frame above
    ``benchmark_all_configs``), named by the kernel that line runs where ``code`` holds the
    generated modules (``zoo.py --keep-output-code``). Why: gemc's first steps ran this
    autotuning at many more sites than torch.compile's (MMoE: 67 against 12, twelfth
    session) and the samples alone name a line, not a kernel."""
    files = {f.stem: f for f in code.rglob("c*.py")} if code is not None else {}
    lines: dict[str, list[str]] = {}
    sites: Counter[str] = Counter()
    for frames, count in stacks:
        at = next((i for i, f in enumerate(frames) if _AUTOTUNE.search(f)), None)
        if at is None:
            continue
        site = next((m for f in reversed(frames[:at]) if (m := _GENERATED.search(f))), None)
        if site is None:
            sites["(no generated frame)"] += count
            continue
        name = f"{site['module'][:10]}..py:{site['line']}"
        src = files.get(site["module"])
        if src is not None:
            text = lines.setdefault(site["module"], src.read_text(errors="replace").splitlines())
            n = int(site["line"])
            launch = _LAUNCH.match(text[n - 1]) if 0 < n <= len(text) else None
            if launch:
                name = f"{launch['kernel']} ({name})"
        sites[name] += count
    return sites


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw", type=Path, help="py-spy record --format raw output")
    p.add_argument("--rate", type=float, default=100.0, help="py-spy's -r (samples/s)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--step", action="store_true",
                   help="only the training steps' samples: the step loop on the main thread "
                   "(batch creation left out) and the autograd engine's thread")
    p.add_argument("--code", type=Path, default=None,
                   help="a directory of Inductor's generated modules (zoo.py "
                   "--keep-output-code): name the kernels its runtime autotuning tuned")
    args = p.parse_args(argv)
    if not args.raw.is_file():
        print(f"first_step_profile: {args.raw}: no such file (run py-spy record --format raw "
              "-o it first)", file=sys.stderr)
        return 2
    stacks = parse(args.raw)
    if not stacks:
        print(f"first_step_profile: {args.raw}: no collapsed stacks in it (py-spy's "
              "--format raw writes 'frame;frame;... count' lines)", file=sys.stderr)
        return 2
    if args.step:
        loop = step_loop_lines()
        stacks = [(f, c) for f, c in stacks if in_step(f, loop)]
    print(f"== {args.raw.name}{' (training steps only)' if args.step else ''}")
    print(summarise(stacks, args.rate, args.top))
    sites = autotuned_sites(stacks, args.code)
    if sites:
        print(f"inductor runtime autotuning, {len(sites)} launch site(s), by samples:")
        print("\n".join(f"  {c / args.rate:7.2f} s  {n}" for n, c in sites.most_common(args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
