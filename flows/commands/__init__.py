"""`omni`'s commands, one module per group: each module adds its commands' parsers to the CLI's subparsers
(`add_*`) and names the handler that runs them (`set_defaults(handler=...)`); `flows.cli` assembles the
parser and dispatches. A handler imports what its command needs when it runs, so `omni --help` and
`omni recipe check` import neither Prefect nor MLflow."""
