import sys

from dmd2_core.cli import main

sys.exit(main())
