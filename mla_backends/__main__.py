import sys

from mla_backends.cli import main

sys.exit(main())
