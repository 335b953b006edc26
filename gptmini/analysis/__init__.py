"""Looking at a model: attention weights and candidates as the page shows them
(inspection.py), head roles (heads.py), attention maps and training curves (plots.py),
evaluation (evaluate.py) and the `visualize.py` command (visualize.py)."""
