"""The `hamburger` CLI on a tiny local model: JSON output, info, checkpoints, and bad input without tracebacks."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from hamburger.cli import main
from hamburger.kernels import native

DECODING = ("generate", "info", "demo", "serve", "eval", "bench-serve")  # --quantize auto by default


def run_json(capsys, *args) -> dict:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_on_a_base_model(capsys, tiny_model_dir):
    out = run_json(capsys, "generate", "w1 w2 w3", "--model", str(tiny_model_dir), "--max-new-tokens", "7", "--json")
    assert {"text", "generated_tokens", "macro_steps", "tokens_per_step", "kv_entries", "decode_tokens_per_s"} <= out.keys()
    assert out["hamburger"] is False and out["tokens_per_step"] == 1.0
    assert out["generated_tokens"] <= 7 and out["kv_entries"] == out["prompt_tokens"] + out["macro_steps"]


def test_generate_json_on_a_checkpoint(capsys, checkpoint):
    out = run_json(capsys, "generate", "w5 w6", "--model", str(checkpoint), "--max-new-tokens", "12",
                   "--confidence", "0.2", "--json")
    assert out["hamburger"] is True
    assert sum(out["steps"]) == out["generated_tokens"] and out["macro_steps"] == len(out["steps"])
    assert out["tokens_per_step"] > 1.0


def test_generate_streams_text_and_sampling_is_seeded(capsys, checkpoint):
    args = ["generate", "w5 w6", "--model", str(checkpoint), "--max-new-tokens", "10", "--temperature", "0.9",
            "--top-p", "0.9", "--seed", "3", "--json"]
    assert run_json(capsys, *args)["text"] == run_json(capsys, *args)["text"]
    assert main(["generate", "w5", "--model", str(checkpoint), "--max-new-tokens", "6", "--raw"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "tokens/forward" in captured.err


def test_info(capsys, checkpoint, tiny_model_dir):
    out = run_json(capsys, "info", "--model", str(checkpoint), "--json")
    assert out["hamburger_checkpoint"] is True and out["architecture"] == "LlamaForCausalLM"
    assert set(out["parameters"]) == {"base", "embedder", "micro", "stop_head"} and out["feature_layers"] == [1, 2, 3, 4]
    assert all(v > 0 for v in out["parameters"].values())
    assert out["default_mode"] == "trust" and out["kv_merger"] is False and 0 < out["verify_confidence"] <= 1
    assert main(["info", "--model", str(tiny_model_dir)]) == 0
    assert "a base model" in capsys.readouterr().out


def test_quantize_another_scheme_on_the_lm_head(capsys, checkpoint):
    """SCHEME/HEAD: int4 projections with an int8 LM head, through generate and info."""
    from hamburger.kernels.qlinear import Int4Linear, Int8Linear
    from hamburger.loading import load

    info = run_json(capsys, "info", "--model", str(checkpoint), "--json", "--quantize", "int4/int8")
    assert info["quantize"] == "int4/int8" and info["group_size"] == 32
    model, _ = load(str(checkpoint), quantize="int4/int8", quiet=False)
    assert type(model.base.get_output_embeddings()) is Int8Linear
    assert type(model.base.model.layers[0].mlp.down_proj) is Int4Linear
    line = next(s for s in capsys.readouterr().err.splitlines() if s.startswith("quantize:"))
    assert line.startswith("quantize: int4 (groups of 32), LM head int8: ")
    assert main(["generate", "w5 w6", "--model", str(checkpoint), "--max-new-tokens", "4", "--quantize",
                 "none/int8", "--json", "--verbose"]) == 0  # the head alone
    assert "quantize: none, LM head int8: 1 linear layers" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["generate", "", "--model", "MODEL"], "prompt is empty"),
    (["generate", "   ", "--model", "MODEL"], "prompt is empty"),
    (["generate", "w1", "--model", "MODEL", "--max-new-tokens", "0"], "max-new-tokens"),
    (["generate", "w1", "--model", "MODEL", "--max-new-tokens", "-5"], "max-new-tokens"),
    (["generate", "w1", "--model", "MODEL", "--confidence", "0"], "confidence"),
    (["generate", "w1", "--model", "MODEL", "--confidence", "1.01"], "confidence"),
    (["generate", "w1", "--model", "MODEL", "--temperature", "-1"], "temperature"),
    (["generate", "w1", "--model", "./no/such/model"], "does not exist"),
    (["generate", "w1", "--model", "/no/such/model"], "does not exist"),
    (["info", "--model", "/no/such/model"], "does not exist"),
    (["info", "--model", "no such/hub id"], "neither a local path nor a valid hub id"),
    (["generate", "w1", "--model", "MODEL", "--device", "not-a-device"], "not usable here"),
    (["generate", "w1", "--model", "MODEL", "--quantize", "fp16+a8"], "the layers' scheme must be int4"),
    (["generate", "w1", "--model", "MODEL", "--quantize", "int8/int4+a8"], "the layers' scheme must be int4"),
    (["generate", "w1", "--model", "MODEL", "--quantize", "int4+a8+bf16"], "--quantize must be one of"),
])
def test_bad_input_exits_nonzero_with_a_message(capsys, tiny_model_dir, args, message):
    args = [str(tiny_model_dir) if a == "MODEL" else a for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_prompt_from_stdin(capsys, monkeypatch, tiny_model_dir):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("w7 w8 w9\n"))
    out = run_json(capsys, "generate", "-", "--model", str(tiny_model_dir), "--raw", "--max-new-tokens", "3", "--json")
    assert out["prompt_tokens"] == 3


def test_unreachable_hub_id_fails_fast(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["info", "--model", "nobody-here/no-model"]) == 2
    assert "hub cannot be reached" in capsys.readouterr().err


def test_checkpoint_for_another_base_is_refused(capsys, tmp_path, checkpoint):
    from conftest import tiny_base, tiny_tokenizer

    other = tmp_path / "other-base"
    tiny_base("llama", seed=42).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    assert main(["generate", "w1", "--model", str(checkpoint), "--base", str(other)]) == 2
    err = capsys.readouterr().err
    assert "fingerprint" in err and "Traceback" not in err


def test_a_folder_that_is_not_a_model(capsys, tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{not json")
    assert main(["generate", "w1", "--model", str(tmp_path / "junk")]) == 2
    assert "could not load model" in capsys.readouterr().err


def test_console_script_bad_input_has_no_traceback(tiny_model_dir):
    proc = subprocess.run([sys.executable, "-m", "hamburger.cli", "generate", "w1", "--model", str(tiny_model_dir),
                           "--confidence", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "confidence must be in (0, 1]" in proc.stderr and "Traceback" not in proc.stderr


# --- --quantize ------------------------------------------------------------------------------------------------


@pytest.fixture
def smooth_model_dir(tmp_path):
    """A tiny Llama with the default init (std 0.02, as a trained model's scale), saved as a folder. (The shared tiny
    base's std 0.2 makes int8's logit error, ~5%, larger than some of its top-2 gaps.)"""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import EOS, PAD, VOCAB, tiny_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS,
                      pad_token_id=PAD, bos_token_id=None, tie_word_embeddings=True, initializer_range=0.02)
    path = tmp_path / "smooth"
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_generate_int8_gives_the_float_greedy_text_where_no_choice_is_a_near_tie(capsys, smooth_model_dir):
    """Greedy int8 must follow float greedy wherever the float top-2 logits are further apart than twice int8's
    largest logit error at that position: checked along the float reply (teacher-forced), then the CLI's texts
    are compared."""
    import torch

    from hamburger.loading import load

    args = ["generate", "w5 w6 w7", "--model", str(smooth_model_dir), "--raw", "--max-new-tokens", "16", "--json"]
    float_out = run_json(capsys, *args, "--quantize", "none")
    assert main(args + ["--quantize", "int8", "--verbose"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["quantize"] == "int8" and float_out["quantize"] == "none"
    assert captured.err.count("quantize: int8:") == 1 and "MB -> " in captured.err
    assert "linear layers (base 15);" in captured.err  # 2 layers x 7 + the head; a plain base has no micro-step decoder

    float_model, _ = load(str(smooth_model_dir), quantize="none")
    int8_model, _ = load(str(smooth_model_dir), quantize="int8")
    tok = float_model.tokenizer
    prompt = tok("w5 w6 w7")["input_ids"]
    ids = torch.tensor([prompt + tok(float_out["text"])["input_ids"]])
    with torch.no_grad():
        ref, got = float_model.base(ids).logits[0], int8_model.base(ids).logits[0]
    assert ((got - ref).norm() / ref.norm()).item() < 0.03  # measured 0.012
    top2 = ref.topk(2, -1).values
    near_tie = (top2[:, 0] - top2[:, 1]) < 2 * (got - ref).abs().amax(-1)
    assert not near_tie[len(prompt) - 1:].any()  # so int8 cannot flip a choice along this reply...
    assert out["text"] == float_out["text"] and out["generated_tokens"] == float_out["generated_tokens"] == 16


def test_generate_quantized_checkpoint_quantizes_the_micro_decoder(capsys, checkpoint):
    assert main(["generate", "w5 w6", "--model", str(checkpoint), "--max-new-tokens", "12", "--confidence", "0.3",
                 "--quantize", "int8", "--json", "--verbose"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["hamburger"] is True and out["tokens_per_step"] > 1.0
    line = next(s for s in captured.err.splitlines() if s.startswith("quantize:"))
    assert "(base 29, micro 28)" in line  # 4 layers x 7 projections + the head; the micro-step decoder 4 x 7


def test_generate_quantized_int4_runs_and_says_what_it_did(capsys, checkpoint):
    assert main(["generate", "w5 w6", "--model", str(checkpoint), "--max-new-tokens", "8", "--quantize", "int4",
                 "--group-size", "64", "--json", "--verbose"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["generated_tokens"] > 0
    line = next(s for s in captured.err.splitlines() if s.startswith("quantize:"))
    # every linear layer of the tiny model takes 64 or 128 inputs: all fit groups of 64, none is left float
    assert "int4 (groups of 64)" in line and "left float" not in line


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
def test_quantize_a8_gives_the_4_bit_layers_8_bit_inputs(capsys, checkpoint):
    """SCHEME/HEAD+a8: every native 4-bit layer (base and micro-step decoder) takes 8-bit inputs (`native.INT4_Q8`),
    the int8 head keeps its int16 ones; generate says so and runs."""
    from hamburger.kernels.qlinear import Int4Linear, Int8Linear
    from hamburger.loading import load

    model, _ = load(str(checkpoint), quantize="int4/int8+a8", quiet=False)
    fours = {id(m): m for m in model.modules() if isinstance(m, Int4Linear)}
    fours.update({id(m.group.linear): m.group.linear for m in model.modules() if hasattr(m, "group")})  # q/k/v, gate/up
    fours = list(fours.values())
    assert len(fours) > 4 and all(m.activations8 and m.native_desc().kind == native.INT4_Q8 for m in fours)
    assert model.micro is not None and any(isinstance(m, Int4Linear) for m in model.micro.modules())
    assert model.base.get_output_embeddings().native_desc().kind == native.INT8_Q16
    assert isinstance(model.base.get_output_embeddings(), Int8Linear)
    line = next(s for s in capsys.readouterr().err.splitlines() if s.startswith("quantize:"))
    assert f"8-bit inputs to {len(fours)} 4-bit layers" in line
    assert main(["generate", "w5 w6", "--model", str(checkpoint), "--max-new-tokens", "6", "--quantize",
                 "int4/int8+a8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["generated_tokens"] > 0


def test_info_quantized(capsys, checkpoint):
    float_info = run_json(capsys, "info", "--model", str(checkpoint), "--json", "--quantize", "none")
    info = run_json(capsys, "info", "--model", str(checkpoint), "--json", "--quantize", "int4")
    assert info["parameters"] == float_info["parameters"]  # the float model's counts
    assert info["quantize"] == "int4" and info["group_size"] == 32
    assert set(info["quantized_layers"]) == {"base", "micro"}
    assert info["quantized_weights_mb"] < info["weights_mb"] == float_info["weights_mb"]
    assert main(["info", "--model", str(checkpoint), "--quantize", "int8", "--verbose"]) == 0
    captured = capsys.readouterr()
    assert "quantized_weights_mb" in captured.out and "quantize: int8:" in captured.err


@pytest.mark.parametrize("args,message", [
    (["--quantize", "int3"], "--quantize must be one of auto, none, fp16, int8, int4 (or SCHEME/HEAD"),
    (["--quantize", "int4/int3"], "got 'int4/int3'"),
    (["--quantize", "int4/int8/int8"], "--quantize must be one of"),
    (["--quantize", "int8,int4"], "--quantize must be one of"),  # a comma list is bench's
    (["--quantize", "int4", "--group-size", "48"], "group_size must be one of (32, 64, 128, 256)"),
    (["--group-size", "0"], "group_size must be one of"),
    (["--quantize", "int4", "--group-size", "256"], "no linear layer of this model fits the kernels"),
    (["--quantize", "int8", "--device", "meta"], "run on cpu and cuda only"),
])
def test_bad_quantize_arguments_exit_2_without_a_traceback(capsys, tiny_model_dir, args, message):
    for command in (["generate", "w1"], ["info"]):
        capsys.readouterr()
        assert main([*command, "--model", str(tiny_model_dir), *args]) == 2
        err = [line for line in capsys.readouterr().err.splitlines()
               if line.strip() and not line.startswith(("Loading", "Writing"))]  # transformers' progress bars
        assert len(err) == 1 and err[0].startswith("hamburger: error: ") and message in err[0], err


def test_int4_on_cuda_needs_bfloat16():
    """Checked from the arguments alone, before any loading (no GPU needed to test it)."""
    import torch

    from hamburger.errors import HamburgerError
    from hamburger.loading import check_quantize

    with pytest.raises(HamburgerError, match="--dtype bfloat16"):
        check_quantize("int4", 32, torch.device("cuda"), torch.float32)
    check_quantize("int4", 32, torch.device("cuda"), torch.bfloat16)
    check_quantize("int8", 32, torch.device("cuda"), torch.float32)


def test_only_decoding_commands_take_quantize():
    from hamburger.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    # distill decodes too (the teacher's replies come from the fast engine); training commands never quantize
    for name in (*DECODING, "bench", "distill"):
        assert "--quantize" in commands[name]._option_string_actions, name
    for name in ("train", "train-drafter", "train-merger", "segment"):
        assert "--quantize" not in commands[name]._option_string_actions, name


def test_eval_and_demo_decode_the_quantized_model(capsys, tmp_path, checkpoint):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w5 w6 w7"}) + "\n")
    assert main(["eval", "--model", str(checkpoint), "--tasks", "prompts", "--prompts", str(prompts),
                 "--max-new-tokens", "4", "--quantize", "int8", "--verbose"]) == 0
    assert "quantize: int8: 57 linear layers (base 29, micro 28)" in capsys.readouterr().err
    assert main(["demo", "--model", str(checkpoint), "--max-new-tokens", "4", "--prompt", "w5 w6",
                 "--quantize", "int4", "--verbose"]) == 0
    assert "quantize: int4 (groups of 32)" in capsys.readouterr().err


# --- defaults that deliver, and what the CLI says ----------------------------------------------------------------


def start_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("hamburger: ") and "error" not in line]


def test_quantize_auto_resolves_by_device_and_dtype():
    from hamburger.errors import HamburgerError
    from hamburger.kernels.qlinear import fp16_unavailable
    from hamburger.loading import parse_schemes, resolve_device, resolve_quantize

    assert parse_schemes("auto,int8", many=True) == ["auto", "int8"]  # bench's comma list takes it too
    for bad in ("auto/int8", "auto+bf16"):  # auto is a whole spec
        with pytest.raises(HamburgerError, match="--quantize must be"):
            parse_schemes(bad)
    expected = "fp16" if fp16_unavailable("cpu") is None else "none"
    assert resolve_quantize("auto", "cpu") == expected
    assert resolve_quantize("auto", "cpu", "bfloat16") == "none"  # fp16 packed weights compute in float32 only
    assert resolve_quantize("auto", "meta") == "none"
    assert resolve_quantize("int8", "meta") == "int8"  # an explicit scheme is never changed
    # the embedded default: its GGUF's own Q4_1 / Q8_0 blocks where the native kernels run (its weights exactly)
    from hamburger.kernels import native
    blocks = "int4/int8" if native.available() else expected
    assert resolve_quantize("auto", "cpu", model="default") == blocks
    assert resolve_quantize("auto", "cpu", model="SmolLM2-135M-Instruct") == blocks
    assert resolve_quantize("auto", "cpu", model="default", base="elsewhere") == expected  # another base: unknown
    assert resolve_quantize("auto", "cpu", model="runs/mine") == expected
    assert resolve_quantize("auto", "cpu", "bfloat16", model="default") == "none"
    with native.turned_off():
        assert resolve_quantize("auto", "cpu", model="default") == expected
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")



def test_quantize_auto_takes_the_gguf_blocks_for_a_checkpoint_on_the_default_base(tmp_path):
    """A checkpoint folder trained on the embedded default's base (a copy of the shipped one, an export of a run
    from it) decodes on the default's GGUF blocks too; not one that holds base weights of its own or a LoRA, nor one
    on another base."""
    from hamburger.kernels import native
    from hamburger.kernels.qlinear import fp16_unavailable
    from hamburger.loading import resolve_quantize
    from hamburger.model.hamburger_model import packaged_checkpoint

    expected = "fp16" if fp16_unavailable("cpu") is None else "none"
    blocks = "int4/int8" if native.available() else expected

    def folder(name: str, **cfg) -> str:
        path = tmp_path / name
        path.mkdir()
        path.joinpath("config.json").write_text(json.dumps({"hamburger": {
            "base_model": "SmolLM2-135M-Instruct", "base_in_checkpoint": False, "lora_rank": 0, **cfg}}))
        return str(path)

    assert resolve_quantize("auto", "cpu", model=folder("copy")) == blocks
    assert resolve_quantize("auto", "cpu", model=str(packaged_checkpoint())) == blocks
    assert resolve_quantize("auto", "cpu", model=folder("full", base_in_checkpoint=True)) == expected
    assert resolve_quantize("auto", "cpu", model=folder("lora", lora_rank=16)) == expected
    assert resolve_quantize("auto", "cpu", model=folder("other", base_model="Qwen/Qwen2-0.5B")) == expected
    assert resolve_quantize("auto", "cpu", model=folder("copy2"), base="elsewhere") == expected
    assert resolve_quantize("auto", "cpu", "bfloat16", model=folder("copy3")) == "none"


def test_decoding_defaults_are_auto_and_one_line_says_what_runs(capsys, checkpoint, tiny_model_dir):
    from hamburger.cli import build_parser
    from hamburger.kernels.qlinear import fp16_unavailable

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in DECODING:
        assert commands[name].get_default("quantize") == "auto", name
    for name in (*DECODING, "train-drafter", "segment"):
        assert commands[name].get_default("device") == "auto", name
    auto = "fp16" if fp16_unavailable("cpu") is None else "none"
    out = run_json(capsys, "generate", "w5 w6", "--model", str(checkpoint), "--max-new-tokens", "3", "--json")
    assert out["quantize"] == auto
    captured = run_and_capture(capsys, "generate", "w5 w6", "--model", str(checkpoint), "--max-new-tokens", "3",
                               "--mode", "verify")
    from hamburger.loading import kernels_note
    weights = "fp16" if auto == "fp16" else "float32"
    kernels = f"; {note}" if (note := kernels_note(auto, torch.device("cpu"))) else ""  # native or PyTorch's, and why
    assert start_lines(captured.err) == [f"hamburger: cpu ({torch.get_num_threads()} threads), {weights} weights "
                                         f"(auto{kernels}), verify mode: the output of the {weights} base"]
    assert "quantize:" not in captured.err  # the quantization's details only with --verbose
    captured = run_and_capture(capsys, "generate", "w5 w6", "--model", str(tiny_model_dir), "--max-new-tokens", "3",
                               "--quantize", "none")
    [line] = start_lines(captured.err)
    assert "float32 weights, a base model (one token per step): the output of the float32 base" in line
    assert "(auto)" not in line


def run_and_capture(capsys, *args):
    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr()


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"hamburger {version('hamburger')}"


def test_reference_engine_resolves_the_checkpoints_mode_first(capsys, tmp_path, checkpoint):
    """The mode is the checkpoint's before the engine is asked (it once said "None mode runs on the fast engine
    only"); a checkpoint whose default is verify gets a message naming --mode trust."""
    out = run_json(capsys, "generate", "w5", "--model", str(checkpoint), "--engine", "reference",
                   "--max-new-tokens", "3", "--json")
    assert out["mode"] == "trust" and out["generated_tokens"] > 0  # the checkpoint's default: trust
    config = json.loads((checkpoint / "config.json").read_text())
    config["hamburger"]["default_mode"] = "verify"
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert main(["generate", "w5", "--model", str(checkpoint), "--engine", "reference"]) == 2
    err = capsys.readouterr().err
    assert "default mode, verify," in err and "add --mode trust" in err and "None" not in err
    out = run_json(capsys, "generate", "w5", "--model", str(checkpoint), "--engine", "reference", "--mode", "trust",
                   "--max-new-tokens", "3", "--json")
    assert out["mode"] == "trust"


def test_the_kv_cache_dtype_is_the_fast_engines(capsys, tmp_path, checkpoint):
    """--kv-cache-dtype float32 (or float16) decodes on the fast engine; given with the reference engine, whose cache is
    transformers', it is refused rather than ignored."""
    for dtype in ("float32", "float16"):
        out = run_json(capsys, "generate", "w5", "--model", str(checkpoint), "--kv-cache-dtype", dtype,
                       "--max-new-tokens", "3", "--json")
        assert out["generated_tokens"] > 0
    assert main(["generate", "w5", "--model", str(checkpoint), "--engine", "reference", "--kv-cache-dtype",
                 "float16"]) == 2
    assert "the reference engine keeps transformers' cache" in capsys.readouterr().err


def test_parser_imports_no_torch_and_help_is_fast():
    code = ("import sys, time; t = time.perf_counter(); from hamburger.cli import build_parser; "
            "build_parser().format_help(); print(time.perf_counter() - t, "
            "sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    seconds, heavy = proc.stdout.split(maxsplit=1)
    assert heavy.strip() == "[]"
    assert float(seconds) < 1.0


def test_the_parsers_literals_match_the_library():
    """Building the parser imports no torch, so it repeats a few of the library's names: they must not drift."""
    from hamburger.cli import common
    from hamburger.evaluation import bench_systems, evaluate
    from hamburger.inference import admission, engine, runner
    from hamburger.kernels import quantize
    from hamburger.loading import DTYPES
    from hamburger.model import base, merger
    from hamburger.training import sources

    assert common.DEFAULT_MODEL == base.DEFAULT_MODEL and common.DTYPES == DTYPES
    assert (common.SCHEMES, common.GROUP_SIZES) == (quantize.SCHEMES, quantize.GROUP_SIZES)
    assert common.ENGINES == engine.ENGINES and common.PREFILL_TOKENS == admission.PREFILL_TOKENS
    assert common.KV_CACHE_DTYPES == tuple(runner.KV_CACHE_DTYPES)
    assert common.BUILTIN_SOURCES == sources.BUILTIN and common.MERGER_WEIGHTS == merger.WEIGHTS
    assert (common.TASKS, common.DEFAULT_TASKS, common.MAX_NEW_TOKENS) == (
        evaluate.TASKS, evaluate.DEFAULT_TASKS, evaluate.MAX_NEW_TOKENS)
    assert (common.BENCH_SETS, common.BENCH_SYSTEMS) == (bench_systems.SETS, bench_systems.SYSTEMS)


@pytest.mark.parametrize("args,hint", [
    (["generate", "x", "--max-tokens", "10"],
     "unrecognized arguments: --max-tokens 10 (did you mean --max-new-tokens?)"),
    (["serve", "--max-batches=4"], "(did you mean --max-batch-size?)"),
    (["generate", "x", "--zzzz"], "unrecognized arguments: --zzzz\n"),
])
def test_unknown_option_gets_a_hint(capsys, args, hint):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert hint in err and f"hamburger {args[0]}: error:" in err


def test_every_subcommands_help_shows_the_defaults():
    from hamburger.cli import build_parser
    from hamburger.cli.common import DefaultsFormatter

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name, parser in commands.items():
        assert parser.formatter_class is DefaultsFormatter, name
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if action.option_strings and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS):
                assert f"default: {action.default}" in text or "default" in (action.help or ""), (name, action.dest)
    generate = " ".join(commands["generate"].format_help().split())
    assert "(default: 256)" in generate and "(default: auto)" in generate
    assert "--warmup WARMUP default: 50" in " ".join(commands["train-drafter"].format_help().split())
    assert "tokens, seconds) (default" not in " ".join(commands["serve"].format_help().split())  # a flag: none


# --- generate --stop, --quiet ----------------------------------------------------------------------------------


def test_generate_stops_before_a_stop_text(capsys, checkpoint):
    args = ["generate", "w5 w6", "--model", str(checkpoint), "--max-new-tokens", "24", "--confidence", "0.3", "--json"]
    full = run_json(capsys, *args)
    words = full["text"].split()
    assert len(words) >= 4, full["text"]
    stop = " " + words[2]  # a text the greedy reply reaches after a few steps
    cut = full["text"][:full["text"].index(stop)]
    out = run_json(capsys, *args, "--stop", "no such text", "--stop", stop)
    assert out["text"] == cut and out["stopped"] is True
    assert out["generated_tokens"] < full["generated_tokens"]  # decoding ended there
    assert out["decode_s"] > 0  # the clock of the steps taken
    assert main(args[:-1] + ["--stop", stop]) == 0
    assert capsys.readouterr().out == cut + "\n"  # streamed: nothing past the stop text, even held back
    assert main(args + ["--stop", ""]) == 2


def test_quiet_prints_no_start_line_and_no_progress_bar(capsys, checkpoint):
    from transformers.utils import logging

    logging.enable_progress_bar()
    try:
        captured = run_and_capture(capsys, "generate", "w5", "--model", str(checkpoint), "--max-new-tokens", "2")
        assert len(start_lines(captured.err)) == 1
        assert not logging.is_progress_bar_enabled()  # stderr is not a terminal here: no bars
        captured = run_and_capture(capsys, "generate", "w5", "--model", str(checkpoint), "--max-new-tokens", "2",
                                   "--quiet")
        assert start_lines(captured.err) == []
    finally:
        logging.enable_progress_bar()


def test_kv_memory_takes_bytes_or_entries():
    from hamburger.cli.common import parse_kv_memory

    assert parse_kv_memory("512MB") == (512 * 10**6, "bytes")
    assert parse_kv_memory("2GiB") == (2 * 2**30, "bytes")
    assert parse_kv_memory("300000000") == (300000000, "bytes")
    assert parse_kv_memory("40000entries") == (40000, "entries")
    for bad in ("lots", "12XB", "0", "-5MB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_kv_memory(bad)


def test_serve_refuses_kv_memory_beside_a_batch_size(capsys):
    assert main(["serve", "--kv-memory", "64MB", "--max-batch-size", "4"]) == 2
    assert "--kv-memory" in capsys.readouterr().err
