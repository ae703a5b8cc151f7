"""`rosetta`: the command line, one module per command.

- args.py: what every command shares: exit codes, UsageError, the parser class, argument types
  (seeds, repeats, framework lists), the model arguments and the model they name, id files.
- task_models.py: what train, translate and demo share: the trainable frameworks, building a
  model, training it with a progress bar, a task's weights, the beam check.
- inspect.py, parity.py, forward.py, convert.py, train.py, translate.py, demo.py: one
  command each, as `add_<command>(sub)` (its arguments) and `run_<command>_command(args)`.
- main.py: the parser of all commands, `main` and its error handling (one line, exit 2), and a
  standard output that may close.
- __main__.py: `python -m transformer_rosetta ...`, the same commands as `rosetta ...`.

Imports point one way: the command modules import args (and task_models), main imports the
commands, and only common/cli.py imports main. This file imports nothing,
so no cycle can pass through it.
"""
