"""``python -m kvsnap ...``: the ``kvsnap`` command (`kvsnap.launch`)."""

from kvsnap.launch import main

raise SystemExit(main())
