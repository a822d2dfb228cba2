"""Run under torchrun: a whole ``train()`` run (``--distributed=MODE`` and any further
settings given), then what it left in this process. ``train()`` must have ended the
process group and its threads (NOTE [ Distributed training ] rule 6), whether the run
finished or failed: a thread left over dies during interpreter shutdown, sometimes taking
the rank down with it. Each rank writes ``threads-RANK.json`` into the output folder: the
threads' names, whether a process group is still initialized, and the error's class if
the run failed with one of remat3d's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from remat3d.errors import Remat3dError
from remat3d.train import load_settings, train


def main(config: str, output_dir: str, mode: str = "fsdp", *extra: str) -> None:
    settings = load_settings(config, [f"--distributed={mode}", "--epochs=1",
                                      f"--output_dir={output_dir}", *extra])
    error = None
    try:
        train(settings, say=lambda _: None)
    except Remat3dError as exc:
        error = type(exc).__name__
    tasks = Path("/proc/self/task")
    names = sorted((t / "comm").read_text().strip() for t in tasks.iterdir())
    rank = int(os.environ["RANK"])
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / f"threads-{rank}.json").write_text(json.dumps(
        {"threads": names, "initialized": dist.is_initialized(), "error": error}))


if __name__ == "__main__":
    main(*sys.argv[1:])
