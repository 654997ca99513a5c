"""`python -m otelprof` is the `otelprof` command."""

import sys

from otelprof.cli import main

sys.exit(main())
