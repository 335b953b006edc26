"""Training: the command (command.py, LightningCLI), the run resolved once before anything is
built (plan.py, and source.py for a fine-tune's source), the LightningModule (module.py) and
the task it delegates the step to (tasks/), which weights train (adapters.py), its optimizers
(optim.py; Muon in muon.py), callbacks, progress bar, loggers, the report a run ends with,
the run directory's lock and the random state a resume restores."""
