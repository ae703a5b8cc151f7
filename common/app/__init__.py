"""The application: the rosetta CLI, parity report, plots, training app, tasks and the docs generator."""
