"""A transformers Trainer run whose dataset augments from the global RNGs (run as a module).

``python -m tests.support.hf_augment STORE KEY OUT --epochs E --every K [--workers W]``: the
one-layer GPT-2 of :mod:`tests.support.hf_training`, but each ``__getitem__`` replaces tokens
at positions drawn from ``torch.randint`` with tokens drawn from ``numpy.random`` and masks one
label drawn from Python ``random`` — the training process's global RNGs with no workers, each
worker's with ``--workers``. Prints ``start``, ``loss``, ``saved``, ``committed`` and ``end``
lines as :mod:`tests.support.hf_training` does; writes the final weights to OUT.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from cairn.integrations.huggingface import CairnCallback, train
from tests.support.hf_training import RandomTokens, Report


class Augmented(RandomTokens):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[i].clone()
        where = torch.randint(0, len(ids), (2,))
        ids[where] = torch.from_numpy(np.random.randint(0, 64, 2)).to(ids.dtype)
        labels = ids.clone()
        labels[random.randrange(len(ids))] = -100
        return {"input_ids": ids, "labels": labels}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("key")
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="log %(name)s %(message)s",
                        stream=sys.stdout)

    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    torch.set_num_threads(1)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    cairn = CairnCallback(store=args.store, key=args.key, every_steps=args.every,
                          every_seconds=None)
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=8, num_train_epochs=args.epochs,
            learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=4, logging_steps=1,
            save_strategy="no", report_to="none", seed=1, use_cpu=True, disable_tqdm=True,
            max_grad_norm=1.0, dataloader_num_workers=args.workers)
        trainer = Trainer(model=model, args=training, train_dataset=Augmented(),
                          callbacks=[cairn, Report(cairn)])
        result = train(trainer)
    print(f"end {result.global_step}", flush=True)
    torch.save(model.state_dict(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
