"""Allows ``python -m webhook``; same as the ``gpuslice`` console script."""

from webhook.cli import main

raise SystemExit(main())
