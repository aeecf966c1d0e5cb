"""The `lightning-sparse` command: `cli` (LightningCLI, the entry point), `compare`, `sweep`."""
