"""A small, deterministic transformers Trainer run that resumes through cairn (run as a module).

``python -m tests.support.hf_training STORE KEY OUT --epochs E --every K`` trains a one-layer
GPT-2 (32-wide, vocabulary of 64, dropout on) from scratch on random tokens with AdamW and a
linear schedule with warmup, through :func:`cairn.integrations.huggingface.train`. It prints
``start GLOBAL_STEP`` when training starts, ``loss STEP VALUE`` for each optimizer step
(``logging_steps=1``), ``saved STEP`` when a snapshot is staged and ``committed STEP`` when the
writer process reports it durable, and writes the final weights to OUT. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
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


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, count: int = 96, length: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 64, (count, length), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class Report(TrainerCallback):
    """Prints what the test reads; must come after the CairnCallback in ``callbacks``."""

    def __init__(self, cairn: CairnCallback) -> None:
        self.cairn = cairn
        self.saved: int | None = None
        self.committed: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print(f"start {state.global_step}", flush=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.cairn.saved_step != self.saved:
            self.saved = self.cairn.saved_step
            print(f"saved {self.saved}", flush=True)
        committed = self.cairn.checkpointer.committed_step
        if committed != self.committed:
            self.committed = committed
            print(f"committed {committed}", flush=True)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            print(f"loss {state.global_step - 1} {logs['loss']!r}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("key")
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--accumulate", type=int, default=1)
    args = parser.parse_args()

    torch.manual_seed(1)
    torch.set_num_threads(1)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    cairn = CairnCallback(store=args.store, key=args.key, every_steps=args.every,
                          every_seconds=None)
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=8, num_train_epochs=args.epochs,
            gradient_accumulation_steps=args.accumulate, learning_rate=1e-3,
            lr_scheduler_type="linear", warmup_steps=4, logging_steps=1, save_strategy="no",
            report_to="none", seed=1, use_cpu=True, disable_tqdm=True)
        trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(),
                          callbacks=[cairn, Report(cairn)])
        result = train(trainer)
    print(f"end {result.global_step}", flush=True)
    torch.save(model.state_dict(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
