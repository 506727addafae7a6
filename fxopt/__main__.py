import sys

from fxopt.cli import main

sys.exit(main())
