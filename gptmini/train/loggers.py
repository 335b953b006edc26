"""Where a run's metrics go: a CSV file always, Weights & Biases when asked (offline, without
prompting, when no API key is set up)."""

import netrc
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, WandbLogger

__all__ = ["make_loggers", "wandb_api_key_present"]


def make_loggers(run_dir: Path, run_name: str, use_wandb: bool, project: str) -> list:
    loggers = [CSVLogger(save_dir=run_dir, name="logs")]
    if use_wandb:
        if not wandb_api_key_present():
            # Offline never prompts and never waits on a network.
            os.environ["WANDB_MODE"] = "offline"
            print(f"wandb: no API key found, logging offline under {run_dir / 'wandb'}; "
                  f"upload later with: wandb sync {run_dir / 'wandb'}/offline-run-*",
                  flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        loggers.append(WandbLogger(project=project, name=run_name, save_dir=str(run_dir)))
    return loggers


def wandb_api_key_present() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False
