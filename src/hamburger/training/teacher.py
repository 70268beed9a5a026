"""The teacher: the base's own next-token distribution over the training data, cached by `segment`.

`hamburger segment --teacher-top-k K` already runs the base over every example to read its entropies; it
then also keeps, for every response token, the base's K most likely next tokens and their log-probabilities
(teacher-forced on the unmerged sequence, exactly where the base predicts that token). They land beside the
data as safetensors shards, `DATA.teacher/part{process}-{n}.safetensors`, one `{id}.ids` (int32) and
`{id}.logprobs` (float16) tensor of shape (response tokens, K) per example, with the top-k and the base's
fingerprint in each shard's metadata.

`hamburger train --kd-weight W` reads them (when present and made by the same base) instead of running the
base a second time per batch: the KL is then taken over the K tokens plus one bucket for the rest of the
vocabulary (`sparse_kl`), which equals the full KL when K is the vocabulary and is a lower bound otherwise.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hamburger.errors import HamburgerError
from hamburger.model.outputs import sparse_kl  # noqa: F401 - the teacher's loss, defined with the model's

SHARD_EXAMPLES = 1024  # examples per shard file


def teacher_dir(data: Path) -> Path:
    """Where the teacher of a segmented data file lives: `DATA.teacher/` beside it."""
    return data.with_name(data.name + ".teacher")


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely next tokens (int32) and their log-probabilities (float16) at each position."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return ids.to(torch.int32), values.to(torch.float16)


class TeacherWriter:
    """Collects each example's top-k and writes a shard every `SHARD_EXAMPLES` examples (and at `close`)."""

    def __init__(self, folder: Path, k: int, base_fingerprint: str, prefix: str = "part0"):
        self.folder, self.prefix = folder, prefix
        self.meta = {"top_k": str(k), "base_fingerprint": base_fingerprint}
        self.pending: dict[str, torch.Tensor] = {}
        self.shards = 0
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, rid: str, ids: torch.Tensor, logprobs: torch.Tensor) -> None:
        self.pending[f"{rid}.ids"] = ids.contiguous().cpu()
        self.pending[f"{rid}.logprobs"] = logprobs.contiguous().cpu()
        if len(self.pending) >= 2 * SHARD_EXAMPLES:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file  # noqa: PLC0415

        if self.pending:
            save_file(self.pending, str(self.folder / f"{self.prefix}-{self.shards:05d}.safetensors"), self.meta)
            self.pending, self.shards = {}, self.shards + 1


def read_teacher(folder: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, str]]:
    """Every example's (ids, logprobs) in a teacher folder, and the metadata its shards agree on."""
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HamburgerError(f"{folder} holds no teacher shards (*.safetensors): re-run `hamburger segment "
                             "--teacher-top-k K`")
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    meta: dict[str, str] | None = None
    for path in files:
        try:
            with safe_open(str(path), "pt") as f:
                here = f.metadata() or {}
                keys = set(f.keys())
                tensors = {key: f.get_tensor(key) for key in keys}
        except (SafetensorError, OSError) as exc:
            raise HamburgerError(f"{path}: not a readable teacher shard ({exc})") from exc
        if meta is None:
            meta = here
        elif here != meta:
            raise HamburgerError(f"{path}: made with {here}, other shards with {meta}: re-run `hamburger segment`")
        for key in keys:
            if key.endswith(".ids"):
                rid = key[: -len(".ids")]
                if rid in out:
                    raise HamburgerError(f"{path}: example {rid!r} appears in two teacher shards")
                if f"{rid}.logprobs" not in keys:
                    raise HamburgerError(f"{path}: example {rid!r} has ids but no logprobs")
                out[rid] = (tensors[key], tensors[f"{rid}.logprobs"])
    return out, meta or {}
