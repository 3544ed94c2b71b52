"""Continue a run in its own dir: `make resume RUN=<run dir> [EPOCHS=N] [ARGS="k=v ..."]`.

    python experiments/resume.py [--nproc N] RUN [trainer.num_train_epochs=N] [run-shape overrides ...]

1. Checks, before anything is written: RUN is a run dir (holds run_config.yaml), and every
   override is run-shape (trainer.num_train_epochs / logging_steps / agent_devices and the other
   keys of the trainer's RUN_SHAPE_KEYS, checkpoint.*, logger.mode, hydra.*). Anything else is
   refused with a message naming the key and the allowed ones.
2. A run whose latest complete checkpoint already reached the target epochs: says so, exits 0
   (unless final/ lacks an agent's weights, stopped while writing it: then it is written again).
3. Otherwise re-composes the run from its saved config and continues in place:

       python experiments/main.py --config-path=<RUN> --config-name=run_config \
           hydra.run.dir=<RUN> hydra.job.name=train hydra.output_subdir=.hydra/resume-<time> \
           resume=true <overrides>

   main.py checks the composed config against run_config.yaml once more, the trainer resumes from
   the latest complete checkpoint ("auto") and restores the W&B run id stored in it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from comlrl.run import (
    RUN_CONFIG,
    RunDirError,
    check_resume_overrides,
    checkpoint_progress,
    checkpoint_world_size,
    latest_checkpoint,
    load_run_config,
)

MAIN = Path(__file__).resolve().with_name("main.py")


def _quote(value: str) -> str:
    """A Hydra override value that survives any path characters."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def missing_final_agents(run_dir: Path, checkpoint: Path) -> list:
    """Agents whose final/agent_<i>/model.safetensors is missing (a run stopped while writing final/)."""
    num_agents = int(json.loads((checkpoint / "trainer_state.json").read_text()).get("num_agents", 0))
    return [i for i in range(num_agents) if not (run_dir / "final" / f"agent_{i}" / "model.safetensors").is_file()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="the run dir (outputs/<name>/<timestamp>_<uid>)")
    parser.add_argument("overrides", nargs="*", help="run-shape Hydra overrides, e.g. trainer.num_train_epochs=4")
    parser.add_argument("--nproc", type=int, default=1,
                        help="data-parallel ranks (torchrun, one node); use the run's original count")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    args = parser.parse_args(argv)

    try:
        run_dir = Path(args.run).expanduser().resolve()
        saved = load_run_config(run_dir)
        accepted = check_resume_overrides(args.overrides, saved)
    except RunDirError as exc:
        print(f"make resume: {exc}", file=sys.stderr)
        return 2

    target = accepted.get("trainer.num_train_epochs", OmegaConf.select(saved, "trainer.num_train_epochs"))
    latest = latest_checkpoint(run_dir)
    if latest is not None:
        done = int(checkpoint_progress(latest).get("epoch", 0))
        finished = target is not None and done >= int(target)
        if finished and not missing_final_agents(run_dir, latest):
            print(f"{run_dir} is finished: {latest.name} completed {done} of {target} epochs. Nothing to do; "
                  f"pass EPOCHS=<more than {done}> to train further.")
            return 0
        if finished:  # stopped after its last checkpoint, while writing final/: write it again from there
            print(f"{run_dir} finished training ({latest.name}) but final/ is incomplete: writing it from {latest.name}.")
        else:
            print(f"Resuming {run_dir} from {latest.name} ({done} epochs done) to {target} epochs.")
        ranks = checkpoint_world_size(latest)
        if ranks is not None and ranks != args.nproc:
            print(f"Note: {latest.name} was written by {ranks} rank(s) and is resumed by {args.nproc} (NPROC={args.nproc}). "
                  "Training continues (samples are drawn per prompt, so they do not depend on the rank count), "
                  "but gradients are summed in a different order, so the result is no longer bit-identical "
                  f"to an uninterrupted {ranks}-rank run. NPROC={ranks} keeps it exact.")
    else:
        print(f"{run_dir} has no complete checkpoint yet: training it from the start, in place.")

    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    launcher = [sys.executable]
    if args.nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    command = [
        *launcher, str(MAIN),
        f"--config-path={run_dir}", f"--config-name={Path(RUN_CONFIG).stem}",
        f"hydra.run.dir={_quote(str(run_dir))}",
        "hydra.job.name=train",
        f"hydra.output_subdir=.hydra/resume-{stamp}",
        "resume=true",
        *args.overrides,
    ]
    if args.dry_run:
        print(" ".join(command))
        return 0
    sys.stdout.flush()
    os.execv(sys.executable, command)  # the training process takes over (signals, exit status)
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
