"""``python -m healthagent.training.torchrun [torchrun arguments]``: torchrun with the hooks installed.

torchrun's event and metric destinations are registries inside the torchrun process, so something
must register the healthagent handler there before torchrun starts. This wrapper does exactly that
and then hands the unchanged arguments to ``torch.distributed.run.main``. It reads the ranks per
node with torchrun's own argument parser, so ``--nproc-per-node gpu`` and
``PET_*`` environment variables resolve the way torchrun resolves them.
"""

from __future__ import annotations

import sys

from healthagent.training.elastic_hooks import install_elastic_hooks


def ranks_per_node(argv: list[str]) -> int | None:
    """``--nproc-per-node`` as torchrun resolves it (``gpu``, ``auto``, ``PET_*``); None if unknown."""
    try:
        # deferred: torch is optional; without it the rank count is unknown (None)
        from torch.distributed.run import config_from_args, parse_args

        config, _, _ = config_from_args(parse_args(argv))
        return int(config.nproc_per_node)
    except Exception:
        return None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # deferred: torch is optional; without it this command exits with one line saying so
        from torch.distributed.run import main as torchrun_main
    except ImportError:
        raise SystemExit("healthagent.training.torchrun needs PyTorch in this environment "
                         "(it wraps torch.distributed.run); install torch or use torchrun directly") from None
    install_elastic_hooks(nproc_per_node=ranks_per_node(argv))
    torchrun_main(argv)


if __name__ == "__main__":
    main()
