"""`python -m attacks`: see attacks.cli."""

import sys

from attacks.cli import main

sys.exit(main())
