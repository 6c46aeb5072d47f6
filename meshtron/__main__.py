"""`python -m meshtron ...` is the same as the `meshtron` console script."""

import sys

from meshtron.cli import main

sys.exit(main())
