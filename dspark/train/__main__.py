"""python -m dspark.train {trunk, drafter, calibrate, export} [--out DIR] [--threads N]"""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dspark.train")
    ap.add_argument("stage", choices=("trunk", "drafter", "calibrate", "export"))
    ap.add_argument("--out", type=Path, default=Path("train_out"), help="working directory for checkpoints")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (the machine is shared)")
    ap.add_argument("--budget-min", type=float, default=None, help="override the stage's wall-time budget")
    a = ap.parse_args(argv)
    import dataclasses

    import torch
    torch.set_num_threads(a.threads)
    from . import recipe
    if a.stage == "trunk":
        from .train_trunk import train
        r = recipe.TrunkRecipe()
        train(a.out, r if a.budget_min is None else dataclasses.replace(r, budget_s=a.budget_min * 60))
    elif a.stage == "drafter":
        from .train_drafter import train
        r = recipe.DrafterRecipe()
        train(a.out, r if a.budget_min is None else dataclasses.replace(r, budget_s=a.budget_min * 60))
    elif a.stage == "calibrate":
        from .calibrate import calibrate
        calibrate(a.out)
    else:
        from .export import export
        export(a.out)


if __name__ == "__main__":
    main()
