"""Run under torchrun: a whole ``train()`` run (FSDP2, or the mode named third), then the
names of the threads left in this process. ``train()`` must have ended the process group's
threads (NOTE [ Distributed training ] rule 6); a thread left over dies during interpreter
shutdown, sometimes taking the rank down with it. Each rank writes ``threads-RANK.json``
into the output folder."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from remat3d.train import load_settings, train


def main(config: str, output_dir: str, mode: str = "fsdp") -> None:
    settings = load_settings(config, [f"--distributed={mode}", "--epochs=1",
                                      f"--output_dir={output_dir}"])
    train(settings, say=lambda _: None)
    tasks = Path("/proc/self/task")
    names = sorted((t / "comm").read_text().strip() for t in tasks.iterdir())
    rank = int(os.environ["RANK"])
    (Path(output_dir) / f"threads-{rank}.json").write_text(json.dumps(names))


if __name__ == "__main__":
    main(*sys.argv[1:])
