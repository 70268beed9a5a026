#!/usr/bin/env bash
# The GPU run (docs/training.md, "A GPU run"): about 15 minutes of one GPU, no network there, at most 64 MiB of
# working tree per command; a warm machine keeps its disk between calls (it goes back after ~30 s idle).
#
# Here, once:   bash benchmarks/gpu_run.sh split --part-mib 12   # runs/gpu/parts/part-00..07 + manifest, runs/gpu/lib
# Then the tree that travels made light (5 MiB; training.md says how), and device `run` calls back to back:
#   1. carry runs/gpu/lib, the manifest, part-00..03, runs/gpu/prompts.jsonl:  bash benchmarks/gpu_run.sh receive --tests
#   2. carry part-04..07:                                                       bash benchmarks/gpu_run.sh receive
#   3. carry the checkpoint's model.safetensors, timeout_s 560:  bash benchmarks/gpu_run.sh probe --budget 480
#      (or `all --budget 480`: bench, distill, segment, LoRA training, export, pack)
# What comes back ($OUT): tests.log; probe-ARM.jsonl, distill.jsonl and the logs (probe); bench-b*.json, run.log,
#   ckpt.tar.part-NN + ckpt.tar.manifest.json (all: cat ckpt.tar.part-* > ckpt.tar && tar xf ckpt.tar)
# CPU smoke (the test suite runs it on a tiny model): bash benchmarks/gpu_run.sh smoke [--probe DATA] --model TINY \
#   --checkpoint CKPT --out DIR
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && [ "${1:-}" = split -o "${1:-}" = smoke ] && PY=.venv/bin/python
exec "$PY" benchmarks/gpu_run.py "$@"
