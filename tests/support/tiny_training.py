"""A small, deterministic training job that uses cairn's Checkpointer (run as a module).

``python -m tests.support.tiny_training STORE KEY OUT --total N --every K`` trains a small MLP
on synthetic data with a StatefulDataLoader (2 workers, shuffled) and a random augmentation
drawn from the torch RNG, snapshotting every K steps. It prints ``loss STEP VALUE`` after each
step, ``saved STEP`` when a snapshot is staged and ``committed STEP`` when the writer process
reports it durable, and writes the final weights to OUT.
"""

from __future__ import annotations

import signal
import sys

import torch
from torch.utils.data import Dataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from cairn.state import Checkpointer
from tests.support.script_common import arguments, mlp, seed, train


class Noisy(Dataset):
    """Fixed inputs; each item gets fresh noise from its worker's own generator.

    The dataset is stateful (state_dict/load_state_dict), so StatefulDataLoader saves each
    worker's generator with its position: the augmentation resumes exactly, not re-seeded.
    """

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 8, generator=g)
        self.y = (self.x.sum(dim=1, keepdim=True) > 0).float()
        self._gen: torch.Generator | None = None

    def _generator(self) -> torch.Generator:
        if self._gen is None:
            info = get_worker_info()
            self._gen = torch.Generator().manual_seed(info.seed if info is not None else 0)
        return self._gen

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8, generator=self._generator()), self.y[i]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self._generator().get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._generator().set_state(state["generator"])


def main() -> int:
    parser = arguments(default=48)
    parser.add_argument("--prev-handler", action="store_true",
                        help="install a SIGTERM handler first, as Airflow's task runner does")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds to sleep per step")
    args = parser.parse_args()
    if args.prev_handler:
        def previous_handler(signum: int, frame: object) -> None:
            print("previous handler ran", flush=True)
            sys.exit(143)

        signal.signal(signal.SIGTERM, previous_handler)

    seed()
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    loader = StatefulDataLoader(Noisy(), batch_size=16, shuffle=True, num_workers=2,
                                generator=torch.Generator().manual_seed(2))
    ckpt = Checkpointer(store=args.store, key=args.key, every_steps=args.every, every_seconds=None)
    train(ckpt, model, opt, loader, args.total, scheduler=sched, pace=args.pace)
    torch.save(model.state_dict(), args.out)
    ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
