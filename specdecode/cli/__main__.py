"""`python -m specdecode.cli ...` (torchrun and the serving benchmark start the CLI this way)."""

import sys

from specdecode.cli import main

sys.exit(main())
