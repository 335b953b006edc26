"""Training: the command (command.py, LightningCLI), the LightningModule (module.py), its
optimizers (optim.py), callbacks, progress bar, loggers, the report a run ends with, the
run directory's lock and the random state a resume restores."""
