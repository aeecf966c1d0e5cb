"""The `lightning-sparse` command, one module per job.

- `cli`: the entry point (``lightning-sparse = lightning_sparse.app.cli:main``).
- `command`: runs one command line: the subcommand's module, expected failures as a few lines.
- `common`: the table of subcommands (`common.SUBCOMMANDS`: add a subcommand there), ``--debug``,
  reading a LightningCLI configuration's class entries.
- `fit`: ``fit`` / ``validate`` / ``test`` / ``predict`` (LightningCLI); `preflight`: the files
  the command line names, checked first; `run_dirs`: one ``version_N`` directory per run;
  `wandb_mode`: W&B online or offline; `quiet`: noise filters; `errors`: expected failures as
  one line (configuration values: three); `threads`: torch's thread count.
- `compare`, `sweep`, `export_cmd`: the other subcommands; `svg_plot`: compare's plot.
"""
