"""`hamburger vllm`: vLLM's OpenAI server with HAMburger's drafts (`hamburger.vllm`), for traffic past one machine.

`hamburger vllm serve` converts the model if it must (the embedded default becomes a Hugging Face folder), then
replaces itself with `vllm serve FOLDER --speculative-config '{...}'`; `--vllm-args` go to vLLM as they are.
`hamburger vllm command` prints that line instead; `hamburger vllm check` says whether vLLM imports here.
"""

from __future__ import annotations

import argparse

from hamburger.cli.common import command

ACTIONS = ("serve", "command", "check")


def register(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "vllm", "vLLM's OpenAI server with HAMburger's verify-mode drafts (needs hamburger[vllm])")
    p.add_argument("action", choices=ACTIONS,
                   help="serve: start `vllm serve`; command: print its command line; check: does vLLM import here")
    p.add_argument("--model", default="default",
                   help="the base vLLM serves (hub id or folder); default: the embedded default, converted")
    p.add_argument("--drafts", choices=("lookup", "micro", "ngram", "suffix", "none"), default="lookup",
                   help="lookup: HAMburger's lookup drafts (prompt, reply, the checkpoint's stored replies); micro: "
                        "lookup in the prompt and reply, else the micro-step decoder (the default checkpoint's base); "
                        "ngram, suffix: vLLM's own methods; none: plain vLLM")
    p.add_argument("--num-drafts", type=int, default=4, help="drafts per step (vLLM's num_speculative_tokens)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")
    p.add_argument("--dtype", default="float32", help="vLLM's --dtype (float32: the weights as our engine runs them)")
    p.add_argument("--served-model-name", default="default", help="the model name clients send")
    p.add_argument("--checkpoint", default=None,
                   help="the HAMburger checkpoint whose stored replies (and micro-step decoder) to use; default: the "
                        "packaged one when --model is the embedded default, else none")
    p.add_argument("--micro-min-prob", type=float, default=0.0,
                   help="--drafts micro: a draft ends before a token the decoder gives less probability (0: never)")
    p.add_argument("--vllm-args", default="", metavar="ARGS",
                   help="more arguments for `vllm serve`, one shell-quoted string, e.g. "
                        "--vllm-args='--max-model-len 2048 --max-num-seqs 16'")
    p.set_defaults(func=cmd_vllm)


def cmd_vllm(args: argparse.Namespace) -> int:
    import os
    import shlex

    from hamburger.vllm import launch

    if args.action == "check":
        version = launch.require_vllm()
        print(f"vLLM {version} imports; the model it loads: {launch.hf_folder(args.model)}")
        return 0
    if args.action == "serve":
        launch.check_vllm()  # one clear line now, not a traceback from vLLM's start
    extra = shlex.split(args.vllm_args)
    settings = {k: v for k, v in (("checkpoint", args.checkpoint), ("min_prob", args.micro_min_prob)) if v}
    argv = launch.serve_argv(launch.hf_folder(args.model), args.drafts, args.num_drafts, args.host, args.port,
                             args.dtype, args.served_model_name, extra, settings, cpu=launch.cpu_build())
    if args.action == "command":
        print(shlex.join(argv))
        return 0
    os.execvp(argv[0], argv)  # vLLM's server in this process: signals and exit status are its own
    return 0  # not reached
