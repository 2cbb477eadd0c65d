"""A small, deterministic transformers Trainer run that resumes through cairn (run as a module).

``python -m tests.support.hf_training STORE KEY OUT --epochs E --every K`` trains a one-layer
GPT-2 (32-wide, vocabulary of 64, dropout on) from scratch on random tokens with AdamW and a
linear schedule with warmup, through :func:`cairn.integrations.huggingface.train`. It prints
``start GLOBAL_STEP`` when training starts, ``loss STEP VALUE`` for each optimizer step
(``logging_steps=1``), ``saved STEP`` when a snapshot is staged and ``committed STEP`` when the
writer process reports it durable, and writes the final weights to OUT. Nothing is downloaded.
A script that adds ``--die-after STEP`` to the arguments SIGKILLs itself once that step's
snapshot is durable, before the next one is staged (:class:`DieAfter`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from cairn.integrations.huggingface import CairnCallback, train
from tests.support.script_common import SnapshotLines, seed
from tests.support.script_common import arguments as script_arguments


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, count: int = 96, length: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 64, (count, length), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class DieAfter(TrainerCallback):
    """SIGKILLs the run once the snapshot of step ``step`` is durable, before the CairnCallback
    (which must come after it in ``callbacks``) stages the next one at step ``step + every``:
    on a busy machine a kill sent when the test reads ``committed STEP`` lands later."""

    def __init__(self, cairn: CairnCallback, *, step: int, every: int) -> None:
        self.cairn = cairn
        self.step = step
        self.every = every

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step != self.step + self.every + 1:
            return
        # The writer process commits in the background; wait() also takes its report (on a
        # busy machine it comes after the step that would otherwise have taken it).
        ckpt = self.cairn.checkpointer
        if not ckpt.wait(timeout=300) or ckpt.committed_step != self.step:
            print(f"the snapshot of step {self.step} was not committed "
                  f"(committed: {ckpt.committed_step})", flush=True)
            os._exit(3)
        print(f"committed {self.step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class Report(TrainerCallback):
    """Prints what the test reads; must come after the CairnCallback in ``callbacks``."""

    def __init__(self, cairn: CairnCallback) -> None:
        self.snapshots = SnapshotLines(cairn)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print(f"start {state.global_step}", flush=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.snapshots.report()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            print(f"loss {state.global_step - 1} {logs['loss']!r}", flush=True)


def tiny_gpt2() -> GPT2LMHeadModel:
    """The one-layer GPT-2 the runs train (32 wide, a vocabulary of 64, dropout on)."""
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def run(args: argparse.Namespace, dataset: torch.utils.data.Dataset, **training: Any) -> int:
    """Train a fresh one-layer GPT-2 on ``dataset`` for ``args.epochs`` through cairn (with
    ``training`` added to the TrainingArguments), print ``end GLOBAL_STEP`` and write the
    weights to ``args.out``."""
    model = tiny_gpt2()
    cairn = CairnCallback(store=args.store, key=args.key, every_steps=args.every,
                          every_seconds=None)
    with tempfile.TemporaryDirectory() as output_dir:
        hf_args = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=8, num_train_epochs=args.epochs,
            learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=4, logging_steps=1,
            save_strategy="no", report_to="none", seed=1, use_cpu=True, disable_tqdm=True,
            **training)
        die_after = getattr(args, "die_after", None)
        die = [] if die_after is None else [DieAfter(cairn, step=die_after, every=args.every)]
        trainer = Trainer(model=model, args=hf_args, train_dataset=dataset,
                          callbacks=[*die, cairn, Report(cairn)])
        result = train(trainer)
    print(f"end {result.global_step}", flush=True)
    torch.save(model.state_dict(), args.out)
    return 0


def main() -> int:
    parser = script_arguments("--epochs", default=3)
    parser.add_argument("--accumulate", type=int, default=1)
    args = parser.parse_args()
    seed()
    return run(args, RandomTokens(), gradient_accumulation_steps=args.accumulate)


if __name__ == "__main__":
    sys.exit(main())
