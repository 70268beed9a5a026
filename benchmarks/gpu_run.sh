#!/usr/bin/env bash
# The GPU run of issue 39 (docs/training.md, "A GPU run"): about 15 minutes of one GPU, no network there, at most
# 64 MiB of working tree per command (the tracked tree is ~48 MiB), a warm machine keeps its disk between calls.
#
# Here, once:   bash benchmarks/gpu_run.sh split          # runs/gpu/parts/part-00..07 (12 MiB each) + runs/gpu/lib
# There, as device `run` calls, back to back (the machine goes back after ~30 s idle, and its disk with it):
#   1. carry ["runs/gpu/lib", "runs/gpu/parts/manifest.json", "runs/gpu/parts/part-00"]  command: bash benchmarks/gpu_run.sh receive
#   2..7. carry ["runs/gpu/parts/part-0N"]  (N = 1..6)                                     command: bash benchmarks/gpu_run.sh receive
#   8. carry ["runs/gpu/parts/part-07"]  timeout_s 540   command: bash benchmarks/gpu_run.sh a   (join, GPU tests, bench, distill)
#   9.                                   timeout_s 540   command: bash benchmarks/gpu_run.sh b   (segment, train, export, pack)
# What comes back ($OUT): tests.log, bench.json (a), ckpt.tar.part-NN + ckpt.tar.manifest.json (b):
#   cat ckpt.tar.part-* > ckpt.tar && tar xf ckpt.tar   # export/ (the checkpoint), log.jsonl, the segment summary
# CPU smoke (the test suite runs it on a tiny model): bash benchmarks/gpu_run.sh smoke --model TINY --checkpoint CKPT --out DIR
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && [ "${1:-}" = split -o "${1:-}" = smoke ] && PY=.venv/bin/python
exec "$PY" benchmarks/gpu_run.py "$@"
