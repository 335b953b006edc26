"""Looking at a model: attention weights and candidates as the page shows them
(inspection.py), head roles (heads.py), attention maps (plots.py), a run's metrics and
training curves (curves.py), evaluation (evaluate.py), the `visualize.py` command
(visualize.py) and the speed run's statistics over seeds (stats.py)."""
