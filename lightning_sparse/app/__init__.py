"""The `lightning-sparse` command, one module per job.

- `cli`: the entry point (``lightning-sparse = lightning_sparse.app.cli:main``).
- `command`: runs one command line: the subcommand's module, expected failures as a few lines;
  ``lightning-sparse --help`` (from `common`, without torch or Lightning).
- `common`: the table of subcommands (`common.SUBCOMMANDS`: add a subcommand there), ``--debug``,
  reading a LightningCLI configuration's class entries.
- `fit`: ``fit`` / ``validate`` / ``test`` / ``predict`` (LightningCLI); `preflight`: the files
  the command line names, checked first; `parse_errors`: a parse error as one line with the
  closest name; `config_edits`: what the command changes in a configuration before building
  it (no logger, ``fast_dev_run``, evaluations); `run_dirs`: one ``version_N`` directory per
  run, an evaluation folder inside the run it evaluates; `evaluation`: what ``validate`` /
  ``test`` / ``predict`` write there; `progress`: the progress bar; `wandb_mode`: W&B online
  or offline; `quiet`: noise filters; `errors`: expected failures as one line (configuration
  values: three); `threads`: torch's thread count.
- `compare`, `sweep`, `export_cmd`, `generate`: the other subcommands; `svg_plot`: compare's
  plot.
"""
