"""The settings of the training commands (`train`, `train-drafter`, `train-merger`): plain dataclasses, in a module
that imports nothing heavy, so that the CLI builds its options from their fields without loading torch. The
trainers keep them in their resumable state (`asdict`)."""

from __future__ import annotations

from dataclasses import dataclass

BASE_TRAINING = ("frozen", "lora", "full")  # `train --base-training`: how the base learns besides the new modules


@dataclass
class TrainArgs:
    data: str
    out: str
    base_training: str = "frozen"  # frozen: the base untouched; lora: a LoRA on it learns (attached if missing); full
    lora_rank: int = 16  # the LoRA attached with --base-training lora to a model that has none
    epochs: int = 1
    max_steps: int = 0  # optimizer steps; 0 = as many as the epochs give
    max_minutes: float = 0.0  # stop training after this long (then evaluate and save); 0: no limit
    batch_size: int = 8  # examples per process per micro-batch
    grad_accum: int = 1
    lr: float = 1e-4  # new modules
    base_lr: float = 5e-5  # the base (full) or its LoRA (lora)
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    bucket_pool: int = 32  # global batches per length-sorted pool (length bucketing); 0 = plain random batches
    eval_fraction: float = 0.05
    eval_every: int = 100
    save_every: int = 100
    bf16: bool = True
    verified_stops: bool = False  # the stop head also ends a step before a token the micro-decoder gets wrong
    kd_weight: float = 0.0  # dense loss: KL(unmerged base || model) at every target (--base-training frozen)
    state_weight: float = 0.0  # dense loss: merged slots' states regressed onto the unmerged base's (frozen base)
    partial_steps: float = 0.0  # probability that a training step of >= 2 tokens is cut in two (`data.cut_steps`)
    teacher_cache: bool = True  # KD reads DATA.teacher/ (from `segment --teacher-top-k`) when it is there
    seed: int = 0
    report_to: str = "none"  # an accelerate tracker (tensorboard, wandb, mlflow, ...) that also gets the metrics


@dataclass
class DrafterArgs:
    data: str
    out: str
    max_steps: int = 2000  # one example (up to `positions` positions) per step
    positions: int = 128  # response positions sampled per example per step
    max_len: int = 512  # tokens of an example read (prompt included)
    lr: float = 2e-4
    warmup: int = 50
    stop_weight: float = 0.5
    eval_fraction: float = 0.05  # the same held-out split as `hamburger train`
    eval_examples: int = 40
    eval_every: int = 250
    save_every: int = 100
    gate_lr: float = 1e-2  # the context gates' learning rate (they start closed; at `lr` they would barely open)
    micro_context: int = -1  # > 0: the micro-step decoder attends to that many latest base positions; -1: as the checkpoint
    micro_layers: int = 0  # > 0: keep only the micro-step decoder's last that many layers (a cheaper micro-step); 0: all
    bf16: bool = True  # autocast the training passes (not the evaluation) where the CPU or GPU has bf16
    seed: int = 0
    report_to: str = "none"  # an accelerate tracker (tensorboard, wandb, mlflow, ...) that also gets the metrics
    draft_stop_head: bool = False  # train a stop head of verify mode's own (a copy of the trust one to start)


@dataclass
class MergerArgs:
    data: str
    out: str
    max_steps: int = 1000  # optimizer steps of `batch_size` examples each
    max_minutes: float = 0.0  # stop training after this long (then evaluate and save); 0: no limit
    batch_size: int = 1
    lr: float = 0.05  # a thousand logits and biases: large steps are safe (the pilot's rate)
    max_len: int = 384  # tokens of an example read (prompt included)
    max_step_tokens: int = 4
    random_steps: bool = False  # cut responses into uniform random steps of 1..K instead of the data's
    gates: bool = False
    channels: bool = False  # softmax weights per channel, not per head
    merge_window: int = 0  # compress mode's merge_window: steps this close stay unmerged (training and evaluation)
    init: str = ""  # start from this merger (a merger.safetensors file); with --max-steps 0: evaluate it
    eval_fraction: float = 0.05  # the same held-out split as `hamburger train`
    eval_examples: int = 30
    eval_every: int = 100
    save_every: int = 100
    seed: int = 0
    report_to: str = "none"  # an accelerate tracker (tensorboard, wandb, mlflow, ...) that also gets the metrics
