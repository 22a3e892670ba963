"""``python -m kvsnap.cli ...``: the ``kvsnap`` commands in this process (`main`), without the
console script's early start of the workers' fork server (`kvsnap.cli.launch`)."""

from kvsnap.cli import main

raise SystemExit(main())
