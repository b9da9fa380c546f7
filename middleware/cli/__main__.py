"""``python -m steptap.middleware.cli``: the ``steptap`` command, as the launchers run it (the same
interpreter and install as theirs)."""

import sys

from steptap.middleware.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
